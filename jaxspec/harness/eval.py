"""The tree-vs-linear evaluation harness (the DeepSeek-V4 report's Table 1, Fig. 3 and Fig. 4 for our models).

For each dataset, spec and batch size it runs `speculative_generate` (and `generate` as the
autoregressive baseline) over held-out prompts, data-parallel over all local devices with one
replica per device (`generate(..., mesh=)` over a "data" mesh), and records accepted length tau, per-prompt
tau and tokens/s. It also measures the draft's per-rank acceptance vector and the Sequoia DP
optimum tau* for each budget, so every tree's tau stands next to the best any tree of that size
could reach under the same acceptance model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxspec.core import measure
from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.harness.report import write_report
from jaxspec.model.network import ModelParams
from jaxspec.sharding.rules import make_mesh
from jaxspec.speculation.budget import sequoia_optimum
from jaxspec.speculation.drafter import Draft
from jaxspec.speculation.generate import generate, speculative_generate, summarize_stats
from jaxspec.speculation.inputs import batch_bucket
from jaxspec.training.data import DATASETS, EVAL_DATASETS, HELDOUT_SPLITS, load_dataset
from jaxspec.training.tokenizer import encode

LINEAR_SPECS = ("s4_k1_d5", "s5_k1_d6", "s6_k1_d7", "s7_k1_d8")
# Draft depth s needs s + 1 tokens at least (the root and one per depth): s5_k2_d5 is not a tree.
TREE_SPECS = tuple(f"s{s}_k2_d{d}" for s in (3, 4, 5) for d in (5, 6, 7, 8) if s < d)


@dataclasses.dataclass(frozen=True)
class Sampled:
    """The sampling a sweep or a tune measures at (None there: greedy): temperature / top-p processing,
    the acceptance rule of the speculative runs (`speculation/policy.py`; None = the default at T > 0,
    "block") and the seed of every run (the same draws in every timed round)."""

    temperature: float
    top_p: float | None = None
    accept: str | None = None
    seed: int = 0

    def __post_init__(self):
        from jaxspec.speculation.policy import ACCEPT_RULES

        if not self.temperature > 0:
            raise ValueError(f"a sampled run needs temperature > 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.accept is not None and self.accept not in ACCEPT_RULES:
            raise ValueError(f"accept must be one of {ACCEPT_RULES}, got {self.accept!r}")

    def kwargs(self, speculative: bool) -> dict[str, Any]:
        """The keywords `generate` / `speculative_generate` take for these settings."""
        out: dict[str, Any] = dict(temperature=self.temperature, top_p=self.top_p, rng=jax.random.key(self.seed))
        if speculative:
            out["accept"] = self.accept
        return out

    def record(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "accept": self.accept or "block",
                "seed": self.seed}


# ---- data-parallel runs ------------------------------------------------------------------------


def data_mesh(batch: int, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh | None:
    """A "data"-only mesh over as many local devices as divide the batch bucket (None for one)."""
    devices = list(devices or jax.local_devices())
    n = len(devices)
    while n > 1 and batch % n:
        n -= 1
    return None if n == 1 else make_mesh(data=n, devices=devices)


def run_batch(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None = None,
    devices: Sequence[jax.Device] | jax.sharding.Mesh | None = None,
    longest_prompt: int | None = None,
    pad_batch_to: int | None = None,
    *,
    draft: Draft | None = None,
    sampling: Sampled | None = None,
) -> dict[str, Any]:
    """Generation of one prompt batch with `generate` / `speculative_generate` (of `draft`: its calibration
    ranks the trees), greedy or at `sampling`'s settings; -> tokens, lengths, stats, seconds. `devices`: a
    sequence of devices (default: the local ones) runs one replica of the model per device; a Mesh runs the
    model sharded over it (params placed there by `shard_params` / `load_checkpoint(mesh=)`, the batch over
    "data").

    Prompts are padded to `longest_prompt` (the longest of a whole dataset) and the batch to
    `pad_batch_to` rows, so every batch of a sweep reuses one compiled program and no timing
    includes a compile; padding rows are cut from the outputs and the statistics.
    """
    model_mesh = devices if isinstance(devices, jax.sharding.Mesh) else None
    n_dev = model_mesh.shape["data"] if model_mesh is not None else len(devices or jax.local_devices())
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    longest = int(lengths.max()) if longest_prompt is None else int(longest_prompt)
    if longest < int(lengths.max()):
        raise ValueError(f"longest_prompt={longest} is shorter than a prompt of {int(lengths.max())} tokens")
    bucket = batch_bucket(max(len(prompts), int(pad_batch_to or 0)))
    bucket = -(-bucket // n_dev) * n_dev
    tokens = np.zeros((bucket, longest), np.int32)
    padded_lengths = np.ones((bucket,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    padded_lengths[: len(prompts)] = lengths
    mesh = model_mesh if model_mesh is not None else data_mesh(bucket, devices)
    kwargs = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, mesh=mesh, prompt_lengths=padded_lengths,
                  **(sampling.kwargs(spec is not None) if sampling else {}))  # the key made outside the timing
    start = time.perf_counter()
    if spec is None:
        out = generate(params, cfg, tokens, **kwargs)
    else:
        out = speculative_generate(params, cfg, tokens, spec, **kwargs, draft=draft)
    seconds = time.perf_counter() - start
    n = len(prompts)
    per_sequence = {k: np.asarray(v)[:n] for k, v in out.stats["per_sequence"].items()}
    stats = summarize_stats(per_sequence, out.stats["spec"], out.stats["decode_steps"], out.stats["scores"])
    return {
        "tokens": out.tokens[:n],
        "lengths": out.lengths[:n],
        "stats": stats,
        "seconds": seconds,
        "devices": 1 if mesh is None else int(mesh.devices.size),
    }


def timed_methods(
    params: ModelParams,
    cfg: ModelConfig,
    methods: Mapping[str, Any],  # name -> spec (with `draft`), (Draft, spec), or None: `generate`, the AR reference
    batches: Sequence[list[list[int]]],
    max_new_tokens: int,
    repeats: int,
    longest_prompt: int,
    pad_batch_to: int,
    devices: Sequence[jax.Device] | jax.sharding.Mesh | None = None,  # as `run_batch` takes them
    describe: Callable[[str], None] | None = None,
    *,
    draft: Draft | None = None,
    sampling: Sampled | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every method over every prompt batch, timed as the measurement discipline says (`jaxspec.core.measure`).

    A first pass runs each method on each batch once: it compiles, and its outputs give the
    statistics (greedy runs are deterministic). Then `repeats` rounds run every (batch, method)
    round-robin inside a `measure.Watch`; a method's seconds are the sum over batches of its median
    over rounds, its spread that of its per-round totals. -> (name -> {"seconds", "spread",
    "round_seconds", "generated", "tokens_per_s", "outputs": the first pass's `run_batch` results},
    the Watch's verdict, with the first method as the reference)."""
    run = {name: functools.partial(run_batch, params, cfg, m[1] if isinstance(m, tuple) else m,
                                   max_new_tokens=max_new_tokens, devices=devices, longest_prompt=longest_prompt,
                                   pad_batch_to=pad_batch_to, draft=m[0] if isinstance(m, tuple) else draft,
                                   sampling=sampling)
           for name, m in methods.items()}
    first = {}
    for name, call in run.items():
        if describe is not None:
            describe(f"{name}: compile + first pass")
        first[name] = [call(chunk) for chunk in batches]
    times = {name: np.zeros((repeats, len(batches))) for name in run}
    with measure.Watch() as watch:
        for r in range(repeats):
            for i, chunk in enumerate(batches):
                for name, call in run.items():
                    if describe is not None:
                        describe(f"round {r + 1}/{repeats}, batch {i + 1}/{len(batches)}: {name}")
                    times[name][r, i] = call(chunk)["seconds"]
    out = {}
    for name in run:
        generated = int(sum(int(res["lengths"].sum()) for res in first[name]))
        seconds = float(np.median(times[name], axis=0).sum())
        rounds = measure.Timing(tuple(float(x) for x in times[name].sum(axis=1)))
        out[name] = {"seconds": seconds, "spread": rounds.spread, "round_seconds": list(rounds.seconds),
                     "generated": generated, "tokens_per_s": generated / seconds, "outputs": first[name]}
    reference = next(iter(run))
    verdict = watch.verdict(measure.Timing(tuple(out[reference]["round_seconds"])), reference)
    return out, verdict


def measure_rank_acceptance(
    params: ModelParams, cfg: ModelConfig, prompts: list[list[int]], width: int = 4, max_new_tokens: int = 64,
    batch_size: int = 16, *, draft: Draft | None = None,
    devices: Sequence[jax.Device] | jax.sharding.Mesh | None = None,  # as `run_batch` takes them
) -> np.ndarray:
    """p[k] = P(the k-th ranked draft child is the accepted one), from a one-level tree of `width`."""
    spec = SpecConfig(1, width, width + 1)
    hist = np.zeros(width)
    cycles = 0
    longest = max(len(p) for p in prompts)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        result = run_batch(
            params, cfg, spec, chunk, max_new_tokens, devices=devices, longest_prompt=longest, pad_batch_to=batch_size,
            draft=draft)
        hist += np.asarray(result["stats"]["rank_histogram"], float)
        cycles += result["stats"]["cycles"]
    return hist / max(cycles, 1)


def distinct_ngram_ratio(tokens: np.ndarray, lengths: np.ndarray, n: int = 4) -> float:
    """Mean over sequences of distinct n-grams / n-grams in each generated continuation (1.0 = no
    n-gram repeats; a model stuck in a loop scores near 0). Sequences shorter than n are skipped."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    if tokens.ndim != 2 or lengths.shape != tokens.shape[:1] or n < 1:
        raise ValueError(f"need tokens [B, T], lengths [B] and n >= 1, got {tokens.shape}, {lengths.shape}, {n}")
    ratios = []
    for row, length in zip(tokens, lengths, strict=True):
        seq = row[: int(length)].tolist()
        grams = [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    if not ratios:
        raise ValueError(f"no continuation has {n} tokens")
    return float(np.mean(ratios))


# ---- the sweep --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    datasets: tuple[str, ...] = ("gsm8k", "mbpp", "sharegpt")
    specs: tuple[str, ...] = LINEAR_SPECS + TREE_SPECS
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    num_prompts: int = 64
    max_new_tokens: int = 128
    max_prompt_tokens: int = 192
    rank_width: int = 4
    repeats: int = 3  # timed rounds per (dataset, batch size) group, every method round-robin (jaxspec.core.measure)
    sampling: Sampled | None = None  # None: greedy

    def __post_init__(self):
        bad = [d for d in self.datasets if d not in EVAL_DATASETS]
        if bad or not self.datasets:
            raise ValueError(f"unknown dataset(s) {bad}; allowed: {list(EVAL_DATASETS)}")
        for name in self.specs:
            SpecConfig.parse(name)
        if not self.batch_sizes or any(int(b) < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {list(self.batch_sizes)}")
        for field in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "rank_width", "repeats"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


def tuning_prompts(tokenizer: Any, num_prompts: int, max_prompt_tokens: int, datasets: Sequence[str] = DATASETS,
                   data_root: str | Path | None = None) -> dict[str, list[list[int]]]:
    """Held-out prompts for choosing a spec, disjoint from the ones its figures are reported on: MBPP's
    validation split (task ids 511-600), and the last `num_prompts` of GSM8K's and ShareGPT's test
    splits (sweeps and benchmarks take the first ones)."""
    out = {}
    for name in datasets:
        if name == "mbpp":
            examples = load_dataset(name, "validation", root=data_root)[:num_prompts]
        else:
            examples = load_dataset(name, HELDOUT_SPLITS[name], root=data_root)[-num_prompts:]
        out[name] = encode_prompts(tokenizer, examples, max_prompt_tokens)
    return out


def encode_prompts(tokenizer: Any, examples: Sequence[Any], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each example's prompt; long prompts keep their last max_prompt_tokens tokens."""
    out = []
    for ex in examples:
        ids = encode(tokenizer, ex.prompt)
        out.append(ids[-max_prompt_tokens:])
    return out


def run_sweep(
    params: ModelParams,
    cfg: ModelConfig,
    tokenizer: Any,
    sweep: SweepConfig,
    out_dir: str | Path,
    devices: Sequence[jax.Device] | jax.sharding.Mesh | None = None,  # as `run_batch` takes them
    prompts_by_dataset: dict[str, list[list[int]]] | None = None,
    progress: bool = True,
    resume: bool = False,
    data_root: str | Path | None = None,
    *,
    draft: Draft | None = None,
) -> list[dict[str, Any]]:
    """Run every (dataset, spec, batch size) of `draft` (default: the MTP block of `params`) and write
    runs.jsonl, table.md and the figures.

    resume=True keeps the (dataset, batch size) groups an earlier, interrupted run of the same sweep
    finished in out_dir/runs.jsonl and runs the rest; a half-finished group is run again whole, so
    every speed ratio still compares runs made back to back in one process."""
    from rich.progress import Progress

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [SpecConfig.parse(s) for s in sweep.specs]
    if prompts_by_dataset is None:
        prompts_by_dataset = {}
        for name in sweep.datasets:
            examples = load_dataset(name, HELDOUT_SPLITS[name], root=data_root)[: sweep.num_prompts]
            prompts_by_dataset[name] = encode_prompts(tokenizer, examples, sweep.max_prompt_tokens)
    # One prompt width for every dataset, so all datasets share each (spec, batch) compiled program. (Split
    # a long sweep over processes by batch size, each with every dataset, and the width stays the same.)
    longest = max(len(p) for name in sweep.datasets for p in prompts_by_dataset[name])
    runs_path = out_dir / "runs.jsonl"
    done: dict[tuple[str, int], list[dict[str, Any]]] = {}
    if resume and runs_path.exists():
        counts = {name: len(prompts_by_dataset[name]) for name in sweep.datasets}
        done = _finished_groups(load_runs(runs_path), sweep, counts)
    records: list[dict[str, Any]] = [r for group in done.values() for r in group]
    batches_left = {name: [b for b in sweep.batch_sizes if (name, b) not in done] for name in sweep.datasets}
    with open(runs_path, "w") as sink, Progress(disable=not progress) as bar:
        for r in records:
            sink.write(json.dumps(r) + "\n")
        task = bar.add_task("sweep", total=sum(map(len, batches_left.values())) * (len(specs) + 1))
        for name in sweep.datasets:
            if not batches_left[name]:
                continue
            prompts = prompts_by_dataset[name]
            acceptance = measure_rank_acceptance(params, cfg, prompts, sweep.rank_width, draft=draft, devices=devices)
            for batch_size in batches_left[name]:
                batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
                methods = {"ar": None, **{spec.name: spec for spec in specs}}
                timed, verdict = timed_methods(
                    params, cfg, methods, batches, sweep.max_new_tokens, sweep.repeats, longest, batch_size, devices,
                    lambda text, name=name, b=batch_size: bar.update(task, description=f"{name} b={b} {text}"),
                    draft=draft, sampling=sweep.sampling)
                for method, spec in methods.items():
                    record = _sweep_record(name, batch_size, spec, len(prompts), sweep, timed[method], verdict,
                                           acceptance, timed["ar"]["tokens_per_s"])
                    records.append(record)
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                    bar.advance(task)
    write_report(records, out_dir)
    return records


def _sweep_record(dataset: str, batch_size: int, spec: SpecConfig | None, num_prompts: int, sweep: SweepConfig,
                  timed: dict[str, Any], verdict: dict[str, Any], acceptance: np.ndarray,
                  ar_tokens_per_s: float) -> dict[str, Any]:
    """One runs.jsonl record: a method's timing over a (dataset, batch size) group and its statistics."""
    outputs = timed["outputs"]
    record = {
        "dataset": dataset, "batch_size": batch_size, "spec": spec.name if spec else "ar", "num_prompts": num_prompts,
        "max_new_tokens": sweep.max_new_tokens, "tokens_per_s": timed["tokens_per_s"], "seconds": timed["seconds"],
        "generated": timed["generated"], "spread": timed["spread"], "repeats": sweep.repeats,
        "devices": outputs[0]["devices"], "measurement": verdict,
        **({"sampling": sweep.sampling.record()} if sweep.sampling else {}),
    }
    if spec is None:
        rows = np.concatenate([res["tokens"] for res in outputs])
        lengths = np.concatenate([res["lengths"] for res in outputs])
        record["distinct_4gram"] = distinct_ngram_ratio(rows, lengths, 4)
        return record
    per_prompt_tau, accepted, cycles, depth = [], 0, 0, 0.0
    for res in outputs:
        st = res["stats"]
        per_prompt_tau += st["per_sequence"]["mean_accepted_length"]
        accepted += int(sum(st["per_sequence"]["accepted"]))
        cycles += st["cycles"]
        depth = depth + np.asarray(st["per_depth_acceptance"]) * st["cycles"]
    record.update({
        "kind": "linear" if spec.topk == 1 else "tree",
        "num_draft_tokens": spec.num_draft_tokens,
        "tau": (accepted + cycles) / max(cycles, 1),
        "per_prompt_tau": per_prompt_tau,
        "per_depth_acceptance": (np.asarray(depth) / max(cycles, 1)).tolist(),
        "speedup_vs_ar": timed["tokens_per_s"] / ar_tokens_per_s,
        "tau_star": sequoia_optimum(acceptance, spec.num_draft_tokens, spec.num_steps),
        "rank_acceptance": acceptance.tolist(),
    })
    return record


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    """Records of a sweep's runs.jsonl (a cut-off last line, from a killed run, is dropped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def merge_runs(paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    """Records of several runs.jsonl files (e.g. one sweep split over processes) -> (the records of every
    complete (dataset, batch size) group, the groups left out). A group is taken whole from one file, the
    last in which it is complete (it holds AR and every spec any file ran), so its speed ratios compare
    runs of one process; a group a stopped process cut short is left out unless another file finished it."""
    per_file = [load_runs(path) for path in paths]
    specs = {r["spec"] for records in per_file for r in records} | {"ar"}
    complete: dict[tuple[str, int], list[dict[str, Any]]] = {}
    seen: set[tuple[str, int]] = set()
    for records in per_file:
        groups: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
        for r in records:
            groups.setdefault((r["dataset"], r["batch_size"]), {})[r["spec"]] = r
        seen |= set(groups)
        complete.update({key: list(g.values()) for key, g in groups.items() if set(g) == specs})
    return [r for group in complete.values() for r in group], sorted(seen - set(complete))


def _finished_groups(
    records: list[dict[str, Any]], sweep: SweepConfig, num_prompts: dict[str, int]
) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(dataset, batch size) -> its records, for the groups of `sweep` that hold AR and every spec, run
    on as many prompts and new tokens, at the same sampling settings, as this sweep."""
    wanted = {"ar", *sweep.specs}
    groups: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in records:
        if r.get("dataset") not in num_prompts or r.get("batch_size") not in sweep.batch_sizes:
            continue
        if r.get("num_prompts") != num_prompts[r["dataset"]] or r.get("max_new_tokens") != sweep.max_new_tokens:
            continue
        if r.get("sampling") != (sweep.sampling.record() if sweep.sampling else None):  # greedy or other settings
            continue
        groups.setdefault((r["dataset"], r["batch_size"]), {})[r["spec"]] = r
    return {key: [g[s] for s in ["ar", *sweep.specs]] for key, g in groups.items() if wanted <= set(g)}
