"""The drafted tree of a cycle, whichever drafter grew it: the candidate pool, the beam that grows it,
the children each expanded node gets, and the pruning to the verify budget.

A drafter only says how the logits of a step's new slots come about (`StepLogits`); which children a
slot gets (top-K by value, or sampled from the draft at temperature > 0) and which candidates the
next step expands are decided here, once for every drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.spec import SpecConfig
from jaxspec.model.sampling import select_rows
from jaxspec.speculation.sampled import SampledDraft, sampled_children
from jaxspec.speculation.values import Calibration, node_log_values


@struct.dataclass
class DraftPool:
    token: jax.Array  # [B, N] drafted tokens, N = K + (S-1)K^2, in drafting order
    parent: jax.Array  # [B, N] pool index of the parent, -1 = the root
    score: jax.Array  # [B, N] cumulative log node value (raw draft log-prob without a calibration)
    rank: jax.Array  # [B, N] rank of the token among its parent's K children
    depth: jax.Array  # [B, N] depth of the candidate (1 = a child of the root)
    feature: jax.Array  # [B, N] the value feature it was ranked by (`Expander.source`), in (0, 1]
    confidence: jax.Array  # [B, N] sigma(c) of the slot it was drafted from (1 without a confidence head)
    # Sampled drafts only (`speculation/sampled.py`): log q of every slot, and the slot each candidate was drawn from.
    q: jax.Array | None = None  # [B, slots, V]
    q_slot: jax.Array | None = None  # [B, N]


@struct.dataclass
class Tree:
    """What every drafter returns: the D nodes a cycle verifies."""

    tokens: jax.Array  # [B, D] node tokens, node 0 = root
    parent: jax.Array  # [B, D] parent node, parent[:, 0] = 0; parents precede children
    depth: jax.Array  # [B, D] node depth (root 0)
    rank: jax.Array  # [B, D] child rank under its parent (0 for the root)
    score: jax.Array  # [B, D] cumulative log node value (0 for the root): log P(the walk reaches it)
    feature: jax.Array  # [B, D] the value feature each node was ranked by (root: 1)
    q: jax.Array | None = None  # [B, D, V] sampled drafts: log q each node was drawn from (root: zeros)
    confidence: jax.Array | None = None  # [B, D] sigma(c) of the slot each node was drafted from (root: 1)


@struct.dataclass
class Expander:
    """How an expanded slot gets its K children this cycle: top-K ranked by `values`, or drawn from the
    draft (`sampler`, temperature > 0 under the residual rule); and how many of a step's candidates the
    next step expands (K in a cycle's beam; 1 for the chain with every node's K children that
    calibration records).

    A top-K child's value feature (`source`): "draft", its own draft probability q_r; "confidence", the
    drafter's confidence that the slot's top child survives, sigma(c), scaled to the child as
    sigma(c) q_r / q_0 (a drafter without a confidence head falls back to "draft"); "both", q_r, with sigma(c)
    as a second feature a "both" calibration reads. Uncalibrated, the feature is the value; a calibration
    maps it (`values.node_log_values`)."""

    temperature: jax.Array  # [] or [B] traced: picks a calibration's sampling map when > 0
    context: jax.Array | None  # [B] int32 context bin of each sequence (greedy values), None = pooled
    sampler: SampledDraft | None
    k: int = struct.field(pytree_node=False, default=1)  # children per expanded slot
    values: Calibration | None = struct.field(pytree_node=False, default=None)  # None: raw draft log-probs
    expand: int = struct.field(pytree_node=False, default=0)  # candidates the next step expands (0: k)
    source: str = struct.field(pytree_node=False, default="draft")  # "draft" | "confidence" | "both"

    @property
    def width(self) -> int:
        return self.expand or self.k

    def children(
        self,
        logits: jax.Array,  # [B, n, V] draft logits of the slots drafted this step
        confidence: jax.Array | None,  # [B, n] the drafter's confidence logit per slot, or None
        score: jax.Array,  # [B, n] their cumulative values
        pool_index: jax.Array,  # [B, n] their pool index (-1: the root)
        slots: jax.Array,  # [n] their slot indices (sampled drafts' keys)
        depth: int,  # of the children (1 = the root's)
    ) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
        """-> ((token, parent, score, rank, feature, confidence) [B, n*K] pool columns, log q [B, n, V] or None)."""
        b, n = score.shape
        k = self.k
        # "both" values read the runner-up of every slot, a chain's (K = 1) too
        width = max(k, 2) if self.source == "both" else k
        wide_logp, wide_token = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), width)  # [B, n, width]
        if width > k:
            # XLA:CPU runs a top_k whose indices are read narrower than its values as a full sort of the
            # vocabulary (a DSpark chain's draft with "both" values: 3.0 ms against 0.7); whole outputs it
            # keeps as one fast top-k call
            wide_logp, wide_token = jax.lax.optimization_barrier((wide_logp, wide_token))
        top_token = wide_token[..., :k]  # [B, n, K]
        log_feature = wide_logp
        slot_confidence = jnp.ones((b, n, width)) if confidence is None else jnp.broadcast_to(
            jax.nn.sigmoid(confidence.astype(jnp.float32))[..., None], (b, n, width))
        if self.source == "confidence" and confidence is not None:
            log_feature = jax.nn.log_sigmoid(confidence)[..., None] + wide_logp - wide_logp[..., :1]
        log_value = node_log_values(self.values, depth, log_feature, self.temperature, self.context,
                                    None if confidence is None else slot_confidence)[..., :k]
        log_feature, slot_confidence = log_feature[..., :k], slot_confidence[..., :k]
        columns = (
            top_token.reshape(b, n * k).astype(jnp.int32),
            jnp.repeat(pool_index, k, axis=1),
            (score[:, :, None] + log_value).reshape(b, n * k),
            jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, n, k)).reshape(b, n * k),
        )
        feature = jnp.exp(log_feature).reshape(b, n * k)
        slot_confidence = slot_confidence.reshape(b, n * k)
        if self.sampler is None:
            return (*columns, feature, slot_confidence), None
        columns, logq = sampled_children(logits, score, slots, depth, self.sampler, columns)
        drawn = jnp.exp(jnp.take_along_axis(logq, columns[0].reshape(b, n, k), axis=2)).reshape(b, n * k)
        return (*columns, select_rows(self.temperature > 0, drawn, feature), slot_confidence), logq


# (new token [B, n], parent [B, n] = index among the previous step's slots, step, carry)
#   -> (logits [B, n, V], confidence logit [B, n] or None, carry)
StepLogits = Callable[[jax.Array, jax.Array, int, Any], tuple[jax.Array, jax.Array | None, Any]]


def grow_beam(spec: SpecConfig, expander: Expander, root: jax.Array, step_logits: StepLogits, carry: Any) -> DraftPool:
    """The top-K beam of S steps (EAGLE-2 style) every drafter grows: step 1 expands the root, every
    later step the K best candidates of the previous one (`expander.width`), K children each;
    `step_logits` gives the draft logits of a step's new slots (1 at step one, K after) -> the pool of
    K + (S-1)K^2 candidates."""
    s_steps, k, width = spec.num_steps, expander.k, expander.width
    b = root.shape[0]
    new_token = root[:, None]  # [B, n]
    new_parent = jnp.zeros((b, 1), jnp.int32)  # index among the previous step's slots
    new_slots = jnp.zeros((1,), jnp.int32)
    new_pool_index = jnp.full((b, 1), -1, jnp.int32)
    new_score = jnp.zeros((b, 1), jnp.float32)
    # token, parent, score, rank, feature, confidence, depth
    columns: list[list[jax.Array]] = [[], [], [], [], [], [], []]
    slot_q, q_slot = [], []
    pool_offset = 0
    for step in range(1, s_steps + 1):
        n = new_slots.shape[0]
        logits, confidence, carry = step_logits(new_token, new_parent, step, carry)
        children, logq = expander.children(logits, confidence, new_score, new_pool_index, new_slots, step)
        for column, c in zip(columns, (*children, jnp.full((b, n * k), step, jnp.int32)), strict=True):
            column.append(c)
        if logq is not None:
            slot_q.append(logq)
            q_slot.append(jnp.broadcast_to(jnp.repeat(new_slots, k), (b, n * k)))
        if step == s_steps:
            break
        _, best = jax.lax.top_k(columns[2][-1], width)  # [B, width] local index among this step's n*K
        new_parent = (best // k).astype(jnp.int32)
        new_token = jnp.take_along_axis(columns[0][-1], best, axis=1)
        new_slots = jnp.arange(1 + (step - 1) * width, 1 + step * width, dtype=jnp.int32)
        new_pool_index = pool_offset + best
        new_score = jnp.take_along_axis(columns[2][-1], best, axis=1)
        pool_offset += n * k
    token, parent, score, rank, feature, confidence, depth = (jnp.concatenate(c, axis=1) for c in columns)
    sampled = bool(slot_q)
    return DraftPool(token=token, parent=parent, score=score, rank=rank, depth=depth, feature=feature,
                     confidence=confidence,
                     q=jnp.concatenate(slot_q, axis=1) if sampled else None,
                     q_slot=jnp.concatenate(q_slot, axis=1) if sampled else None)


def num_slots(spec: SpecConfig, expander: Expander) -> int:
    """Draft slots a beam expands: the root, then `expander.width` per later step."""
    return 1 + (spec.num_steps - 1) * expander.width


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

    def kept(column: jax.Array, first: Any) -> jax.Array:
        return jnp.concatenate([first, jnp.take_along_axis(column, keep, axis=1)], axis=1)

    return Tree(
        tokens=kept(pool.token, root[:, None]),
        parent=jnp.concatenate([zeros, parent], axis=1),
        depth=kept(pool.depth, zeros),
        rank=kept(pool.rank, zeros),
        score=kept(pool.score, jnp.zeros((b, 1))),
        feature=kept(pool.feature, jnp.ones((b, 1))),
        q=q,
        confidence=kept(pool.confidence, jnp.ones((b, 1))),
    )


def shrink(tree: Tree, width: int) -> Tree:
    """The best `width` nodes of a pruned tree (root included), as a tree of their own: the nodes
    `prune_to_budget` would keep from the whole pool at that budget."""
    b, d = tree.tokens.shape
    if width == d:
        return tree
    pool = DraftPool(
        token=tree.tokens[:, 1:],
        parent=tree.parent[:, 1:] - 1,  # the root (0) becomes -1, node i pool index i - 1
        score=tree.score[:, 1:],
        rank=tree.rank[:, 1:],
        depth=tree.depth[:, 1:],
        feature=tree.feature[:, 1:],
        confidence=jnp.ones_like(tree.feature[:, 1:]) if tree.confidence is None else tree.confidence[:, 1:],
        q=None if tree.q is None else tree.q[:, 1:],
        q_slot=None if tree.q is None else jnp.broadcast_to(jnp.arange(d - 1, dtype=jnp.int32), (b, d - 1)),
    )
    return prune_to_budget(pool, tree.tokens[:, 0], width)
