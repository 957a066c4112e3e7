"""The first draft, kept as the test reference of the MTP drafter's beam (`jaxspec.speculation.mtp`;
test-only code lives in tests/): every step re-runs the MTP block over every slot drafted so far
(O(S^2 K) token-forwards) and the head over all of them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.layers.attention import AttentionContext
from jaxspec.model.network import ModelParams, mtp_forward
from jaxspec.speculation.cycle import SpecState
from jaxspec.speculation.plan import build_plan
from jaxspec.speculation.tree import DraftPool, Expander


def _slot_ancestors(slot_parent: jax.Array, max_depth: int) -> jax.Array:
    plan = build_plan(slot_parent, jnp.zeros(slot_parent.shape[:1], jnp.int32), max_depth)
    return plan.ancestor_mask


def draft_tree_exhaustive(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig,
    state: SpecState,  # committed; its draft state the MTP ring, root at position P
) -> DraftPool:
    """The first draft, kept as the test reference of the MTP drafter: every step re-runs the MTP block
    over every slot drafted so far (O(S^2 K) token-forwards) and the head over all of them."""
    s_steps, k = spec.num_steps, spec.topk
    root, mtp = state.root, state.drafter
    root_hidden = mtp.last_hidden  # [B, hc, d] target streams at position P-1
    b = root.shape[0]
    num_slots = 1 + (s_steps - 1) * k
    slot_token = jnp.zeros((b, num_slots), jnp.int32).at[:, 0].set(root)
    slot_hidden = jnp.zeros((b, num_slots, *root_hidden.shape[1:]), root_hidden.dtype).at[:, 0].set(root_hidden)
    slot_parent = jnp.zeros((b, num_slots), jnp.int32)
    slot_depth = jnp.zeros((b, num_slots), jnp.int32)
    slot_filled = jnp.zeros((b, num_slots), bool).at[:, 0].set(True)
    pool = pool_token, pool_parent, pool_score, pool_rank, pool_feature, pool_confidence = [], [], [], [], [], []
    pool_depth = []
    expander = Expander(jnp.float32(0.0), None, None, k)
    # per new slot: its pool index (-1 for the root) and score
    new_slots = jnp.zeros((1,), jnp.int32)
    new_pool_index = jnp.full((b, 1), -1, jnp.int32)
    new_score = jnp.zeros((b, 1), jnp.float32)
    pool_offset = 0
    batch_index = jnp.arange(b)[:, None]
    for step in range(1, s_steps + 1):
        visible = _slot_ancestors(slot_parent, step) & slot_filled[:, None, :]
        ctx = AttentionContext(
            positions=mtp.length[:, None] + slot_depth,
            committed=mtp.length,
            visible=visible,
            ancestor_at_depth=jnp.zeros((b, num_slots, num_slots), jnp.int32),
            valid=slot_filled,
        )
        logits, z, _ = mtp_forward(params, params.mtp, cfg, mtp.ring, slot_hidden, slot_token, ctx)
        n = new_slots.shape[0]
        children, _ = expander.children(logits[:, new_slots], None, new_score, new_pool_index, new_slots, step)
        for column, values in zip(pool, children, strict=True):
            column.append(values)
        pool_depth.append(jnp.full((b, n * k), step, jnp.int32))
        if step == s_steps:
            break
        # Expand the K best candidates of this step in the next one.
        _, best = jax.lax.top_k(pool_score[-1], k)  # [B, K] local index among this step's n*K
        next_slots = jnp.arange(1 + (step - 1) * k, 1 + step * k, dtype=jnp.int32)
        parent_slot = new_slots[best // k]  # [B, K] slot that drafted them
        slot_token = slot_token.at[batch_index, next_slots].set(jnp.take_along_axis(pool_token[-1], best, axis=1))
        slot_hidden = slot_hidden.at[batch_index, next_slots].set(z[batch_index, parent_slot])
        slot_parent = slot_parent.at[batch_index, next_slots].set(parent_slot)
        slot_depth = slot_depth.at[:, next_slots].set(step)
        slot_filled = slot_filled.at[:, next_slots].set(True)
        new_slots = next_slots
        new_pool_index = pool_offset + best
        new_score = jnp.take_along_axis(pool_score[-1], best, axis=1)
        pool_offset += n * k
    return DraftPool(
        token=jnp.concatenate(pool_token, axis=1),
        parent=jnp.concatenate(pool_parent, axis=1),
        score=jnp.concatenate(pool_score, axis=1),
        rank=jnp.concatenate(pool_rank, axis=1),
        depth=jnp.concatenate(pool_depth, axis=1),
        feature=jnp.concatenate(pool_feature, axis=1),
        confidence=jnp.concatenate(pool_confidence, axis=1),
    )
