"""DeepSeek-V4.1's MoE FFN (docs/v41.md): V4's router without hash-routed layers (`moe.route`), and
experts that see their inputs as the reference's FP8 GEMMs do: the token rounded to FP8 (blocks of
32) before the gate / up projections, and the routing weight applied to the SwiGLU output *before*
it is rounded to FP8 for the down projection (the rounding depends on the scale, so the order is
part of the model). Under a mesh the experts are split over devices as V4's
(`sharding.active.routed_experts`): each device runs its own assignments and the outputs are summed."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.core.config import ModelConfig
from jaxspec.layers.moe import MLPParams, MoEParams, clamped_swiglu, combine_weights, route, sorted_assignments
from jaxspec.ops import fakequant, quant
from jaxspec.ops.pallas.grouped_matmul import grouped_matmul
from jaxspec.sharding.active import routed_experts


def _hidden(gate: jax.Array, up: jax.Array, weight: jax.Array, cfg: ModelConfig, dtype) -> jax.Array:
    """The down projection's input: SwiGLU in fp32, times the routing weight [N], cast, rounded to FP8."""
    act = clamped_swiglu(gate.astype(dtype).astype(jnp.float32), up.astype(dtype).astype(jnp.float32),
                         cfg.swiglu_limit)
    return fakequant.roundings(cfg.v41.qat).fp8((act * weight[:, None]).astype(dtype))


def gathered_qat_experts(
    experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array, weights: jax.Array
) -> jax.Array:
    """x [N, d] (FP8-rounded), indices / weights [N, k] (>= E: not on this device) -> [N, d] fp32: each
    assignment's expert weights gathered and run on its token alone (the N*k selected experts are read)."""
    n, d = x.shape
    k = indices.shape[1]
    flat = indices.reshape(-1)
    here = flat < experts.w1.shape[0]
    picked = jax.tree.map(lambda w: quant.take(w, jnp.where(here, flat, 0)), experts, is_leaf=quant.is_quantized)
    rows = jnp.repeat(x, k, axis=0)  # [N*k, d]
    gate = quant.einsum("nd,ndi->ni", rows, picked.w1)
    up = quant.einsum("nd,ndi->ni", rows, picked.w3)
    hidden = _hidden(gate, up, jnp.where(here, weights.reshape(-1), 0.0), cfg, x.dtype)
    out = quant.einsum("ni,nid->nd", hidden, picked.w2, preferred_element_type=jnp.float32)
    return out.reshape(n, k, d).sum(axis=1)


def dense_qat_experts(
    experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array, weights: jax.Array
) -> jax.Array:
    """The same with every expert on every token, an unselected one's routing weight 0 (its rounded
    hidden is then exactly 0) -> [N, d] fp32: E/k times the work, no copy of any weight. Many tokens
    (training, prefill) on small expert counts, where gathering each assignment's weights would copy
    them N*k times."""
    num_experts = experts.w1.shape[0]
    combine = combine_weights(indices, weights, num_experts)  # [N, E]
    per_expert = (((2,), (1,)), ((0,), (0,)))  # contract the feature axis, batch over experts
    rows = jnp.broadcast_to(x, (num_experts, *x.shape))  # [E, N, d]
    gate = jax.lax.dot_general(rows, quant.dequantize(experts.w1), per_expert)  # [E, N, I]
    up = jax.lax.dot_general(rows, quant.dequantize(experts.w3), per_expert)
    flat = combine.T.reshape(-1)  # [E*N]
    e, n, i = gate.shape
    hidden = _hidden(gate.reshape(e * n, i), up.reshape(e * n, i), flat, cfg, x.dtype).reshape(e, n, i)
    out = jax.lax.dot_general(hidden, quant.dequantize(experts.w2), per_expert,
                              preferred_element_type=jnp.float32)  # [E, N, d]
    return jnp.sum(out, axis=0)


def kernel_qat_experts(
    experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array, weights: jax.Array
) -> jax.Array:
    """The same on the Pallas grouped matmul (assignments sorted by expert, each selected expert's weights
    read once per tile of its rows; FP8 / FP4 weights dequantized inside the kernel) -> [N, d] fp32."""
    n, d = x.shape
    num_experts = experts.w1.shape[0]
    flat, order, token, group_sizes = sorted_assignments(indices, num_experts)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes).astype(jnp.int32)])
    rows = x[token]  # [N*k, d] in expert order
    here = flat[order] < num_experts  # rows past the last group are never written: select, not scale
    weight = jnp.where(here, weights.reshape(-1)[order], 0.0)
    hidden = _hidden(grouped_matmul(rows, experts.w1, offsets), grouped_matmul(rows, experts.w3, offsets),
                     weight, cfg, x.dtype)
    out = jnp.where(here[:, None], grouped_matmul(hidden, experts.w2, offsets), 0.0)
    return jnp.zeros((n, d), jnp.float32).at[token].add(out)


def qat_experts(experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array,
                weights: jax.Array) -> jax.Array:
    """`cfg.kernels == "pallas"`: the grouped-matmul kernel (compiled for CUDA, interpreted elsewhere);
    "xla": the gathered path while the assignments are few (decode, draft, a small verify), the dense one
    beyond (the rule of V4's many-expert CPU path, `moe.cpu_experts_path`: gathering copies each
    assignment's weights, so past 1.5 E assignments running every expert reads less)."""
    if cfg.kernels == "pallas":
        return kernel_qat_experts(experts, cfg, x, indices, weights)
    dense = 2 * indices.size > 3 * experts.w1.shape[0]
    return (dense_qat_experts if dense else gathered_qat_experts)(experts, cfg, x, indices, weights)


def qat_moe(p: MoEParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """x [B, T, d] -> [B, T, d]."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    indices, weights = route(p, cfg, flat.astype(jnp.float32), jnp.zeros((b * t,), jnp.int32))
    rounded = fakequant.roundings(cfg.v41.qat).fp8(flat)
    out = routed_experts(qat_experts, p.experts, cfg, rounded, indices, weights)
    if p.shared is not None:
        s = p.shared
        hidden = _hidden(quant.matmul(rounded, s.w1), quant.matmul(rounded, s.w3), jnp.ones((b * t,), jnp.float32),
                         cfg, x.dtype)
        out = out + quant.matmul(hidden, s.w2).astype(jnp.float32)
    return out.reshape(b, t, d).astype(x.dtype)
