"""Acceptance: walk the tree from the root following the child the target agrees with.

Greedy: at node i the target's choice is argmax(logits_i); the child carrying that token (top-K
children have distinct tokens) is accepted. The walk is a fixed number (S) of gathers. Lossless
sampling plugs in by replacing `target_choice` with a per-node draw from the target distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Acceptance:
    path_mask: jax.Array  # [B, D] bool: root and accepted nodes
    num_accepted: jax.Array  # [B] accepted draft tokens (bonus excluded)
    last_node: jax.Array  # [B] deepest accepted node (0 = root)
    bonus: jax.Array  # [B] the target's token after the last accepted node
    path_nodes: jax.Array  # [B, S+1] node at depth 0..S on the path (valid up to num_accepted)


def greedy_accept(
    tokens: jax.Array,  # [B, D] node tokens
    parent: jax.Array,  # [B, D]
    target_choice: jax.Array,  # [B, D] the target's token after each node (argmax, or a draw)
    max_depth: int,
) -> Acceptance:
    b, d = tokens.shape
    nodes = jnp.arange(d)
    current = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path_mask = nodes[None, :] == 0
    path_nodes = [current]
    num_accepted = jnp.zeros((b,), jnp.int32)
    for _ in range(max_depth):
        wanted = jnp.take_along_axis(target_choice, current[:, None], axis=1)  # [B, 1]
        match = (parent == current[:, None]) & (nodes[None, :] != 0) & (tokens == wanted)
        found = jnp.any(match, axis=1) & alive
        nxt = jnp.argmax(match, axis=1).astype(jnp.int32)
        current = jnp.where(found, nxt, current)
        path_mask = path_mask | ((nodes[None, :] == nxt[:, None]) & found[:, None])
        num_accepted = num_accepted + found.astype(jnp.int32)
        alive = found
        path_nodes.append(current)
    bonus = jnp.take_along_axis(target_choice, current[:, None], axis=1)[:, 0]
    return Acceptance(
        path_mask=path_mask,
        num_accepted=num_accepted,
        last_node=current,
        bonus=bonus,
        path_nodes=jnp.stack(path_nodes, axis=1),
    )
