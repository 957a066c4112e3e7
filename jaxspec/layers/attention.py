"""V4 attention: MQA with one shared K=V head, sliding window + compressed entries (CSA top-k or
HCA dense) under one softmax with a per-head sink, inverse RoPE on the output, grouped low-rank
output projection (reference doc section 3).

`attention` reads the committed decode state and returns the new tokens' rows (their window kv,
compressor rows and candidate compressed entries) instead of writing them: the caller either
commits every valid token (prefill / extend / decode) or only an accepted tree path.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec import sharding
from jaxspec.config import ModelConfig
from jaxspec.layers.compressor import CompressorParams, compressor_rows, init_compressor, pool_entries
from jaxspec.layers.indexer import IndexerParams, index_queries, index_scores, init_indexer
from jaxspec.layers.norms import rms_norm, unweighted_rms_norm
from jaxspec.layers.rope import apply_rope, inv_freq, rope_angles

_QUERY_AXES = ("batch", None, "heads", None)  # [B, T, H, c]


@struct.dataclass
class AttentionParams:
    wq_a: jax.Array  # [d, q_lora_rank]
    q_norm: jax.Array  # [q_lora_rank] fp32
    wq_b: jax.Array  # [q_lora_rank, H*c]
    wkv: jax.Array  # [d, c]
    kv_norm: jax.Array  # [c] fp32
    wo_a: jax.Array  # [g, H*c/g, o_lora_rank]
    wo_b: jax.Array  # [g*o_lora_rank, d]
    sink: jax.Array  # [H] fp32
    compressor: CompressorParams | None
    indexer: IndexerParams | None


@struct.dataclass
class AttentionContext:
    """Where the new tokens sit relative to the committed state; shared by every layer."""

    positions: jax.Array  # [B, T] int32 absolute positions of the new tokens
    committed: jax.Array  # [B] int32 committed length P (positions < P are in the state)
    visible: jax.Array  # [B, T, T] bool: new token i may read new token j (self included)
    ancestor_at_depth: jax.Array  # [B, T, T] int32: index of i's chain element at position P + d
    valid: jax.Array  # [B, T] bool: padding tokens are False


@struct.dataclass
class AttentionRows:
    """Per-new-token results of one layer: the scratch a commit takes rows from."""

    kv: jax.Array  # [B, T, c] window kv (normed, RoPE'd)
    comp_kv: jax.Array | None = None  # [B, T, coff*c] fp32 compressor rows
    comp_gate: jax.Array | None = None  # [B, T, coff*c] fp32 (APE added)
    comp_entry: jax.Array | None = None  # [B, T, c] entry the token emits if it closes a block
    idx_kv: jax.Array | None = None  # [B, T, 2*c_I] fp32 indexer compressor rows
    idx_gate: jax.Array | None = None
    idx_entry: jax.Array | None = None  # [B, T, c_I]


def init_attention(cfg: ModelConfig, key: jax.Array, kind: str, std: float = 0.02) -> AttentionParams:
    d, h, c, dq = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    g, do = cfg.o_groups, cfg.o_lora_rank
    dtype = jnp.dtype(cfg.dtype)
    keys = jax.random.split(key, 8)

    def normal(kk, shape):
        return (std * jax.random.normal(kk, shape, jnp.float32)).astype(dtype)

    compressor = indexer = None
    if kind == "csa":
        compressor = init_compressor(cfg, keys[5], cfg.csa_ratio, overlap=True, width=c)
        indexer = init_indexer(cfg, keys[6])
    elif kind == "hca":
        compressor = init_compressor(cfg, keys[5], cfg.hca_ratio, overlap=False, width=c)
    return AttentionParams(
        wq_a=normal(keys[0], (d, dq)),
        q_norm=jnp.ones((dq,), jnp.float32),
        wq_b=normal(keys[1], (dq, h * c)),
        wkv=normal(keys[2], (d, c)),
        kv_norm=jnp.ones((c,), jnp.float32),
        wo_a=normal(keys[3], (g, h * c // g, do)),
        wo_b=normal(keys[4], (g * do, d)),
        sink=jnp.zeros((h,), jnp.float32),
        compressor=compressor,
        indexer=indexer,
    )


def ring_positions(committed: jax.Array, ring_size: int) -> jax.Array:
    """Absolute position held by each slot of a ring written at pos mod size: [B, R] (-1: empty)."""
    slots = jnp.arange(ring_size, dtype=jnp.int32)
    last = committed[:, None] - 1
    pos = last - jnp.mod(last - slots, ring_size)
    return jnp.where(pos >= 0, pos, -1)


def _sink_softmax(logits: jax.Array, sink: jax.Array) -> jax.Array:
    """Softmax over the last axis with exp(sink_h) added to the denominator.  logits: [B,T,H,K]."""
    sink = sink.astype(jnp.float32)[None, None, :, None]
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
    e = jnp.exp(logits - m)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))


def attention(
    p: AttentionParams,
    cfg: ModelConfig,
    kind: str,
    x: jax.Array,  # [B, T, d] normed sub-layer input
    layer_state: Any,  # state.LayerState: committed rings and compressed caches
    ctx: AttentionContext,
) -> tuple[jax.Array, AttentionRows]:
    b, t, _ = x.shape
    h, c = cfg.num_heads, cfg.head_dim
    compressed = kind != "sliding"
    ratio = {"sliding": 0, "csa": cfg.csa_ratio, "hca": cfg.hca_ratio}[kind]
    freqs = inv_freq(cfg, compressed)
    cos, sin = rope_angles(ctx.positions, freqs)  # [B, T, r/2]

    q_latent = rms_norm(x @ p.wq_a, p.q_norm, cfg.rms_norm_eps)
    q = (q_latent @ p.wq_b).reshape(b, t, h, c)
    q = apply_rope(unweighted_rms_norm(q, cfg.rms_norm_eps), cos[:, :, None], sin[:, :, None])
    kv = apply_rope(rms_norm(x @ p.wkv, p.kv_norm, cfg.rms_norm_eps), cos, sin)  # [B, T, c]
    rows = AttentionRows(kv=kv)

    # Window keys: the committed ring (last W positions) followed by the new tokens.
    window = cfg.sliding_window
    ring = layer_state.swa_kv
    ring_pos = ring_positions(ctx.committed, ring.shape[1])  # [B, W]
    pos_q = ctx.positions[:, :, None]
    ring_ok = (ring_pos[:, None, :] >= 0) & (ring_pos[:, None, :] > pos_q - window)
    new_ok = ctx.visible & (ctx.positions[:, None, :] > pos_q - window)
    win_keys = jnp.concatenate([ring.astype(kv.dtype), kv], axis=1)  # [B, W+T, c]
    win_ok = jnp.concatenate([ring_ok, new_ok], axis=-1)  # [B, T, W+T]
    scale = c**-0.5
    logits = jnp.einsum("bthc,bsc->bths", q, win_keys, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(win_ok[:, :, None, :], logits, -jnp.inf)

    comp_values = None
    if compressed:
        comp_kv_rows, comp_gate_rows = compressor_rows(p.compressor, x, ctx.positions, ratio)
        entry = pool_entries(
            p.compressor, cfg, ratio, kind == "csa", layer_state.comp_rows_kv, layer_state.comp_rows_gate,
            comp_kv_rows, comp_gate_rows, ctx.positions, ctx.committed, ctx.ancestor_at_depth, freqs,
        ).astype(kv.dtype)
        rows = rows.replace(comp_kv=comp_kv_rows, comp_gate=comp_gate_rows, comp_entry=entry)
        emits = ((ctx.positions + 1) % ratio == 0) & ctx.valid  # [B, T]
        num_committed_entries = ctx.committed // ratio  # [B]
        cache = layer_state.comp_kv
        cache_ok = jnp.arange(cache.shape[1])[None, :] < num_committed_entries[:, None]  # [B, Lc]
        entries = jnp.concatenate([cache.astype(kv.dtype), entry], axis=1)  # [B, Lc+T, c]
        entry_ok = jnp.concatenate(
            [jnp.broadcast_to(cache_ok[:, None, :], (b, t, cache.shape[1])), ctx.visible & emits[:, None, :]],
            axis=-1,
        )  # [B, T, Lc+T]
        if kind == "hca":
            comp_keys = entries
            comp_logits = jnp.einsum("bthc,bsc->bths", q, entries, preferred_element_type=jnp.float32)
            comp_logits = jnp.where(entry_ok[:, :, None, :], comp_logits * scale, -jnp.inf)
        else:
            ip = p.indexer
            idx_kv_rows, idx_gate_rows = compressor_rows(ip.compressor, x, ctx.positions, ratio)
            idx_entry = pool_entries(
                ip.compressor, cfg, ratio, True, layer_state.idx_rows_kv, layer_state.idx_rows_gate,
                idx_kv_rows, idx_gate_rows, ctx.positions, ctx.committed, ctx.ancestor_at_depth, freqs,
            )
            rows = rows.replace(idx_kv=idx_kv_rows, idx_gate=idx_gate_rows, idx_entry=idx_entry)
            index_keys = jnp.concatenate([layer_state.idx_kv.astype(jnp.float32), idx_entry], axis=1)
            iq, iw = index_queries(ip, cfg, q_latent, x, cos, sin)
            scores = jnp.where(entry_ok, index_scores(iq, iw, index_keys), -jnp.inf)
            k = min(cfg.index_topk, entries.shape[1])
            top_scores, top_index = jax.lax.top_k(scores, k)  # [B, T, k]
            selected_ok = top_scores > -jnp.inf
            comp_keys = jnp.take_along_axis(
                entries[:, None, :, :], top_index[..., None], axis=2
            )  # [B, T, k, c]
            comp_logits = jnp.einsum("bthc,btkc->bthk", q, comp_keys, preferred_element_type=jnp.float32)
            comp_logits = jnp.where(selected_ok[:, :, None, :], comp_logits * scale, -jnp.inf)
        comp_values = comp_keys
        logits = jnp.concatenate([logits, comp_logits], axis=-1)

    if cfg.attention_impl == "pallas":
        # Same key sets, given to the kernel as lengths / index lists; the dense logits above are
        # then unused and dropped by jit.
        from jaxspec.pallas.tree_attention import attention_from_context  # lazy: the kernels import layers

        comp = {}
        if compressed:
            comp = dict(cache=cache, num_committed_entries=num_committed_entries, entry=entry, emits=emits)
            if kind == "csa":
                comp.update(top_index=top_index, selected_ok=selected_ok)
        # Under a mesh the kernel runs once per shard on its own heads (shard_kernel); every other
        # argument holds this data shard's rows whole.
        kernel = sharding.shard_kernel(
            attention_from_context,
            in_axes=[_QUERY_AXES, None, None, None, None, ("heads",)],
            out_axes=_QUERY_AXES,
        )
        out = kernel(q, kv, ring, ring_pos, ctx, p.sink, window=window, scale=scale, kind=kind, **comp)
    else:
        probs = _sink_softmax(logits, p.sink)  # [B, T, H, W+T (+ compressed)]
        n_win = win_keys.shape[1]
        out = jnp.einsum("bths,bsc->bthc", probs[..., :n_win], win_keys.astype(jnp.float32))
        if comp_values is not None:
            comp_probs = probs[..., n_win:]
            if kind == "hca":
                out = out + jnp.einsum("bths,bsc->bthc", comp_probs, comp_values.astype(jnp.float32))
            else:
                out = out + jnp.einsum("bthk,btkc->bthc", comp_probs, comp_values.astype(jnp.float32))
    out = apply_rope(out, cos[:, :, None], sin[:, :, None], inverse=True).astype(x.dtype)

    g = cfg.o_groups
    grouped = out.reshape(b, t, g, h * c // g)
    projected = jnp.einsum("btgi,gio->btgo", grouped, p.wo_a).reshape(b, t, -1)
    return projected @ p.wo_b, rows
