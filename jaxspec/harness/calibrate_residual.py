"""Residual node values: fit P(child of rank r accepted by recursive rejection | parent reached) for
sampled drafts (speculation/sampled.py, docs/sampling_values.md).

Runs *sampled* chain cycles (each chain token a draw from the draft's processed q, verified by the
chain residual rule, as the loop's K = 1 program does), so the contexts a chain node is reached in
follow the residual rule's accepted path. At every chain node whose parent is on that path it
replays one level of recursive rejection at the parent, `replays` times with fresh randomness: K
children by Gumbel-top-K from the parent's processed q, tried in sampling order against the
target's processed p after the parent (`verify._residual_step`); label[r] = the share of replays in
which rank r was the accepted one. Features: depth, rank, the parent's processed top-1 draft
probability (the residual maps' feature) and the parent's q entropy (recorded for comparison).

A tree also reaches nodes below rank > 0 children; their contexts are approximated by the chain's
(rank > 0 children are accepted rarely: docs/sampling_values.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.config import ModelConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.harness.calibrate import chain_cycles_in_slices, chain_speculator, sampled_chain_records
from jaxspec.harness.fit_values import fit_map
from jaxspec.model.network import ModelParams, Models, without_mtp
from jaxspec.model.sampling import Sampling
from jaxspec.speculation.cycle import Speculator
from jaxspec.speculation.drafter import Draft
from jaxspec.speculation.generate import draft_of
from jaxspec.speculation.values import Calibration, ValueMap
from jaxspec.speculation.verify import _residual_step

FIELDS = ("depth", "rank", "parent_top1", "parent_entropy", "label")


def replay_labels(
    logq: jax.Array,  # [N, V] the parent's processed draft log-probs
    p: jax.Array,  # [N, V] the target's processed probabilities after the parent
    key: jax.Array,  # [] typed key
    k: int,
    replays: int,
) -> jax.Array:
    """-> [N, k] float32: share of `replays` recursive-rejection levels (K = k children by
    Gumbel-top-K from q, tried in sampling order) in which rank r was the accepted child."""
    n, vocab = logq.shape
    q0 = jnp.exp(logq)

    def one(key):
        noise_key, coin_key = jax.random.split(key)
        _, children = jax.lax.top_k(logq + jax.random.gumbel(noise_key, (n, vocab)), k)  # [N, k] sampling order
        coins = jax.random.uniform(coin_key, (n, k))
        pi, qi, found, hits = p, q0, jnp.zeros((n,), bool), []
        for r in range(k):
            ok, pi, qi = _residual_step(pi, qi, children[:, r], coins[:, r], ~found)
            hits.append(ok)
            found = found | ok
        return jnp.stack(hits, 1).astype(jnp.float32)

    return jnp.mean(jax.vmap(one)(jax.random.split(key, replays)), axis=0)


@functools.partial(bounded_jit, static_argnums=(1, 4))
def _collect_residual_loop(
    models: Models,
    sp: Speculator,  # an sS_k1 chain under the residual rule: the loop's own K = 1 sampled program
    prompt_tokens: jax.Array,  # [B, Sb] int32
    prompt_lengths: jax.Array,  # [B] int32
    shape: tuple[int, int, int, int],  # (k, cycles, max_len, replays)
    sampling: Sampling,
):
    """-> per cycle [C, B, S, ...]: label [.., k], parent top-1 and entropy, mask (parent on the path)."""
    k, cycles, max_len, replays = shape
    num_steps = sp.spec.num_steps
    bb = prompt_tokens.shape[0]
    label_key = jax.random.fold_in(sampling.key, 0x5EED)  # apart from the loop's node keys

    def record(chain, logq, logp, acc, cycle):  # logq [B, S, V]: the distribution chain token j was drawn from
        vocab = logq.shape[-1]
        label = replay_labels(logq.reshape(-1, vocab), jnp.exp(logp[:, :-1]).reshape(-1, vocab),
                              jax.random.fold_in(label_key, cycle[0]), k, replays).reshape(bb, num_steps, k)
        q = jnp.exp(logq)
        top1 = jnp.max(q, -1)  # [B, S]
        entropy = -jnp.sum(jnp.where(q > 0, q * logq, 0.0), -1)
        mask = jnp.arange(1, num_steps + 1)[None, :] <= acc.num_accepted[:, None] + 1  # parent on the path
        return label, top1, entropy, mask

    return sampled_chain_records(sp, models, prompt_tokens, prompt_lengths, cycles, max_len, sampling, record)


def collect_residual(
    params: ModelParams,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    temperature: float,
    cycles: int = 12,
    batch_size: int = 48,
    num_steps: int = 10,
    topk: int = 4,
    replays: int = 8,
    top_p: float | None = None,
    seed: int = 0,
    *,
    draft: Draft | None = None,
) -> dict[str, np.ndarray]:
    """Node samples (FIELDS) of `cycles` sampled chain cycles per prompt at `temperature`, of `draft`
    (default: the MTP block of `params`)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for residual values, got {temperature}")
    draft = draft_of(params, cfg, draft)
    sampling = Sampling.create(temperature, top_p=top_p, key=jax.random.key(seed))
    sp = chain_speculator(cfg, draft, num_steps, "residual")
    models = Models(target=without_mtp(params), drafter=draft.params)
    parts: dict[str, list[np.ndarray]] = {f: [] for f in FIELDS}
    for label, top1, entropy, mask in chain_cycles_in_slices(
        sp, prompts, cycles, batch_size,
        lambda tokens, lengths, max_len: _collect_residual_loop(models, sp, tokens, lengths,
                                                                (topk, cycles, max_len, replays), sampling),
    ):  # label [C, b, S, k]; the rest [C, b, S]
        keep = np.broadcast_to(mask[..., None], label.shape)
        parts["depth"].append(np.broadcast_to(np.arange(1, num_steps + 1)[:, None], label.shape)[keep])
        parts["rank"].append(np.broadcast_to(np.arange(topk), label.shape)[keep])
        parts["parent_top1"].append(np.broadcast_to(top1[..., None], label.shape)[keep])
        parts["parent_entropy"].append(np.broadcast_to(entropy[..., None], label.shape)[keep])
        parts["label"].append(label[keep])
    return {f: np.concatenate(v) for f, v in parts.items()}


def fit_residual(samples: dict[str, np.ndarray], temperature: float) -> ValueMap:
    """The residual map of one temperature (feature: the parent's processed top-1 draft probability)."""
    return fit_map("residual", temperature, samples["depth"], samples["rank"], samples["parent_top1"],
                   samples["label"])


def with_residual(calibration: Calibration, maps: Sequence[ValueMap]) -> Calibration:
    """`calibration` with its residual maps replaced by `maps` (ascending temperature)."""
    return dataclasses.replace(calibration, residual=tuple(sorted(maps, key=lambda m: m.temperature)))


__all__ = ["collect_residual", "fit_residual", "with_residual", "replay_labels"]
