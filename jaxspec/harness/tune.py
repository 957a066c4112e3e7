"""The budget chooser: which tree (S, K, D), linear chain, per-cycle-width tree or no speculation at
all gives the most tokens per second at each batch bucket, chosen from end-to-end timings of the
loops a user runs.

Per batch bucket and dataset, `generate` (AR) and `speculative_generate` of every candidate run over
the same prompt batches, round-robin in one process under the measurement discipline of
`jaxspec.core.measure` (`eval.timed_methods`: a first pass that compiles and records tau, then `repeats`
timed rounds, a bandwidth probe before and after, the busy share of the other cores). A method's
tokens/s pools the datasets (tokens generated / seconds); the best per bucket is the choice ("ar"
where nothing beats plain decoding). A group measured on a loaded machine is measured again up to
`retries` times, and a bucket that stays loaded is refused (a ValueError naming why) unless
`allow_loaded`: a choice made from a loaded run is what shipped "ar" everywhere before
(docs/results.md, "Measuring speed").

Earlier versions chose from the sum of separately jitted stages and a predicted tau; stages timed
apart under-count the loop (repeated inputs keep the same experts in the cache; docs/speed.md,
section 3), so the loop itself is what is timed now.

With `projected` (an accelerator of `jaxspec.cost`, e.g. "h200") the choice instead takes the
cost model's projected AR-step and cycle times for `projected_cfg` on `projected_mesh` with the tau
measured here: a choice for a machine that is not at hand (the measured figures are kept beside).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxspec import cost as costmodel
from jaxspec.core.checks import is_int
from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.harness.eval import Sampled, timed_methods
from jaxspec.model.network import ModelParams, check_params
from jaxspec.speculation.auto import NO_SPECULATION, Tuning, qualified, split_choice
from jaxspec.speculation.drafter import Draft, DraftSet
from jaxspec.speculation.generate import draft_of
from jaxspec.speculation.inputs import batch_bucket, length_bucket, prepare_prompts

# Chains from 1 to 15 draft steps, the report's K = 2 trees, and per-cycle widths: what can pay on a
# CPU at batch 1 (long chains: a cycle costs less than its tokens' AR steps) and at large batches
# (short chains: a verify reads every expert once for the whole batch).
DEFAULT_CANDIDATES = (
    "s1_k1_d2", "s2_k1_d3", "s3_k1_d4", "s5_k1_d6", "s7_k1_d8", "s11_k1_d12", "s15_k1_d16",
    "s3_k2_d6", "s4_k2_d8", "s7_k2_d8_w4", "s15_k2_d16_w4.8",
)
PRUNE_BELOW = 0.9  # x AR at one bucket below which a candidate is not measured at larger buckets
MIN_PROMPTS = 8  # prompts per dataset and bucket: a batch-1 figure averages 8 prompts, a batch-64 one holds 64


def _check(cfg: ModelConfig, params: ModelParams, draft: Draft | DraftSet | None, batch_sizes: Sequence[int],
           candidates: Sequence[Any], repeats: int) -> tuple[dict[str, Any], Draft | None]:
    """-> (the methods to time: name -> None (AR), a spec of the one draft or (draft, spec) across a DraftSet;
    the one draft, None for a DraftSet)."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    check_params(params, cfg)
    if not batch_sizes or any(not is_int(b) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be ints >= 1, got {list(batch_sizes)}")
    if not is_int(repeats) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    specs = [SpecConfig.parse(c) if isinstance(c, str) else c for c in candidates]
    if not specs:
        raise ValueError("need at least one candidate spec")
    for spec in specs:
        spec.validate_for(cfg)
    methods: dict[str, Any] = {NO_SPECULATION: None}
    if not isinstance(draft, DraftSet):
        draft = draft_of(params, cfg, draft)
        for spec in specs:
            draft.drafter.check(cfg, spec)
        return methods | {s.name: s for s in specs}, draft
    for d in draft.drafts:  # every candidate each draft can grow (a DSpark block bounds a chain's depth)
        for spec in specs:
            try:
                d.drafter.check(cfg, spec)
            except ValueError:
                continue
            methods[qualified(d.name, spec.name)] = (d, spec)
    if len(methods) == 1:
        raise ValueError(f"no draft of {draft!r} can grow any of the candidates {[s.name for s in specs]}")
    return methods, None


def tune(
    params: ModelParams,
    cfg: ModelConfig,
    prompts: Mapping[str, Sequence[Sequence[int]]],  # dataset -> prompts (held-out, not the evaluation's)
    batch_sizes: Sequence[int] = (1, 4, 16, 64),
    candidates: Sequence[str | SpecConfig] = DEFAULT_CANDIDATES,
    max_new_tokens: int = 128,
    repeats: int = 3,
    retries: int = 2,
    allow_loaded: bool = False,
    progress: bool = True,
    resume: str | Path | None = None,
    projected: str | None = None,
    projected_cfg: ModelConfig | None = None,
    projected_mesh: tuple[int, int, int] = (1, 1, 1),
    prune_below: float | None = PRUNE_BELOW,
    *,
    draft: Draft | DraftSet | None = None,
    devices: Sequence[jax.Device] | jax.sharding.Mesh | None = None,  # as `harness.eval.run_batch` takes them
    sampling: Sampled | None = None,  # the settings to choose for (rule included); None = greedy
) -> Tuning:
    """Time AR and every candidate end to end per batch bucket and dataset; choose per bucket.

    With `resume` (a JSON-lines file) each finished (bucket, dataset) group is appended there and a
    group the file already holds for the same model, prompts, candidates and lengths is not measured
    again: a stopped run continues where it stopped (a group is measured whole or not at all, so its
    ratios still compare runs of one process).

    Buckets run smallest first, and a candidate whose tokens/s pooled over the datasets falls below
    `prune_below` x AR at one bucket is not measured at the larger ones (None: every candidate at
    every bucket). That assumes a candidate 10% behind AR does not win at a larger batch: a verify's
    work grows with batch x nodes while AR's grows with the batch alone (docs/speed.md, section 5).

    `draft` a `DraftSet`: every draft runs every candidate it can grow, side by side with the others and
    AR in one process; methods and choices are named "draft/spec" (`speculation.auto.qualified`).
    """
    from rich.progress import Progress, TimeElapsedColumn

    methods, one_draft = _check(cfg, params, draft, batch_sizes, candidates, repeats)
    if not prompts or any(not p for p in prompts.values()):
        raise ValueError("need at least one prompt per dataset")
    if projected is not None:
        if isinstance(draft, DraftSet):
            raise ValueError("projected times model the MTP draft's cycle: tune one draft at a time with projected")
        costmodel.hardware(projected)  # a ValueError naming the known ones
    specs = [m[1] if isinstance(m, tuple) else m for m in methods.values() if m is not None]
    max_steps = max(s.num_steps for s in specs)
    rows = {name: _checked_prompts(cfg, p, max_new_tokens + max_steps + 1) for name, p in prompts.items()}
    longest = max(len(p) for ps in rows.values() for p in ps)
    buckets = sorted({batch_bucket(int(b)) for b in batch_sizes})
    signature = _signature(cfg, rows, list(methods), max_new_tokens, repeats, sampling)
    finished = _finished_groups(resume, signature)
    if prune_below is not None and not 0 <= prune_below <= 1:
        raise ValueError(f"prune_below must be in [0, 1] or None, got {prune_below!r}")
    records: list[dict[str, Any]] = []
    verdicts: list[dict[str, Any]] = []
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), disable=not progress) as bar:
        task = bar.add_task("tuning", total=len(buckets) * len(rows))
        for b in buckets:
            for name, ps in rows.items():
                key = f"{b}:{name}"
                if key not in finished:
                    group = _measure_group(params, cfg, methods, ps, b, max_new_tokens, repeats, retries, longest,
                                           lambda text, k=key: bar.update(task, description=f"{k} {text}"), one_draft,
                                           devices, sampling)
                    if not group["verdict"]["clean"] and not allow_loaded:
                        raise ValueError(f"batch {b}, {name}: the machine stayed loaded over {retries + 1} tries ("
                                         f"{'; '.join(group['verdict']['reasons'])}); tune on a quiet machine "
                                         "(docs/results.md, 'Measuring speed') or pass allow_loaded")
                    finished[key] = group
                    if resume is not None:
                        _append_line(resume, json.dumps({"signature": signature, "group": key, **group}))
                records += finished[key]["records"]
                verdicts.append({"batch": b, "dataset": name, **finished[key]["verdict"]})
                bar.advance(task)
            if prune_below is not None:
                bucket = pooled_measurements([r for r in records if r["batch"] == b])
                ratios = {m["spec"]: m["ratio_vs_ar"] for m in bucket}
                methods = {n: s for n, s in methods.items() if s is None or ratios.get(n, 1.0) >= prune_below}
    pooled = pooled_measurements(records)
    if projected is not None:
        context = length_bucket(longest + max_new_tokens + max_steps + 1, cfg.max_position_embeddings, minimum=64)
        project_measurements(pooled, projected_cfg or cfg, context, projected, tuple(projected_mesh))
    return Tuning(
        choices=choose(pooled, "projected_tokens_per_s" if projected is not None else "tokens_per_s"),
        measurements=tuple(pooled),
        max_new_tokens=int(max_new_tokens),
        estimator="end-to-end" if projected is None else "projected",
        projected=None if projected is None else f"{projected}:{(projected_cfg or cfg).num_layers}-layer model",
        groups=tuple(records),
        verdicts=tuple(verdicts),
        sampling=None if sampling is None else sampling.record(),
    )


def _checked_prompts(cfg: ModelConfig, prompts: Sequence[Sequence[int]], room: int) -> list[list[int]]:
    batch = prepare_prompts(cfg, list(prompts), room)  # the checks `generate` makes
    return [batch.tokens[i, : int(batch.lengths[i])].tolist() for i in range(batch.batch)]


def _measure_group(params, cfg, methods, prompts, b, max_new_tokens, repeats, retries, longest, describe, draft,
                   devices, sampling=None):
    """AR and every candidate over max(b, MIN_PROMPTS) prompts (cycled if too few) in batches of b, timed
    round-robin; retried while the machine is loaded -> {"records": [...], "verdict": ...}."""
    count = max(b, MIN_PROMPTS)
    chosen = [list(prompts[i % len(prompts)]) for i in range(count)]
    batches = [chosen[i : i + b] for i in range(0, count, b)]
    for attempt in range(retries + 1):
        timed, verdict = timed_methods(params, cfg, methods, batches, max_new_tokens, repeats, longest, b,
                                       devices, describe, draft=draft, sampling=sampling)
        if verdict["clean"]:
            break
        describe(f"loaded ({'; '.join(verdict['reasons'])}): measuring again ({attempt + 1}/{retries})")
    ar = timed[NO_SPECULATION]
    records = []
    for name, t in timed.items():
        record = {"batch": b, "spec": name, "seconds": t["seconds"], "generated": t["generated"],
                  "tokens_per_s": t["tokens_per_s"], "ratio_vs_ar": t["tokens_per_s"] / ar["tokens_per_s"],
                  "spread": t["spread"], "prompts": count}
        if methods[name] is not None:
            accepted = sum(int(np.sum(res["stats"]["per_sequence"]["accepted"])) for res in t["outputs"])
            cycles = sum(int(res["stats"]["cycles"]) for res in t["outputs"])
            record.update(tau=(accepted + cycles) / max(cycles, 1), cycles=cycles)
        records.append(record)
    return {"records": records, "verdict": verdict}


def choose(measurements: Sequence[dict[str, Any]], rate: str = "tokens_per_s") -> dict[int, str]:
    """Per bucket, the spec with the highest `rate` ("ar" included: where nothing beats it, no speculation)."""
    best: dict[int, dict[str, Any]] = {}
    for m in measurements:
        if m["batch"] not in best or m[rate] > best[m["batch"]][rate]:
            best[m["batch"]] = m
    return {b: m["spec"] for b, m in sorted(best.items())}


def pooled_measurements(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (bucket, spec): tokens generated / seconds summed over the datasets, tau over their cycles."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["batch"], r["spec"]), []).append(r)
    ar = {b: sum(r["generated"] for r in rs) / sum(r["seconds"] for r in rs)
          for (b, spec), rs in groups.items() if spec == NO_SPECULATION}
    out = []
    for (b, spec), rs in groups.items():
        m = {"batch": b, "spec": spec, "datasets": len(rs), "generated": sum(r["generated"] for r in rs),
             "seconds": sum(r["seconds"] for r in rs), "spread": max(r["spread"] for r in rs)}
        m["tokens_per_s"] = m["generated"] / m["seconds"]
        m["ratio_vs_ar"] = m["tokens_per_s"] / ar[b]
        if spec != NO_SPECULATION:
            cycles = sum(r["cycles"] for r in rs)
            m["tau"] = sum(r["tau"] * r["cycles"] for r in rs) / max(cycles, 1)
        out.append(m)
    return out


def project_measurements(measurements: list[dict[str, Any]], cfg: ModelConfig, context: int, accelerator: str,
                         mesh: tuple[int, int, int] = (1, 1, 1)) -> None:
    """Add the cost model's projected tokens/s on `mesh` of `accelerator` (with the measured tau) in place."""
    for m in measurements:
        spec = split_choice(m["spec"])[1]
        seconds = costmodel.projected_seconds(cfg, spec, m["batch"], context, accelerator, mesh)
        m["projected_seconds"] = seconds
        m["projected_tokens_per_s"] = m["batch"] * (1.0 if spec is None else m["tau"]) / seconds


def _signature(cfg: ModelConfig, prompts, names: list[str], max_new_tokens: int, repeats: int,
               sampling: Sampled | None = None) -> str:
    """What a finished group's measurements depend on: a resumed run reuses only matching ones."""
    what = [repr(cfg), prompts, [n for n in names if n != NO_SPECULATION], max_new_tokens, repeats,
            [d.device_kind for d in jax.local_devices()]]
    if sampling is not None:  # greedy signatures as before
        what.append(sampling.record())
    what = json.dumps(what)
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def _append_line(path: str | Path, line: str) -> None:
    """Append one JSON line; a line a killed run cut off (no newline) is closed first, so it does not
    swallow the record written after it."""
    path = Path(path)
    cut_off = False
    if path.is_file() and path.stat().st_size > 0:
        with open(path, "rb") as f:  # only the last byte: the file grows with every group
            f.seek(-1, 2)
            cut_off = f.read(1) != b"\n"
    with open(path, "a") as sink:
        sink.write(("\n" if cut_off else "") + line + "\n")


def _finished_groups(resume: str | Path | None, signature: str) -> dict[str, dict[str, Any]]:
    if resume is None or not Path(resume).is_file():
        return {}
    finished = {}
    for line in Path(resume).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a stopped run
            continue
        if isinstance(record, dict) and record.get("signature") == signature and "group" in record:
            finished[record["group"]] = {"records": record["records"], "verdict": record["verdict"]}
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
        chosen = tuning.name_for(batch)
        if chosen not in runs or NO_SPECULATION not in runs:
            raise ValueError(f"the sweep has no run of {chosen!r} (or of 'ar') at {dataset}, batch {batch}")
        for name, r in runs.items():
            acc = pooled.setdefault(batch, {}).setdefault(name, [0.0, 0.0])
            acc[0] += r["generated"]
            acc[1] += r["seconds"]
        rows.append(_compare_row(dataset, batch, chosen, {n: r["tokens_per_s"] for n, r in runs.items()}))
    for batch, runs in sorted(pooled.items()):
        chosen = tuning.name_for(batch)
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
