"""Everything about a tree that verification needs, derived from its parent vector by a fixed
number of gathers: ancestor mask, depths, positions, and the chain element at each depth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.layers.attention import AttentionContext


@struct.dataclass
class TreePlan:
    ancestor_mask: jax.Array  # [B, D, D] bool: node j is i or an ancestor of i
    depth: jax.Array  # [B, D] int32 (root = 0)
    positions: jax.Array  # [B, D] int32 = committed + depth
    ancestor_at_depth: jax.Array  # [B, D, D] int32: i's ancestor at depth d (d <= depth[i])


def build_plan(parent: jax.Array, committed: jax.Array, max_depth: int) -> TreePlan:
    """parent: [B, D] int32 with parent[:, 0] = 0 (the root is its own parent); committed: [B]."""
    b, d = parent.shape
    nodes = jnp.arange(d, dtype=jnp.int32)
    onehot = nodes[None, :, None] == nodes[None, None, :]
    mask = jnp.broadcast_to(onehot, (b, d, d))
    current = jnp.broadcast_to(nodes, (b, d))
    for _ in range(max_depth):
        current = jnp.take_along_axis(parent, current, axis=1)
        mask = mask | (current[:, :, None] == nodes[None, None, :])
    depth = jnp.sum(mask, axis=-1).astype(jnp.int32) - 1
    at_depth = mask[:, :, None, :] & (depth[:, None, None, :] == nodes[None, None, :, None])  # [B,D,d,j]
    ancestor_at_depth = jnp.argmax(at_depth, axis=-1).astype(jnp.int32)
    return TreePlan(
        ancestor_mask=mask,
        depth=depth,
        positions=committed[:, None] + depth,
        ancestor_at_depth=ancestor_at_depth,
    )


def verify_context(plan: TreePlan, committed: jax.Array) -> AttentionContext:
    b, d = plan.depth.shape
    return AttentionContext(
        positions=plan.positions,
        committed=committed,
        visible=plan.ancestor_mask,
        ancestor_at_depth=plan.ancestor_at_depth,
        valid=jnp.ones((b, d), bool),
    )
