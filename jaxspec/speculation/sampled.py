"""Sampled drafts for temperature > 0: children drawn from the draft's own processed distribution.

At temperature > 0 the target-only rule accepts a top-K child only when an independent target draw
equals it, i.e. with the target's probability of that token, however good the draft is. Children
*sampled* from the draft q admit the residual rules (docs/sampling.md): accept x with probability
min(1, p(x)/q(x)) and resample the residual on rejection, which accepts with 1 - TV(p, q) per step.

Each expanded slot draws its K children without replacement by Gumbel-top-K over its processed
draft log-probabilities (temperature, top-k, top-p exactly as the target's, `processed_logprobs`):
the order of the perturbed scores is the sampling order, so rank r is the (r+1)-th draw. The slot's
log q is kept for the verifier (`verify.sampled_accept`). A spec with `children="greedy"` (suffix "_gs")
draws the greedy draft set instead (Hu et al., ICLR 2025): rank 0 is the argmax of q, ranks 1.. are draws
without replacement from q without it; the verifiers know each child's law from its rank.

Which candidates are expanded and kept follows their *value*: the parent's value plus an estimate
of log P(child of rank r at depth d accepted | parent reached) (`log_value` [S, K]), never the
child's own token or probability. Recursive rejection is exact only if the kept children of a node
are a prefix of its sampling order and their number does not depend on their own identities; a value
that falls with the rank and ignores the token gives exactly that (ties go to the lower rank, the
lower pool index). `log_value` is the hook for a calibrated estimate; `prior_log_values` is the
default.

With a calibration's residual maps (`Calibration.residual`, one per temperature; `Calibration.block` under
the block rule, `policy.Policy.sampled_maps`) the value also reads
the parent's processed draft distribution: log f(depth, rank, top-1 of the parent's q), a table
[S, K, prob bins] (`residual_table`). It is known before the parent's children are drawn, so a node's
kept children stay a prefix of its sampling order whose length does not depend on their own tokens
(it may depend on earlier siblings' subtrees, which are tried or discarded first; docs/sampling_values.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.core.spec import SpecConfig
from jaxspec.model.sampling import Sampling, node_keys, processed_logprobs, select_rows
from jaxspec.speculation.values import NUM_RANKS, PROB_EDGES, ValueMap, depth_bin

# A-priori P(the accepted child has rank r | its parent was reached), for the residual rule on a good
# draft: the first draw is accepted most of the time, later ones only from the residual's leftovers.
PRIOR_RANK_ACCEPTANCE = (0.75, 0.12, 0.05, 0.03)


@struct.dataclass
class SampledDraft:
    """What the beam (`tree.grow_beam`, as `Expander.sampler`) needs to sample children instead of taking
    the top K."""

    sampling: Sampling
    keys: jax.Array  # [B, slots] typed keys, one per draft slot (sequence, cycle, slot)
    log_value: jax.Array  # [S, K] float32: log acceptance estimate of a child at depth d + 1, rank r
    # [S, K, P] ([B, S, K, P] with per-row temperatures) float32 or None: the same per bin of the parent's
    # processed top-1 draft probability (PROB_EDGES); when given it replaces log_value
    residual: jax.Array | None = None
    greedy_set: bool = struct.field(pytree_node=False, default=False)  # rank 0 is q's argmax (SpecConfig.children)


def prior_log_values(spec: SpecConfig) -> np.ndarray:
    """-> [S, K] float32 log of `PRIOR_RANK_ACCEPTANCE` (ranks past its length get its last entry / 2^r),
    the same at every depth."""
    rates = [PRIOR_RANK_ACCEPTANCE[min(r, len(PRIOR_RANK_ACCEPTANCE) - 1)]
             / 2.0 ** max(0, r - len(PRIOR_RANK_ACCEPTANCE) + 1) for r in range(spec.topk)]
    return np.log(np.broadcast_to(np.asarray(rates, np.float32), (spec.num_steps, spec.topk))).astype(np.float32)


def draft_keys(
    key: jax.Array,  # [] typed key
    cycle: jax.Array,  # [B] int32 per-sequence cycle counter
    spec: SpecConfig,
) -> jax.Array:
    """-> [B, slots] keys of the draft slots: `node_keys` indices D .. D + slots - 1, past the D the
    verifier uses, so draft and verify randomness never share a key (global row folded: a sequence's
    drafts do not depend on its batch bucket or device split)."""
    slots = 1 + (spec.num_steps - 1) * spec.topk
    d = spec.num_draft_tokens
    return node_keys(key, cycle, d + slots)[:, d:]


def residual_table(
    maps: tuple[ValueMap, ...],  # "residual" or "block" maps, one per fitted temperature
    spec: SpecConfig,
    temperature: jax.Array,  # [] or [B] traced: the map nearest in temperature is used (per row)
) -> jax.Array:
    """-> [S, K, P] (or [B, S, K, P] for per-row temperatures) float32 log P(child of rank r at depth d
    accepted | parent reached) per bin of the parent's processed top-1 draft probability, from the map
    nearest `temperature`; non-increasing in the rank and <= 0 (what exactness needs, see `make_sampled_draft`)."""
    depths = [depth_bin(d) for d in range(1, spec.num_steps + 1)]
    ranks = [min(r, NUM_RANKS - 1) for r in range(spec.topk)]
    tables = np.stack([np.log(m.array()[depths][:, ranks]) for m in maps]).astype(np.float32)  # [M, S, K, P]
    temps = jnp.asarray([m.temperature for m in maps], jnp.float32)
    nearest = jnp.argmin(jnp.abs(temps - temperature[..., None]), axis=-1)
    table = jnp.asarray(tables)[nearest]
    return jax.lax.cummin(jnp.minimum(table, 0.0), axis=table.ndim - 2)


def make_sampled_draft(
    spec: SpecConfig,
    sampling: Sampling,
    cycle: jax.Array,  # [B] int32
    log_value: jax.Array | None = None,  # [S, K]; None = prior_log_values(spec)
    residual: tuple[ValueMap, ...] = (),  # a calibration's maps for the rule (residual or block); () = the prior
) -> SampledDraft:
    if len({m.mode for m in residual}) > 1 or any(m.mode not in ("residual", "block") for m in residual):
        raise ValueError(f"residual must hold 'residual' or 'block' maps of one mode, got {[m.mode for m in residual]}")
    if log_value is None:
        log_value = jnp.asarray(prior_log_values(spec))
    if log_value.shape != (spec.num_steps, spec.topk):
        raise ValueError(f"log_value must be [S={spec.num_steps}, K={spec.topk}], got {log_value.shape}")
    # Exactness needs the kept children of a node to be a prefix of its sampling order: values must not
    # rise with the rank (a noisy calibration might), and <= 0 keeps a kept node's ancestors kept.
    log_value = jax.lax.cummin(jnp.minimum(jnp.asarray(log_value, jnp.float32), 0.0), axis=1)
    table = residual_table(residual, spec, sampling.temperature) if residual else None
    return SampledDraft(sampling, draft_keys(sampling.key, cycle, spec), log_value, table,
                        greedy_set=spec.greedy_set)


def _child_log_values(sampler: SampledDraft, step: int, logq: jax.Array) -> jax.Array:  # logq: [B, n, V]
    """-> [B, n, K] (or [1, 1, K]) log value of each slot's children: by depth and rank, or with a residual
    table also by the bin of the slot's processed top-1 draft probability (siblings share it)."""
    if sampler.residual is None:
        return sampler.log_value[step - 1][None, None, :]
    top1 = jnp.exp(jnp.max(logq, axis=-1))  # [B, n]
    prob_bin = jnp.searchsorted(jnp.asarray(PROB_EDGES, jnp.float32), top1, side="right")
    table = sampler.residual[..., step - 1, :, :]  # [K, P] or [B, K, P] (per-row temperatures)
    table = jnp.broadcast_to(table, (top1.shape[0],) + table.shape[-2:])[:, None]  # [B, 1, K, P]
    return jnp.take_along_axis(table, prob_bin[:, :, None, None], axis=3)[..., 0]  # [B, n, K]


def sampled_children(
    logits: jax.Array,  # [B, n, V] MTP logits of the slots drafted this step
    score: jax.Array,  # [B, n] value of those slots
    slots: jax.Array,  # [n] their slot indices
    step: int,  # 1-based draft step: the children sit at depth `step`
    sampler: SampledDraft,
    greedy: tuple[jax.Array, jax.Array, jax.Array, jax.Array],  # the top-K children (token, parent, score, rank)
) -> tuple[tuple[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]:
    """-> ((token, parent, value, rank) [B, n*K], log q [B, n, V]).

    Temperature 0 returns `greedy` untouched (and log q zeros). Otherwise the K children of each slot
    are its Gumbel-top-K draws in sampling order (the greedy draft set: q's argmax, then Gumbel-top-(K-1)
    of the rest); a child beyond the support of q (top-k / top-p left fewer than K tokens) gets value
    -inf, so it is kept only where nothing else is left and the verifier skips it.
    """
    b, n, vocab = logits.shape
    k = sampler.log_value.shape[1]
    s = sampler.sampling

    def skip():
        return greedy[0], greedy[2], jnp.zeros((b, n, vocab), jnp.float32)

    def draw():
        logq = processed_logprobs(logits, s.temperature, s.top_k, s.top_p)  # [B, n, V]
        keys = sampler.keys[:, slots]  # [B, n]
        noise = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32)))(keys)
        perturbed = logq + noise
        if sampler.greedy_set:  # the argmax first, whatever its noise; the rest drawn as before, without it
            hub = jnp.argmax(logq, axis=-1)[..., None]  # [B, n, 1]
            perturbed = jnp.where(jnp.arange(vocab) == hub, jnp.inf, perturbed)
        _, token = jax.lax.top_k(perturbed, k)  # [B, n, K] sampling order, without replacement
        in_support = jnp.isfinite(jnp.take_along_axis(logq, token, axis=2))
        value = score[:, :, None] + _child_log_values(sampler, step, logq)
        value = jnp.where(in_support, value, -jnp.inf)
        drawn = token.reshape(b, n * k).astype(jnp.int32), value.reshape(b, n * k), logq
        return select_rows(s.sampled_rows, drawn, skip())  # greedy rows of a mixed batch keep the top K

    # A cond: greedy runs skip the vocab sort and the noise.
    token, value, logq = jax.lax.cond(s.any_sampled, draw, skip)
    return (token, greedy[1], value, greedy[3]), logq
