"""Token-level gated pooling of the CSA / HCA compressors (docs/architecture.md §3).

Each token t writes one fp32 row `(u_t, z_t + ape[t mod ratio])`; the token that closes block w
(position ratio*w + ratio - 1) pools the last coff*ratio rows with a per-channel softmax. CSA
(coff = 2) reads the previous block through the A half of its rows and its own block through the B
half; HCA (coff = 1) reads its own block. Rows are addressed by absolute position, so the same
pooling serves prefill, chunked extend, decode and tree verification: the caller says where the
row of every source position lives (committed ring or a new token on the query's own chain).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import LayerGeometry, ModelConfig, pooling_coff
from jaxspec.ops.pallas.chain_compress import chain_compress
from jaxspec.ops.pooling import pool_rows
from jaxspec.sharding.rules import axes


@struct.dataclass
class CompressorParams:
    wkv: jax.Array = axes("embed", "compress")  # [d, coff*D]
    wgate: jax.Array = axes("embed", "compress")  # [d, coff*D]
    ape: jax.Array = axes("ratio", "compress")  # [ratio, coff*D] fp32, learned in-block position bias
    norm: jax.Array = axes("kv")  # [D] fp32


def init_compressor(
    cfg: ModelConfig, key: jax.Array, ratio: int, overlap: bool, width: int, std: float = 0.02
) -> CompressorParams:
    coff = pooling_coff(overlap)
    k1, k2 = jax.random.split(key)
    dtype = jnp.float32  # V4 keeps compressor projections in fp32
    return CompressorParams(
        wkv=(std * jax.random.normal(k1, (cfg.hidden_size, coff * width))).astype(dtype),
        wgate=(std * jax.random.normal(k2, (cfg.hidden_size, coff * width))).astype(dtype),
        ape=jnp.zeros((ratio, coff * width), jnp.float32),
        norm=jnp.ones((width,), jnp.float32),
    )


@struct.dataclass
class PoolRows:
    """Compressor rows: the committed ring's ([B, R, coff*D], slot = pos mod R) or new tokens' ([B, T, coff*D])."""

    kv: jax.Array  # fp32
    gate: jax.Array  # fp32, APE added


def compressor_rows(
    p: CompressorParams, x: jax.Array, positions: jax.Array, ratio: int  # x: [B, T, d], pos: [B, T]
) -> PoolRows:
    """-> kv rows [B, T, coff*D] fp32, gate rows (APE added) [B, T, coff*D] fp32."""
    x32 = x.astype(jnp.float32)
    kv = x32 @ p.wkv.astype(jnp.float32)
    gate = x32 @ p.wgate.astype(jnp.float32) + p.ape[positions % ratio]
    return PoolRows(kv, gate)


def pool_entries(
    p: CompressorParams,
    cfg: ModelConfig,
    geo: LayerGeometry,  # the layer's ratio and pooling overlap (an indexer pools with overlap)
    ring: PoolRows,  # [B, R, coff*D] committed rows
    new: PoolRows,  # [B, T, coff*D] the new tokens' rows
    ctx: Any,  # the layer's AttentionContext: positions [B, T], committed [B], ancestor_at_depth [B, T, T]
    freqs: jax.Array,
) -> jax.Array:
    """Candidate compressed entry of every new token as if it closed a block: [B, T, D].

    Only tokens with (pos + 1) % ratio == 0 emit (the caller masks the rest); computing all keeps
    shapes static and lets sibling tree nodes close the same block index differently.
    """
    pool = chain_compress if cfg.kernels == "pallas" else pool_rows
    return pool(ring.kv, ring.gate, new.kv, new.gate, ctx.positions, ctx.committed, ctx.ancestor_at_depth, p.norm,
                freqs, ratio=geo.ratio, overlap=geo.overlap, eps=cfg.rms_norm_eps)
