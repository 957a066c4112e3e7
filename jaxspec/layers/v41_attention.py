"""DeepSeek-V4.1 attention (docs/v41.md): MQA with one K=V head over a 128-token window and, on a
compressed layer, the top-k entries of a pool shared by a group of layers.

A layer plays one role, fixed by `cfg.v41` (`V41Layout`):
* window only (ratio 0);
* kv source ("owner"): its compressor pools every 2 tokens (softmax gate over the pair) or every
  token (ratio 1) into the group's pool, publishes one index key per entry, and runs an indexer;
* index source: its own indexer (queries from its own q latent) over the owner's keys; after the
  candidate source it chooses only inside the candidate blocks (the two-level top-k);
* reuse: reads the owner's pool with the last index source's top-k.
Within one forward the owner's pool and the last selection travel to the layers after it as a
`PoolShare`. Like V4's `attention`, it reads the committed state and returns the new tokens' rows
(window kv, compressor rows, the entry and index key each token would emit) for the caller to
commit; new tokens read the entries only their own ancestors emitted (`ctx.visible`), so one code
path serves prefill, chunked extend, decode and tree verification.

The QAT roundings (ops/fakequant.py) sit where DeepSeek's reference applies them: FP8 on the input
of every FP8 linear and on the window kv, FP4 on the pool entries and on the indexer's q and k.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.layers.attention import (
    AttentionContext,
    AttentionRows,
    attend_dense,
    grouped_projection,
    ring_positions,
)
from jaxspec.ops import fakequant, quant
from jaxspec.ops.norms import rms_norm
from jaxspec.ops.pooling import gated_sum, gather_sources, source_indices
from jaxspec.ops.quant import Weight
from jaxspec.ops.rope import apply_rope, inv_freq, rope_angles
from jaxspec.sharding.rules import axes


@struct.dataclass
class PoolCompressorParams:
    """A kv source's compressor and index-key projection."""

    wkv: jax.Array = axes("embed", "kv")  # [d, c]
    wgate: jax.Array | None = axes("embed", "kv")  # [d, c] on ratio-2 owners (softmax gate), None at ratio 1
    norm: jax.Array = axes("kv")  # [c]
    wk: jax.Array = axes("kv", "index_kv")  # [c, c_I] index keys from the unrotated latent
    k_norm: jax.Array = axes("index_kv")  # [c_I]


@struct.dataclass
class PoolIndexerParams:
    wq_b: Weight = axes("q_lora", "index_heads", quant="fp8_32")  # [q_lora_rank, H_I * c_I]
    weights_proj: jax.Array = axes("embed", "index_heads")  # [d, H_I]


@struct.dataclass
class PoolAttentionParams:
    wq_a: Weight = axes("embed", "q_lora", quant="fp8_32")  # [d, q_lora_rank]
    q_norm: jax.Array = axes("q_lora")  # [q_lora_rank]
    wq_b: Weight = axes("q_lora", "heads", quant="fp8_32")  # [q_lora_rank, H*c], head-major
    wkv: Weight = axes("embed", "kv", quant="fp8_32")  # [d, c]
    kv_norm: jax.Array = axes("kv")  # [c]
    # [g, H*c/g, o_lora_rank]; its input is not rounded (the reference dequantizes it to bf16)
    wo_a: Weight = axes("o_groups", "group_width", "o_lora", quant="fp8_32_groups")
    wo_b: Weight = axes("o_groups", "embed", quant="fp8_32")  # [g*o_lora_rank, d]
    sink: jax.Array = axes("heads")  # [H] fp32
    compressor: PoolCompressorParams | None  # kv sources
    indexer: PoolIndexerParams | None  # index sources


@struct.dataclass
class PoolShare:
    """What a kv source and an index source hand to the layers after them in one forward."""

    pool: jax.Array | None = None  # [B, Lc, c] the owner's committed entries
    entries: jax.Array | None = None  # [B, T, c] the entry each new token would emit
    keys: jax.Array | None = None  # [B, Lc, c_I] the owner's committed index keys
    new_keys: jax.Array | None = None  # [B, T, c_I]
    emits: jax.Array | None = None  # [B, T] bool: the new token closes a group
    comp_index: jax.Array | None = None  # [B, T, k] committed entries picked (-1: none)
    picked: jax.Array | None = None  # [B, T, T] bool: token i reads new token j's entry
    cand: jax.Array | None = None  # [B, T, Lc] bool: entries (by absolute index) in i's candidate blocks


def init_pool_attention(cfg: ModelConfig, key: jax.Array, layer: int, std: float = 0.02) -> PoolAttentionParams:
    v = cfg.v41
    d, h, c, dq = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    g, do, hi, ci = cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    dtype = jnp.dtype(cfg.dtype)
    keys = iter(jax.random.split(key, 12))

    def normal(shape, dt=dtype):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    compressor = indexer = None
    if layer in v.kv_sources:
        compressor = PoolCompressorParams(
            wkv=normal((d, c)), wgate=normal((d, c)) if v.ratios[layer] == 2 else None,
            norm=jnp.ones((c,), jnp.float32), wk=normal((c, ci)), k_norm=jnp.ones((ci,), jnp.float32))
    if layer in v.index_sources:
        indexer = PoolIndexerParams(wq_b=normal((dq, hi * ci)), weights_proj=normal((d, hi)))
    return PoolAttentionParams(
        wq_a=normal((d, dq)), q_norm=jnp.ones((dq,), jnp.float32), wq_b=normal((dq, h * c)),
        wkv=normal((d, c)), kv_norm=jnp.ones((c,), jnp.float32), wo_a=normal((g, h * c // g, do)),
        wo_b=normal((g * do, d)), sink=jnp.zeros((h,), jnp.float32), compressor=compressor, indexer=indexer)


def _latents(
    p: PoolCompressorParams, cfg: ModelConfig, ratio: int, x: jax.Array, layer_state: Any, ctx: AttentionContext,
) -> tuple[jax.Array, AttentionRows]:
    """The unrotated latent each new token would close its group with [B, T, c] (the caller masks
    those that close none) and the compressor rows a commit keeps (ratio 2: fp32 kv and gate)."""
    if ratio == 1:  # every token is its own group: no gate, no fp32 promotion
        return rms_norm(x @ p.wkv.astype(x.dtype), p.norm, cfg.rms_norm_eps), AttentionRows(kv=None)
    x32 = x.astype(jnp.float32)
    kv, gate = x32 @ p.wkv.astype(jnp.float32), x32 @ p.wgate.astype(jnp.float32)  # [B, T, c]
    # The group's rows: the committed ring (slot pos mod 2) or a new token on the query's own chain.
    index, valid = source_indices(ctx.positions, ctx.committed, ctx.ancestor_at_depth, ratio, ratio)
    latent = gated_sum(gather_sources(layer_state.comp_rows_kv, kv, index),
                       gather_sources(layer_state.comp_rows_gate, gate, index), valid)
    latent = rms_norm(latent.astype(x.dtype), p.norm, cfg.rms_norm_eps)
    return latent, AttentionRows(kv=None, comp_kv=kv, comp_gate=gate)


def _index_scores(
    q: jax.Array,  # [B, T, H_I, c_I] rounded index queries
    w: jax.Array,  # [B, T, H_I] head weights (scales folded in)
    keys: jax.Array,  # [B, N, c_I]
) -> jax.Array:
    """sum_h relu(q_h . k) w_h -> [B, T, N] fp32."""
    dots = jnp.einsum("bthc,bnc->bthn", q.astype(jnp.float32), keys.astype(jnp.float32))
    return jnp.einsum("bthn,bth->btn", jax.nn.relu(dots), w)


def _by_entry(
    scores: jax.Array,  # [B, T, Lc] committed entries' scores (-inf: not visible)
    new_scores: jax.Array,  # [B, T, T] new tokens' entries' scores (-inf: not visible to the query)
    ratio: int,
    ctx: AttentionContext,
) -> jax.Array:
    """-> [B, T, Lc]: every score at its entry's absolute index (a new token's entry at pos // ratio).

    A query sees at most one entry per index (its own branch's), so the scatter keeps it. Selecting over
    absolute indices makes ties break the same way whichever call an entry was computed in (FP4-rounded
    queries and keys make equal scores common): prefill, chunks, decode and trees pick alike."""
    b, t, lc = scores.shape
    index = jnp.broadcast_to((ctx.positions // ratio)[:, None, :], (b, t, t))
    rows = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    return scores.at[(*rows, index)].max(new_scores, mode="drop")


def _candidate_blocks(cfg: ModelConfig, ratio: int, scores: jax.Array, ctx: AttentionContext) -> jax.Array:
    """Level one of the two-level top-k -> [B, T, Lc] bool: per query, the entries of the
    `candidate_topk_blocks` blocks of `candidate_block_size` entries with the highest best score (the
    block holding the query's last visible entry always kept, blocks with no visible entry never).
    scores: by absolute entry index, -inf where not visible."""
    v = cfg.v41
    bs = v.candidate_block_size
    b, t, lc = scores.shape
    nb = -(-lc // bs)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, nb * bs - lc)), constant_values=-jnp.inf)
    block_score = jnp.max(padded.reshape(b, t, nb, bs), axis=-1)  # [B, T, NB]
    last = ((ctx.positions + 1) // ratio - 1) // bs  # [B, T] (negative: no visible entry yet)
    pinned = jnp.where(jnp.arange(nb) == last[..., None], jnp.inf, block_score)
    _, top = jax.lax.top_k(pinned, min(v.candidate_topk_blocks, nb))
    rows = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    keep = jnp.zeros((b, t, nb), bool).at[(*rows, top)].set(True) & (block_score > -jnp.inf)
    return jnp.repeat(keep, bs, axis=-1)[..., :lc]


def _select(
    p: PoolAttentionParams, cfg: ModelConfig, layer: int, ratio: int, x: jax.Array, q_latent: jax.Array,
    rope: tuple[jax.Array, jax.Array], share: PoolShare, ctx: AttentionContext,
) -> PoolShare:
    """An index source's top-k over the owner's committed and branch-local keys."""
    v = cfg.v41
    b, t = ctx.positions.shape
    lc = share.pool.shape[1]
    hi, ci = cfg.index_n_heads, cfg.index_head_dim
    cos, sin = rope
    ip = p.indexer
    fq = fakequant.roundings(v.qat)
    q = quant.matmul(fq.fp8(q_latent), ip.wq_b).reshape(b, t, hi, ci)
    q = fq.fp4_ue8m0(apply_rope(q, cos[:, :, None], sin[:, :, None]))
    w = (x @ ip.weights_proj.astype(x.dtype)).astype(jnp.float32) * (ci**-0.5 * hi**-0.5)
    num_committed = ctx.committed // ratio  # [B]
    committed_ok = jnp.arange(lc)[None, None, :] < num_committed[:, None, None]  # [B, 1, Lc]
    new_ok = ctx.visible & share.emits[:, None, :]  # [B, T, T] entries of the token's own ancestors
    scores = _by_entry(jnp.where(committed_ok, _index_scores(q, w, share.keys), -jnp.inf),
                       jnp.where(new_ok, _index_scores(q, w, share.new_keys), -jnp.inf), ratio, ctx)
    if v.uses_candidates(layer):
        scores = jnp.where(share.cand, scores, -jnp.inf)
    elif layer == v.candidate_source:
        share = share.replace(cand=_candidate_blocks(cfg, ratio, scores, ctx))
    top_scores, top = jax.lax.top_k(scores, min(cfg.index_topk, lc))  # [B, T, k] absolute entry ids
    picked = top_scores > -jnp.inf
    # A pick past the committed entries is the entry of the query's ancestor at position (j + 1) * r - 1.
    depth = jnp.clip((top + 1) * ratio - 1 - ctx.committed[:, None, None], 0, t - 1)
    node = jnp.where(picked & (top >= num_committed[:, None, None]),
                     jnp.take_along_axis(ctx.ancestor_at_depth, depth, axis=-1), t)
    rows = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    picked_new = jnp.zeros((b, t, t + 1), bool).at[(*rows, node)].set(True)[..., :t]
    return share.replace(comp_index=jnp.where(picked & (top < num_committed[:, None, None]), top, -1),
                         picked=picked_new)


def pool_attention(
    p: PoolAttentionParams,
    cfg: ModelConfig,
    layer: int,
    x: jax.Array,  # [B, T, d] normed sub-layer input
    layer_state: Any,  # state_v41.PoolLayerState: the committed window ring (and pool, on an owner)
    ctx: AttentionContext,  # dense (band = 0)
    share: PoolShare,  # the owner's pool and the last selection, from the layers before
) -> tuple[jax.Array, AttentionRows, PoolShare]:
    """-> output [B, T, d], the new tokens' rows, the share for the layers after."""
    v = cfg.v41
    ratio = v.ratios[layer]
    cos, sin = rope_angles(ctx.positions, inv_freq(cfg, ratio > 0))  # [B, T, r/2]
    fq = fakequant.roundings(v.qat)
    q_latent, q, kv = window_qkv(p, cfg, x, cos, sin)
    rows = AttentionRows(kv=kv)
    entry_keys: dict[str, jax.Array] = {}
    if ratio:
        if p.compressor is not None:  # an owner: the group's pool and index keys start here
            latent, comp_rows = _latents(p.compressor, cfg, ratio, x, layer_state, ctx)
            at = rope_angles((ctx.positions // ratio) * ratio, inv_freq(cfg, True))
            entry = fq.fp4_e4m3(apply_rope(latent, *at), 16)
            pk = p.compressor
            key = rms_norm(latent @ pk.wk.astype(latent.dtype), pk.k_norm, cfg.rms_norm_eps)
            key = fq.fp4_ue8m0(apply_rope(key, *at))
            rows = rows.replace(comp_kv=comp_rows.comp_kv, comp_gate=comp_rows.comp_gate, comp_entry=entry,
                                idx_entry=key)
            share = PoolShare(pool=layer_state.comp_kv, entries=entry, keys=layer_state.idx_kv, new_keys=key,
                              emits=((ctx.positions + 1) % ratio == 0) & ctx.valid,
                              cand=share.cand)
        if p.indexer is not None:
            share = _select(p, cfg, layer, ratio, x, q_latent, (cos, sin), share, ctx)
        entry_keys = dict(comp_kv=share.pool, comp_index=share.comp_index, tree_entries=share.entries,
                          tree_entry_mask=share.picked)
    ring_pos = ring_positions(ctx.committed, layer_state.swa_kv.shape[1])
    new_mask = ctx.visible & (ctx.positions[:, None, :] > ctx.positions[:, :, None] - cfg.sliding_window)
    out = attend_dense(cfg, q, layer_state.swa_kv, ring_pos, kv, new_mask, ctx.positions, p.sink, entry_keys)
    return project_out(p, cfg, out, cos, sin, x.dtype), rows, share


def window_qkv(
    p: PoolAttentionParams, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array,  # x: [B, T, d] normed
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> the query latent [B, T, q_lora_rank], the RoPE'd queries [B, T, H, c] (no per-head norm in
    V4.1) and the FP8-rounded window kv [B, T, c] of the rows `x` (also a DSpark stage's)."""
    b, t, _ = x.shape
    fq = fakequant.roundings(cfg.v41.qat)
    q_latent = rms_norm(quant.matmul(fq.fp8(x), p.wq_a), p.q_norm, cfg.rms_norm_eps)
    q = quant.matmul(fq.fp8(q_latent), p.wq_b).reshape(b, t, cfg.num_heads, cfg.head_dim)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    return q_latent, q, window_kv(p, cfg, x, cos, sin)


def window_kv(p: PoolAttentionParams, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The window kv [B, T, c] a row writes: kv_norm(wkv FQ8(x)), RoPE'd at its position, FQ8-rounded."""
    fq = fakequant.roundings(cfg.v41.qat)
    kv = rms_norm(quant.matmul(fq.fp8(x), p.wkv), p.kv_norm, cfg.rms_norm_eps)
    return fq.fp8(apply_rope(kv, cos, sin))


def project_out(p: PoolAttentionParams, cfg: ModelConfig, out: jax.Array, cos: jax.Array, sin: jax.Array,
                dtype) -> jax.Array:
    """[B, T, H, c] attention output -> [B, T, d]: the grouped projection, then wo_b on its FP8-rounded input."""
    projected = grouped_projection(p.wo_a, cfg, out, cos, sin, dtype)
    return quant.matmul(fakequant.roundings(cfg.v41.qat).fp8(projected), p.wo_b)
