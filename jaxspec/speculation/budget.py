"""What a verification budget can buy: Sequoia's dynamic program for the best tree of D nodes
under a per-rank acceptance model, and its value for a spec's (S, K, D)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxspec.core.spec import SpecConfig


def sequoia_optimum(acceptance: Sequence[float] | Sequence[Sequence[float]], budget: int, max_depth: int) -> float:
    """Best expected tokens per cycle over all trees of `budget` nodes (root included) and depth
    <= max_depth, when the k-th ranked child of any node is the accepted one with probability
    acceptance[k-1] (Sequoia, Chen et al. 2024). The root counts 1.

    `acceptance` may also be per depth, acceptance[d-1][k-1] for a child at depth d (the last row
    serving deeper children): a draft reused for several steps is surer near the root than deep in."""
    rows = np.asarray(acceptance, dtype=float)
    if rows.ndim == 1:
        rows = rows[None, :]
    if rows.ndim != 2 or rows.size == 0 or not np.all((rows >= 0.0) & (rows <= 1.0)):
        raise ValueError(f"acceptance must be probabilities in [0, 1] (per rank, or per depth and rank), "
                         f"got {acceptance!r}")
    if budget < 1 or max_depth < 0:
        raise ValueError(f"budget must be >= 1 and max_depth >= 0, got {budget}, {max_depth}")

    def at(l: int) -> list[float]:
        # children of a subtree root with l levels left below it sit at depth max_depth - l + 1
        return rows[min(max_depth - l, rows.shape[0] - 1)].tolist()

    width = rows.shape[1]
    neg = -np.inf
    # best[m][l]: best value of a subtree of m nodes with depth <= l (any number of children)
    best = np.full((budget + 1, max_depth + 1), neg)
    # with_children[m][l][b]: exactly b children at the root
    with_children = np.full((budget + 1, max_depth + 1, width + 1), neg)
    for l in range(max_depth + 1):
        with_children[1, l, 0] = 1.0
        best[1, l] = 1.0
    def attach(prob: float, subtree: float) -> float:
        # an impossible subtree stays impossible even behind a zero-probability edge (0 * -inf)
        return prob * subtree if np.isfinite(subtree) else neg

    for l in range(1, max_depth + 1):
        p = at(l)
        for m in range(2, budget + 1):
            with_children[m, l, 1] = 1.0 + attach(p[0], best[m - 1, l - 1])
            for b in range(2, width + 1):
                candidates = [
                    with_children[y, l, b - 1] + attach(p[b - 1], best[m - y, l - 1]) for y in range(1, m)
                ]
                with_children[m, l, b] = max(candidates)
            best[m, l] = np.max(with_children[m, l])
    if not np.isfinite(best[budget, max_depth]):
        raise ValueError(
            f"no tree of {budget} nodes fits depth <= {max_depth} with {width} ranked children per node"
        )
    return float(best[budget, max_depth])


def expected_tokens_per_cycle(acceptance: Sequence[float] | Sequence[Sequence[float]], spec: SpecConfig) -> float:
    """Sequoia's optimum for the spec's budget: best tree of D nodes, depth <= S, <= K children
    (acceptance per rank, or per depth and rank as `sequoia_optimum` takes it)."""
    rows = np.asarray(acceptance, dtype=float)
    rows = rows[None, :] if rows.ndim == 1 else rows
    ranked = np.zeros((rows.shape[0], spec.topk))
    ranked[:, : min(spec.topk, rows.shape[1])] = rows[:, : spec.topk]
    return sequoia_optimum(ranked if np.asarray(acceptance).ndim == 2 else ranked[0], spec.num_draft_tokens,
                           spec.num_steps)


def matched_linear(spec: SpecConfig) -> SpecConfig:
    """The linear chain verifying the same number of tokens per cycle: s(D-1)_k1_dD."""
    d = spec.num_draft_tokens
    return SpecConfig(d - 1, 1, d)
