"""One speculative cycle as separately jitted stages, plus the one timer every measurement uses.

`jaxspec tune` times an AR step, the draft and whole cycles with these; `bench/spec_vs_ar.py` times
every stage for its per-stage split. Each stage is the function the loop runs (nothing re-written
here), so a stage's time is what that part of `speculative_cycle` costs when jitted alone. Their
compiled programs share the bounded LRU of `jaxspec.core.programs` with the loops.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.config import ModelConfig, SpecConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.model.network import ForwardOutput, ModelParams, extend, forward
from jaxspec.model.state import DecodeState
from jaxspec.speculation.commit import commit_accepted_path
from jaxspec.speculation.draft import Tree, draft_tree, prune_to_budget
from jaxspec.speculation.generate import prefill_for_speculation, speculative_cycle
from jaxspec.speculation.plan import TreePlan, build_plan, verify_context
from jaxspec.speculation.values import Calibration
from jaxspec.speculation.verify import tree_accept

STAGES = ("draft", "plan", "verify", "accept")

# Target prefill + MTP ring over the prompt: -> (state, root [B], last_hidden [B, hc, d]).
prefill = bounded_jit(prefill_for_speculation, static_argnums=(1, 4))


@functools.partial(bounded_jit, static_argnums=(1,), donate_argnums=(2,))
def ar_step(params: ModelParams, cfg: ModelConfig, state: DecodeState, last: jax.Array):  # last: [B] int32
    """One greedy autoregressive step: -> (state, next token [B])."""
    out, state = extend(params, cfg, state, last[:, None], jnp.ones((last.shape[0], 1), bool))
    return state, jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)


@functools.partial(bounded_jit, static_argnums=(1, 2, 6))
def draft(params: ModelParams, cfg: ModelConfig, spec: SpecConfig, state: DecodeState, root: jax.Array,
          last_hidden: jax.Array, values: Calibration | None = None) -> Tree:
    """draft_tree + prune_to_budget: root [B], last_hidden [B, hc, d] -> the D-node tree, ranked by
    `values` (None: raw draft log-probs; `tree.values.resolve_scores` gives what the loop uses)."""
    pool = draft_tree(params, cfg, spec, state, root, last_hidden, values=values)
    return prune_to_budget(pool, root, spec.num_draft_tokens)


@functools.partial(bounded_jit, static_argnums=(0,))
def plan(spec: SpecConfig, parent: jax.Array, length: jax.Array) -> TreePlan:  # parent [B, D], length [B]
    return build_plan(parent, length, spec.num_steps)


@functools.partial(bounded_jit, static_argnums=(1,))
def verify(params: ModelParams, cfg: ModelConfig, state: DecodeState, tokens: jax.Array,
           tree_plan: TreePlan) -> ForwardOutput:
    """The target forward over the D tree nodes (tokens [B, D]) against the committed state."""
    return forward(params, cfg, state, tokens, verify_context(tree_plan, state.length))


@functools.partial(bounded_jit, static_argnums=(1, 2))
def accept(params: ModelParams, cfg: ModelConfig, spec: SpecConfig, state: DecodeState, tree: Tree,
           verify_out: ForwardOutput, last_hidden: jax.Array, active: jax.Array):
    """Greedy acceptance + commit of the accepted path: -> (state, last_hidden)."""
    acc = tree_accept(tree.tokens, tree.parent, verify_out.logits, spec.num_steps)
    return commit_accepted_path(params, cfg, state, tree.tokens, verify_out, acc, last_hidden, active)


@functools.partial(bounded_jit, static_argnums=(1, 2, 6), donate_argnums=(3,))
def cycle(params: ModelParams, cfg: ModelConfig, spec: SpecConfig, state: DecodeState, root: jax.Array,
          last_hidden: jax.Array, values: Calibration | None = None):
    """One whole greedy cycle (state donated, as in the loop), ranked by `values` as `draft`:
    -> (state, bonus, last_hidden, accepted [B])."""
    active = jnp.ones(root.shape, bool)
    state, last_hidden, _, acc = speculative_cycle(params, cfg, spec, state, root, last_hidden, active, values=values)
    return state, acc.bonus, last_hidden, acc.num_accepted


def median_seconds(step: Callable[[Any], Any], carry: Any = None, iters: int = 10) -> tuple[float, float, list[Any]]:
    """Run `carry = step(carry)` once (compile + run), then `iters` times timed.

    -> (first call seconds, median seconds, the timed calls' results). Arrays in `carry` are copied
    first, so a step that donates its state (`ar_step`, `cycle`) never consumes the caller's.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    carry = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, carry)
    start = time.perf_counter()
    carry = jax.block_until_ready(step(carry))
    first = time.perf_counter() - start
    seen, times = [], []
    for _ in range(iters):
        start = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        times.append(time.perf_counter() - start)
        seen.append(carry)
    return first, float(np.median(times)), seen


def time_stages(params: ModelParams, cfg: ModelConfig, spec: SpecConfig, state: DecodeState, root: jax.Array,
                last_hidden: jax.Array, iters: int = 10, values: Calibration | None = None) -> dict[str, Any]:
    """Median milliseconds of each stage of one greedy cycle from (state, root, last_hidden), each
    jitted alone on the previous stage's real output; also the first call (compile) seconds. The
    tree is ranked by `values`, as in `draft`."""
    active = jnp.ones(root.shape, bool)
    tree = jax.block_until_ready(draft(params, cfg, spec, state, root, last_hidden, values))
    tree_plan = jax.block_until_ready(plan(spec, tree.parent, state.length))
    verify_out = jax.block_until_ready(verify(params, cfg, state, tree.tokens, tree_plan))
    calls = {
        "draft": lambda _: draft(params, cfg, spec, state, root, last_hidden, values),
        "plan": lambda _: plan(spec, tree.parent, state.length),
        "verify": lambda _: verify(params, cfg, state, tree.tokens, tree_plan),
        "accept": lambda _: accept(params, cfg, spec, state, tree, verify_out, last_hidden, active),
    }
    stage_ms, first_s = {}, {}
    for name, call in calls.items():
        first_s[name], seconds, _ = median_seconds(call, None, iters)
        stage_ms[name] = 1e3 * seconds
    total = sum(stage_ms.values())
    return {"stage_ms": stage_ms, "first_call_s": first_s, "sum_of_stages_ms": total,
            "stage_pct": {s: 100.0 * ms / total for s, ms in stage_ms.items()}}
