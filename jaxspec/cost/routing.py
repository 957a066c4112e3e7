"""How many routed experts a pass touches: the union over its tokens, per device under expert
parallelism, and the busiest device's share (the one a step waits for).

Independent routing: each of n tokens picks k distinct experts of E uniformly, so an expert is
missed by all of them with probability (1 - k/E)^n and the union holds E(1 - (1 - k/E)^n). An
`overlap` rho in [0, 1) says tokens share experts more than that (as a learned router does on real
text): every token after the first adds only (1 - rho) of the new experts independence would.

The busiest device: under independent uniform routing, given the union's size u, the union is a
uniform u-subset of the experts (by symmetry), so the busiest of G devices holding m = E/G experts
each has an exactly computable expected count: P(max < j) = [x^u] (sum_{c<j} C(m, c) x^c)^G / C(E, u)
(a polynomial product), E[max] = sum_j (1 - P(max < j)). The one approximation: u is taken at its
mean (interpolated between the neighbouring integers). For one token (u = k) this is exact.
"""

from __future__ import annotations

import functools
import math

import numpy as np


def _check(num_experts: int, topk: int, tokens: float, overlap: float) -> None:
    if num_experts < 1 or not 1 <= topk <= num_experts:
        raise ValueError(f"need 1 <= topk <= num_experts, got topk={topk}, num_experts={num_experts}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if not 0.0 <= overlap < 1.0:
        raise ValueError(f"overlap must be in [0, 1), got {overlap}")


def expected_distinct(num_experts: int, topk: int, tokens: float, overlap: float = 0.0) -> float:
    """Expected number of distinct experts n tokens route to: E(1 - (1 - k/E)^n), shrunk toward k
    by `overlap` (k + (union - k)(1 - rho)); 0 for no tokens."""
    _check(num_experts, topk, tokens, overlap)
    if tokens == 0:
        return 0.0
    union = num_experts * (1.0 - (1.0 - topk / num_experts) ** tokens)
    if tokens < 1:
        return union
    return topk + (union - topk) * (1.0 - overlap)


@functools.lru_cache(maxsize=4096)
def _max_given_union(num_experts: int, groups: int, union: int) -> float:
    """E[max over groups of the experts of a uniform `union`-subset in each group] (exact)."""
    m = num_experts // groups
    total = math.comb(num_experts, union)
    out = 0.0
    for j in range(1, min(m, union) + 1):
        per_group = np.array([math.comb(m, c) for c in range(j)], dtype=np.float64)
        poly = np.ones(1)
        for _ in range(groups):
            poly = np.convolve(poly, per_group)[: union + 1]
        below = poly[union] / total if len(poly) > union else 0.0
        out += 1.0 - below
    return out


def expected_max_per_device(num_experts: int, topk: int, tokens: float, groups: int, overlap: float = 0.0) -> float:
    """Expected distinct experts on the busiest of `groups` devices holding E/groups experts each
    (exact given the union's size, taken at its mean: see the module docstring). groups 1: the union."""
    _check(num_experts, topk, tokens, overlap)
    if groups < 1 or num_experts % groups:
        raise ValueError(f"groups must divide num_experts={num_experts}, got {groups}")
    distinct = expected_distinct(num_experts, topk, tokens, overlap)
    if groups == 1 or distinct == 0:
        return distinct
    low = math.floor(distinct)
    frac = distinct - low
    value = _max_given_union(num_experts, groups, low) if low else 0.0
    if frac > 1e-9:
        value = (1.0 - frac) * value + frac * _max_given_union(num_experts, groups, low + 1)
    return value


def expected_mean_per_device(num_experts: int, topk: int, tokens: float, groups: int, overlap: float = 0.0) -> float:
    """Expected distinct experts on an average device: the union / groups."""
    if groups < 1 or num_experts % groups:
        raise ValueError(f"groups must divide num_experts={num_experts}, got {groups}")
    return expected_distinct(num_experts, topk, tokens, overlap) / groups
