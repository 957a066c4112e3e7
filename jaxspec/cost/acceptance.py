"""Expected accepted length of the tree jaxspec grows, from per-depth, per-rank acceptance rates (for
projections where no draft was measured on the target: docs/cost_model.md, "DSpark").

rates[d][r] = P(the rank-r child of a node at depth d is the target's token | that node accepted). A
published chain's per-position acceptance a_k (P(the first k drafts all accepted)) gives the rank-0 rates
c_k = a_k / a_(k-1); siblings need an assumption (`rates_from_chain`) or a measurement.

The tree is the beam of `speculation/tree.py`: step 1 gives the root K children, every later step expands
the K best candidates of the step before, and the D - 1 best of the pool are kept. "Best" is taken as the
node's path acceptance (a calibrated value, the tree's best case). Greedy verification accepts one path,
so tau = 1 + the sum of the kept nodes' path acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxspec.core.spec import SpecConfig


def rates_from_chain(per_position: Sequence[float], sibling: float, k: int = 2) -> list[list[float]]:
    """Rates from a chain's per-position acceptance (non-increasing, in (0, 1]) and the probability that the
    rank-1 child is the target's token when rank 0 is not (the same at every depth); ranks >= 2 get 0. A
    child of an accepted sibling accepts as a chain node at its depth does (a parent-conditioned draft)."""
    if not 0.0 <= sibling <= 1.0:
        raise ValueError(f"sibling acceptance must be in [0, 1], got {sibling}")
    out, prev = [], 1.0
    for a in per_position:
        if not 0.0 < a <= prev:
            raise ValueError(f"per-position acceptance must be non-increasing in (0, 1], got {list(per_position)}")
        c, prev = a / prev, a
        out.append(([c, (1.0 - c) * sibling] + [0.0] * k)[:k])
    return out


def beam_tau(rates: Sequence[Sequence[float]], spec: SpecConfig) -> tuple[float, list[tuple[int, ...]]]:
    """-> (tau, the kept nodes as rank paths from the root) of the tree `spec` grows under `rates`."""
    k, steps = spec.topk, spec.num_steps
    if steps > len(rates) or any(len(r) < k for r in rates[:steps]):
        raise ValueError(f"{spec.name} needs rates for {steps} depths and {k} ranks, got {len(rates)} depths")
    pool: list[tuple[float, tuple[int, ...]]] = []
    frontier: list[tuple[float, tuple[int, ...]]] = [(1.0, ())]
    for depth in range(steps):
        children = [(v * rates[depth][r], path + (r,)) for v, path in frontier for r in range(k)]
        pool += children
        frontier = sorted(children, key=lambda c: -c[0])[:k]
    kept = sorted(pool, key=lambda c: -c[0])[: spec.num_draft_tokens - 1]
    return 1.0 + sum(v for v, _ in kept), [p for _, p in kept]
