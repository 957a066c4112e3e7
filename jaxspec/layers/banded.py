"""Banded attention for a causal chunk of new tokens (chunked prefill, docs/prefill.md "Banded chunks").

`attention.attend` gives every new token a row over all T new keys ([B, T, H, W + T] window logits)
and every new token's candidate compressed entry ([B, T, T] masks): fine for a decode step or a tree
of a few dozen nodes, quadratic in a prefill chunk. When the T new tokens are one causal chain
(positions P .. P+T-1, a valid prefix per row), a token at row i reads new window keys only in rows
(i - W, i], so the chunk splits into query blocks of `block` >= W rows and block j reads the
committed ring, block j-1 and itself: logits [B, T/block, block, H, W + 2*block], linear in T.

The chunk's own compressed entries need no [T, T] mask either: a chain's entries are the ones the
commit will write, at index pos // ratio, so they go into a copy of the compressed cache (and of the
indexer's keys) and token i reads entries [0, (pos_i + 1) // ratio) of it -- HCA densely, CSA
through the indexer's top-k over that same prefix. Same key sets, same softmax as `attend`; only the
order of the keys in the sum differs (the tests hold both to 1e-5 of the one-shot program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.core.checks import next_power_of_two
from jaxspec.core.config import ModelConfig

MIN_BLOCK = 64  # query rows per block: below this the per-block einsums are too small to pay


def band_block(cfg: ModelConfig, t: int) -> int:
    """Query rows per block of the banded path for a causal chunk of `t` tokens; 0 = the dense path
    (chunks up to two blocks, and the Pallas kernels, whose contract is the dense one)."""
    if cfg.kernels == "pallas":
        return 0
    block = max(MIN_BLOCK, next_power_of_two(cfg.sliding_window))
    return block if t > 2 * block and t % block == 0 else 0


def with_chain_entries(
    cache: jax.Array,  # [B, Lc, D] committed entries (index = block)
    entries: jax.Array,  # [B, T, D] candidate entry of every new token
    positions: jax.Array,  # [B, T] int32
    emits: jax.Array,  # [B, T] bool: the token closes a block (and is valid)
    ratio: int,
) -> jax.Array:
    """The cache with the chain's emitted entries written where the commit will put them."""
    index = jnp.where(emits, positions // ratio, cache.shape[1])
    batch_index = jnp.arange(cache.shape[0])[:, None]
    return cache.at[batch_index, index].set(entries.astype(cache.dtype), mode="drop")


def chain_entry_ok(positions: jax.Array, num_entries: int, ratio: int) -> jax.Array:
    """[B, T, Lc] bool: token i of a chain reads entries [0, (pos_i + 1) // ratio) (committed + its own chain's)."""
    return jnp.arange(num_entries)[None, None, :] < ((positions + 1) // ratio)[..., None]


def attend_banded(
    q: jax.Array,  # [B, T, H, c] queries (RoPE'd), T a multiple of block
    window_kv: jax.Array,  # [B, W, c] committed window ring
    window_pos: jax.Array,  # [B, W] int32 absolute position of each slot (-1: empty)
    new_kv: jax.Array,  # [B, T, c] window kv of the chain's tokens
    valid: jax.Array,  # [B, T] bool, a prefix of each row
    positions: jax.Array,  # [B, T] int32: P + row
    sink: jax.Array,  # [H] fp32
    *,
    window: int,
    scale: float,
    block: int,
    comp_kv: jax.Array | None = None,  # [B, Lc, c] compressed entries, the chain's own written in
    comp_ok: jax.Array | None = None,  # [B, T, Lc] bool: dense (HCA) -- the entries token i reads
    comp_index: jax.Array | None = None,  # [B, T, K] int32: sparse (CSA) -- per-token ids, -1 = none
) -> jax.Array:
    """`attention.attend` for one causal chain, block by block -> [B, T, H, c] fp32."""
    bsz, t, h, c = q.shape
    n = t // block
    dt, f32 = q.dtype, jnp.float32
    qb = q.reshape(bsz, n, block, h, c)
    win_ok = (window_pos[:, None, :] >= 0) & (window_pos[:, None, :] > positions[:, :, None] - window)  # [B, T, W]

    def previous_and_own(x):  # [B, n, block, ...] -> [B, n, 2*block, ...]: block j-1 (zeros for j=0), then j
        pad = [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2)
        return jnp.concatenate([jnp.pad(x, pad)[:, :-1], x], axis=2)

    local_kv = previous_and_own(new_kv.astype(dt).reshape(bsz, n, block, c))  # [B, n, 2b, c]
    local_valid = previous_and_own(valid.reshape(bsz, n, block))  # [B, n, 2b]
    rel = jnp.arange(2 * block)[None, :] - block - jnp.arange(block)[:, None]  # [b, 2b] key row - query row
    local_ok = (rel <= 0)[None, None] & (rel > -window)[None, None] & local_valid[:, :, None, :]  # [B, n, b, 2b]

    parts = [  # (keys, ok [B, n, b, S], einsum of q with the keys, of probs with the keys)
        (window_kv.astype(dt), win_ok.reshape(bsz, n, block, -1), "bnihc,bsc->bnihs", "bnihs,bsc->bnihc"),
        (local_kv, local_ok, "bnihc,bnsc->bnihs", "bnihs,bnsc->bnihc"),
    ]
    if comp_kv is not None and comp_ok is not None:
        parts.append((comp_kv.astype(dt), comp_ok.reshape(bsz, n, block, -1), "bnihc,bsc->bnihs", "bnihs,bsc->bnihc"))
    if comp_kv is not None and comp_index is not None:
        picked = jnp.take_along_axis(comp_kv.astype(dt)[:, None], jnp.maximum(comp_index, 0)[..., None], axis=2)
        parts.append((picked.reshape(bsz, n, block, -1, c), (comp_index >= 0).reshape(bsz, n, block, -1),
                      "bnihc,bnikc->bnihk", "bnihk,bnikc->bnihc"))
    logits = []
    for keys, ok, spec, _ in parts:
        s = jnp.einsum(spec, qb, keys, preferred_element_type=f32) * scale
        logits.append(jnp.where(ok[..., None, :], s, -jnp.inf))
    logits = jnp.concatenate(logits, axis=-1)  # [B, n, b, H, W + 2b + entries]
    sk = sink.astype(f32)[None, None, None, :, None]
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sk)
    e = jnp.exp(logits - m)
    probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sk - m))
    out, offset = 0.0, 0
    for keys, _, _, spec in parts:
        width = keys.shape[-2]
        out = out + jnp.einsum(spec, probs[..., offset : offset + width], keys.astype(f32))
        offset += width
    return out.reshape(bsz, t, h, c)
