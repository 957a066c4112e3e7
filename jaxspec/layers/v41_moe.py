"""DeepSeek-V4.1's MoE FFN (docs/v41.md): V4's router without hash-routed layers (`moe.route`), and
experts that see their inputs as the reference's FP8 GEMMs do: the token rounded to FP8 (blocks of
32) before the gate / up projections, and the routing weight applied to the SwiGLU output *before*
it is rounded to FP8 for the down projection (the rounding depends on the scale, so the order is
part of the model)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.core.config import ModelConfig
from jaxspec.layers.moe import MLPParams, MoEParams, clamped_swiglu, route
from jaxspec.ops import fakequant, quant


def _expert_mlp(
    w: MLPParams, cfg: ModelConfig, rows: jax.Array, weight: jax.Array, dtype,  # rows: [N, d] FP8-rounded
) -> jax.Array:
    """One SwiGLU expert per row (w: the rows' own weights, gathered [N, ...], or one shared expert)
    -> [N, d] fp32; `weight` [N] multiplies the hidden state before its FP8 rounding."""
    spec_in, spec_out = ("nd,ndi->ni", "ni,nid->nd") if w.w1.ndim == 3 else ("nd,di->ni", "ni,id->nd")
    gate = quant.einsum(spec_in, rows, w.w1).astype(jnp.float32)
    up = quant.einsum(spec_in, rows, w.w3).astype(jnp.float32)
    hidden = fakequant.fp8((clamped_swiglu(gate, up, cfg.swiglu_limit) * weight[:, None]).astype(dtype))
    return quant.einsum(spec_out, hidden, w.w2, preferred_element_type=jnp.float32)


def qat_moe(p: MoEParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """x [B, T, d] -> [B, T, d]. Each token's selected experts are gathered and run on it alone (only
    the N*k selected experts are read)."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    indices, weights = route(p, cfg, flat.astype(jnp.float32), jnp.zeros((b * t,), jnp.int32))
    k = indices.shape[1]
    rows = jnp.repeat(fakequant.fp8(flat), k, axis=0)  # [N*k, d]
    picked = jax.tree.map(lambda w: quant.take(w, indices.reshape(-1)), p.experts,
                          is_leaf=quant.is_quantized)
    out = _expert_mlp(picked, cfg, rows, weights.reshape(-1), x.dtype).reshape(b * t, k, d).sum(axis=1)
    if p.shared is not None:
        out = out + _expert_mlp(p.shared, cfg, fakequant.fp8(flat), jnp.ones((b * t,), jnp.float32), x.dtype)
    return out.reshape(b, t, d).astype(x.dtype)
