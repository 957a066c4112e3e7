"""Manifold-constrained hyper-connections: hc_mult residual streams mixed by Sinkhorn-projected
doubly-stochastic matrices (docs/architecture.md §5). All mixing math runs in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.ops.norms import unweighted_rms_norm
from jaxspec.ops.pallas.sinkhorn import sinkhorn, sinkhorn_reference
from jaxspec.sharding.rules import axes


@struct.dataclass
class HyperConnParams:
    fn: jax.Array = axes("hc_embed", "hc_mix")  # [hc*d, (2+hc)*hc] fp32
    base: jax.Array = axes("hc_mix")  # [(2+hc)*hc] fp32
    scale: jax.Array = axes(None)  # [3] fp32


@struct.dataclass
class HyperHeadParams:
    fn: jax.Array = axes("hc_embed", "streams")  # [hc*d, hc] fp32
    base: jax.Array = axes("streams")  # [hc] fp32
    scale: jax.Array = axes(None)  # [1] fp32


def init_hyper_conn(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> HyperConnParams:
    hc, d = cfg.hc_mult, cfg.hidden_size
    width = (2 + hc) * hc
    return HyperConnParams(
        fn=std * jax.random.normal(key, (hc * d, width), jnp.float32),
        base=jnp.zeros((width,), jnp.float32),
        scale=jnp.ones((3,), jnp.float32),
    )


def init_hyper_head(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> HyperHeadParams:
    hc, d = cfg.hc_mult, cfg.hidden_size
    return HyperHeadParams(
        fn=std * jax.random.normal(key, (hc * d, hc), jnp.float32),
        base=jnp.zeros((hc,), jnp.float32),
        scale=jnp.ones((1,), jnp.float32),
    )


def hc_pre(
    p: HyperConnParams, cfg: ModelConfig, streams: jax.Array  # [B, T, hc, d]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> collapsed [B, T, d] (sub-layer input), post [B, T, hc], comb [B, T, hc, hc]."""
    pre, post, comb = hc_mixes(p, cfg, streams)
    return hc_collapse(pre, streams), post, comb


def hc_collapse(pre: jax.Array, streams: jax.Array) -> jax.Array:
    """sum_h pre_h X_h in fp32: pre [B, T, hc], streams [B, T, hc, d] -> [B, T, d] in the streams' dtype."""
    return jnp.einsum("...h,...hd->...d", pre, streams.astype(jnp.float32)).astype(streams.dtype)


def hc_mixes(
    p: HyperConnParams, cfg: ModelConfig, streams: jax.Array  # [B, T, hc, d]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> pre [B, T, hc], post [B, T, hc], comb [B, T, hc, hc] (Sinkhorn-projected), all fp32. V4's
    sub-layer collapses with its own pre; V4.1's single pass hands it to the next sub-layer."""
    hc = cfg.hc_mult
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    mix = unweighted_rms_norm(flat, cfg.rms_norm_eps) @ p.fn
    pre_w, post_w, comb_w = mix[..., :hc], mix[..., hc : 2 * hc], mix[..., 2 * hc :]
    pre_b, post_b, comb_b = p.base[:hc], p.base[hc : 2 * hc], p.base[2 * hc :]
    pre = jax.nn.sigmoid(pre_w * p.scale[0] + pre_b) + cfg.hc_eps
    post = 2.0 * jax.nn.sigmoid(post_w * p.scale[1] + post_b)
    comb_logits = (comb_w * p.scale[2] + comb_b).reshape(*comb_w.shape[:-1], hc, hc)
    comb = jax.nn.softmax(comb_logits, axis=-1) + cfg.hc_eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + cfg.hc_eps)

    # With the Pallas kernels, one fused Sinkhorn launch on CUDA instead of ~3 per step; the loop elsewhere.
    normalise = sinkhorn if cfg.kernels == "pallas" else sinkhorn_reference
    return pre, post, normalise(comb, cfg.hc_sinkhorn_iters - 1, cfg.hc_eps)


def hc_post(
    out: jax.Array,  # [B, T, d]
    streams: jax.Array,  # [B, T, hc, d]
    post: jax.Array,  # [B, T, hc]
    comb: jax.Array,  # [B, T, hc, hc]
) -> jax.Array:
    """X'_k = post_k * out + sum_j comb[j, k] X_j (comb is applied transposed)."""
    dtype = streams.dtype
    mixed = jnp.einsum("btjk,btjd->btkd", comb.astype(dtype), streams)
    return post.astype(dtype)[..., None] * out[..., None, :] + mixed


def hc_post_fp32(
    out: jax.Array,  # [B, T, d]
    streams: jax.Array,  # [B, T, hc, d]
    post: jax.Array,  # [B, T, hc] fp32
    comb: jax.Array,  # [B, T, hc, hc] fp32
) -> jax.Array:
    """`hc_post` as V4.1's reference writes it: the weighted sum in fp32, cast to the streams' dtype once (in
    bfloat16 `hc_post` rounds comb, each product and the sum; in float32 the two are the same)."""
    mixed = jnp.einsum("btjk,btjd->btkd", comb, streams.astype(jnp.float32))
    return (post[..., None] * out.astype(jnp.float32)[..., None, :] + mixed).astype(streams.dtype)


def hc_head(p: HyperHeadParams, cfg: ModelConfig, streams: jax.Array) -> jax.Array:
    """Final collapse of the streams (no Sinkhorn).  streams: [B, T, hc, d] -> [B, T, d]."""
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    mix = unweighted_rms_norm(flat, cfg.rms_norm_eps) @ p.fn
    pre = jax.nn.sigmoid(mix * p.scale[0] + p.base) + cfg.hc_eps
    return jnp.einsum("...h,...hd->...d", pre, streams.astype(jnp.float32)).astype(streams.dtype)
