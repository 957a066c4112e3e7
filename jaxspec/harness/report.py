"""Tables and figures of a sweep (the DeepSeek-V4 report's Table 1 / Fig. 3 / Fig. 4 analogues) and of
a tuning, as Markdown and PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxspec.core.spec import SpecConfig
from jaxspec.speculation.auto import NO_SPECULATION, Tuning
from jaxspec.speculation.budget import matched_linear


def write_report(records: list[dict[str, Any]], out_dir: str | Path) -> None:
    """table.md and the Fig. 3 / Fig. 4 analogues of a sweep's records."""
    (Path(out_dir) / "table.md").write_text(markdown_table(records))
    plot_gains(records, out_dir)


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


def plot_acceptance(before: list[dict[str, Any]], after: list[dict[str, Any]], spec: str,
                    path: str | Path) -> Path:
    """Per-depth and per-rank acceptance of one spec, two drafts (e.g. before / after distillation),
    one column per dataset: draft tokens accepted per cycle at each depth of `spec`'s trees, and the
    sweep's per-dataset rank acceptance (how often the k-th ranked child is the target's token)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    def pick(records, dataset):  # any batch: greedy acceptance does not depend on it
        return next((r for r in records if r["spec"] == spec and r["dataset"] == dataset
                     and "per_depth_acceptance" in r), None)

    datasets = sorted({r["dataset"] for r in after if r["spec"] == spec} & {r["dataset"] for r in before
                                                                           if r["spec"] == spec})
    if not datasets:
        raise ValueError(f"no dataset has {spec} runs in both record sets")
    fig = Figure(figsize=(4.2 * len(datasets), 6.4))
    axes = fig.subplots(2, len(datasets), squeeze=False)
    for col, dataset in enumerate(datasets):
        for (label, records), style in zip((("before", before), ("after", after)), ("--", "-"), strict=True):
            r = pick(records, dataset)
            if r is None:
                continue
            depth, rank = r["per_depth_acceptance"], r["rank_acceptance"]
            axes[0][col].plot(range(1, len(depth) + 1), depth, style, marker="o",
                              label=f"{label} (tau {r['tau']:.2f})")
            axes[1][col].bar(np.arange(len(rank)) + (0.2 if label == "after" else -0.2), rank, width=0.4,
                             label=label)
        axes[0][col].set_title(f"{dataset}, {spec}")
        axes[0][col].set_xlabel("draft depth")
        axes[0][col].xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[0][col].set_ylabel("draft tokens accepted at depth, per cycle")
        axes[0][col].set_ylim(0, 1)
        axes[0][col].legend(fontsize=7)
        axes[1][col].set_xlabel("child rank (0 = draft's top-1), one-level tree of 4")
        axes[1][col].set_ylabel("P(this rank is the target's token)")
        axes[1][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


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
    """Per bucket: every candidate's end-to-end tokens/s pooled over the datasets, x AR, tau and the
    spread over repeats, the winner marked; then each (bucket, dataset) group's measurement verdict."""
    projected = tuning.estimator == "projected"
    source = f"the cost model's projection onto {tuning.projected}" if projected else "end-to-end timings"
    lines = [
        f"Chosen from {source} of {tuning.max_new_tokens}-token generations.",
        "",
        "| batch | spec | tok/s | x AR | tau | spread |" + (" projected tok/s |" if projected else "") + " chosen |",
        "|---:|---|---:|---:|---:|---:|" + ("---:|" if projected else "") + ":---:|",
    ]
    for m in sorted(tuning.measurements, key=lambda m: (m["batch"], m["spec"] != NO_SPECULATION, -m["tokens_per_s"])):
        mark = "x" if tuning.choices.get(m["batch"]) == m["spec"] else ""
        tau = "1" if m["spec"] == NO_SPECULATION else f"{m['tau']:.2f}"
        extra = f" {m['projected_tokens_per_s']:.1f} |" if projected else ""
        lines.append(f"| {m['batch']} | {m['spec']} | {m['tokens_per_s']:.1f} | {m['ratio_vs_ar']:.2f} | {tau} | "
                     f"{100 * m['spread']:.0f}% |{extra} {mark} |")
    if tuning.verdicts:
        lines += ["", "| batch | dataset | measurement |", "|---:|---|---|"]
        for v in tuning.verdicts:
            state = "clean" if v["clean"] else "LOADED: " + "; ".join(v["reasons"])
            lines.append(f"| {v['batch']} | {v['dataset']} | {state} |")
    return "\n".join(lines) + "\n"
