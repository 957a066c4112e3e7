"""`jaxspec calibrate`: fit the node values (speculation/values.py) of a checkpoint's draft.

Runs chain speculative cycles on prompts and records, for the top-K children of every chain node
on or just after the accepted path (= every tree node whose parent is accepted), its features
(depth, rank, own draft probability, the parent's top-1 draft probability) and its outcome:
greedy runs record whether the token is the target's argmax after the parent (the greedy event),
sampled runs the target's processed probability of the token after the parent (the acceptance
probability of the target-only rule, a lower-variance label than the 0/1 draw). Fitting is on
train-split prompts; the same collection on held-out prompts measures the calibration error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.config import ModelConfig, SpecConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.layers.attention import AttentionContext
from jaxspec.model.network import ModelParams, forward, mtp_forward
from jaxspec.model.sampling import Sampling, processed_logprobs
from jaxspec.model.state import DecodeState
from jaxspec.speculation.commit import commit_accepted_path
from jaxspec.speculation.generate import length_bucket, prefill_for_speculation, prepare_prompts
from jaxspec.speculation.plan import build_plan, verify_context
from jaxspec.speculation.values import (
    CONTEXT_CAP,
    CONTEXT_EDGES,
    Calibration,
    ValueMap,
    context_bins,
    draft_fingerprint,
    expected_calibration_error,
    fit_map,
    predict,
)
from jaxspec.speculation.verify import tree_accept

COLLECT_STEPS = 10  # chain depth drafted per cycle (deeper nodes share the last depth bin)
COLLECT_TOPK = 4  # ranks recorded at every chain node (3+ share the last rank bin)
FIELDS = ("depth", "rank", "own_prob", "parent_top1", "label", "context")


def draft_chain(
    params: ModelParams,
    cfg: ModelConfig,
    state: DecodeState,  # committed; state.mtp_length == state.length - 1
    root: jax.Array,  # [B] int32
    root_hidden: jax.Array,  # [B, hc, d]
    num_steps: int,
    choose: Callable[[int, jax.Array], tuple[jax.Array, Any]],  # (step, logits [B, V]) -> (token [B], record)
) -> tuple[jax.Array, list[Any]]:
    """An MTP chain of `num_steps` steps from the root, each step's token picked by `choose`; each step
    reads the committed MTP ring plus the chain's own earlier steps, as `draft_tree`'s sS_k1 chain
    does -> (chain [B, S], the records `choose` returned, one per step)."""
    b = root.shape[0]
    scratch_kv = jnp.zeros((b, num_steps, cfg.head_dim), jnp.dtype(cfg.dtype))
    scratch_pos = jnp.zeros((b, num_steps), jnp.int32)
    token, hidden = root[:, None], root_hidden[:, None]
    chain, records = [], []
    for step in range(num_steps):
        positions = state.mtp_length[:, None] + step  # [B, 1]
        ctx = AttentionContext(
            positions=positions,
            committed=state.mtp_length,
            visible=jnp.ones((b, 1, 1), bool),
            ancestor_at_depth=jnp.zeros((b, 1, 1), jnp.int32),
            valid=jnp.ones((b, 1), bool),
            prior_kv=scratch_kv,
            prior_positions=scratch_pos,
            prior_visible=jnp.broadcast_to(jnp.arange(num_steps) < step, (b, 1, num_steps)),
        )
        logits, z, rows = mtp_forward(params, cfg, state, hidden, token, ctx)
        scratch_kv = scratch_kv.at[:, step].set(rows.kv[:, 0].astype(scratch_kv.dtype))
        scratch_pos = scratch_pos.at[:, step].set(positions[:, 0])
        next_token, record = choose(step, logits[:, 0])
        records.append(record)
        chain.append(next_token)
        token, hidden = next_token[:, None], z
    return jnp.stack(chain, 1), records


def draft_chain_topk(
    params: ModelParams,
    cfg: ModelConfig,
    state: DecodeState,  # committed; state.mtp_length == state.length - 1
    root: jax.Array,  # [B] int32
    root_hidden: jax.Array,  # [B, hc, d]
    num_steps: int,
    k: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The top-1 chain `draft_tree` drafts for s{num_steps}_k1, plus the top-k of the draft's
    distribution at every chain node -> chain [B, S], top_logp [B, S, k], top_token [B, S, k].

    A tree node whose parent is on the accepted path sees exactly the draft state of this chain
    (its ancestors are the accepted path), so every sibling's features and outcome can be read off
    the chain without verifying the siblings."""

    def top(step, logits):
        top_logp, top_token = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)  # [B, k]
        return top_token[:, 0].astype(jnp.int32), (top_logp, top_token.astype(jnp.int32))

    chain, records = draft_chain(params, cfg, state, root, root_hidden, num_steps, top)
    return chain, jnp.stack([r[0] for r in records], 1), jnp.stack([r[1] for r in records], 1)


@functools.partial(bounded_jit, static_argnums=(1, 4, 5, 6, 7))
def _collect_loop(
    params: ModelParams,
    cfg: ModelConfig,
    prompt_tokens: jax.Array,  # [B, Sb] int32
    prompt_lengths: jax.Array,  # [B] int32
    num_steps: int,
    k: int,
    cycles: int,
    max_len: int,
    sampling: Sampling,
):
    """-> per cycle [C, B, S, k]: top_logp, label, mask (parent accepted), and [C, B] the sequence's
    context bin before the cycle (`context_bins`, as the loop computes it); depth = S index + 1, rank = k index."""
    bb = prompt_tokens.shape[0]
    greedy = sampling.temperature <= 0
    state, root, last_hidden = prefill_for_speculation(params, cfg, prompt_tokens, prompt_lengths, max_len, sampling)
    parent = jnp.broadcast_to(jnp.maximum(jnp.arange(num_steps + 1, dtype=jnp.int32) - 1, 0), (bb, num_steps + 1))

    def body(carry, _):
        state, root, last_hidden, cycle, capped = carry
        context = context_bins(capped, cycle)
        chain, top_logp, top_token = draft_chain_topk(params, cfg, state, root, last_hidden, num_steps, k)
        tokens = jnp.concatenate([root[:, None], chain], axis=1)  # [B, S+1]
        plan = build_plan(parent, state.length, num_steps)
        out = forward(params, cfg, state, tokens, verify_context(plan, state.length))
        acc = tree_accept(tokens, parent, out.logits, num_steps, sampling, cycle)
        active = jnp.ones((bb,), bool)
        state, last_hidden = commit_accepted_path(params, cfg, state, tokens, out, acc, last_hidden, active)
        parent_logits = out.logits[:, :-1]  # [B, S, V] the target after chain node d-1

        def argmax_label():  # greedy: the child is the target's argmax after its parent
            return (top_token == jnp.argmax(parent_logits, -1)[..., None]).astype(jnp.float32)

        def soft_label():  # the target-only rule's acceptance probability of the child
            logp = processed_logprobs(parent_logits, sampling.temperature, sampling.top_k, sampling.top_p)
            return jnp.exp(jnp.take_along_axis(logp, top_token, axis=-1))

        label = jax.lax.cond(greedy, argmax_label, soft_label)
        depth = jnp.arange(1, num_steps + 1)[None, :, None]
        mask = jnp.broadcast_to(depth <= acc.num_accepted[:, None, None] + 1, label.shape)  # parent on the path
        capped = capped + jnp.minimum(acc.num_accepted, CONTEXT_CAP)
        return (state, acc.bonus, last_hidden, cycle + 1, capped), (top_logp, label, mask, context)

    carry = (state, root, last_hidden, jnp.zeros((bb,), jnp.int32), jnp.zeros((bb,), jnp.int32))
    _, records = jax.lax.scan(body, carry, None, length=cycles)
    return records


def chain_cycles_in_slices(
    params: ModelParams,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    cycles: int,
    num_steps: int,
    batch_size: int,
    run: Callable[[jax.Array, jax.Array, int], tuple[jax.Array, ...]],  # (tokens, lengths, max_len) -> records
) -> Iterator[list[np.ndarray]]:
    """The prompts in slices of `batch_size` rows (one program for every slice, the last one padded),
    each through `run`, a jitted loop of `cycles` s{num_steps}_k1 chain cycles -> per slice its records
    [C, b, ...] with the padding rows cut. Checks what `generate` checks first."""
    if params.mtp is None:
        raise ValueError("calibration needs an MTP draft block; these params have none")
    if not prompts:
        raise ValueError("no prompts to calibrate on")
    SpecConfig(num_steps, 1, num_steps + 1).validate_for(cfg)
    generated = cycles * (num_steps + 1) + 1
    batch = prepare_prompts(cfg, prompts, generated)  # the checks `generate` makes, and the width bucket
    sb = batch.tokens.shape[1]
    max_len = length_bucket(sb + generated, cfg.max_position_embeddings, minimum=64)
    for start in range(0, batch.batch, batch_size):
        n = min(batch_size, batch.batch - start)
        tokens = np.zeros((batch_size, sb), np.int32)
        lengths = np.ones((batch_size,), np.int32)
        tokens[:n], lengths[:n] = batch.tokens[start : start + n], batch.lengths[start : start + n]
        yield [np.asarray(x)[:, :n] for x in run(jnp.asarray(tokens), jnp.asarray(lengths), max_len)]


def collect(
    params: ModelParams,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    temperature: float = 0.0,
    cycles: int = 24,
    batch_size: int = 64,
    num_steps: int = COLLECT_STEPS,
    topk: int = COLLECT_TOPK,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Node samples (FIELDS) of `cycles` chain cycles per prompt, greedy or sampled at `temperature`."""
    sampling = Sampling.create(temperature, key=jax.random.key(seed))
    parts: dict[str, list[np.ndarray]] = {f: [] for f in FIELDS}
    for top_logp, label, mask, context in chain_cycles_in_slices(
        params, cfg, prompts, cycles, num_steps, batch_size,
        lambda tokens, lengths, max_len: _collect_loop(params, cfg, tokens, lengths, num_steps, topk, cycles, max_len,
                                                       sampling),
    ):  # [C, b, S, k]
        keep = mask.astype(bool)
        depth = np.broadcast_to(np.arange(1, num_steps + 1)[:, None], mask.shape)
        rank = np.broadcast_to(np.arange(topk), mask.shape)
        parts["depth"].append(depth[keep])
        parts["rank"].append(rank[keep])
        parts["own_prob"].append(np.exp(top_logp[keep]))
        parts["parent_top1"].append(np.exp(np.broadcast_to(top_logp[..., :1], mask.shape)[keep]))
        parts["label"].append(label[keep])
        parts["context"].append(np.broadcast_to(context[:, :, None, None], mask.shape)[keep])
    return {f: np.concatenate(v) for f, v in parts.items()}


def map_feature(value_map: ValueMap, samples: dict[str, np.ndarray]) -> np.ndarray:
    return samples["own_prob"] if value_map.mode == "greedy" else samples["parent_top1"]


def fit(samples_by_temperature: dict[float, dict[str, np.ndarray]], fingerprint: str,
        meta: dict[str, Any] | None = None) -> Calibration:
    """The greedy map from the samples at temperature 0, a sampling map per other temperature."""
    if 0.0 not in samples_by_temperature:
        raise ValueError("a calibration needs greedy samples (temperature 0)")
    maps = {}
    for t, s in sorted(samples_by_temperature.items()):
        mode = "greedy" if t == 0 else "sampling"
        feature = s["own_prob"] if mode == "greedy" else s["parent_top1"]
        maps[t] = fit_map(mode, t, s["depth"], s["rank"], feature, s["label"])
    meta_items = tuple(sorted((str(k), str(v)) for k, v in (meta or {}).items()))
    return Calibration(fingerprint, maps[0.0], tuple(m for t, m in sorted(maps.items()) if t > 0), meta_items,
                       fit_context_maps(samples_by_temperature[0.0], maps[0.0]))


def fit_context_maps(greedy: dict[str, np.ndarray], pooled: ValueMap) -> tuple[ValueMap, ...]:
    """One greedy map per context bin from the greedy samples; a bin with no samples keeps the pooled map
    (samples without a "context" field, e.g. hand-made ones, give no context maps)."""
    if "context" not in greedy:
        return ()
    maps = []
    for c in range(len(CONTEXT_EDGES) + 1):
        sel = greedy["context"] == c
        maps.append(fit_map("greedy", 0.0, *(greedy[f][sel] for f in ("depth", "rank", "own_prob", "label")))
                    if sel.any() else pooled)
    return tuple(maps)


def predict_values(calibration: Calibration, value_map: ValueMap, samples: dict[str, np.ndarray]) -> np.ndarray:
    """The value the engine gives each sample: per context bin for greedy maps with context maps."""
    if value_map.mode != "greedy" or not calibration.greedy_by_context:
        return predict(value_map, samples["depth"], samples["rank"], map_feature(value_map, samples))
    out = np.empty(samples["label"].shape, np.float64)
    for c, m in enumerate(calibration.greedy_by_context):
        sel = samples["context"] == c
        out[sel] = predict(m, samples["depth"][sel], samples["rank"][sel], samples["own_prob"][sel])
    return out


def calibration_errors(calibration: Calibration, samples_by_temperature: dict[float, dict[str, np.ndarray]]
                       ) -> dict[str, dict[str, float]]:
    """Per temperature: ECE of the raw draft probability and of the fitted values, and the sample count."""
    out = {}
    maps = {0.0: calibration.greedy, **{m.temperature: m for m in calibration.sampling}}
    for t, s in sorted(samples_by_temperature.items()):
        value_map = maps.get(t) or min(maps.values(), key=lambda m: abs(m.temperature - t))
        fitted = predict(value_map, s["depth"], s["rank"], map_feature(value_map, s))
        out[f"T={t:g}"] = {
            "ece_raw": expected_calibration_error(s["own_prob"], s["label"]),
            "ece_calibrated": expected_calibration_error(fitted, s["label"]),
            "mean_label": float(np.mean(s["label"])),
            "samples": int(s["label"].size),
        }
        if value_map.mode == "greedy" and calibration.greedy_by_context:  # what deep trees (S >= 8) rank by
            by_context = predict_values(calibration, value_map, s)
            out[f"T={t:g}"]["ece_per_context"] = expected_calibration_error(by_context, s["label"])
    return out


def reliability_points(predicted: np.ndarray, label: np.ndarray, num_bins: int = 10) -> tuple[np.ndarray, ...]:
    """-> (mean predicted, mean observed, count) per equal-width bin of the prediction."""
    which = np.minimum((np.asarray(predicted) * num_bins).astype(int), num_bins - 1)
    rows = [(predicted[which == b].mean(), label[which == b].mean(), int((which == b).sum()))
            for b in range(num_bins) if np.any(which == b)]
    return tuple(np.asarray(c) for c in zip(*rows, strict=True))


def plot_reliability(calibration: Calibration, heldout: dict[float, dict[str, np.ndarray]], path: str) -> None:
    """One panel per temperature: raw draft probability vs fitted value against the observed rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    maps = {0.0: calibration.greedy, **{m.temperature: m for m in calibration.sampling}}
    temps = [t for t in sorted(heldout) if t in maps]
    fig, axes = plt.subplots(1, len(temps), figsize=(4.2 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        s, value_map = heldout[t], maps[t]
        fitted = predict(value_map, s["depth"], s["rank"], map_feature(value_map, s))
        curves = [("raw draft prob", s["own_prob"], "o--"), ("calibrated", fitted, "s-")]
        if value_map.mode == "greedy" and calibration.greedy_by_context:
            curves.append(("per context", predict_values(calibration, value_map, s), "^:"))
        for name, pred, style in curves:
            x, y, n = reliability_points(pred, s["label"])
            ece = expected_calibration_error(pred, s["label"])
            ax.plot(x, y, style, label=f"{name} (ECE {ece:.3f})")
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8)
        event = "argmax agreement" if t == 0 else f"p_target(token), T={t:g}"
        ax.set(title=f"{'greedy' if t == 0 else 'sampling'}: {event}", xlabel="predicted P(accept | parent accepted)",
               ylabel="observed (held-out)", xlim=(0, 1), ylim=(0, 1))
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["collect", "fit", "calibration_errors", "plot_reliability", "draft_fingerprint", "draft_chain_topk"]
