"""`jaxspec calibrate`: fit the node values (speculation/values.py; the fit: harness/fit_values.py) of a
checkpoint's draft.

Runs chain speculative cycles on prompts and records, for the top-K children of every chain node
on or just after the accepted path (= every tree node whose parent is accepted), its features
(depth, rank, own draft probability, the parent's top-1 draft probability, the confidence head's sigma(c)
of its slot where the drafter has one) and its outcome:
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

from jaxspec.core.config import ModelConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.core.spec import SpecConfig
from jaxspec.harness.fit_values import expected_calibration_error, fit_map, predict
from jaxspec.model.network import ModelParams, Models, without_mtp
from jaxspec.model.runner import on_mesh
from jaxspec.model.sampling import Sampling, processed_logprobs
from jaxspec.speculation.cycle import (
    SpecState,
    Speculator,
    accept_stage,
    commit_stage,
    draft_stage,
    plan_stage,
    prefill,
    verify_stage,
)
from jaxspec.speculation.drafter import Draft
from jaxspec.speculation.dspark import DSparkDrafter
from jaxspec.speculation.generate import draft_of
from jaxspec.speculation.inputs import length_bucket, prepare_prompts
from jaxspec.speculation.policy import Policy
from jaxspec.speculation.tree import Expander, Tree
from jaxspec.speculation.values import (
    CONTEXT_CAP,
    CONTEXT_EDGES,
    Calibration,
    ValueMap,
    both_first_feature,
    context_bins,
    draft_fingerprint,
)

COLLECT_STEPS = 10  # chain depth drafted per cycle (deeper nodes share the last depth bin)
COLLECT_TOPK = 4  # ranks recorded at every chain node (3+ share the last rank bin)
FIELDS = ("depth", "rank", "own_prob", "parent_top1", "runner_up", "label", "context", "confidence")


def chain_with_children(sp: Speculator, models: Models, state: SpecState, k: int, temperature: jax.Array
                        ) -> tuple[Tree, jax.Array, jax.Array, jax.Array]:
    """The top-1 chain the drafter drafts for sS_k1, plus the top-k children at every chain node ->
    (the chain as a tree of S+1 nodes, log value features [B, S, k] (`sp.spec.values`: the draft's
    log-probs, or the confidence feature), tokens [B, S, k], sigma(c) of each child's slot [B, S, k]
    (1 without a confidence head)).

    One beam that expands only the best candidate of each step, k children each: the chain, and every
    child a tree node whose parent is on the accepted path could have (its ancestors are the accepted
    path, so it sees exactly this draft state); their outcomes are read off the chain's verify."""
    s = sp.spec.num_steps
    wide = SpecConfig(s, k, 1 + k * s, values=sp.spec.values)
    expander = Expander(temperature, None, None, k=k, expand=1, source=sp.spec.values)  # raw values: rank 0 leads
    full = sp.drafter.draft(models, sp.cfg, wide, state.drafter, state.root, expander)
    b = full.tokens.shape[0]
    top_token = full.tokens[:, 1:].reshape(b, s, k)
    log_feature = jnp.log(full.feature[:, 1:]).reshape(b, s, k)
    nodes = jnp.arange(s + 1, dtype=jnp.int32)
    zeros = jnp.zeros((b, s + 1), jnp.int32)
    chain = Tree(
        tokens=jnp.concatenate([state.root[:, None], top_token[:, :, 0]], axis=1),
        parent=zeros + jnp.maximum(nodes - 1, 0), depth=zeros + nodes, rank=zeros,
        score=jnp.concatenate([jnp.zeros((b, 1)), jnp.cumsum(log_feature[:, :, 0], axis=1)], axis=1),
        feature=jnp.concatenate([jnp.ones((b, 1)), full.feature[:, 1::k]], axis=1),
    )
    return chain, log_feature, top_token, full.confidence[:, 1:].reshape(b, s, k)


@functools.partial(bounded_jit, static_argnums=(1, 4))
def _collect_loop(
    models: Models,
    sp: Speculator,  # an sS_k1 chain under the target-only rule (greedy at temperature 0)
    prompt_tokens: jax.Array,  # [B, Sb] int32
    prompt_lengths: jax.Array,  # [B] int32
    shape: tuple[int, int, int],  # (k, cycles, max_len)
    sampling: Sampling,
):
    """-> per sequence [B, C, S, k] (batch first, so a mesh splits it over "data"): top_logp, label, mask
    (parent accepted), the slot's sigma(c), and [B, C] the sequence's context bin before the cycle
    (`context_bins`, as the loop computes it); depth = S index + 1, rank = k index."""
    k, cycles, max_len = shape
    num_steps = sp.spec.num_steps
    bb = prompt_tokens.shape[0]
    greedy = sampling.temperature <= 0
    state = prefill(sp, models, prompt_tokens, prompt_lengths, max_len, sampling)

    def body(carry, _):
        state, capped = carry
        context = context_bins(capped, state.stats.cycles)
        chain, top_logp, top_token, confidence = chain_with_children(sp, models, state, k, sampling.temperature)
        out = verify_stage(sp, models, state.target, chain, plan_stage(sp, state.target, chain))
        acc = accept_stage(sp, chain, out.logits, sampling, state.stats.cycles)
        state, _ = commit_stage(sp, models, state, chain, out, acc, jnp.ones((bb,), bool))
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
        return (state, capped), (top_logp, label, mask, confidence, context)

    _, records = jax.lax.scan(body, (state, jnp.zeros((bb,), jnp.int32)), None, length=cycles)
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), records)


def sampled_chain_records(
    sp: Speculator,  # an sS_k1 chain under a sampled rule: the loop's own K = 1 program
    models: Models,
    prompt_tokens: jax.Array,  # [B, Sb] int32
    prompt_lengths: jax.Array,  # [B] int32
    cycles: int,
    max_len: int,
    sampling: Sampling,
    record: Callable[[Tree, jax.Array, jax.Array, Any, jax.Array], Any],
) -> Any:
    """Prefill, then `cycles` chain cycles of `sp` as the loop runs them (traced: call it inside a jit);
    record(chain, log q [B, S, V] each chain token was drawn from, processed target log p [B, S+1, V],
    the Acceptance, the cycle counter [B]) -> a pytree per cycle, stacked [C, ...]."""
    bb = prompt_tokens.shape[0]
    state = prefill(sp, models, prompt_tokens, prompt_lengths, max_len, sampling)

    def body(state, _):
        cycle = state.stats.cycles
        chain = draft_stage(sp, models, state, sampling)
        out = verify_stage(sp, models, state.target, chain, plan_stage(sp, state.target, chain))
        acc = accept_stage(sp, chain, out.logits, sampling, cycle)
        state, _ = commit_stage(sp, models, state, chain, out, acc, jnp.ones((bb,), bool))
        logp = processed_logprobs(out.logits, sampling.temperature, sampling.top_k, sampling.top_p)
        return state, record(chain, chain.q[:, 1:], logp, acc, cycle)

    return jax.lax.scan(body, state, None, length=cycles)[1]


def chain_cycles_in_slices(
    sp: Speculator,
    prompts: Sequence[Sequence[int]],
    cycles: int,
    batch_size: int,
    run: Callable[[jax.Array, jax.Array, int], tuple[jax.Array, ...]],  # (tokens, lengths, max_len) -> records
) -> Iterator[list[np.ndarray]]:
    """The prompts in slices of `batch_size` rows (one program for every slice, the last one padded),
    each through `run`, a jitted loop of `cycles` chain cycles of `sp` -> per slice its records
    [C, b, ...] with the padding rows cut. Checks what `generate` checks first."""
    if not prompts:
        raise ValueError("no prompts to calibrate on")
    cfg, num_steps = sp.cfg, sp.spec.num_steps
    sp.spec.validate_for(cfg)
    sp.drafter.check(cfg, sp.spec)
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


def chain_speculator(cfg: ModelConfig, draft: Draft, num_steps: int, rule: str, values: str = "draft") -> Speculator:
    """The sS_k1 chain calibration runs, under `rule` (speculation/policy.py), raw values of feature `values`."""
    return Speculator(cfg, SpecConfig(num_steps, 1, num_steps + 1, values=values), draft.drafter, Policy(rule))


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
    *,
    draft: Draft | None = None,
    values: str = "draft",
    mesh: jax.sharding.Mesh | None = None,
) -> dict[str, np.ndarray]:
    """Node samples (FIELDS) of `cycles` chain cycles per prompt, greedy or sampled at `temperature`, of
    `draft` (default: the MTP block of `params`); "own_prob" is the node's value feature (`values`: its
    draft probability for "draft" and "both", the confidence feature for "confidence"), "confidence" its
    slot's sigma(c) (1 without a confidence head). `mesh`: run sharded over it (the params
    placed there, `batch_size` rows split over "data"), as `speculative_generate(mesh=)` does."""
    draft = draft_of(params, cfg, draft)
    if values != "draft" and not isinstance(draft.drafter, DSparkDrafter):  # it would fall back to "draft"
        raise ValueError(f"values={values!r}: the draft {draft.name!r} has no confidence head (a DSpark drafter "
                         "has one: --draft dspark)")
    if values == "both" and topk < 2:
        raise ValueError(f"values='both' reads each slot's runner-up: topk must be >= 2, got {topk}")
    sampling = Sampling.create(temperature, key=jax.random.key(seed))
    sp = chain_speculator(cfg, draft, num_steps, "target", values)
    models = Models(target=without_mtp(params), drafter=draft.params)
    parts: dict[str, list[np.ndarray]] = {f: [] for f in FIELDS}
    loop = on_mesh(_collect_loop, mesh, batch_size)
    for top_logp, label, mask, confidence, context in chain_cycles_in_slices(
        sp, prompts, cycles, batch_size,
        lambda tokens, lengths, max_len: [np.swapaxes(np.asarray(x), 0, 1) for x in loop(
            models, sp, tokens, lengths, (topk, cycles, max_len), sampling)],
    ):  # [C, b, S, k]
        keep = mask.astype(bool)
        depth = np.broadcast_to(np.arange(1, num_steps + 1)[:, None], mask.shape)
        rank = np.broadcast_to(np.arange(topk), mask.shape)
        parts["depth"].append(depth[keep])
        parts["rank"].append(rank[keep])
        parts["own_prob"].append(np.exp(top_logp[keep]))
        parts["parent_top1"].append(np.exp(np.broadcast_to(top_logp[..., :1], mask.shape)[keep]))
        parts["runner_up"].append(np.exp(np.broadcast_to(top_logp[..., 1:2], mask.shape)[keep]) if topk > 1
                                  else np.zeros(int(keep.sum()), np.float32))
        parts["label"].append(label[keep])
        parts["context"].append(np.broadcast_to(context[:, :, None, None], mask.shape)[keep])
        parts["confidence"].append(confidence[keep])
    return {f: np.concatenate(v) for f, v in parts.items()}


def greedy_inputs(samples: dict[str, np.ndarray], two_features: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """What a greedy map reads: (the node's draft probability, None), or for a two-feature ("both") map
    (`both_first_feature`, sigma(c))."""
    if not two_features:
        return samples["own_prob"], None
    first = both_first_feature(samples["rank"], samples["own_prob"], samples["parent_top1"], samples["runner_up"])
    return first, samples["confidence"]


def map_inputs(value_map: ValueMap, samples: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """The features `value_map` reads: (the probability feature, sigma(c) for a two-feature map or None)."""
    if value_map.mode != "greedy":
        return samples["parent_top1"], None
    return greedy_inputs(samples, value_map.two_features)


def fit(samples_by_temperature: dict[float, dict[str, np.ndarray]], fingerprint: str,
        meta: dict[str, Any] | None = None, feature: str = "draft") -> Calibration:
    """The greedy map from the samples at temperature 0, a sampling map per other temperature; for
    feature "both" the greedy maps read the samples' "confidence" too."""
    if 0.0 not in samples_by_temperature:
        raise ValueError("a calibration needs greedy samples (temperature 0)")
    both = feature == "both"
    if both and not {"confidence", "runner_up"} <= set(samples_by_temperature[0.0]):
        raise ValueError("a 'both' calibration needs the confidence and runner-up features of every greedy sample")
    maps = {}
    for t, s in sorted(samples_by_temperature.items()):
        mode = "greedy" if t == 0 else "sampling"
        values, second = greedy_inputs(s, both) if mode == "greedy" else (s["parent_top1"], None)
        maps[t] = fit_map(mode, t, s["depth"], s["rank"], values, s["label"], second)
    meta_items = tuple(sorted((str(k), str(v)) for k, v in (meta or {}).items()))
    return Calibration(fingerprint, maps[0.0], tuple(m for t, m in sorted(maps.items()) if t > 0), meta_items,
                       fit_context_maps(samples_by_temperature[0.0], maps[0.0]), feature=feature)


def fit_context_maps(greedy: dict[str, np.ndarray], pooled: ValueMap) -> tuple[ValueMap, ...]:
    """One greedy map per context bin from the greedy samples (reading the confidence too where `pooled`
    does); a bin with no samples keeps the pooled map (samples without a "context" field, e.g. hand-made
    ones, give no context maps)."""
    if "context" not in greedy:
        return ()
    maps = []
    prob, second = map_inputs(pooled, greedy)
    for c in range(len(CONTEXT_EDGES) + 1):
        sel = greedy["context"] == c
        maps.append(fit_map("greedy", 0.0, greedy["depth"][sel], greedy["rank"][sel], prob[sel], greedy["label"][sel],
                            None if second is None else second[sel]) if sel.any() else pooled)
    return tuple(maps)


def predict_values(calibration: Calibration, value_map: ValueMap, samples: dict[str, np.ndarray]) -> np.ndarray:
    """The value the engine gives each sample: per context bin for greedy maps with context maps."""
    if value_map.mode != "greedy" or not calibration.greedy_by_context:
        return predict(value_map, samples["depth"], samples["rank"], *map_inputs(value_map, samples))
    out = np.empty(samples["label"].shape, np.float64)
    for c, m in enumerate(calibration.greedy_by_context):
        sel = samples["context"] == c
        prob, second = map_inputs(m, samples)
        out[sel] = predict(m, samples["depth"][sel], samples["rank"][sel], prob[sel],
                           None if second is None else second[sel])
    return out


def calibration_errors(calibration: Calibration, samples_by_temperature: dict[float, dict[str, np.ndarray]]
                       ) -> dict[str, dict[str, float]]:
    """Per temperature: ECE of the raw draft probability and of the fitted values, and the sample count."""
    out = {}
    maps = {0.0: calibration.greedy, **{m.temperature: m for m in calibration.sampling}}
    for t, s in sorted(samples_by_temperature.items()):
        value_map = maps.get(t) or min(maps.values(), key=lambda m: abs(m.temperature - t))
        fitted = predict(value_map, s["depth"], s["rank"], *map_inputs(value_map, s))
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
    from matplotlib.figure import Figure  # not pyplot: the caller's backend (a notebook's inline) is left alone

    maps = {0.0: calibration.greedy, **{m.temperature: m for m in calibration.sampling}}
    temps = [t for t in sorted(heldout) if t in maps]
    fig = Figure(figsize=(4.2 * len(temps), 4))
    axes = fig.subplots(1, len(temps), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        s, value_map = heldout[t], maps[t]
        fitted = predict(value_map, s["depth"], s["rank"], *map_inputs(value_map, s))
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


__all__ = ["collect", "fit", "calibration_errors", "plot_reliability", "draft_fingerprint", "chain_with_children"]
