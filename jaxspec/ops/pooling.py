"""Gated pooling of compressor rows into one compressed entry (docs/architecture.md §3).

Rows are addressed by absolute position: the row of position p sits in the committed ring (slot
p mod R) when p < P, else it is a new token's row, found through the chain of ancestors of the
query (`ancestor_at_depth`). The same pooling serves prefill, chunked extend, decode and tree
verification, and it is the jnp path the chain-compress kernel is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.core.config import pooling_coff
from jaxspec.ops.norms import rms_norm
from jaxspec.ops.rope import apply_rope, rope_angles


def source_indices(
    positions: jax.Array,  # [B, T] query positions
    committed: jax.Array,  # [B] committed length P
    ancestor_at_depth: jax.Array | None,  # [B, T, T] new-token index of the chain element at P + depth
    num_sources: int,
    ring_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Where the rows of positions pos-num_sources+1 .. pos live, per query.

    Index into concat(committed ring [ring_size], new rows [T]) -> ([B, T, S] int32, valid [B, T, S]).
    ancestor_at_depth None: the new tokens are one causal chain (the element at P + depth is row depth).
    """
    offsets = jnp.arange(num_sources, dtype=jnp.int32) - (num_sources - 1)
    src_pos = positions[..., None] + offsets  # [B, T, S]
    p = committed[:, None, None]
    depth = jnp.clip(src_pos - p, 0, (positions if ancestor_at_depth is None else ancestor_at_depth).shape[-1] - 1)
    chain = depth if ancestor_at_depth is None else jnp.take_along_axis(ancestor_at_depth, depth, axis=-1)
    from_new = ring_size + chain
    from_ring = src_pos % ring_size
    index = jnp.where(src_pos >= p, from_new, from_ring)
    return index.astype(jnp.int32), src_pos >= 0


def gather_sources(
    ring: jax.Array,  # [B, R, D] committed rows
    new: jax.Array,  # [B, T, D] the new tokens' rows
    index: jax.Array,  # [B, T, S] from `source_indices`: into concat(ring, new)
) -> jax.Array:
    """The S source rows of every query -> [B, T, S, D]."""
    b, t, s = index.shape
    rows = jnp.concatenate([ring, new], axis=1)
    return jnp.take_along_axis(rows, index.reshape(b, t * s, 1), axis=1).reshape(b, t, s, -1)


def gated_sum(
    kv: jax.Array,  # [B, T, S, D] source rows
    gate: jax.Array,  # [B, T, S, D] their gate logits
    valid: jax.Array,  # [B, T, S] bool: sources at positions >= 0
) -> jax.Array:
    """sum_s kv_s softmax_s(gate) per channel over the valid sources -> [B, T, D] fp32."""
    gate = jnp.where(valid[..., None], gate, -jnp.inf)
    kv = jnp.where(valid[..., None], kv, 0.0)
    return jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2)


def pool_rows(
    ring_kv: jax.Array,  # [B, R, coff*D] committed rows, slot = pos mod R
    ring_gate: jax.Array,  # [B, R, coff*D]
    new_kv: jax.Array,  # [B, T, coff*D]
    new_gate: jax.Array,  # [B, T, coff*D]
    positions: jax.Array,  # [B, T]
    committed: jax.Array,  # [B]
    ancestor_at_depth: jax.Array | None,  # [B, T, T]; None: one causal chain
    norm: jax.Array,  # [D] fp32 RMSNorm weight
    freqs,
    *,
    ratio: int,
    overlap: bool,
    eps: float,
) -> jax.Array:
    """Entry of every new token as if it closed a block: [B, T, D] fp32 (callers mask the tokens that do
    not close one). The jnp path of `layers.compressor.pool_entries` and the chain-compress kernel's reference."""
    coff = pooling_coff(overlap)
    width = norm.shape[0]
    num_sources = coff * ratio
    ring_size = ring_kv.shape[1]
    index, src_valid = source_indices(positions, committed, ancestor_at_depth, num_sources, ring_size)
    kv, gate = gather_sources(ring_kv, new_kv, index), gather_sources(ring_gate, new_gate, index)
    if overlap:
        # Slots 0..ratio-1 read the previous block's A half, the rest the own block's B half.
        first = (jnp.arange(num_sources) < ratio)[None, None, :, None]
        kv = jnp.where(first, kv[..., :width], kv[..., width:])
        gate = jnp.where(first, gate[..., :width], gate[..., width:])
    pooled = rms_norm(gated_sum(kv, gate, src_valid), norm, eps)
    cos, sin = rope_angles((positions // ratio) * ratio, freqs)
    return apply_rope(pooled, cos, sin)
