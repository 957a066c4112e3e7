"""Fitting the node values offline (the maps `speculation/values.py` evaluates while drafting).

`fit_map` bins a calibration run's samples per (depth, rank, feature) cell, pulls sparse cells towards
their pool over depths (PRIOR_STRENGTH pseudo-counts), and makes each row monotone in the feature with
pool-adjacent-violators: simple and inspectable (docs/calibration.md, "The fit"). `predict` reads a map
at samples in numpy and `expected_calibration_error` scores it on held-out ones. The harness's
collectors (`calibrate`, `calibrate_residual`, `calibrate_block`) fit with these; the decode path never
imports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxspec.speculation.values import (
    CONFIDENCE_EDGES,
    DEPTH_EDGES,
    NUM_RANKS,
    PROB_EDGES,
    SAMPLED_MODES,
    ValueMap,
)

PRIOR_STRENGTH = 20.0  # pseudo-counts pulling a sparse cell towards its all-depth pool
VALUE_RANGE = (1e-4, 1.0 - 1e-4)  # log-values stay finite and strictly negative along a path



def _pav(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Pool-adjacent-violators: the nondecreasing fit of y minimising sum w (fit - y)^2."""
    blocks: list[list[float]] = []  # [value, weight, length]
    for value, weight in zip(y.tolist(), w.tolist(), strict=True):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            total = w1 + w2
            blocks.append([(v1 * w1 + v2 * w2) / total if total > 0 else (v1 + v2) / 2, total, n1 + n2])
    return np.concatenate([np.full(n, v) for v, _, n in blocks])


def bin_indices(depth: np.ndarray, rank: np.ndarray, prob: np.ndarray, confidence: np.ndarray | None = None
                ) -> np.ndarray:
    """Flat cell index of each sample (the numpy twin of the cells `values.node_log_values` reads); with
    `confidence`, of a two-feature map."""
    d = np.searchsorted(np.asarray(DEPTH_EDGES), depth, side="right")
    p = np.searchsorted(np.asarray(PROB_EDGES, np.float32), prob.astype(np.float32), side="right")
    r = np.minimum(rank, NUM_RANKS - 1)
    index = (d * NUM_RANKS + r) * (len(PROB_EDGES) + 1) + p
    if confidence is None:
        return index
    c = np.searchsorted(np.asarray(CONFIDENCE_EDGES, np.float32), np.asarray(confidence, np.float32), side="right")
    return index * (len(CONFIDENCE_EDGES) + 1) + c


def _pav_rows(value: np.ndarray, weight: np.ndarray, increasing: bool) -> np.ndarray:
    """PAV along the last axis of every row."""
    out = np.empty_like(value)
    for i in np.ndindex(value.shape[:-1]):
        out[i] = _pav(value[i], weight[i]) if increasing else -_pav(-value[i], weight[i])
    return out


def _monotone_2d(value: np.ndarray, weight: np.ndarray, along_confidence: bool, sweeps: int = 200) -> np.ndarray:
    """value [P, C] nondecreasing along P (and along C with `along_confidence`): alternating PAV along
    each axis (projections onto two convex sets) until neither moves a value by more than 1e-9."""
    value = _pav_rows(value.T, weight.T, True).T  # along P (rows of the transpose)
    for _ in range(sweeps if along_confidence else 0):
        before = value
        value = _pav_rows(value, weight, True)  # along C
        value = _pav_rows(value.T, weight.T, True).T
        if np.max(np.abs(value - before)) < 1e-9:
            break
    return value


def fit_map(mode: str, temperature: float, depth: Sequence[int], rank: Sequence[int], prob: Sequence[float],
            label: Sequence[float], confidence: Sequence[float] | None = None,
            weight: Sequence[float] | None = None) -> ValueMap:
    """Binned, smoothed and monotone fit of E[label | depth, rank, prob]; `prob` is the node's own
    draft probability (greedy) or its parent's top-1 draft probability (sampling). With `confidence`
    (greedy only: sigma(c) of the node's slot), of E[label | depth, rank, prob, confidence] (a "both"
    calibration's map, `prob` its `both_first_feature`): nondecreasing in `prob`, and for rank 0 in the
    confidence too.
    Later ranks are left free along the confidence: a confident top child leaves its siblings less to be
    right about, yet marks a slot the drafter reads well, and the data decide which wins.
    `weight` (one per sample): a cell's value is then sum(weight * label) / sum(weight), a ratio of
    expectations (block maps: a child's P(the path passes it) over its parent's)."""
    if mode not in ("greedy", *SAMPLED_MODES):
        raise ValueError(f"mode must be one of {('greedy', *SAMPLED_MODES)}, got {mode!r}")
    if confidence is not None and mode != "greedy":
        raise ValueError("only greedy maps read the confidence feature")
    depth, rank, prob, label = (np.asarray(x) for x in (depth, rank, prob, label))
    if not depth.size:
        raise ValueError("no samples to fit a calibration on")
    shape = (len(DEPTH_EDGES) + 1, NUM_RANKS, len(PROB_EDGES) + 1)
    if confidence is not None:
        confidence = np.asarray(confidence)
        if confidence.shape != depth.shape:
            raise ValueError(f"confidence needs one value per sample ({depth.shape}), got {confidence.shape}")
        shape = (*shape, len(CONFIDENCE_EDGES) + 1)
    cells = int(np.prod(shape))
    index = bin_indices(depth, rank, prob, confidence)
    w = np.ones(depth.shape) if weight is None else np.asarray(weight, np.float64)
    if w.shape != depth.shape:
        raise ValueError(f"weight needs one value per sample ({depth.shape}), got {w.shape}")
    n = np.bincount(index, weights=w, minlength=cells).reshape(shape)
    s = np.bincount(index, weights=w * label.astype(np.float64), minlength=cells).reshape(shape)
    # Backoff: a cell borrows strength from the same (rank, prob) cell pooled over depths, which
    # borrows from its rank's overall mean.
    other = tuple(a for a in range(n.ndim) if a != 1)
    rank_n, rank_s = n.sum(other), s.sum(other)
    rank_mean = (rank_s + 0.5) / (rank_n + 1.0)  # [R]
    pool_n, pool_s = n.sum(0), s.sum(0)  # [R, P(, C)]
    rank_prior = rank_mean.reshape(-1, *(1,) * (pool_n.ndim - 1))
    pool = (pool_s + PRIOR_STRENGTH * rank_prior) / (pool_n + PRIOR_STRENGTH)
    value = (s + PRIOR_STRENGTH * pool[None]) / (n + PRIOR_STRENGTH)
    weight = n + PRIOR_STRENGTH
    # Residual and block maps stay unconstrained in the feature: under recursive rejection rank 0 is U-shaped
    # and rank 1 peaks in the parent's top-1 probability (docs/sampling_values.md); only smoothed.
    for d in range(shape[0] if mode in ("greedy", "sampling") else 0):
        for r in range(shape[1]):
            increasing = mode == "greedy" or r == 0
            row, w = value[d, r], weight[d, r]
            if confidence is not None:
                value[d, r] = _monotone_2d(row, w, along_confidence=r == 0)
            else:
                value[d, r] = _pav(row, w) if increasing else -_pav(-row, w)
    value = np.clip(value, *VALUE_RANGE)
    counts = np.bincount(index, minlength=cells)
    return ValueMap(mode, float(temperature), tuple(float(x) for x in value.ravel()),
                    tuple(int(x) for x in counts))


def predict(value_map: ValueMap, depth: np.ndarray, rank: np.ndarray, prob: np.ndarray,
            confidence: np.ndarray | None = None) -> np.ndarray:
    """The map's values at the samples; a two-feature map needs `confidence`."""
    if value_map.two_features != (confidence is not None):
        raise ValueError("a two-feature map needs the confidence feature, a one-feature map takes none")
    index = bin_indices(np.asarray(depth), np.asarray(rank), np.asarray(prob), confidence)
    return np.asarray(value_map.table)[index]


def expected_calibration_error(predicted: np.ndarray, label: np.ndarray, num_bins: int = 10) -> float:
    """sum over equal-width bins of predicted value: share of samples * |mean predicted - mean label|."""
    predicted, label = np.asarray(predicted, np.float64), np.asarray(label, np.float64)
    if not predicted.size:
        raise ValueError("no samples to measure calibration error on")
    which = np.minimum((predicted * num_bins).astype(int), num_bins - 1)
    total = 0.0
    for b in range(num_bins):
        sel = which == b
        if sel.any():
            total += sel.mean() * abs(predicted[sel].mean() - label[sel].mean())
    return float(total)
