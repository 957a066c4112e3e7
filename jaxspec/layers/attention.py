"""V4 attention: MQA with one shared K=V head, sliding window + compressed entries (CSA top-k or
HCA dense) under one softmax with a per-head sink, inverse RoPE on the output, grouped low-rank
output projection (docs/architecture.md §2).

`attention` reads the committed decode state and returns the new tokens' rows (their window kv,
compressor rows and candidate compressed entries) instead of writing them: the caller either
commits every valid token (prefill / extend / decode) or only an accepted tree path.

The key sets a token reads are built once, as lengths and index lists (never as masks over the
history), and handed either to `attend` (the jnp path, the reference the kernel is tested
against) or to the Pallas kernel `pallas.tree_attention.tree_attention`, which share one contract.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.layers.banded import attend_banded, chain_entry_ok, with_chain_entries
from jaxspec.layers.compressor import CompressorParams, PoolRows, compressor_rows, init_compressor, pool_entries
from jaxspec.layers.indexer import IndexerParams, index_queries, index_scores, init_indexer
from jaxspec.ops import quant
from jaxspec.ops.norms import rms_norm, unweighted_rms_norm
from jaxspec.ops.pallas.tree_attention import tree_attention
from jaxspec.ops.quant import Weight
from jaxspec.ops.rope import apply_rope, inv_freq, rope_angles
from jaxspec.sharding.active import shard_kernel
from jaxspec.sharding.rules import axes

_QUERY_AXES = ("batch", None, "heads", None)  # [B, T, H, c]


@struct.dataclass
class AttentionParams:
    # The projections may be BlockScaled (weights kept FP8 as the release stores them).
    wq_a: Weight = axes("embed", "q_lora", quant="fp8")  # [d, q_lora_rank]
    q_norm: jax.Array = axes("q_lora")  # [q_lora_rank] fp32
    wq_b: Weight = axes("q_lora", "heads", quant="fp8")  # [q_lora_rank, H*c], head-major
    wkv: Weight = axes("embed", "kv", quant="fp8")  # [d, c]: one shared K=V head (MQA), never split
    kv_norm: jax.Array = axes("kv")  # [c] fp32
    wo_a: Weight = axes("o_groups", "group_width", "o_lora", quant="fp8_groups")  # [g, H*c/g, o_lora_rank]
    wo_b: Weight = axes("o_groups", "embed", quant="fp8")  # [g*o_lora_rank, d], group-major
    sink: jax.Array = axes("heads")  # [H] fp32
    compressor: CompressorParams | None
    indexer: IndexerParams | None


@struct.dataclass
class AttentionContext:
    """Where the new tokens sit relative to the committed state; shared by every layer."""

    positions: jax.Array  # [B, T] int32 absolute positions of the new tokens
    committed: jax.Array  # [B] int32 committed length P (positions < P are in the state)
    visible: jax.Array | None  # [B, T, T] bool: new token i may read new token j (self included)
    ancestor_at_depth: jax.Array | None  # [B, T, T] int32: index of i's chain element at position P + d
    valid: jax.Array  # [B, T] bool: padding tokens are False
    # Window kv of uncommitted tokens computed by earlier calls (the draft's scratch): a new token
    # also reads prior key j where prior_visible[i, j]. Sliding-window layers only.
    prior_kv: jax.Array | None = None  # [B, X, c]
    prior_positions: jax.Array | None = None  # [B, X] int32
    prior_visible: jax.Array | None = None  # [B, T, X] bool
    # Static: > 0 when the new tokens are one causal chain (positions P + row, a valid prefix per
    # row) read through `layers.banded` in query blocks of this many rows; visible and
    # ancestor_at_depth are then None (nothing [T, T] is built). 0: the dense path (`attend`).
    band: int = struct.field(pytree_node=False, default=0)


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
    geo = cfg.geometry(kind)
    if geo.compressed:
        compressor = init_compressor(cfg, keys[5], geo.ratio, overlap=geo.overlap, width=c)
    if geo.indexed:
        indexer = init_indexer(cfg, keys[6])
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


def queries(
    p: AttentionParams,
    cfg: ModelConfig,
    x: jax.Array,  # [B, T, d] normed sub-layer input
    cos: jax.Array,  # [B, T, r/2] at the tokens' positions
    sin: jax.Array,  # [B, T, r/2]
) -> tuple[jax.Array, jax.Array]:
    """-> q [B, T, H, c] (per-head unweighted RMS, RoPE'd at cos/sin), q_latent [B, T, q_lora_rank] (the
    indexer's input)."""
    b, t, _ = x.shape
    q_latent = rms_norm(quant.matmul(x, p.wq_a), p.q_norm, cfg.rms_norm_eps)
    q = quant.matmul(q_latent, p.wq_b).reshape(b, t, cfg.num_heads, cfg.head_dim)
    return apply_rope(unweighted_rms_norm(q, cfg.rms_norm_eps), cos[:, :, None], sin[:, :, None]), q_latent


def window_kv(
    p: AttentionParams,
    cfg: ModelConfig,
    x: jax.Array,  # [B, T, d]
    cos: jax.Array,  # [B, T, r/2] at the rows' positions
    sin: jax.Array,  # [B, T, r/2]
) -> jax.Array:
    """-> the shared K=V row [B, T, c] of each token: wkv, kv_norm, RoPE."""
    return apply_rope(rms_norm(quant.matmul(x, p.wkv), p.kv_norm, cfg.rms_norm_eps), cos, sin)


def attend(
    q: jax.Array,  # [B, T, H, c] queries (RoPE'd)
    window_kv: jax.Array,  # [B, W, c] committed window ring
    window_pos: jax.Array,  # [B, W] int32 absolute position held by each slot (-1: empty)
    new_kv: jax.Array,  # [B, N, c] window kv of the uncommitted tokens (the new ones, maybe after a scratch)
    new_mask: jax.Array,  # [B, T, N] bool: token i reads uncommitted token j (ancestor-or-self, in window)
    positions: jax.Array,  # [B, T] int32 absolute positions of the new tokens
    sink: jax.Array,  # [H] fp32 per-head sink logit
    *,
    window: int,
    scale: float,
    comp_kv: jax.Array | None = None,  # [B, Lc, c] committed compressed entries
    comp_len: jax.Array | None = None,  # [B] int32: dense (HCA) -- entries [0, comp_len) for all tokens
    comp_index: jax.Array | None = None,  # [B, T, K] int32: sparse (CSA) -- per-token ids, -1 = none
    tree_entries: jax.Array | None = None,  # [B, T, c] branch-local entries (candidate per new token)
    tree_entry_mask: jax.Array | None = None,  # [B, T, T] bool: token i reads token j's entry
) -> jax.Array:
    """One softmax (with the per-head sink in the denominator) over the window keys, the committed
    compressed entries and the branch-local entries a token may read -> [B, T, H, c] fp32, before
    the output de-rotation. K = V: the keys are the values."""
    dt = q.dtype
    f32 = jnp.float32
    pos_q = positions[:, :, None]
    win_ok = (window_pos[:, None, :] >= 0) & (window_pos[:, None, :] > pos_q - window)  # [B, T, W]
    shared = [(window_kv.astype(dt), win_ok), (new_kv.astype(dt), new_mask)]
    if comp_kv is not None and comp_len is not None:
        ok = jnp.arange(comp_kv.shape[1])[None, :] < comp_len[:, None]
        shared.append((comp_kv.astype(dt), jnp.broadcast_to(ok[:, None, :], (*positions.shape, comp_kv.shape[1]))))
    if tree_entries is not None:
        shared.append((tree_entries.astype(dt), tree_entry_mask))
    logits, values = [], []
    for keys, ok in shared:
        s = jnp.einsum("bthc,bsc->bths", q, keys, preferred_element_type=f32) * scale
        logits.append(jnp.where(ok[:, :, None, :], s, -jnp.inf))
        values.append(("shared", keys))
    if comp_kv is not None and comp_index is not None:
        keys = jnp.take_along_axis(comp_kv.astype(dt)[:, None], jnp.maximum(comp_index, 0)[..., None], axis=2)
        s = jnp.einsum("bthc,btkc->bthk", q, keys, preferred_element_type=f32) * scale
        logits.append(jnp.where((comp_index >= 0)[:, :, None, :], s, -jnp.inf))
        values.append(("per_token", keys))
    logits = jnp.concatenate(logits, axis=-1)
    sk = sink.astype(f32)[None, None, :, None]
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sk)
    e = jnp.exp(logits - m)
    probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sk - m))
    out, offset = 0.0, 0
    for kind, keys in values:
        n = keys.shape[-2]
        part = probs[..., offset : offset + n]
        spec = "bths,bsc->bthc" if kind == "shared" else "bthk,btkc->bthc"
        out = out + jnp.einsum(spec, part, keys.astype(f32))
        offset += n
    return out


@struct.dataclass
class EntryKeys:
    """The compressed keys the new tokens of a compressed layer read beside the window, in the one contract
    `attend`, `attend_banded` and the Pallas kernel share (`kwargs()`). HCA reads every committed entry
    (comp_len), CSA the ones its indexer picked (comp_index); a tree's tokens also read the branch-local
    entries their own ancestors emitted (tree_entries, tree_entry_mask); a banded chain reads its entries
    from a copy of the cache (comp_ok)."""

    comp_kv: jax.Array  # [B, Lc, c] committed compressed entries (a banded chain's own written in)
    comp_len: jax.Array | None = None  # [B] int32: dense (HCA) -- entries [0, comp_len) for all tokens
    comp_index: jax.Array | None = None  # [B, T, K] int32: sparse (CSA) -- per-token ids, -1 = none
    tree_entries: jax.Array | None = None  # [B, T, c] branch-local entries (candidate per new token)
    tree_entry_mask: jax.Array | None = None  # [B, T, T] bool: token i reads token j's entry
    comp_ok: jax.Array | None = None  # [B, T, Lc] bool: banded (HCA) -- the entries each token reads

    def kwargs(self) -> dict[str, jax.Array]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def _entry_keys(
    p: AttentionParams, cfg: ModelConfig, kind: str, x: jax.Array, q_latent: jax.Array, rope: tuple[jax.Array, ...],
    layer_state: Any, ctx: AttentionContext, rows: AttentionRows,
) -> tuple[EntryKeys, AttentionRows]:
    """The compressed keys a compressed layer's new tokens read and the rows they add to the commit's
    scratch (rope: the tokens' (cos, sin) at the compressed layers' frequencies)."""
    b, t = ctx.positions.shape
    cos, sin = rope
    freqs = inv_freq(cfg, True)
    geo = cfg.geometry(kind)
    ratio = geo.ratio
    new = compressor_rows(p.compressor, x, ctx.positions, ratio)
    ring = PoolRows(layer_state.comp_rows_kv, layer_state.comp_rows_gate)
    entry = pool_entries(p.compressor, cfg, geo, ring, new, ctx, freqs).astype(rows.kv.dtype)
    rows = rows.replace(comp_kv=new.kv, comp_gate=new.gate, comp_entry=entry)
    emits = ((ctx.positions + 1) % ratio == 0) & ctx.valid  # [B, T]
    cache = layer_state.comp_kv  # [B, Lc, c]
    lc = cache.shape[1]
    if ctx.band:  # one causal chain: its entries go where the commit puts them (layers/banded.py)
        cache = with_chain_entries(cache, entry, ctx.positions, emits, ratio)
        entry_ok = chain_entry_ok(ctx.positions, lc, ratio)  # [B, T, Lc]
    else:
        num_committed_entries = ctx.committed // ratio  # [B]
        # A token reads the branch-local entries its own ancestors (and itself) emitted.
        ancestor_entries = ctx.visible & emits[:, None, :]  # [B, T, T]
    if not geo.indexed:
        if ctx.band:
            return EntryKeys(comp_kv=cache, comp_ok=entry_ok), rows
        return EntryKeys(comp_kv=cache, tree_entries=entry, comp_len=num_committed_entries,
                         tree_entry_mask=ancestor_entries), rows
    ip = p.indexer
    new = compressor_rows(ip.compressor, x, ctx.positions, ratio)
    ring = PoolRows(layer_state.idx_rows_kv, layer_state.idx_rows_gate)
    idx_entry = pool_entries(ip.compressor, cfg, geo, ring, new, ctx, freqs)  # CSA's geometry: overlapping
    rows = rows.replace(idx_kv=new.kv, idx_gate=new.gate, idx_entry=idx_entry)
    iq, iw = index_queries(ip, cfg, q_latent, x, cos, sin)
    if ctx.band:  # the top-k over committed + chain entries, all in one (copied) index cache
        index_keys = with_chain_entries(layer_state.idx_kv.astype(jnp.float32), idx_entry, ctx.positions, emits, ratio)
        scores = jnp.where(entry_ok, index_scores(iq, iw, index_keys), -jnp.inf)  # [B, T, Lc]
        top_scores, top_index = jax.lax.top_k(scores, min(cfg.index_topk, lc))
        return EntryKeys(comp_kv=cache, comp_index=jnp.where(top_scores > -jnp.inf, top_index, -1)), rows
    # The indexer picks the top-k of committed + branch-local entries per token.
    index_keys = jnp.concatenate([layer_state.idx_kv.astype(jnp.float32), idx_entry], axis=1)
    committed_ok = jnp.arange(lc)[None, :] < num_committed_entries[:, None]  # [B, Lc]
    entry_ok = jnp.concatenate(
        [jnp.broadcast_to(committed_ok[:, None, :], (b, t, lc)), ancestor_entries], axis=-1
    )  # [B, T, Lc+T]
    scores = jnp.where(entry_ok, index_scores(iq, iw, index_keys), -jnp.inf)
    top_scores, top_index = jax.lax.top_k(scores, min(cfg.index_topk, lc + t))  # [B, T, k]
    selected = top_scores > -jnp.inf
    local = jnp.where(selected & (top_index >= lc), top_index - lc, -1)  # [B, T, k] picked new entries
    return EntryKeys(
        comp_kv=cache, tree_entries=entry, comp_index=jnp.where(selected & (top_index < lc), top_index, -1),
        tree_entry_mask=_picked_mask(local, t),
    ), rows


def _picked_mask(local: jax.Array, t: int) -> jax.Array:
    """[B, T, k] picked new-entry ids (-1: none) -> [B, T, T] bool: token i reads token j's entry."""
    if t <= 64:  # a decode step or a tree: the compare is small ([B, T, k, T])
        return jnp.any(local[..., None] == jnp.arange(t, dtype=local.dtype), axis=-2)
    # A long dense chunk (the one-shot reference): [B, T, k, T] would be T*k*T bytes (4.6 GB at
    # T = 3000, k = 512); the scatter builds the same mask in [B, T, T].
    b, _, k = local.shape
    rows = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    hit = jnp.zeros((b, t, t + 1), bool).at[(*rows, jnp.where(local >= 0, local, t))].set(True)
    return hit[..., :t]


def attention(
    p: AttentionParams,
    cfg: ModelConfig,
    kind: str,
    x: jax.Array,  # [B, T, d] normed sub-layer input
    layer_state: Any,  # state.LayerState: committed rings and compressed caches
    ctx: AttentionContext,
) -> tuple[jax.Array, AttentionRows]:
    c = cfg.head_dim
    compressed = cfg.geometry(kind).compressed
    freqs = inv_freq(cfg, compressed)
    cos, sin = rope_angles(ctx.positions, freqs)  # [B, T, r/2]
    q, q_latent = queries(p, cfg, x, cos, sin)
    kv = window_kv(p, cfg, x, cos, sin)
    rows = AttentionRows(kv=kv)
    keys: dict[str, Any] = {}
    if compressed:
        entry_keys, rows = _entry_keys(p, cfg, kind, x, q_latent, (cos, sin), layer_state, ctx, rows)
        keys = entry_keys.kwargs()

    # Window keys: the committed ring (last W positions) and the new tokens a token may see.
    window = cfg.sliding_window
    ring = layer_state.swa_kv
    ring_pos = ring_positions(ctx.committed, ring.shape[1])  # [B, W]
    if ctx.band:
        if ctx.prior_kv is not None:
            raise ValueError("prior (scratch) keys are for the dense path only (band=0)")
        out = attend_banded(q, ring, ring_pos, kv, ctx.valid, ctx.positions, p.sink, window=window,
                            scale=c**-0.5, block=ctx.band, **keys)
        return output(p, cfg, out, cos, sin, x.dtype), rows
    new_kv, new_mask = kv, ctx.visible & (ctx.positions[:, None, :] > ctx.positions[:, :, None] - window)
    if ctx.prior_kv is not None:
        if compressed:
            raise ValueError("prior (scratch) keys are for sliding-window layers only")
        prior_mask = ctx.prior_visible & (ctx.prior_positions[:, None, :] > ctx.positions[:, :, None] - window)
        new_kv = jnp.concatenate([ctx.prior_kv.astype(kv.dtype), kv], axis=1)  # [B, X+T, c]
        new_mask = jnp.concatenate([prior_mask, new_mask], axis=-1)  # [B, T, X+T]

    out = attend_dense(cfg, q, ring, ring_pos, new_kv, new_mask, ctx.positions, p.sink, keys)
    return output(p, cfg, out, cos, sin, x.dtype), rows


def attend_dense(
    cfg: ModelConfig,
    q: jax.Array,  # [B, T, H, c]
    ring: jax.Array,  # [B, W, c] committed window ring
    ring_pos: jax.Array,  # [B, W] int32
    new_kv: jax.Array,  # [B, N, c]
    new_mask: jax.Array,  # [B, T, N] bool
    positions: jax.Array,  # [B, T] int32
    sink: jax.Array,  # [H] fp32
    keys: dict[str, jax.Array],  # the compressed keys (`EntryKeys.kwargs()`); {} on a window-only layer
) -> jax.Array:
    """`attend`'s contract on the path `cfg.kernels` picks: the Pallas tree-attention kernel (under a
    mesh once per shard on its own heads; every other argument holds this data shard's rows whole) or
    the jnp reference -> [B, T, H, c] fp32. V4's layers and V4.1's pooled layers call it alike."""
    args = (q, ring, ring_pos, new_kv, new_mask, positions, sink)
    kw = dict(window=cfg.sliding_window, scale=cfg.head_dim**-0.5, **keys)
    if cfg.kernels == "pallas":
        kernel = shard_kernel(tree_attention, in_axes=[_QUERY_AXES, None, None, None, None, None, ("heads",)],
                              out_axes=_QUERY_AXES)
        return kernel(*args, **kw)
    return attend(*args, **kw)


def grouped_projection(wo_a: Any, cfg: ModelConfig, out: jax.Array, cos: jax.Array, sin: jax.Array,
                       dtype) -> jax.Array:
    """[B, T, H, c] attention output -> [B, T, g*o_lora_rank]: inverse RoPE, the grouped low-rank
    projection (wo_a [g, H*c/g, o_lora_rank]); `wo_b` takes it from there."""
    b, t, h, c = out.shape
    out = apply_rope(out, cos[:, :, None], sin[:, :, None], inverse=True).astype(dtype)
    g = cfg.o_groups
    grouped = out.reshape(b, t, g, h * c // g)
    return quant.einsum("btgi,gio->btgo", grouped, wo_a).reshape(b, t, -1)


def output(p: AttentionParams, cfg: ModelConfig, out: jax.Array, cos: jax.Array, sin: jax.Array, dtype) -> jax.Array:
    """[B, T, H, c] attention output -> [B, T, d]: inverse RoPE, grouped low-rank output projection."""
    return quant.matmul(grouped_projection(p.wo_a, cfg, out, cos, sin, dtype), p.wo_b)
