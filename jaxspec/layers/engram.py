"""Engram (DeepSeek-V4.1; docs/v41.md, "Engram"): hashed n-gram memory added to every residual copy.

A token's 2- to N-gram hashes (`ops.ngram_hash`) pick (N-1)*H rows of the layer's table; `wkv` turns
their concatenation into one key per hyper-connection copy and one value shared by all; copy c adds
the value times a gate, the sigmoid of a signed square root of the normalized dot product of the copy
with its key. The table is the only state-free memory of the model that depends on the previous
tokens: the caller hands each token its own n-gram (on a tree, its path's tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.ops import fakequant, quant
from jaxspec.ops.quant import Weight
from jaxspec.sharding.rules import axes


@struct.dataclass
class EngramParams:
    # [rows, head_dim]: the release stores it FP8 with one scale per 32 columns of a row (~98 GB a
    # layer at V4.1-Flash's sizes); rows are gathered, never the table dequantized.
    table: Weight = axes("engram_rows", "engram_dim", quant="rows")
    wkv: Weight = axes("engram_in", "engram_out", quant="fp8_32")  # [(N-1)*H*head_dim, (hc+1)*d]
    q_weight: jax.Array = axes("streams", "embed")  # [hc, d]; only q_weight * k_weight is used
    k_weight: jax.Array = axes("streams", "embed")  # [hc, d]


def init_engram(cfg: ModelConfig, key: jax.Array, rows: int, std: float = 0.02) -> EngramParams:
    v = cfg.v41
    width = v.engram_hash_columns * v.engram_head_dim
    hc, d, dtype = cfg.hc_mult, cfg.hidden_size, jnp.dtype(cfg.dtype)
    k1, k2 = jax.random.split(key)
    return EngramParams(
        table=jax.random.normal(k1, (rows, v.engram_head_dim), jnp.float32).astype(dtype),
        wkv=(std * jax.random.normal(k2, (width, (hc + 1) * d), jnp.float32)).astype(dtype),
        q_weight=jnp.ones((hc, d), dtype), k_weight=jnp.ones((hc, d), dtype))


def table_rows(table: Weight, ids: jax.Array, dtype) -> jax.Array:
    """ids [...] int32 -> rows [..., head_dim] in `dtype`, gathered still quantized."""
    flat = quant.dequantize(quant.take(table, ids.reshape(-1)))  # [n, head_dim]
    return flat.reshape(*ids.shape, -1).astype(dtype)


def engram(
    p: EngramParams,
    cfg: ModelConfig,
    streams: jax.Array,  # [B, T, hc, d]
    row_ids: jax.Array,  # [B, T, (N-1)*H] int32 table rows of each token's n-grams
) -> jax.Array:
    """-> streams [B, T, hc, d] with the gated n-gram value added to each copy."""
    b, t, hc, d = streams.shape
    emb = table_rows(p.table, row_ids, streams.dtype).reshape(b, t, -1)  # [B, T, cols*head_dim]
    kv = quant.matmul(fakequant.roundings(cfg.v41.qat).fp8(emb), p.wkv)  # [B, T, (hc+1)*d]
    key = kv[..., : hc * d].reshape(b, t, hc, d).astype(jnp.float32)
    value = kv[..., hc * d :].astype(jnp.float32)
    h = streams.astype(jnp.float32)
    eps = cfg.rms_norm_eps
    rstd = (jax.lax.rsqrt(jnp.mean(h * h, axis=-1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, axis=-1) + eps))
    weight = p.q_weight.astype(jnp.float32) * p.k_weight.astype(jnp.float32)
    dot = jnp.sum(h * weight * key, axis=-1) * rstd * d**-0.5  # [B, T, hc]
    magnitude = jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6))
    gate = jax.nn.sigmoid(jnp.where(dot >= 0, magnitude, -magnitude))
    return (h + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)
