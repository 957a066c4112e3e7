"""The budget chooser: which tree (S, K, D), linear chain, or no speculation at all gives the most
tokens per second at each batch bucket.

Sequoia's objective (Chen et al. 2024): expected accepted tokens per cycle over the time of one
cycle. A short calibration run measures what that needs on this machine and model:
- expected tokens per cycle of each candidate, two ways: from the accepted length the real engine
  reaches on each calibration prompt, with a batch taking as many cycles as its slowest row
  (`batch_tokens_per_cycle`; `estimator="measured"`, the default), and Sequoia's dynamic
  program over the draft's per-rank acceptance vector (a one-level tree of width max K,
  `eval.measure_rank_acceptance`, `tree.budget`; `estimator="sequoia"`). Sequoia assumes every depth accepts
  independently; on repetitive text acceptance along a path is correlated and the DP
  under-estimates chains (docs/results.md), so the measured mean is the default and both are kept in
  tune.json;
- per batch bucket, the time of one autoregressive step and of the draft and of a whole cycle
  (draft -> prune -> plan -> verify -> accept -> commit) of every candidate, each a jitted call on a
  state prefilled with real prompts, so the verify cost grows with D and the bucket as it really does
  (`jaxspec.stages`).

The winner per bucket (or "ar" where no speculation is fastest) is saved as JSON beside the
checkpoint (`jaxspec.tuning`) and read back by `tuning.auto_spec` / `speculative_generate(spec="auto")`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import costmodel, stages
from jaxspec.checks import is_int
from jaxspec.config import ModelConfig, SpecConfig
from jaxspec.eval import measure_rank_acceptance
from jaxspec.generate import batch_bucket, length_bucket, prepare_prompts
from jaxspec.model import ModelParams, check_params
from jaxspec.tree.budget import expected_tokens_per_cycle
from jaxspec.tree.values import resolve_scores
from jaxspec.tuning import NO_SPECULATION, Tuning

ESTIMATORS = ("sequoia", "measured")
# The DeepSeek-V4 report's linear chains and K = 2 trees at D = 5..8, plus shorter chains and small trees,
# which are what pays where verifying many tokens is expensive (large batches, CPUs).
DEFAULT_CANDIDATES = (
    "s1_k1_d2", "s2_k1_d3", "s3_k1_d4", "s4_k1_d5", "s5_k1_d6", "s6_k1_d7", "s7_k1_d8",
    "s2_k2_d4", "s3_k2_d5", "s3_k2_d6", "s4_k2_d6", "s4_k2_d7", "s4_k2_d8", "s3_k4_d8",
)


# ---- expected tokens per cycle --------------------------------------------------------------


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


def project_measurements(measurements: Sequence[dict[str, Any]], cfg: ModelConfig, context: int,
                         accelerator: str, mesh: tuple[int, int, int] = (1, 1, 1)) -> None:
    """Replace each measurement's AR-step / cycle seconds by the analytic cost model's projection for
    `cfg` on `mesh` of `accelerator` (in place); the measured ones stay as measured_step_seconds /
    measured_cycle_seconds."""
    for m in measurements:
        spec = None if m["spec"] == NO_SPECULATION else SpecConfig.parse(m["spec"])
        seconds = costmodel.projected_seconds(cfg, spec, m["batch"], context, accelerator, tuple(mesh))
        if spec is None:
            m.update(measured_step_seconds=m["step_seconds"], step_seconds=seconds, tokens_per_s=m["batch"] / seconds)
        else:
            m.update(measured_cycle_seconds=m["cycle_seconds"], cycle_seconds=seconds)


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
    projected: str | None = None,
    projected_cfg: ModelConfig | None = None,
    projected_mesh: tuple[int, int, int] = (1, 1, 1),
    resume: str | Path | None = None,
) -> Tuning:
    """Measure acceptance and step times on `prompts`, then choose a spec (or none) per batch bucket.

    With `projected` (an accelerator of `jaxspec.costmodel`, e.g. "h200") the choice uses the analytic
    cost model's projected AR-step and cycle times on `projected_mesh` of that accelerator instead of
    this machine's (of `projected_cfg`, default the checkpoint's own config) with the acceptance measured here: a
    choice for a machine that is not at hand. The measured times are kept beside them.

    With `resume` (a JSON-lines file) each finished batch bucket is appended there, and a bucket a
    file already holds for the same model, prompts, candidates and lengths is not measured again: a
    stopped calibration continues where it stopped (ratios still compare runs of one process: a
    bucket is measured whole or not at all).
    """
    from rich.progress import Progress, TimeElapsedColumn

    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    check_params(params, cfg)
    if params.mtp is None:
        raise ValueError("tuning speculation needs an MTP draft block; these params have none")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if not batch_sizes or any(not is_int(b) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be ints >= 1, got {list(batch_sizes)}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if projected is not None:
        costmodel.hardware(projected)  # a ValueError naming the known ones
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
    signature = _signature(cfg, prompts, specs, max_new_tokens, iters)
    finished = _finished_buckets(resume, signature, buckets)
    measurements: list[dict[str, Any]] = []
    accepted: dict[str, dict[int, list[int]]] = {}  # spec -> prompt -> accepted drafts per cycle
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), disable=not progress) as bar:
        task = bar.add_task("calibrating", total=len(buckets) * (len(specs) + 1))
        for b in buckets:
            if b in finished:
                record = finished[b]
                bar.advance(task, len(specs) + 1)
            else:
                record = _measure_bucket(params, cfg, specs, prompts, b, width, max_len, cycles,
                                         lambda text: bar.update(task, description=text), lambda: bar.advance(task))
                if resume is not None:  # a bucket at a time: a stopped run keeps what it finished
                    _append_line(resume, json.dumps({"signature": signature, "bucket": b, **record}))
            measurements += record["measurements"]
            for spec_name, rows in record["accepted"].items():
                for row, values in rows.items():
                    accepted.setdefault(spec_name, {}).setdefault(int(row), []).extend(values)
    if projected is not None:
        project_measurements(measurements, projected_cfg or cfg, max_len, projected, projected_mesh)
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
        projected=None if projected is None else f"{projected}:{(projected_cfg or cfg).num_layers}-layer model",
    )


def _measure_bucket(params, cfg, specs, prompts, b, width, max_len, cycles, describe, advance) -> dict[str, Any]:
    """AR step, draft and whole-cycle times of every candidate at batch bucket b, and the accepted
    drafts per calibration prompt -> {"measurements": [...], "accepted": {spec: {prompt: [...]}}}."""
    tokens, lengths = _prompt_rows(prompts, b, width)
    start_state, root0, hidden0 = stages.prefill(params, cfg, tokens, lengths, max_len)
    describe(f"b={b} ar")
    _, seconds, _ = stages.median_seconds(lambda c: stages.ar_step(params, cfg, *c), (start_state, root0), cycles)
    measurements = [{"batch": b, "spec": NO_SPECULATION, "step_seconds": seconds, "tokens_per_s": b / seconds}]
    accepted: dict[str, dict[int, list[int]]] = {}
    advance()
    for spec in specs:
        describe(f"b={b} {spec.name}")
        # ranked as speculative_generate ranks it: by the checkpoint's calibration where it has one
        spec, values = resolve_scores(params, cfg, spec)
        _, draft_seconds, _ = stages.median_seconds(
            lambda c, spec=spec, s=start_state, r=root0, h=hidden0, v=values: stages.draft(params, cfg, spec, s, r, h,
                                                                                          v),
            None, cycles,
        )
        _, cycle_seconds, seen = stages.median_seconds(
            lambda c, spec=spec, v=values: stages.cycle(params, cfg, spec, c[0], c[1], c[2], v),
            (start_state, root0, hidden0, jnp.zeros_like(root0)), cycles,
        )
        per_row = np.stack([np.asarray(c[3]) for c in seen])  # [cycles, b] accepted drafts
        for row in range(b):
            accepted.setdefault(spec.name, {}).setdefault(row % len(prompts), []).extend(
                int(x) for x in per_row[:, row])
        measurements.append({
            "batch": b, "spec": spec.name, "draft_seconds": draft_seconds,
            "verify_commit_seconds": max(cycle_seconds - draft_seconds, 0.0), "cycle_seconds": cycle_seconds,
        })
        advance()
    return {"measurements": measurements, "accepted": accepted}


def _signature(cfg: ModelConfig, prompts, specs, max_new_tokens: int, iters: int) -> str:
    """What a finished bucket's measurements depend on: a resumed run reuses only matching ones."""
    what = json.dumps([repr(cfg), prompts, [s.name for s in specs], max_new_tokens, iters,
                       [d.device_kind for d in jax.local_devices()]])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def _append_line(path: str | Path, line: str) -> None:
    """Append one JSON line; a line a killed run cut off (no newline) is closed first, so it does not
    swallow the record written after it."""
    path = Path(path)
    cut_off = False
    if path.is_file() and path.stat().st_size > 0:
        with open(path, "rb") as f:  # only the last byte: the file grows with every bucket
            f.seek(-1, 2)
            cut_off = f.read(1) != b"\n"
    with open(path, "a") as sink:
        sink.write(("\n" if cut_off else "") + line + "\n")


def _finished_buckets(resume: str | Path | None, signature: str, buckets: Sequence[int]) -> dict[int, dict[str, Any]]:
    if resume is None or not Path(resume).is_file():
        return {}
    finished = {}
    for line in Path(resume).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a stopped run
            continue
        if isinstance(record, dict) and record.get("signature") == signature and record.get("bucket") in buckets:
            finished[record["bucket"]] = record
    return finished


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
