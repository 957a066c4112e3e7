"""Block node values: what a sampled child of rank r is worth to a tree verified by the block rule
(`verify.traversal_accept`), fitted per (depth, rank, the parent's processed top-1 draft probability).

Under the block rule the path passes a node n with probability P(n's subtree is tried) * w_n, where w_n
is n's sequence-level weight (docs/block_verification.md §3: a subtree tried with weight w is accepted with
probability exactly w, whatever lies below it). Along a chain every node is tried, so P(the path passes
n) = E[w_n]. A child c_j of rank j (siblings drawn without replacement, tried in sampling order) is tried
when its earlier siblings' subtrees were all rejected and is then accepted with its own weight, so

    P(the path passes c_j) = E[ prod_{i<j} (1 - w_{c_i}) w_{c_j} ],   w_{c_i} = min(1, T_i(x_i) / q_i(x_i)),

with T_1 = w_n p_n and the sibling updates of the traversal. The value of rank j under n is the ratio
E[that] / E[w_n]: a ratio of expectations, so each sample's label is the replayed expectation over
w_n and the fit weighs it by w_n (`fit_values.fit_map(weight=)`). The chains are the loop's own K = 1 sampled
program under the block rule, on train-split prompts; every chain node is a parent (its weight says how
often the path reaches it), its children are replayed `replays` times by Gumbel-top-K from its q.
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
from jaxspec.speculation.verify import _sibling_rejected, block_terms

FIELDS = ("depth", "rank", "parent_top1", "label", "weight")


def replay_values(
    logq: jax.Array,  # [N, V] the parent's processed draft log-probs
    p: jax.Array,  # [N, V] the target's processed probabilities after the parent
    weight: jax.Array,  # [N] the parent's block weight w_n
    key: jax.Array,  # [] typed key
    k: int,
    replays: int,
) -> jax.Array:
    """-> [N, k] E[prod_{i<j} (1 - w_{c_i}) w_{c_j}]: P(the path passes the rank-j child), over `replays`
    draws of k children by Gumbel-top-K from q (the traversal's sibling updates between them)."""
    n, vocab = logq.shape
    q0 = jnp.exp(logq)

    def one(key):
        _, children = jax.lax.top_k(logq + jax.random.gumbel(key, (n, vocab)), k)  # [N, k] sampling order
        t, q, left, out = weight[:, None] * p, q0, jnp.ones((n,)), []
        for j in range(k):
            x = children[:, j : j + 1]
            qx = jnp.take_along_axis(q, x, 1)[:, 0]
            w = jnp.where(qx > 0, jnp.minimum(1.0, jnp.take_along_axis(t, x, 1)[:, 0] / jnp.where(qx > 0, qx, 1.0)), 0)
            out.append(left * w)
            left = left * (1.0 - w)
            t, q = _sibling_rejected(t, q, x)
        return jnp.stack(out, 1)

    return jnp.mean(jax.vmap(one)(jax.random.split(key, replays)), axis=0)


@functools.partial(bounded_jit, static_argnums=(1, 4))
def _collect_block_loop(
    models: Models,
    sp: Speculator,  # an sS_k1 chain under the block rule: the loop's own K = 1 sampled program
    prompt_tokens: jax.Array,  # [B, Sb] int32
    prompt_lengths: jax.Array,  # [B] int32
    shape: tuple[int, int, int, int],  # (k, cycles, max_len, replays)
    sampling: Sampling,
):
    """-> per cycle [C, B, S, ...]: label [.., k], the parent's weight and processed top-1."""
    k, cycles, max_len, replays = shape
    num_steps = sp.spec.num_steps
    bb = prompt_tokens.shape[0]
    label_key = jax.random.fold_in(sampling.key, 0xB10C)  # apart from the loop's node keys

    def record(chain, logq, logp, acc, cycle):  # logq [B, S, V]: node j's children's q (chain token j + 1's)
        weight = block_terms(chain.tokens, logq, logp)[0][:, :-1]  # [B, S] of nodes 0..S-1, the parents
        vocab = logq.shape[-1]
        label = replay_values(logq.reshape(-1, vocab), jnp.exp(logp[:, :-1]).reshape(-1, vocab), weight.reshape(-1),
                              jax.random.fold_in(label_key, cycle[0]), k, replays).reshape(bb, num_steps, k)
        return label, weight, jnp.exp(jnp.max(logq, -1))

    return sampled_chain_records(sp, models, prompt_tokens, prompt_lengths, cycles, max_len, sampling, record)


def collect_block(
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
    """Samples (FIELDS) of `cycles` sampled chain cycles per prompt under the block rule at `temperature`,
    of `draft` (default: the MTP block of `params`): one per (chain node, rank), label = P(the path passes
    the child) / w_parent, weight = w_parent."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for block values, got {temperature}")
    draft = draft_of(params, cfg, draft)
    sampling = Sampling.create(temperature, top_p=top_p, key=jax.random.key(seed))
    sp = chain_speculator(cfg, draft, num_steps, "block")
    models = Models(target=without_mtp(params), drafter=draft.params)
    parts: dict[str, list[np.ndarray]] = {f: [] for f in FIELDS}
    for label, weight, top1 in chain_cycles_in_slices(
        sp, prompts, cycles, batch_size,
        lambda tokens, lengths, max_len: _collect_block_loop(models, sp, tokens, lengths,
                                                             (topk, cycles, max_len, replays), sampling),
    ):  # label [C, b, S, k]; weight, top1 [C, b, S]
        keep = np.broadcast_to((weight > 0)[..., None], label.shape)  # a parent the path never reaches adds nothing
        w = np.broadcast_to(weight[..., None], label.shape)
        parts["depth"].append(np.broadcast_to(np.arange(1, num_steps + 1)[:, None], label.shape)[keep])
        parts["rank"].append(np.broadcast_to(np.arange(topk), label.shape)[keep])
        parts["parent_top1"].append(np.broadcast_to(top1[..., None], label.shape)[keep])
        parts["label"].append(label[keep] / w[keep])
        parts["weight"].append(w[keep])
    return {f: np.concatenate(v) for f, v in parts.items()}


def fit_block(samples: dict[str, np.ndarray], temperature: float) -> ValueMap:
    """The block map of one temperature (feature: the parent's processed top-1 draft probability).

    The labels are not clipped to 1: a replayed child's weight min(1, w_n p(x) / q(x)) exceeds its parent's
    w_n wherever p(x) > q(x), so one sample's label (a mean of a few replays, over w_n) can exceed 1 while
    its expectation, sum_x min(q(x) / w_n, p(x)), never does. Clipping the samples biased every cell low, the
    more the deeper (small w_n): on tiny-v4 at T = 1 a chain node at depth 15 was valued at 0.097 against its
    reach of 0.15, and side children displaced chain nodes worth more. The fitted values are clipped."""
    return fit_map("block", temperature, samples["depth"], samples["rank"], samples["parent_top1"],
                   np.maximum(samples["label"], 0.0), weight=samples["weight"])


def with_block(calibration: Calibration, maps: Sequence[ValueMap]) -> Calibration:
    """`calibration` with its block maps replaced by `maps` (ascending temperature)."""
    return dataclasses.replace(calibration, block=tuple(sorted(maps, key=lambda m: m.temperature)))
