"""One speculative cycle, defined once (docs/tree_verification.md §1): draft -> verify -> accept -> commit.

    state (committed target, the drafter's state, the root)
      1 draft    the drafter grows the tree of D nodes (`Drafter.draft`: beam + prune, node values)
      2 verify   plan the tree (ancestor mask, depths, positions), then run the target over its nodes
                 against the committed state; every new row lives in the verify scratch
      3 accept   the policy's rule walks the tree -> accepted path + bonus token
      4 commit   the target commits the path's rows only; the drafter follows the committed rows

The stages have stable signatures; the loop (`generate.py`), the stage-by-stage harness and the cost
analysis call these, nothing else composes a cycle. A spec with per-cycle widths (`spec.widths`) runs
verify -> accept -> commit in the width the tree's values ask for, picked by `lax.switch` among the
compiled widths: the same stages, one loop body either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.model import state as state_lib
from jaxspec.model.network import ForwardOutput, Models, forward
from jaxspec.model.prefill import chunked_prefill
from jaxspec.model.sampling import Sampling, fold, node_keys, sample_tokens
from jaxspec.model.state import DecodeState
from jaxspec.sharding.active import constrain_state
from jaxspec.speculation.drafter import Drafter, Exposed
from jaxspec.speculation.plan import TreePlan, build_plan, verify_context
from jaxspec.speculation.policy import Policy
from jaxspec.speculation.tree import Tree, shrink
from jaxspec.speculation.verify import Acceptance, greedy_accept, sampled_accept, target_accept


@dataclasses.dataclass(frozen=True)
class Speculator:
    """What a cycle runs, static (part of the compiled program)."""

    cfg: ModelConfig
    spec: SpecConfig
    drafter: Drafter
    policy: Policy = Policy()


@struct.dataclass
class SpecStats:
    """Per-sequence counters, summed over cycles (`generate.summarize_stats` turns them into tau)."""

    cycles: jax.Array  # [B] int32 cycles run (also the cycle counter every key folds in)
    accepted: jax.Array  # [B] int32 accepted drafts (bonus excluded)
    verified: jax.Array  # [B] int32 nodes verified (the cycle's width)
    depth_hits: jax.Array  # [B, S] int32 cycles whose path reached depth d + 1
    rank_hist: jax.Array  # [B, K] int32 accepted drafts by their rank among siblings

    @classmethod
    def zeros(cls, spec: SpecConfig, batch: int) -> SpecStats:
        z = jnp.zeros((batch,), jnp.int32)
        return cls(z, z, z, jnp.zeros((batch, spec.num_steps), jnp.int32), jnp.zeros((batch, spec.topk), jnp.int32))


@struct.dataclass
class SpecState:
    """What a cycle starts from and leaves behind."""

    target: DecodeState  # committed target state (length P)
    drafter: Any  # the drafter's own state, following the committed rows
    root: jax.Array  # [B] int32 bonus token of the last cycle, at position P, not yet committed
    stats: SpecStats


@struct.dataclass
class CycleOut:
    """What one cycle emits, per sequence."""

    path: jax.Array  # [B, S+1] int32 tokens of the path's nodes (root first; valid up to num_accepted)
    num_accepted: jax.Array  # [B] int32 accepted drafts
    bonus: jax.Array  # [B] int32 the target's token after the last accepted node (the next root)


# ---- the stages -------------------------------------------------------------------------------


def prefill(sp: Speculator, models: Models, tokens: jax.Array, lengths: jax.Array, max_len: int,
            sampling: Sampling) -> SpecState:
    """Target prefill of the prompts (tokens [B, S] left-aligned, lengths [B] >= 1), the drafter following
    every chunk; the root is the first generated token, drawn exactly as `generate` draws it."""
    if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
        raise ValueError(f"tokens must be [B, S] and lengths [B], got {tokens.shape} and {lengths.shape}")
    b, s = tokens.shape
    if s > max_len:
        raise ValueError(f"max_len={max_len} is shorter than the prompt width {s}")
    cfg, drafter = sp.cfg, sp.drafter
    target = constrain_state(state_lib.init_state(cfg, b, max_len))

    def follow(draft_state, out: ForwardOutput, chunk, positions, valid):
        rows = Exposed(chunk, positions, valid, out.hidden, out.captured)
        return drafter.follow(models, cfg, draft_state, rows)

    out, target = chunked_prefill(models.target, cfg, target, tokens, lengths, capture=drafter.capture,
                                  follow=(follow, drafter.init_state(cfg, b, max_len)))
    root = sample_tokens(out.last_logits, fold(sampling.key, 0), sampling.temperature, sampling.top_k,
                         sampling.top_p)
    return SpecState(target=target, drafter=out.followed, root=root, stats=SpecStats.zeros(sp.spec, b))


def draft_stage(sp: Speculator, models: Models, state: SpecState, sampling: Sampling) -> Tree:
    """1: the tree of D nodes, ranked and drawn as the policy says."""
    context = sp.policy.context(sp.spec, state.stats)
    expander = sp.policy.expander(sp.spec, sampling, state.stats.cycles, context)
    return sp.drafter.draft(models, sp.cfg, sp.spec, state.drafter, state.root, expander)


def plan_stage(sp: Speculator, target: DecodeState, tree: Tree) -> TreePlan:
    """2a: ancestor mask, depths and positions of the tree's nodes, by gathers from the parent vector."""
    return build_plan(tree.parent, target.length, sp.spec.num_steps)


def verify_stage(sp: Speculator, models: Models, target: DecodeState, tree: Tree, plan: TreePlan) -> ForwardOutput:
    """2b: the target forward over the tree's nodes against the committed state (writes nothing)."""
    return forward(models.target, sp.cfg, target, tree.tokens, verify_context(plan, target.length),
                   capture=sp.drafter.capture)


def accept_stage(sp: Speculator, tree: Tree, logits: jax.Array, sampling: Sampling, cycle: jax.Array) -> Acceptance:
    """3: the policy's rule over the verify logits [B, D, V] (`cycle` [B] folds the per-node keys)."""
    s = sp.spec.num_steps
    if sp.policy.rule == "greedy":
        return greedy_accept(tree.tokens, tree.parent, jnp.argmax(logits, axis=-1).astype(jnp.int32), s)
    keys = node_keys(sampling.key, cycle, tree.tokens.shape[1])
    if sp.policy.rule == "target":
        return target_accept(tree.tokens, tree.parent, logits, s, sampling, keys)
    return sampled_accept(tree, logits, s, sp.spec.topk, sampling, keys, sp.policy.rule,
                          sp.spec.greedy_set)


def commit_stage(sp: Speculator, models: Models, state: SpecState, tree: Tree, verify_out: ForwardOutput,
                 acc: Acceptance, active: jax.Array) -> tuple[SpecState, CycleOut]:
    """4: the target commits the accepted path's rows (positions P, P+1, ...; a compressed entry only where
    a path node closes a block), the drafter follows them; finished sequences (`active` [B] False) keep
    everything."""
    path = acc.path_nodes  # [B, S+1]
    steps = path.shape[1]
    on_path = (jnp.arange(steps)[None, :] <= acc.num_accepted[:, None]) & active[:, None]

    def path_rows(x):  # [B, D, ...] -> [B, S+1, ...]
        return jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)

    positions = state.target.length[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    target = state_lib.commit(sp.cfg, state.target, jax.tree.map(path_rows, verify_out.rows), positions, on_path)
    tokens = path_rows(tree.tokens)
    captured = None if verify_out.captured is None else path_rows(verify_out.captured)
    rows = Exposed(tokens, positions, on_path, path_rows(verify_out.hidden), captured)
    draft = sp.drafter.follow(models, sp.cfg, state.drafter, rows)
    out = CycleOut(path=tokens, num_accepted=acc.num_accepted, bonus=acc.bonus)
    stats = _count(state.stats, sp.spec, path_rows(tree.rank)[:, 1:], acc.num_accepted, tree.tokens.shape[1], active)
    root = jnp.where(active, acc.bonus, state.root)
    return SpecState(target=target, drafter=draft, root=root, stats=stats), out


def _count(stats: SpecStats, spec: SpecConfig, ranks: jax.Array, num_accepted: jax.Array, width: int,
           active: jax.Array) -> SpecStats:
    on = active.astype(jnp.int32)
    hit = (jnp.arange(spec.num_steps)[None, :] < num_accepted[:, None]) & active[:, None]  # [B, S]
    by_rank = jax.nn.one_hot(ranks, spec.topk, dtype=jnp.int32) * hit[..., None].astype(jnp.int32)
    return SpecStats(cycles=stats.cycles + on, accepted=stats.accepted + num_accepted * on,
                     verified=stats.verified + width * on, depth_hits=stats.depth_hits + hit.astype(jnp.int32),
                     rank_hist=stats.rank_hist + jnp.sum(by_rank, axis=1))


# ---- the cycle --------------------------------------------------------------------------------


def speculative_cycle(sp: Speculator, models: Models, state: SpecState, sampling: Sampling,
                      active: jax.Array) -> tuple[SpecState, CycleOut]:
    """draft -> verify -> accept -> commit; `active` [B] bool (finished sequences commit nothing)."""
    tree = draft_stage(sp, models, state, sampling)

    def in_width(width: int):
        def run(_):
            sub = shrink(tree, width)
            verify_out = verify_stage(sp, models, state.target, sub, plan_stage(sp, state.target, sub))
            acc = accept_stage(sp, sub, verify_out.logits, sampling, state.stats.cycles)
            return commit_stage(sp, models, state, sub, verify_out, acc, active)

        return run

    widths = sp.spec.widths or (sp.spec.num_draft_tokens,)
    if len(widths) == 1:
        return in_width(widths[0])(None)
    return jax.lax.switch(choose_width(sp.spec, tree, active), [in_width(w) for w in widths], None)


def choose_width(spec: SpecConfig, tree: Tree, active: jax.Array) -> jax.Array:
    """-> [] int32 index into spec.widths: the smallest width holding every active row's nodes whose path
    value clears the threshold (exact: the kept nodes are a function of the draft alone, never of the
    target's draws; docs/sampling.md §3)."""
    need = jnp.sum(jnp.exp(tree.score) >= spec.width_threshold, axis=1)  # [B], the root's value is 1
    need = jnp.max(jnp.where(active, need, 1))
    index = jnp.searchsorted(jnp.asarray(spec.widths, jnp.int32), need, side="left")
    return jnp.minimum(index, len(spec.widths) - 1).astype(jnp.int32)
