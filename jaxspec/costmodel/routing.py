"""How many routed experts a pass touches: the union over its tokens, per device under expert
parallelism, and the busiest device's share (the one a step waits for).

Independent routing: each of n tokens picks k distinct experts of E uniformly, so an expert is
missed by all of them with probability (1 - k/E)^n and the union holds E(1 - (1 - k/E)^n). An
`overlap` rho in [0, 1) says tokens share experts more than that (as a learned router does on real
text): every token after the first adds only (1 - rho) of the new experts independence would.

The busiest device (binomial approximation, stated in docs/cost_model.md): each of the m = E/G
experts of a device is touched independently with the union's probability p, so its count is
Binomial(m, p), and the G devices are treated as independent; then E[max] = sum_{j>=1} (1 - F(j-1)^G)
with F the binomial CDF, computed exactly for that model (no sampling).
"""

from __future__ import annotations

import math


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


def _binomial_cdf(m: int, p: float) -> list[float]:
    """[P(X <= j) for j = 0..m] of X ~ Binomial(m, p)."""
    pmf = [math.comb(m, j) * p**j * (1.0 - p) ** (m - j) for j in range(m + 1)]
    out, total = [], 0.0
    for v in pmf:
        total += v
        out.append(min(total, 1.0))
    return out


def expected_max_per_device(num_experts: int, topk: int, tokens: float, groups: int, overlap: float = 0.0) -> float:
    """Expected distinct experts on the busiest of `groups` devices holding E/groups experts each
    (binomial approximation, see the module docstring). groups 1: the union itself."""
    _check(num_experts, topk, tokens, overlap)
    if groups < 1 or num_experts % groups:
        raise ValueError(f"groups must divide num_experts={num_experts}, got {groups}")
    distinct = expected_distinct(num_experts, topk, tokens, overlap)
    if groups == 1 or distinct == 0:
        return distinct
    m = num_experts // groups
    p = distinct / num_experts
    cdf = _binomial_cdf(m, p)
    return sum(1.0 - cdf[j - 1] ** groups for j in range(1, m + 1))


def expected_mean_per_device(num_experts: int, topk: int, tokens: float, groups: int, overlap: float = 0.0) -> float:
    """Expected distinct experts on an average device: the union / groups."""
    if groups < 1 or num_experts % groups:
        raise ValueError(f"groups must divide num_experts={num_experts}, got {groups}")
    return expected_distinct(num_experts, topk, tokens, overlap) / groups
