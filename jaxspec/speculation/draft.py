"""MTP drafting of a token tree (EAGLE-2 style top-K beam) and pruning to the verify budget.

Step 1 expands the root (the bonus token at position P, drafted by the MTP step at P-1 from the
target's hidden H_{P-1}); every later step expands the K best candidates of the previous step, K
children each. Each step's MTP attention sees the committed MTP ring plus exactly its own
ancestors' steps, never a sibling's (docs/tree_verification.md §2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig, SpecConfig
from jaxspec.layers.attention import AttentionContext
from jaxspec.model.network import ModelParams, mtp_forward
from jaxspec.model.sampling import Sampling
from jaxspec.model.state import DecodeState
from jaxspec.speculation.sampled import SampledDraft, sampled_children
from jaxspec.speculation.values import Calibration, node_log_values


@struct.dataclass
class DraftPool:
    token: jax.Array  # [B, N] drafted tokens, N = K + (S-1)K^2, in drafting order
    parent: jax.Array  # [B, N] pool index of the parent, -1 = the root
    score: jax.Array  # [B, N] cumulative log node value (raw draft log-prob without a calibration)
    rank: jax.Array  # [B, N] rank of the token among its parent's K children
    # Sampled drafts only (`speculation/sampled.py`): log q of every slot, and the slot each candidate was drawn from.
    q: jax.Array | None = None  # [B, slots, V]
    q_slot: jax.Array | None = None  # [B, N]


@struct.dataclass
class Tree:
    tokens: jax.Array  # [B, D] node tokens, node 0 = root
    parent: jax.Array  # [B, D] parent node, parent[:, 0] = 0; parents precede children
    rank: jax.Array  # [B, D] child rank under its parent (0 for the root)
    score: jax.Array  # [B, D] cumulative log node value (0 for the root)
    q: jax.Array | None = None  # [B, D, V] sampled drafts: log q each node was drawn from (root: zeros)


def _children(
    logits: jax.Array,  # [B, n, V] MTP logits of the slots drafted this step
    score: jax.Array,  # [B, n] cumulative log-prob of those slots
    pool_index: jax.Array,  # [B, n] their pool index (-1: the root)
    k: int,
    depth: int = 1,  # of the children
    values: Calibration | None = None,
    temperature: jax.Array | None = None,
    context: jax.Array | None = None,  # [B] int32 context bin (speculation/values.py), None = pooled
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The top-K children of each slot, as pool columns -> token, parent, score, rank [B, n*K];
    score = the slot's + the child's log node value (speculation/values.py)."""
    b, n = score.shape
    top_logp, top_token = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)  # [B, n, K]
    log_value = node_log_values(values, depth, top_logp, temperature, context)
    return (
        top_token.reshape(b, n * k).astype(jnp.int32),
        jnp.repeat(pool_index, k, axis=1),
        (score[:, :, None] + log_value).reshape(b, n * k),
        jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, n, k)).reshape(b, n * k),
    )


def draft_tree(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig,
    state: DecodeState,  # committed; state.mtp_length == state.length - 1
    root: jax.Array,  # [B] int32 root token (position P)
    root_hidden: jax.Array,  # [B, hc, d] target streams at position P-1
    values: Calibration | None = None,  # node values to rank by; None = raw draft log-probs
    temperature: jax.Array | None = None,  # [] traced, picks the sampling map when > 0
    sampler: SampledDraft | None = None,
    context: jax.Array | None = None,  # [B] int32 context bin of each sequence (greedy values), None = pooled
) -> DraftPool:
    """Top-K beam of S MTP steps, each running the MTP block and the head over its new slots only
    (1 at step one, K after): O(S*K) token-forwards.

    A slot drafted at step s sits at MTP position mtp_length + s - 1 and reads the committed MTP
    ring plus the window kv its ancestors left in the draft scratch (`AttentionContext.prior_*`),
    never a sibling's: the pool equals the exhaustive reference's (tests/draft_reference.py). With
    `sampler` (temperature > 0) the children are sampled and ranked by value instead
    (`speculation/sampled.py`); the beam is the same.
    """
    s_steps, k = spec.num_steps, spec.topk
    b = root.shape[0]
    num_slots = 1 + (s_steps - 1) * k
    batch_index = jnp.arange(b)[:, None]
    scratch_kv = jnp.zeros((b, num_slots, cfg.head_dim), jnp.dtype(cfg.dtype))
    scratch_pos = jnp.zeros((b, num_slots), jnp.int32)
    # per new slot: slot index, input token and streams, its ancestor slots, pool index (-1: root), score
    new_slots = jnp.zeros((1,), jnp.int32)
    new_token, new_hidden = root[:, None], root_hidden[:, None]
    new_ancestors = jnp.zeros((b, 1, num_slots), bool)
    new_pool_index = jnp.full((b, 1), -1, jnp.int32)
    new_score = jnp.zeros((b, 1), jnp.float32)
    pool = pool_token, pool_parent, pool_score, pool_rank = [], [], [], []
    slot_q, q_slot = [], []
    pool_offset = 0
    for step in range(1, s_steps + 1):
        n = new_slots.shape[0]
        positions = jnp.broadcast_to(state.mtp_length[:, None] + (step - 1), (b, n))
        ctx = AttentionContext(
            positions=positions,
            committed=state.mtp_length,
            visible=jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n)),  # siblings never see each other
            ancestor_at_depth=jnp.zeros((b, n, n), jnp.int32),
            valid=jnp.ones((b, n), bool),
            prior_kv=scratch_kv,
            prior_positions=scratch_pos,
            prior_visible=new_ancestors,
        )
        logits, z, rows = mtp_forward(params, cfg, state, new_hidden, new_token, ctx)
        scratch_kv = scratch_kv.at[:, new_slots].set(rows.kv.astype(scratch_kv.dtype))
        scratch_pos = scratch_pos.at[:, new_slots].set(positions)
        children = _children(logits, new_score, new_pool_index, k, step, values, temperature, context)
        if sampler is not None:
            children, logq = sampled_children(logits, new_score, new_slots, step, sampler, children)
            slot_q.append(logq)
            q_slot.append(jnp.broadcast_to(jnp.repeat(new_slots, k), (b, n * k)))
        for column, c in zip(pool, children, strict=True):
            column.append(c)
        if step == s_steps:
            break
        # Expand the K best candidates of this step in the next one.
        _, best = jax.lax.top_k(pool_score[-1], k)  # [B, K] local index among this step's n*K
        parent = best // k  # [B, K] which new slot of this step drafted them
        parent_slot = new_slots[parent]
        new_ancestors = jnp.take_along_axis(new_ancestors, parent[..., None], axis=1) | (
            parent_slot[..., None] == jnp.arange(num_slots)
        )
        new_token = jnp.take_along_axis(pool_token[-1], best, axis=1)
        new_hidden = z[batch_index, parent]
        new_slots = jnp.arange(1 + (step - 1) * k, 1 + step * k, dtype=jnp.int32)
        new_pool_index = pool_offset + best
        new_score = jnp.take_along_axis(pool_score[-1], best, axis=1)
        pool_offset += n * k
    return DraftPool(
        token=jnp.concatenate(pool_token, axis=1),
        parent=jnp.concatenate(pool_parent, axis=1),
        score=jnp.concatenate(pool_score, axis=1),
        rank=jnp.concatenate(pool_rank, axis=1),
        q=jnp.concatenate(slot_q, axis=1) if sampler is not None else None,
        q_slot=jnp.concatenate(q_slot, axis=1) if sampler is not None else None,
    )


def draft(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig,
    state: DecodeState,  # committed; state.mtp_length == state.length - 1
    root: jax.Array,  # [B] int32 root token (position P)
    root_hidden: jax.Array,  # [B, hc, d] target streams at position P-1
    values: Calibration | None = None,  # node values to rank by; None = raw draft log-probs
    sampling: Sampling | None = None,  # its temperature picks the sampling map (> 0) or the greedy one
    sampler: SampledDraft | None = None,  # children sampled from the draft (speculation/sampled.py), else top-K
    context: jax.Array | None = None,  # [B] int32 context bin of each sequence (greedy values), None = pooled
) -> Tree:
    """The one drafting entry point of a cycle: the spec's tree of D nodes (a new tree family
    changes this function only)."""
    temperature = None if sampling is None else sampling.temperature
    pool = draft_tree(params, cfg, spec, state, root, root_hidden, values, temperature, sampler, context)
    return prune_to_budget(pool, root, spec.num_draft_tokens)


def prune_to_budget(pool: DraftPool, root: jax.Array, num_draft_tokens: int) -> Tree:
    """Keep the D-1 best-scoring candidates plus the root.

    Scores (sums of log-values < 0) only fall along a path and top_k breaks ties towards the lower
    (earlier-drafted) index, so a kept node's ancestors are kept too.
    """
    b, n = pool.token.shape
    _, keep = jax.lax.top_k(pool.score, num_draft_tokens - 1)
    keep = jnp.sort(keep, axis=1)  # drafting order: parents before children
    batch_index = jnp.arange(b)[:, None]
    node_of = jnp.full((b, n), 0, jnp.int32).at[batch_index, keep].set(
        jnp.arange(1, num_draft_tokens, dtype=jnp.int32)
    )
    pool_parent = jnp.take_along_axis(pool.parent, keep, axis=1)
    parent = jnp.where(pool_parent < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(pool_parent, 0), axis=1))
    zeros = jnp.zeros((b, 1), jnp.int32)
    q = None
    if pool.q is not None:
        drawn_from = jnp.take_along_axis(pool.q_slot, keep, axis=1)  # [B, D-1]
        q = jnp.take_along_axis(pool.q, drawn_from[:, :, None], axis=1)  # [B, D-1, V]
        q = jnp.concatenate([jnp.zeros_like(q[:, :1]), q], axis=1)
    return Tree(
        tokens=jnp.concatenate([root[:, None], jnp.take_along_axis(pool.token, keep, axis=1)], axis=1),
        parent=jnp.concatenate([zeros, parent], axis=1),
        rank=jnp.concatenate([zeros, jnp.take_along_axis(pool.rank, keep, axis=1)], axis=1),
        score=jnp.concatenate([jnp.zeros((b, 1)), jnp.take_along_axis(pool.score, keep, axis=1)], axis=1),
        q=q,
    )
