"""The budget chooser: which tree (S, K, D), linear chain, or no speculation at all gives the most
tokens per second at each batch bucket.

Sequoia's objective (survey section 5): expected accepted tokens per cycle over the time of one
cycle. A short calibration run measures what that needs on this machine and model:
- expected tokens per cycle of each candidate, two ways: from the accepted length the real engine
  reaches on each calibration prompt, with a batch taking as many cycles as its slowest row
  (`batch_tokens_per_cycle`; `estimator="measured"`, the default), and Sequoia's dynamic
  program over the draft's per-rank acceptance vector (a one-level tree of width max K,
  `eval.measure_rank_acceptance`; `estimator="sequoia"`). Sequoia assumes every depth accepts
  independently; on repetitive text acceptance along a path is correlated and the DP
  under-estimates chains by 30-50% on the shipped checkpoint, so the measured mean is the default and
  both are kept in tune.json;
- per batch bucket, the time of one autoregressive step and of the draft and of a whole cycle
  (draft -> prune -> plan -> verify -> accept -> commit) of every candidate, each a jitted call on a
  state prefilled with real prompts, so the verify cost grows with D and the bucket as it really does.

The winner per bucket (or "ar" where no speculation is fastest) is saved as JSON beside the
checkpoint and read back by `SpecConfig.auto` / `speculative_generate(spec="auto")`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig, SpecConfig
from jaxspec.generate import batch_bucket, length_bucket, prefill_for_speculation, prepare_prompts, speculative_cycle
from jaxspec.model import ModelParams, extend
from jaxspec.tree.draft import draft_tree, prune_to_budget

NO_SPECULATION = "ar"
TUNING_FILE = "tune.json"
ESTIMATORS = ("sequoia", "measured")
# The report's linear chains and K = 2 trees at D = 5..8, plus shorter chains and small trees,
# which are what pays where verifying many tokens is expensive (large batches, CPUs).
DEFAULT_CANDIDATES = (
    "s1_k1_d2", "s2_k1_d3", "s3_k1_d4", "s4_k1_d5", "s5_k1_d6", "s6_k1_d7", "s7_k1_d8",
    "s2_k2_d4", "s3_k2_d5", "s3_k2_d6", "s4_k2_d6", "s4_k2_d7", "s4_k2_d8", "s3_k4_d8",
)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Calibration result: the chosen spec per batch bucket and every measurement behind it."""

    acceptance: tuple[float, ...]  # P(k-th ranked draft child is the accepted one)
    choices: dict[int, str]  # batch bucket -> spec name, or "ar" for no speculation
    estimator: str  # how expected tokens per cycle were estimated ("sequoia" or "measured")
    measurements: tuple[dict[str, Any], ...]  # one per (bucket, candidate), "ar" included
    max_new_tokens: int

    def spec_for(self, batch_size: int) -> SpecConfig | None:
        """The choice for `batch_size` (the nearest calibrated bucket in log scale); None = no speculation."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        bucket = min(self.choices, key=lambda b: (abs(math.log2(b) - math.log2(batch_size)), b))
        name = self.choices[bucket]
        return None if name == NO_SPECULATION else SpecConfig.parse(name)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["choices"] = {str(b): name for b, name in sorted(self.choices.items())}
        out["measurements"] = list(self.measurements)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tuning:
        try:
            choices = {int(b): str(name) for b, name in data["choices"].items()}
            tuning = cls(
                acceptance=tuple(float(x) for x in data["acceptance"]),
                choices=choices,
                estimator=str(data["estimator"]),
                measurements=tuple(data["measurements"]),
                max_new_tokens=int(data["max_new_tokens"]),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a jaxspec tuning file (missing or malformed field: {e})") from e
        if not choices:
            raise ValueError("tuning has no choices")
        for name in choices.values():
            if name != NO_SPECULATION:
                SpecConfig.parse(name)
        return tuning

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.is_dir():
            path = path / TUNING_FILE
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def load_tuning(path: str | Path) -> Tuning:
    """Read a tuning written by `jaxspec tune`: the JSON file, or the checkpoint folder holding it."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / TUNING_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no tuning at {str(path)!r}; run `jaxspec tune --checkpoint FOLDER` first")
    return Tuning.from_json(json.loads(path.read_text()))


def as_tuning(tuning: Tuning | str | Path) -> Tuning:
    if isinstance(tuning, Tuning):
        return tuning
    if isinstance(tuning, (str, Path)):
        return load_tuning(tuning)
    raise ValueError(f"tuning must be a Tuning or the path of a tuning file / checkpoint folder, got {tuning!r}")


# ---- expected tokens per cycle --------------------------------------------------------------


def expected_tokens_per_cycle(acceptance: Sequence[float], spec: SpecConfig) -> float:
    """Sequoia's optimum for the spec's budget: best tree of D nodes, depth <= S, <= K children."""
    from jaxspec.eval import sequoia_optimum

    ranked = list(acceptance)[: spec.topk]
    ranked += [0.0] * (spec.topk - len(ranked))
    return sequoia_optimum(ranked, spec.num_draft_tokens, spec.num_steps)


def batch_tokens_per_cycle(per_prompt_tau: Sequence[float], batch: int, draws: int = 256) -> float:
    """Tokens per row per cycle of a batch generating a fixed length: the loop runs until its
    slowest row is done, so a batch takes E[max over its rows of length / tau] cycles. For batch 1
    this is the harmonic mean of tau, not the mean: low-acceptance prompts take the most cycles.
    Estimated by drawing batches from the calibration prompts (fixed seed)."""
    cycles_per_token = 1.0 / np.asarray(per_prompt_tau, np.float64)
    if cycles_per_token.size == 0 or np.any(~np.isfinite(cycles_per_token)):
        raise ValueError(f"need per-prompt accepted lengths >= 1, got {per_prompt_tau!r}")
    rows = np.random.default_rng(0).integers(0, cycles_per_token.size, (draws, batch))
    return float(1.0 / np.mean(cycles_per_token[rows].max(axis=1)))


def choose(measurements: Sequence[dict[str, Any]], estimator: str) -> dict[int, str]:
    """Per bucket, the candidate with the highest predicted tokens/s ("ar" included)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    best: dict[int, tuple[float, str]] = {}
    for m in measurements:
        rate = m["predicted_tokens_per_s"][estimator] if m["spec"] != NO_SPECULATION else m["tokens_per_s"]
        if m["batch"] not in best or rate > best[m["batch"]][0]:
            best[m["batch"]] = (rate, m["spec"])
    return {b: name for b, (_, name) in sorted(best.items())}


# ---- timing --------------------------------------------------------------------------------


def _median_seconds(step, carry, iters: int):
    """Run `carry = step(carry)` once to compile, then `iters` times timed; -> (median s, carries).

    The carry's decode state is donated at every call (updated in place, as inside the jitted
    loop), so it starts from a private copy.
    """
    carry = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, carry)
    carry = jax.block_until_ready(step(carry))
    seen, times = [], []
    for _ in range(iters):
        start = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        times.append(time.perf_counter() - start)
        seen.append(carry)
    return float(np.median(times)), seen


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(2,))
def _ar_step(params, cfg, state, last):  # last: [B] int32
    out, state = extend(params, cfg, state, last[:, None], jnp.ones((last.shape[0], 1), bool))
    return state, jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)


_prefill = jax.jit(prefill_for_speculation, static_argnums=(1, 4))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draft(params, cfg, spec, state, root, last_hidden):
    return prune_to_budget(draft_tree(params, cfg, spec, state, root, last_hidden), root, spec.num_draft_tokens)


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=(3,))
def _cycle(params, cfg, spec, state, root, last_hidden):
    active = jnp.ones(root.shape, bool)
    state, last_hidden, _, acc = speculative_cycle(params, cfg, spec, state, root, last_hidden, active)
    return state, acc.bonus, last_hidden, acc.num_accepted


def _prompt_rows(prompts: Sequence[Sequence[int]], batch: int, width: int) -> tuple[jax.Array, jax.Array]:
    tokens = np.zeros((batch, width), np.int32)
    lengths = np.zeros((batch,), np.int32)
    for row in range(batch):
        p = prompts[row % len(prompts)]
        tokens[row, : len(p)] = p
        lengths[row] = len(p)
    return jnp.asarray(tokens), jnp.asarray(lengths)


def calibrate(
    params: ModelParams,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    batch_sizes: Sequence[int] = (1, 4, 16, 64),
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    max_new_tokens: int = 128,
    iters: int = 16,
    estimator: str = "measured",
    progress: bool = True,
) -> Tuning:
    """Measure acceptance and step times on `prompts`, then choose a spec (or none) per batch bucket."""
    from rich.progress import Progress

    from jaxspec.eval import measure_rank_acceptance

    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if params.mtp is None:
        raise ValueError("tuning speculation needs an MTP draft block; these params have none")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if not batch_sizes or any(isinstance(b, bool) or int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be ints >= 1, got {list(batch_sizes)}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    specs = [SpecConfig.parse(c) if isinstance(c, str) else c for c in candidates]
    if not specs:
        raise ValueError("need at least one candidate spec")
    for spec in specs:
        spec.validate_for(cfg)
    max_steps = max(s.num_steps for s in specs)
    batch = prepare_prompts(cfg, prompts, max_new_tokens + max_steps + 1)  # the checks `generate` makes
    prompts = [batch.tokens[i, : int(batch.lengths[i])].tolist() for i in range(batch.batch)]
    width = length_bucket(max(len(p) for p in prompts), cfg.max_position_embeddings)
    max_len = length_bucket(width + max_new_tokens + max_steps + 1, cfg.max_position_embeddings, minimum=64)
    # Cycles per candidate: as many as fit in max_new_tokens (at most `iters`), so the measured
    # accepted length covers the generation length the choice is for, not only its first cycles.
    cycles = max(1, min(iters, max_new_tokens // (max_steps + 1)))

    width_k = max(s.topk for s in specs)
    acceptance = measure_rank_acceptance(params, cfg, prompts, width=max(width_k, 2), max_new_tokens=64)
    buckets = sorted({batch_bucket(int(b)) for b in batch_sizes})
    measurements: list[dict[str, Any]] = []
    accepted: dict[str, dict[int, list[int]]] = {}  # spec -> prompt -> accepted drafts per cycle
    with Progress(disable=not progress) as bar:
        task = bar.add_task("calibrating", total=len(buckets) * (len(specs) + 1))
        for b in buckets:
            tokens, lengths = _prompt_rows(prompts, b, width)
            start_state, root0, hidden0 = _prefill(params, cfg, tokens, lengths, max_len)
            bar.update(task, description=f"b={b} ar")
            seconds, _ = _median_seconds(lambda c: _ar_step(params, cfg, *c), (start_state, root0), cycles)
            measurements.append(
                {"batch": b, "spec": NO_SPECULATION, "step_seconds": seconds, "tokens_per_s": b / seconds}
            )
            bar.advance(task)
            for spec in specs:
                bar.update(task, description=f"b={b} {spec.name}")
                draft_seconds, _ = _median_seconds(
                    lambda c, spec=spec: (c[0], c[1], c[2], _draft(params, cfg, spec, c[0], c[1], c[2])),
                    (start_state, root0, hidden0, None), cycles,
                )
                cycle_seconds, seen = _median_seconds(
                    lambda c, spec=spec: _cycle(params, cfg, spec, c[0], c[1], c[2]),
                    (start_state, root0, hidden0, jnp.zeros_like(root0)), cycles,
                )
                per_row = np.stack([np.asarray(c[3]) for c in seen])  # [cycles, b] accepted drafts
                for row in range(b):
                    accepted.setdefault(spec.name, {}).setdefault(row % len(prompts), []).extend(per_row[:, row])
                measurements.append({
                    "batch": b, "spec": spec.name, "draft_seconds": draft_seconds,
                    "verify_commit_seconds": max(cycle_seconds - draft_seconds, 0.0), "cycle_seconds": cycle_seconds,
                })
                bar.advance(task)
    # A prompt's accepted length does not depend on the batch (greedy rows are independent): pool
    # every bucket's cycles per prompt.
    for m in measurements:
        if m["spec"] != NO_SPECULATION:
            per_prompt = np.asarray([np.mean(v) + 1.0 for v in accepted[m["spec"]].values()])
            sequoia = expected_tokens_per_cycle(acceptance, SpecConfig.parse(m["spec"]))
            m["tau"] = {"sequoia": sequoia, "measured": float(np.mean(per_prompt))}
            m["predicted_tokens_per_s"] = {
                "sequoia": m["batch"] * sequoia / m["cycle_seconds"],
                "measured": m["batch"] * batch_tokens_per_cycle(per_prompt, m["batch"]) / m["cycle_seconds"],
            }
    return Tuning(
        acceptance=tuple(float(x) for x in acceptance),
        choices=choose(measurements, estimator),
        estimator=estimator,
        measurements=tuple(measurements),
        max_new_tokens=int(max_new_tokens),
    )


# ---- checking a choice against a sweep ------------------------------------------------------


def compare_with_sweep(tuning: Tuning, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dataset, batch size) of a sweep, and pooled over datasets: the chosen config's measured
    tokens/s against the best measured config and against no speculation."""
    by_key: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in records:
        by_key.setdefault((r["dataset"], int(r["batch_size"])), {})[r["spec"]] = r
    pooled: dict[int, dict[str, list[float]]] = {}
    rows = []
    for (dataset, batch), runs in sorted(by_key.items()):
        spec = tuning.spec_for(batch)
        chosen = NO_SPECULATION if spec is None else spec.name
        if chosen not in runs or NO_SPECULATION not in runs:
            raise ValueError(f"the sweep has no run of {chosen!r} (or of 'ar') at {dataset}, batch {batch}")
        for name, r in runs.items():
            acc = pooled.setdefault(batch, {}).setdefault(name, [0.0, 0.0])
            acc[0] += r["generated"]
            acc[1] += r["seconds"]
        rows.append(_compare_row(dataset, batch, chosen, {n: r["tokens_per_s"] for n, r in runs.items()}))
    for batch, runs in sorted(pooled.items()):
        spec = tuning.spec_for(batch)
        chosen = NO_SPECULATION if spec is None else spec.name
        rates = {n: g / s for n, (g, s) in runs.items() if s > 0}
        rows.append(_compare_row("all", batch, chosen, rates))
    return rows


def _compare_row(dataset: str, batch: int, chosen: str, rates: dict[str, float]) -> dict[str, Any]:
    best = max(rates, key=rates.get)
    return {
        "dataset": dataset, "batch_size": batch, "chosen": chosen, "chosen_tokens_per_s": rates[chosen],
        "best": best, "best_tokens_per_s": rates[best], "ar_tokens_per_s": rates[NO_SPECULATION],
        "chosen_over_best": rates[chosen] / rates[best], "chosen_over_ar": rates[chosen] / rates[NO_SPECULATION],
    }


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| dataset | batch | chosen | chosen tok/s | best in sweep | best tok/s | AR tok/s | chosen/best | chosen/AR |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dataset']} | {r['batch_size']} | {r['chosen']} | {r['chosen_tokens_per_s']:.1f} | {r['best']} | "
            f"{r['best_tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | {r['chosen_over_best']:.3f} | "
            f"{r['chosen_over_ar']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def tuning_table(tuning: Tuning) -> str:
    """Per bucket: predicted tokens/s of every candidate, the winner marked."""
    lines = [
        f"Per-rank acceptance: {', '.join(f'{p:.3f}' for p in tuning.acceptance)}; estimator: {tuning.estimator}",
        "",
        "| batch | spec | draft ms | cycle ms | tau (sequoia) | tau (measured) | predicted tok/s | chosen |",
        "|---:|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for m in tuning.measurements:
        mark = "x" if tuning.choices.get(m["batch"]) == m["spec"] else ""
        if m["spec"] == NO_SPECULATION:
            lines.append(
                f"| {m['batch']} | ar | | {1e3 * m['step_seconds']:.2f} | 1 | 1 | {m['tokens_per_s']:.1f} | {mark} |"
            )
        else:
            lines.append(
                f"| {m['batch']} | {m['spec']} | {1e3 * m['draft_seconds']:.2f} | {1e3 * m['cycle_seconds']:.2f} | "
                f"{m['tau']['sequoia']:.2f} | {m['tau']['measured']:.2f} | "
                f"{m['predicted_tokens_per_s'][tuning.estimator]:.1f} | {mark} |"
            )
    return "\n".join(lines) + "\n"
