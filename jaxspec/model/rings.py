"""Writes into a committed decode state, addressed by absolute position (shared by V4's and V4.1's states)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_ring(
    ring: jax.Array,  # [B, R, ...]
    rows: jax.Array,  # [B, T, ...]
    positions: jax.Array,  # [B, T]
    take: jax.Array,  # [B, T] bool
    new_length: jax.Array,  # [B]
) -> jax.Array:
    """Write rows of taken tokens at slot pos mod R; only the last R positions survive."""
    size = ring.shape[1]
    keep = take & (positions >= new_length[:, None] - size)
    slot = jnp.where(keep, positions % size, size)  # out of range -> dropped
    batch_index = jnp.arange(ring.shape[0])[:, None]
    return ring.at[batch_index, slot].set(rows.astype(ring.dtype), mode="drop")


def write_entries(
    cache: jax.Array,  # [B, Lc, ...]
    entries: jax.Array,  # [B, T, ...]
    positions: jax.Array,  # [B, T]
    take: jax.Array,  # [B, T] bool
    ratio: int,
) -> jax.Array:
    """Write the entry of every taken token that closes a block of `ratio` at index pos // ratio."""
    emits = take & ((positions + 1) % ratio == 0)
    index = jnp.where(emits, positions // ratio, cache.shape[1])
    batch_index = jnp.arange(cache.shape[0])[:, None]
    return cache.at[batch_index, index].set(entries.astype(cache.dtype), mode="drop")
