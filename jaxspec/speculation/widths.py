"""Width chosen per cycle (static buckets): verify only the nodes worth verifying this cycle.

A node's score is log P(the walk reaches it) (speculation/values.py), so exp(score) is the token it is
expected to add. After drafting and pruning to D, a cycle counts the nodes whose path value is at
least `spec.width_threshold` (the root always counts) and verifies the best ones in the smallest of
the compiled widths `spec.widths` that holds them; at batch > 1 the widest row decides. Each width
is its own verify + accept + commit program, picked by `lax.switch` inside the loop: static shapes,
no host round-trip, one compile for all widths. A narrower cycle runs fewer target token-forwards
(and, on the grouped-experts path, routes fewer tokens).

Exactness: the kept nodes are a function of the draft alone (their values), never of the target's
draws, so the greedy walk and both sampling rules stay exact (docs/sampling.md §3); the top-w of the
D-tree are the top-w of the pool with the same ties, and prefixes of every node's sampling order stay
prefixes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.core.config import ModelConfig, SpecConfig
from jaxspec.model.network import ModelParams
from jaxspec.model.sampling import Sampling
from jaxspec.model.state import DecodeState
from jaxspec.speculation.commit import commit_accepted_path
from jaxspec.speculation.draft import DraftPool, Tree, prune_to_budget
from jaxspec.speculation.rules import verify_tree
from jaxspec.speculation.verify import Acceptance


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
        q=None if tree.q is None else tree.q[:, 1:],
        q_slot=None if tree.q is None else jnp.broadcast_to(jnp.arange(d - 1, dtype=jnp.int32), (b, d - 1)),
    )
    return prune_to_budget(pool, tree.tokens[:, 0], width)


def choose_width(
    spec: SpecConfig,
    tree: Tree,  # the D-node tree of this cycle
    active: jax.Array,  # [B] bool
) -> jax.Array:
    """-> [] int32 index into spec.widths: the smallest width holding every active row's nodes whose
    path value clears the threshold."""
    need = jnp.sum(jnp.exp(tree.score) >= spec.width_threshold, axis=1)  # [B], the root's value is 1
    need = jnp.max(jnp.where(active, need, 1))
    index = jnp.searchsorted(jnp.asarray(spec.widths, jnp.int32), need, side="left")
    return jnp.minimum(index, len(spec.widths) - 1).astype(jnp.int32)


def accepted_path(tree: Tree, acc: Acceptance) -> tuple[jax.Array, jax.Array]:
    """-> (tokens [B, S+1] of the accepted path's nodes, ranks [B, S] of its drafts)."""
    return (jnp.take_along_axis(tree.tokens, acc.path_nodes, axis=1),
            jnp.take_along_axis(tree.rank, acc.path_nodes[:, 1:], axis=1))


def verify_in_width(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig,
    state: DecodeState,
    last_hidden: jax.Array,  # [B, hc, d]
    active: jax.Array,  # [B] bool
    tree: Tree,  # the D-node tree of this cycle
    sampling: Sampling | None = None,
    cycle: jax.Array | None = None,  # [B] int32
):
    """plan -> verify -> accept -> commit in the width `choose_width` picks.
    -> (state, last_hidden, path tokens [B, S+1], path ranks [B, S], num_accepted [B], bonus [B], width [])."""

    def in_width(width: int):
        def run(_):
            sub = shrink(tree, width)
            out, acc = verify_tree(params, cfg, spec, state, sub, sampling, cycle)
            new_state, new_hidden = commit_accepted_path(params, cfg, state, sub.tokens, out, acc, last_hidden, active)
            return (new_state, new_hidden, *accepted_path(sub, acc), acc.num_accepted, acc.bonus)

        return run

    index = choose_width(spec, tree, active)
    outs = jax.lax.switch(index, [in_width(w) for w in spec.widths], None)
    return (*outs, jnp.asarray(spec.widths, jnp.int32)[index])
