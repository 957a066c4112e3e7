"""The one timer every measurement uses, and the per-stage split of a cycle timed with it.

The stage programs are the cycle's own (`jaxspec.speculation.stages`), so a stage's time is what that
part of `speculative_cycle` costs when jitted alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxspec.model.network import Models
from jaxspec.model.sampling import Sampling
from jaxspec.speculation import stages as st
from jaxspec.speculation.cycle import SpecState, Speculator

STAGES = st.STAGES


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


def time_stages(sp: Speculator, models: Models, state: SpecState, iters: int = 10,
                sampling: Sampling | None = None) -> dict[str, Any]:
    """Median milliseconds of each stage of one cycle from `state`, each jitted alone on the previous
    stage's real output (greedy unless `sampling`); also the first call (compile) seconds."""
    sampling = Sampling.create() if sampling is None else sampling
    tree = jax.block_until_ready(st.draft(sp, models, state, sampling))
    plan = jax.block_until_ready(st.plan(sp, state.target, tree))
    verify_out = jax.block_until_ready(st.verify(sp, models, state.target, tree, plan))
    calls = {
        "draft": lambda _: st.draft(sp, models, state, sampling),
        "plan": lambda _: st.plan(sp, state.target, tree),
        "verify": lambda _: st.verify(sp, models, state.target, tree, plan),
        "commit": lambda _: st.commit(sp, models, state, tree, verify_out, sampling),
    }
    stage_ms, first_s = {}, {}
    for name, call in calls.items():
        first_s[name], seconds, _ = median_seconds(call, None, iters)
        stage_ms[name] = 1e3 * seconds
    total = sum(stage_ms.values())
    return {"stage_ms": stage_ms, "first_call_s": first_s, "sum_of_stages_ms": total,
            "stage_pct": {s: 100.0 * ms / total for s, ms in stage_ms.items()}}
