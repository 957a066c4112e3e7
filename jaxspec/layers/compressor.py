"""Token-level gated pooling of the CSA / HCA compressors (reference doc section 3.3).

Each token t writes one fp32 row `(u_t, z_t + ape[t mod ratio])`; the token that closes block w
(position ratio*w + ratio - 1) pools the last coff*ratio rows with a per-channel softmax. CSA
(coff = 2) reads the previous block through the A half of its rows and its own block through the B
half; HCA (coff = 1) reads its own block. Rows are addressed by absolute position, so the same
pooling serves prefill, chunked extend, decode and tree verification: the caller says where the
row of every source position lives (committed ring or a new token on the query's own chain).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import ModelConfig
from jaxspec.layers.norms import rms_norm
from jaxspec.layers.rope import apply_rope, rope_angles


@struct.dataclass
class CompressorParams:
    wkv: jax.Array  # [d, coff*D]
    wgate: jax.Array  # [d, coff*D]
    ape: jax.Array  # [ratio, coff*D] fp32, learned in-block position bias
    norm: jax.Array  # [D] fp32


def init_compressor(
    cfg: ModelConfig, key: jax.Array, ratio: int, overlap: bool, width: int, std: float = 0.02
) -> CompressorParams:
    coff = 2 if overlap else 1
    k1, k2 = jax.random.split(key)
    dtype = jnp.float32  # V4 keeps compressor projections in fp32
    return CompressorParams(
        wkv=(std * jax.random.normal(k1, (cfg.hidden_size, coff * width))).astype(dtype),
        wgate=(std * jax.random.normal(k2, (cfg.hidden_size, coff * width))).astype(dtype),
        ape=jnp.zeros((ratio, coff * width), jnp.float32),
        norm=jnp.ones((width,), jnp.float32),
    )


def compressor_rows(
    p: CompressorParams, x: jax.Array, positions: jax.Array, ratio: int  # x: [B, T, d], pos: [B, T]
) -> tuple[jax.Array, jax.Array]:
    """-> kv rows [B, T, coff*D] fp32, gate rows (APE added) [B, T, coff*D] fp32."""
    x32 = x.astype(jnp.float32)
    kv = x32 @ p.wkv.astype(jnp.float32)
    gate = x32 @ p.wgate.astype(jnp.float32) + p.ape[positions % ratio]
    return kv, gate


def source_indices(
    positions: jax.Array,  # [B, T] query positions
    committed: jax.Array,  # [B] committed length P
    ancestor_at_depth: jax.Array,  # [B, T, T] new-token index of the chain element at P + depth
    num_sources: int,
    ring_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Where the rows of positions pos-num_sources+1 .. pos live, per query.

    Index into concat(committed ring [ring_size], new rows [T]) -> ([B, T, S] int32, valid [B, T, S]).
    """
    offsets = jnp.arange(num_sources, dtype=jnp.int32) - (num_sources - 1)
    src_pos = positions[..., None] + offsets  # [B, T, S]
    p = committed[:, None, None]
    depth = jnp.clip(src_pos - p, 0, ancestor_at_depth.shape[-1] - 1)
    from_new = ring_size + jnp.take_along_axis(ancestor_at_depth, depth, axis=-1)
    from_ring = src_pos % ring_size
    index = jnp.where(src_pos >= p, from_new, from_ring)
    return index.astype(jnp.int32), src_pos >= 0


def pool_entries(
    p: CompressorParams,
    cfg: ModelConfig,
    ratio: int,
    overlap: bool,
    ring_kv: jax.Array,  # [B, R, coff*D] committed rows, slot = pos mod R
    ring_gate: jax.Array,  # [B, R, coff*D]
    new_kv: jax.Array,  # [B, T, coff*D]
    new_gate: jax.Array,  # [B, T, coff*D]
    positions: jax.Array,  # [B, T]
    committed: jax.Array,  # [B]
    ancestor_at_depth: jax.Array,  # [B, T, T]
    freqs,
) -> jax.Array:
    """Candidate compressed entry of every new token as if it closed a block: [B, T, D].

    Only tokens with (pos + 1) % ratio == 0 emit (the caller masks the rest); computing all keeps
    shapes static and lets sibling tree nodes close the same block index differently.
    """
    if cfg.attention_impl == "pallas":
        from jaxspec.pallas.chain_compress import chain_compress  # lazy: the kernel module imports layers

        return chain_compress(
            ring_kv, ring_gate, new_kv, new_gate, positions, committed, ancestor_at_depth, p.norm, freqs,
            ratio=ratio, overlap=overlap, eps=cfg.rms_norm_eps,
        )
    return pool_rows(
        ring_kv, ring_gate, new_kv, new_gate, positions, committed, ancestor_at_depth, p.norm, freqs,
        ratio=ratio, overlap=overlap, eps=cfg.rms_norm_eps,
    )


def pool_rows(
    ring_kv: jax.Array,  # [B, R, coff*D] committed rows, slot = pos mod R
    ring_gate: jax.Array,  # [B, R, coff*D]
    new_kv: jax.Array,  # [B, T, coff*D]
    new_gate: jax.Array,  # [B, T, coff*D]
    positions: jax.Array,  # [B, T]
    committed: jax.Array,  # [B]
    ancestor_at_depth: jax.Array,  # [B, T, T]
    norm: jax.Array,  # [D] fp32 RMSNorm weight
    freqs,
    *,
    ratio: int,
    overlap: bool,
    eps: float,
) -> jax.Array:
    """The jnp pooling behind `pool_entries` (also the Pallas chain-compress kernel's reference)."""
    coff = 2 if overlap else 1
    width = norm.shape[0]
    num_sources = coff * ratio
    ring_size = ring_kv.shape[1]
    index, src_valid = source_indices(positions, committed, ancestor_at_depth, num_sources, ring_size)
    all_kv = jnp.concatenate([ring_kv, new_kv], axis=1)
    all_gate = jnp.concatenate([ring_gate, new_gate], axis=1)
    b, t, s = index.shape
    flat = index.reshape(b, t * s, 1)
    kv = jnp.take_along_axis(all_kv, flat, axis=1).reshape(b, t, s, -1)
    gate = jnp.take_along_axis(all_gate, flat, axis=1).reshape(b, t, s, -1)
    if overlap:
        # Slots 0..ratio-1 read the previous block's A half, the rest the own block's B half.
        first = (jnp.arange(s) < ratio)[None, None, :, None]
        kv = jnp.where(first, kv[..., :width], kv[..., width:])
        gate = jnp.where(first, gate[..., :width], gate[..., width:])
    gate = jnp.where(src_valid[..., None], gate, -jnp.inf)
    kv = jnp.where(src_valid[..., None], kv, 0.0)
    weights = jax.nn.softmax(gate, axis=2)
    pooled = jnp.sum(kv * weights, axis=2)
    pooled = rms_norm(pooled, norm, eps)
    cos, sin = rope_angles((positions // ratio) * ratio, freqs)
    return apply_rope(pooled, cos, sin)
