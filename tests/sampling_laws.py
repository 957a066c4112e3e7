"""Exact laws for the sampling tests, independent of `jaxspec.model.sampling`: the processed
next-token distribution in float64 numpy, the chi-square check, and the randomized probability
integral transform of a sampled sequence.

The processing the reference implements (and `processed_logprobs` must equal):
1. temperature T > 0: logits / T;
2. top-k (k >= 1): keep every token whose scaled logit is at least the k-th largest one (tokens tied
   with the k-th are all kept; k >= V keeps everything);
3. top-p (0 < p < 1), over the distribution top-k left: keep the most likely tokens, in descending
   order, while the mass before a token is below p (the token that reaches p is kept), and every
   token tied with the last one kept;
4. softmax over what is kept.
"""

from __future__ import annotations

import numpy as np
from scipy import stats as scipy_stats

ALPHA = 0.01


def reference_probs(logits, temperature: float, top_k: int | None = None, top_p: float | None = None) -> np.ndarray:
    """[..., V] logits -> [..., V] float64 probabilities of the processed distribution (see the module
    docstring); temperature 0 puts all the mass on the first argmax."""
    x = np.array(logits, np.float64)
    vocab = x.shape[-1]
    rows = x.reshape(-1, vocab)
    out = np.zeros_like(rows)
    for r, row in enumerate(rows):
        if temperature == 0:
            out[r, int(np.argmax(row))] = 1.0
            continue
        scaled = row / temperature
        keep = np.ones(vocab, bool)
        if top_k is not None and top_k < vocab:
            kth_largest = np.sort(scaled)[::-1][top_k - 1]
            keep = scaled >= kth_largest
        if top_p is not None and top_p < 1.0:
            probs = _softmax(scaled, keep)
            mass_before = 0.0
            last_kept = None
            for v in sorted(np.flatnonzero(keep), key=lambda v: -scaled[v]):
                if mass_before >= top_p:
                    break
                last_kept = scaled[v]
                mass_before += probs[v]
            keep &= scaled >= last_kept
        out[r] = _softmax(scaled, keep)
    return out.reshape(x.shape)


def _softmax(scaled: np.ndarray, keep: np.ndarray) -> np.ndarray:
    z = np.where(keep, scaled - scaled[keep].max(), -np.inf)
    e = np.exp(z)
    return e / e.sum()


def chi_square_p(samples, probs):
    """p-value of `samples` (ints) under `probs` [V]; tokens with probability 0 must never occur.
    Cells with expected count < 5 are pooled (the pool itself reaching 5)."""
    samples = np.asarray(samples)
    counts = np.bincount(samples, minlength=probs.shape[0]).astype(np.float64)
    assert counts[probs == 0].sum() == 0, f"sampled tokens the target removed: {np.flatnonzero(counts * (probs == 0))}"
    expected = probs * samples.size
    order = np.argsort(expected)
    rare = expected < 5
    if rare.any() and expected[rare].sum() < 5:  # the pool itself must reach 5
        rare[order[np.count_nonzero(rare)]] = True
    obs = np.append(counts[~rare], counts[rare].sum())
    exp = np.append(expected[~rare], expected[rare].sum())
    keep = exp > 0
    if keep.sum() < 2:
        return 1.0
    return float(scipy_stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def randomized_pit(tokens, probs, rng) -> tuple[np.ndarray, int]:
    """Randomized probability integral transform: tokens [...] drawn from probs [..., V] (each from its
    own law) -> (u [...], how many tokens had probability 0), u = F(t - 1) + W p(t) with W ~ U(0, 1)
    and F the law's CDF over token ids. If every token is drawn from its law given the past, the u of
    one sequence are independent and uniform on (0, 1) (Rosenblatt), whatever the laws are."""
    tokens = np.asarray(tokens)
    p_t = np.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    below = np.take_along_axis(np.cumsum(probs, axis=-1) - probs, tokens[..., None], axis=-1)[..., 0]
    return below + rng.uniform(size=tokens.shape) * p_t, int(np.count_nonzero(p_t == 0))


def uniform_p(u, bins: int = 16) -> float:
    """Chi-square p-value of u (any shape) against U(0, 1) on `bins` equal bins."""
    counts = np.bincount(np.minimum((np.ravel(u) * bins).astype(int), bins - 1), minlength=bins)
    return float(scipy_stats.chisquare(counts).pvalue)


def consecutive_pairs_p(u, bins: int = 4) -> float:
    """Chi-square p-value of the pairs (u[..., j], u[..., j+1]) against the uniform law on the square
    (`bins` x `bins` cells): consecutive transformed tokens must be independent as well as uniform."""
    u = np.asarray(u)
    cells = np.minimum((u * bins).astype(int), bins - 1)
    pairs = (cells[..., :-1] * bins + cells[..., 1:]).ravel()
    return float(scipy_stats.chisquare(np.bincount(pairs, minlength=bins * bins)).pvalue)
