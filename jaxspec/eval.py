"""The tree-vs-linear evaluation harness (the report's Table 1, Fig. 3 and Fig. 4 for our models).

For each dataset, spec and batch size it runs `speculative_generate` (and `generate` as the
autoregressive baseline) over held-out prompts, data-parallel over all local devices with one
replica per device (`jax.shard_map` over a "data" axis), and records accepted length tau, per-prompt
tau and tokens/s. It also measures the draft's per-rank acceptance vector and the Sequoia DP
optimum tau* for each budget, so every tree's tau stands next to the best any tree of that size
could reach under the same acceptance model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxspec.config import ModelConfig, SpecConfig
from jaxspec.generate import (
    _generate_loop,
    _speculative_loop,
    length_bucket,
    prepare_prompts,
    summarize_stats,
)
from jaxspec.model import ModelParams
from jaxspec.sampling import Sampling

LINEAR_SPECS = ("s4_k1_d5", "s5_k1_d6", "s6_k1_d7", "s7_k1_d8")
TREE_SPECS = tuple(f"s{s}_k2_d{d}" for s in (3, 4, 5) for d in (5, 6, 7, 8))
WIDE_SPECS = ("s3_k3_d8", "s3_k4_d8")


def matched_linear(spec: SpecConfig) -> SpecConfig:
    """The linear chain verifying the same number of tokens per cycle: s(D-1)_k1_dD."""
    d = spec.num_draft_tokens
    return SpecConfig(d - 1, 1, d)


# ---- Sequoia's dynamic program ---------------------------------------------------------------


def sequoia_optimum(acceptance: Sequence[float], budget: int, max_depth: int) -> float:
    """Best expected tokens per cycle over all trees of `budget` nodes (root included) and depth
    <= max_depth, when the k-th ranked child of any node is the accepted one with probability
    acceptance[k-1] (survey section 5). The root counts 1."""
    p = [float(x) for x in acceptance]
    if not p or any(not 0.0 <= x <= 1.0 for x in p):
        raise ValueError(f"acceptance must be probabilities in [0, 1], got {acceptance!r}")
    if budget < 1 or max_depth < 0:
        raise ValueError(f"budget must be >= 1 and max_depth >= 0, got {budget}, {max_depth}")
    width = len(p)
    neg = -np.inf
    # best[m][l]: best value of a subtree of m nodes with depth <= l (any number of children)
    best = np.full((budget + 1, max_depth + 1), neg)
    # with_children[m][l][b]: exactly b children at the root
    with_children = np.full((budget + 1, max_depth + 1, width + 1), neg)
    for l in range(max_depth + 1):
        with_children[1, l, 0] = 1.0
        best[1, l] = 1.0
    def attach(prob: float, subtree: float) -> float:
        # an impossible subtree stays impossible even behind a zero-probability edge (0 * -inf)
        return prob * subtree if np.isfinite(subtree) else neg

    for l in range(1, max_depth + 1):
        for m in range(2, budget + 1):
            with_children[m, l, 1] = 1.0 + attach(p[0], best[m - 1, l - 1])
            for b in range(2, width + 1):
                candidates = [
                    with_children[y, l, b - 1] + attach(p[b - 1], best[m - y, l - 1]) for y in range(1, m)
                ]
                with_children[m, l, b] = max(candidates)
            best[m, l] = np.max(with_children[m, l])
    if not np.isfinite(best[budget, max_depth]):
        raise ValueError(
            f"no tree of {budget} nodes fits depth <= {max_depth} with {width} ranked children per node"
        )
    return float(best[budget, max_depth])


# ---- data-parallel runs ------------------------------------------------------------------------


def data_mesh(batch: int, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A 1-D "data" mesh over as many local devices as divide the batch bucket."""
    devices = list(devices or jax.local_devices())
    n = len(devices)
    while n > 1 and batch % n:
        n -= 1
    return jax.sharding.Mesh(np.asarray(devices[:n]), ("data",))


def _bucket_for_mesh(batch: int, n_devices: int) -> int:
    from jaxspec.generate import batch_bucket

    bucket = batch_bucket(batch)
    return -(-bucket // n_devices) * n_devices


@functools.lru_cache(maxsize=64)
def _sharded_runner(cfg: ModelConfig, spec: SpecConfig | None, max_new: int, max_len: int, mesh):
    """One replica of the (speculative or autoregressive) loop per device, batch split over "data"."""
    if spec is None:
        def replica(params, tokens, lengths, eos):
            toks, n, steps = _generate_loop(
                params, cfg, tokens, lengths, max_new, max_len,
                jnp.float32(0), jnp.int32(0), jnp.float32(1), eos, jax.random.key(0),
            )
            return toks, n, {"steps": jnp.broadcast_to(steps, n.shape)}
    else:
        def replica(params, tokens, lengths, eos):
            greedy = Sampling(jnp.float32(0), jnp.int32(0), jnp.float32(1), jax.random.key(0))
            return _speculative_loop(params, cfg, spec, tokens, lengths, max_new, max_len, eos, greedy)
    stats_spec = P("data")
    sharded = jax.shard_map(
        replica, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
        out_specs=(P("data"), P("data"), stats_spec), check_vma=False,
    )
    return jax.jit(sharded)


def run_batch(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    longest_prompt: int | None = None,
    pad_batch_to: int | None = None,
) -> dict[str, Any]:
    """Greedy generation of one prompt batch, data-parallel; -> tokens, lengths, stats, seconds.

    Shapes are bucketed from the longest prompt; pass `longest_prompt` (the longest of a whole
    dataset) so every batch of a sweep reuses one compiled program and no timing includes a compile;
    `pad_batch_to` does the same for a short last batch.
    """
    n_dev = len(devices or jax.local_devices())
    steps_extra = 0 if spec is None else spec.num_steps + 1
    batch = prepare_prompts(cfg, prompts, max_new_tokens + steps_extra)
    longest = int(batch.lengths.max()) if longest_prompt is None else int(longest_prompt)
    if longest < int(batch.lengths.max()):
        raise ValueError(f"longest_prompt={longest} is shorter than a prompt of {int(batch.lengths.max())} tokens")
    bucket = _bucket_for_mesh(max(len(prompts), int(pad_batch_to or 0)), n_dev)
    tokens = np.zeros((bucket, length_bucket(longest, cfg.max_position_embeddings)), np.int32)
    lengths = np.ones((bucket,), np.int32)
    tokens[: len(prompts), : batch.tokens.shape[1]] = batch.tokens[: len(prompts)]
    lengths[: len(prompts)] = batch.lengths[: len(prompts)]
    mesh = data_mesh(bucket, devices)
    max_len = length_bucket(longest + max_new_tokens + steps_extra, cfg.max_position_embeddings, 64)
    runner = _sharded_runner(cfg, spec, int(max_new_tokens), max_len, mesh)
    eos = jnp.int32(-1 if eos_id is None else eos_id)
    start = time.perf_counter()
    out_tokens, out_lengths, stats = runner(params, jnp.asarray(tokens), jnp.asarray(lengths), eos)
    out_tokens = np.asarray(out_tokens)[: len(prompts)]
    seconds = time.perf_counter() - start
    stats = {k: np.asarray(v)[: len(prompts)] for k, v in stats.items()}
    return {
        "tokens": out_tokens,
        "lengths": np.asarray(out_lengths)[: len(prompts)],
        "stats": summarize_stats(stats, spec) if spec is not None else {"steps": int(stats["steps"].max())},
        "seconds": seconds,
        "devices": int(mesh.devices.size),
    }


def measure_rank_acceptance(
    params: ModelParams, cfg: ModelConfig, prompts: list[list[int]], width: int = 4, max_new_tokens: int = 64,
    batch_size: int = 16,
) -> np.ndarray:
    """p[k] = P(the k-th ranked draft child is the accepted one), from a one-level tree of `width`."""
    spec = SpecConfig(1, width, width + 1)
    hist = np.zeros(width)
    cycles = 0
    longest = max(len(p) for p in prompts)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        result = run_batch(
            params, cfg, spec, chunk, max_new_tokens, longest_prompt=longest, pad_batch_to=batch_size
        )
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

    def __post_init__(self):
        from jaxspec.data import DATASETS

        bad = [d for d in self.datasets if d not in DATASETS]
        if bad or not self.datasets:
            raise ValueError(f"unknown dataset(s) {bad}; allowed: {list(DATASETS)}")
        for name in self.specs:
            SpecConfig.parse(name)
        if not self.batch_sizes or any(int(b) < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {list(self.batch_sizes)}")
        for field in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "rank_width"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


def encode_prompts(tokenizer: Any, examples: Sequence[Any], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each example's prompt; long prompts keep their last max_prompt_tokens tokens."""
    from jaxspec.tokenizer import encode

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
    devices: Sequence[jax.Device] | None = None,
    prompts_by_dataset: dict[str, list[list[int]]] | None = None,
    progress: bool = True,
    resume: bool = False,
) -> list[dict[str, Any]]:
    """Run every (dataset, spec, batch size) and write runs.jsonl, table.md and the figures.

    resume=True keeps the (dataset, batch size) groups an earlier, interrupted run of the same sweep
    finished in out_dir/runs.jsonl and runs the rest; a half-finished group is run again whole, so
    every speed ratio still compares runs made back to back in one process."""
    from rich.progress import Progress

    from jaxspec.data import HELDOUT_SPLITS, load_dataset

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [SpecConfig.parse(s) for s in sweep.specs]
    if prompts_by_dataset is None:
        prompts_by_dataset = {}
        for name in sweep.datasets:
            examples = load_dataset(name, HELDOUT_SPLITS[name])[: sweep.num_prompts]
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
            acceptance = measure_rank_acceptance(params, cfg, prompts, sweep.rank_width)
            for batch_size in batches_left[name]:
                batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
                baseline = None
                for spec in [None, *specs]:
                    bar.update(task, description=f"{name} b={batch_size} {spec.name if spec else 'AR'}")
                    run = functools.partial(
                        run_batch, params, cfg, spec, max_new_tokens=sweep.max_new_tokens, devices=devices,
                        longest_prompt=longest, pad_batch_to=batch_size,
                    )
                    run(batches[0])  # compile
                    seconds, generated, per_prompt_tau, accepted, cycles, depth = 0.0, 0, [], 0, 0, None
                    continuations = []
                    for chunk in batches:
                        res = run(chunk)
                        seconds += res["seconds"]
                        generated += int(res["lengths"].sum())
                        continuations += list(zip(res["tokens"], res["lengths"], strict=True))
                        if spec is not None:
                            st = res["stats"]
                            per_prompt_tau += st["per_sequence"]["mean_accepted_length"]
                            accepted += int(sum(st["per_sequence"]["accepted"]))
                            cycles += st["cycles"]
                            hits = np.asarray(st["per_depth_acceptance"]) * st["cycles"]
                            depth = hits if depth is None else depth + hits
                    record = {
                        "dataset": name, "batch_size": batch_size, "spec": spec.name if spec else "ar",
                        "num_prompts": len(prompts), "max_new_tokens": sweep.max_new_tokens,
                        "tokens_per_s": generated / seconds, "seconds": seconds, "generated": generated,
                        "devices": res["devices"],
                    }
                    if spec is None:
                        baseline = record
                        rows, lengths = zip(*continuations, strict=True)
                        record["distinct_4gram"] = distinct_ngram_ratio(np.stack(rows), np.asarray(lengths), 4)
                    else:
                        record.update({
                            "kind": "linear" if spec.topk == 1 else "tree",
                            "num_draft_tokens": spec.num_draft_tokens,
                            "tau": (accepted + cycles) / max(cycles, 1),
                            "per_prompt_tau": per_prompt_tau,
                            "per_depth_acceptance": (depth / max(cycles, 1)).tolist(),
                            "speedup_vs_ar": record["tokens_per_s"] / baseline["tokens_per_s"],
                            "tau_star": sequoia_optimum(acceptance, spec.num_draft_tokens, spec.num_steps),
                            "rank_acceptance": acceptance.tolist(),
                        })
                    records.append(record)
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                    bar.advance(task)
    write_report(records, out_dir)
    return records


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
    on as many prompts and new tokens as this sweep."""
    wanted = {"ar", *sweep.specs}
    groups: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in records:
        if r.get("dataset") not in num_prompts or r.get("batch_size") not in sweep.batch_sizes:
            continue
        if r.get("num_prompts") != num_prompts[r["dataset"]] or r.get("max_new_tokens") != sweep.max_new_tokens:
            continue
        groups.setdefault((r["dataset"], r["batch_size"]), {})[r["spec"]] = r
    return {key: [g[s] for s in ["ar", *sweep.specs]] for key, g in groups.items() if wanted <= set(g)}


def write_report(records: list[dict[str, Any]], out_dir: str | Path) -> None:
    """table.md and the Fig. 3 / Fig. 4 analogues of a sweep's records."""
    (Path(out_dir) / "table.md").write_text(markdown_table(records))
    plot_gains(records, out_dir)


# ---- reporting ----------------------------------------------------------------------------------


def markdown_table(records: list[dict[str, Any]]) -> str:
    """Table 1 analogue: tau per spec and dataset (smallest batch size), with tau* beside it."""
    spec_records = [r for r in records if r["spec"] != "ar"]
    if not spec_records:
        distinct = {r["dataset"]: r["distinct_4gram"] for r in records if "distinct_4gram" in r}
        ar = ", ".join(f"{r['dataset']} batch {r['batch_size']}: {r['tokens_per_s']:.0f}" for r in records)
        return (f"no speculative runs; AR tokens/s {ar}\n\nDistinct-4-gram ratio of the greedy continuations: "
                + ", ".join(f"{d} {v:.3f}" for d, v in sorted(distinct.items())) + "\n")
    batch = min(r["batch_size"] for r in spec_records)
    datasets = sorted({r["dataset"] for r in spec_records})
    specs = sorted({r["spec"] for r in spec_records}, key=lambda s: (SpecConfig.parse(s).num_draft_tokens, s))
    lines = [
        f"Accepted length tau (tau* = Sequoia optimum for the same budget), batch {batch}",
        "",
        "| spec | " + " | ".join(datasets) + " |",
        "|---|" + "---:|" * len(datasets),
    ]
    for s in specs:
        cells = []
        for d in datasets:
            match = [r for r in spec_records if r["spec"] == s and r["dataset"] == d and r["batch_size"] == batch]
            cells.append(f"{match[0]['tau']:.2f} ({match[0]['tau_star']:.2f})" if match else "-")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Throughput gain of tree over matched linear (same D), per batch size")
    lines.append("")
    lines.append("| dataset | tree | linear | batch | tau gain | tokens/s gain |")
    lines.append("|---|---|---|---:|---:|---:|")
    for r in spec_records:
        if r.get("kind") != "tree":
            continue
        lin = matched_linear(SpecConfig.parse(r["spec"])).name
        base = [x for x in spec_records if x["spec"] == lin and x["dataset"] == r["dataset"]
                and x["batch_size"] == r["batch_size"]]
        if base:
            b = base[0]
            lines.append(
                f"| {r['dataset']} | {r['spec']} | {lin} | {r['batch_size']} | "
                f"{100 * (r['tau'] / b['tau'] - 1):+.1f}% | {100 * (r['tokens_per_s'] / b['tokens_per_s'] - 1):+.1f}% |"
            )
    batches = sorted({r["batch_size"] for r in records})
    ar = {(r["dataset"], r["batch_size"]): r for r in records if r["spec"] == "ar"}
    lines += [
        "",
        f"Tokens/s relative to autoregressive decoding ({' / '.join(datasets)}), per batch size",
        "",
        "| spec | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|" + "---:|" * len(batches),
    ]
    rate = {(r["spec"], r["dataset"], r["batch_size"]): r["tokens_per_s"] for r in records}
    for s in ["ar", *specs]:
        cells = []
        for b in batches:
            vals = [
                f"{rate[(s, d, b)] / ar[(d, b)]['tokens_per_s']:.2f}" if (s, d, b) in rate and (d, b) in ar else "-"
                for d in datasets
            ]
            if s == "ar":
                vals = [f"{rate[(s, d, b)]:.0f}" if (s, d, b) in rate else "-" for d in datasets]
            cells.append(" / ".join(vals))
        lines.append(f"| {'AR tokens/s' if s == 'ar' else s} | " + " | ".join(cells) + " |")
    distinct = {r["dataset"]: r["distinct_4gram"] for r in records if "distinct_4gram" in r}
    if distinct:
        lines += ["", "Distinct-4-gram ratio of the greedy continuations: "
                  + ", ".join(f"{d} {v:.3f}" for d, v in sorted(distinct.items()))]
    return "\n".join(lines) + "\n"


def plot_gains(records: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Fig. 3 / Fig. 4 analogues: tree-over-matched-linear gain in tau and tokens/s per D."""
    # A bare Figure (no pyplot): no global backend switch, so notebooks keep inline plots.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    out_dir = Path(out_dir)
    spec_records = [r for r in records if r["spec"] != "ar"]
    paths = []
    for metric, fname, label in (("tau", "fig3_tau_gain.png", "accepted length"),
                                 ("tokens_per_s", "fig4_throughput_gain.png", "tokens/s")):
        datasets = sorted({r["dataset"] for r in spec_records})
        if not datasets:
            continue
        fig = Figure(figsize=(4.5 * len(datasets), 3.4))
        axes = fig.subplots(1, len(datasets), squeeze=False)
        for ax, d in zip(axes[0], datasets, strict=True):
            for batch in sorted({r["batch_size"] for r in spec_records}):
                best: dict[int, float] = {}
                for r in spec_records:
                    if r["dataset"] != d or r["batch_size"] != batch or r.get("kind") != "tree":
                        continue
                    lin = matched_linear(SpecConfig.parse(r["spec"])).name
                    base = [x for x in spec_records if x["spec"] == lin and x["dataset"] == d
                            and x["batch_size"] == batch]
                    if base:
                        gain = 100 * (r[metric] / base[0][metric] - 1)
                        dd = r["num_draft_tokens"]
                        best[dd] = max(best.get(dd, -np.inf), gain)
                if best:
                    xs = sorted(best)
                    ax.plot(xs, [best[x] for x in xs], marker="o", label=f"batch {batch}")
            ax.axhline(0, color="gray", lw=0.8)
            ax.set_title(d)
            ax.set_xlabel("verify budget D")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(f"best tree vs linear, {label} (%)")
            if ax.get_legend_handles_labels()[0]:  # no matched linear run, no lines
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths
