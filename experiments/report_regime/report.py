"""Tables and figures of the report-regime experiment from the records of tau_grid.py and
acceptance.py (no model runs): per draft, Table 1 (chain vs best calibrated tree per D, paired
bootstrap intervals, Sequoia's optimum beside each tree) and Fig. 3 (tree gain per dataset vs D);
one figure of tree gain vs D (a line per draft x dataset); the per-depth acceptance figure; the tau
spread across batch sizes.

    python experiments/report_regime/report.py [--records results/report_regime/tau.jsonl] \
        [--acceptance results/report_regime/acceptance.json] [--out results/report_regime]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import read_records  # noqa: E402

from jaxspec.core.spec import SpecConfig  # noqa: E402
from jaxspec.speculation.budget import expected_tokens_per_cycle  # noqa: E402

MAIN = ("gsm8k", "mbpp", "sharegpt")
LABEL = {"default": "distilled", "one-step": "one-step"}
DRAWS = 4000
BATCHES = (1, 4, 16, 32, 64)  # 32: the grid's batch


def latest(records, datasets, batch=32):
    """{(draft, spec): record} keeping the last record of each measured on `datasets` at `batch`."""
    out = {}
    for r in records:
        if r["batch"] == batch and tuple(r["datasets"]) == tuple(datasets):
            out[(r["draft"], r["spec"])] = r
    return out


def chain_name(d: int) -> str:
    return f"s{d - 1}_k1_d{d}"


def _arrays(r, ds):
    names = np.asarray(r["per_sequence"]["dataset"])
    sel = names == ds
    return np.asarray(r["per_sequence"]["accepted"])[sel], np.asarray(r["per_sequence"]["cycles"])[sel]


def boot_gain(chain, tree, datasets, rng):
    """Paired bootstrap over prompts within each dataset -> (per-dataset draws [DRAWS, n_ds]) of tree/chain - 1."""
    cols = []
    for ds in datasets:
        (ac, cc), (at, ct) = _arrays(chain, ds), _arrays(tree, ds)
        idx = rng.integers(0, len(ac), size=(DRAWS, len(ac)))
        tc = (ac[idx].sum(1) + cc[idx].sum(1)) / cc[idx].sum(1)
        tt = (at[idx].sum(1) + ct[idx].sum(1)) / ct[idx].sum(1)
        cols.append(tt / tc - 1)
    return np.stack(cols, 1)


def best_trees(recs, draft, d, datasets):
    """The calibrated tree of budget d with the highest mean gain over `datasets` (one spec for all)."""
    chain = recs.get((draft, chain_name(d)))
    trees = [r for (dr, _), r in recs.items() if dr == draft and r["D"] == d and r["K"] > 1]
    if chain is None or not trees:
        return chain, None
    return chain, max(trees, key=lambda r: np.mean([r[ds] / chain[ds] for ds in datasets]))


def sequoia(acc, draft, ds, spec):
    """(rank-only tau*, per-depth tau*) from the held-out acceptance of acceptance.py."""
    if acc is None or draft not in acc or ds not in acc[draft]:
        return None, None
    rate = np.asarray(acc[draft][ds]["rate"])
    return (expected_tokens_per_cycle(rate[0], spec), expected_tokens_per_cycle(rate, spec))


def table1(recs, acc, draft, depths, datasets, rng):
    lines = [f"### {LABEL[draft]} draft: chain vs best calibrated tree (greedy, held-out)", "",
             "| D | chain tau (" + " / ".join(datasets) + ") | best tree | tree tau | gain | mean gain [95% CI] "
             "| Sequoia tau* rank-only / per-depth (all) |", "|---:|---|---|---|---|---|---|"]
    rows = []
    for d in depths:
        chain, tree = best_trees(recs, draft, d, datasets)
        if tree is None:
            continue
        draws = boot_gain(chain, tree, datasets, rng)
        mean = np.mean([tree[ds] / chain[ds] - 1 for ds in datasets])
        lo, hi = np.percentile(draws.mean(1), [2.5, 97.5])
        spec = SpecConfig.parse(tree["spec"])
        s1, s2 = sequoia(acc, draft, "all", spec)
        star = "-" if s1 is None else f"{s1:.2f} / {s2:.2f}"
        lines.append(f"| {d} | " + " / ".join(f"{chain[ds]:.2f}" for ds in datasets) + f" | {tree['spec']} | "
                     + " / ".join(f"{tree[ds]:.2f}" for ds in datasets) + " | "
                     + " / ".join(f"{100 * (tree[ds] / chain[ds] - 1):+.1f}%" for ds in datasets)
                     + f" | {100 * mean:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}] | {star} |")
        rows.append({"D": d, "chain": chain["spec"], "tree": tree["spec"], "mean_gain": mean, "ci": [lo, hi],
                     **{f"gain_{ds}": tree[ds] / chain[ds] - 1 for ds in datasets},
                     **{f"chain_{ds}": chain[ds] for ds in datasets}, **{f"tree_{ds}": tree[ds] for ds in datasets}})
    return lines, rows


def all_specs(recs, acc, draft, datasets):
    lines = [f"### {LABEL[draft]} draft: every spec measured (batch 32 grid)", "",
             "| D | spec | " + " | ".join(datasets)
             + " | all | gain over chain (mean) | Sequoia tau* per-depth (all) |",
             "|---:|---|" + "---:|" * (len(datasets) + 3)]
    mine = sorted((r for (dr, _), r in recs.items() if dr == draft), key=lambda r: (r["D"], r["K"], r["S"]))
    for r in mine:
        chain = recs.get((draft, chain_name(r["D"])))
        gain = "-" if chain is None else f"{100 * np.mean([r[ds] / chain[ds] - 1 for ds in datasets]):+.1f}%"
        star = sequoia(acc, draft, "all", SpecConfig.parse(r["spec"]))[1] if r["D"] > 1 else None
        lines.append(f"| {r['D']} | {r['spec']} | " + " | ".join(f"{r[ds]:.3f}" for ds in datasets)
                     + f" | {r['tau_all']:.3f} | {gain} | {'-' if star is None else f'{star:.2f}'} |")
    return lines


def spread(records, datasets):
    by = {}
    for r in records:
        if tuple(r["datasets"]) != tuple(datasets):
            continue
        by.setdefault((r["draft"], r["spec"]), {})[r["batch"]] = r
    lines = ["### tau of a fixed spec across batch sizes (same prompts)", "",
             "| draft | spec | " + " | ".join(f"batch {b}" for b in BATCHES) + " | max - min |",
             "|---|---|" + "---:|" * (len(BATCHES) + 1)]
    for (draft, spec), rs in sorted(by.items()):
        if len(rs) < 2:
            continue
        taus = {b: np.mean([rs[b][ds] for ds in datasets]) for b in rs}
        lines.append(f"| {LABEL[draft]} | {spec} | " + " | ".join(f"{taus[b]:.3f}" if b in taus else "-"
                                                                  for b in BATCHES)
                     + f" | {max(taus.values()) - min(taus.values()):.3f} |")
    return lines


def figures(rows_by_draft, acc, out):
    from matplotlib.figure import Figure

    for draft, rows in rows_by_draft.items():
        if not rows or "/" in draft:
            continue
        fig = Figure(figsize=(6.5, 3.4))
        ax = fig.subplots()
        x = np.arange(len(rows))
        for i, ds in enumerate(MAIN):
            ax.bar(x + (i - 1) * 0.27, [100 * r[f"gain_{ds}"] for r in rows], 0.27, label=ds)
        ax.set_xticks(x, [f"D={r['D']}\n{r['tree']}" for r in rows], fontsize=7)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_ylabel("tree over chain, tau (%)")
        ax.set_title(f"{LABEL[draft]} draft: best calibrated tree vs matched chain")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"fig3_{draft}.png", dpi=110)
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    for draft, rows in rows_by_draft.items():
        name, _, only = draft.partition("/")
        for i, ds in enumerate([only] if only else MAIN):
            ax.plot([r["D"] for r in rows], [100 * r[f"gain_{ds}"] for r in rows], marker="o",
                    color=f"C{i if not only else 3}", ls="-" if name == "one-step" else "--",
                    label=f"{LABEL[name]}, {ds}")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("verification budget D (tokens per cycle)")
    ax.set_ylabel("best calibrated tree over chain, tau (%)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "tree_gain_vs_d.png", dpi=110)
    if acc:
        fig = Figure(figsize=(9, 3.4))
        axes = fig.subplots(1, 2)
        for j, rank in enumerate((0, 1)):
            for draft in acc:
                for i, ds in enumerate(MAIN):
                    if ds in acc[draft]:
                        rate = np.asarray(acc[draft][ds]["rate"])[:, rank]
                        axes[j].plot(np.arange(1, len(rate) + 1), rate, marker="o", ms=3, color=f"C{i}",
                                     ls="-" if draft == "one-step" else "--", label=f"{LABEL[draft]}, {ds}")
            axes[j].set_xlabel("depth of the child")
            axes[j].set_ylabel(f"P(rank-{rank} child accepted | parent accepted)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "per_depth_acceptance.png", dpi=110)


def fig4(out):
    """Fig. 4 analogue: tree over chain throughput vs batch, measured on this CPU (throughput.json)
    and projected on 8 x H200 (projection.json); either panel is left out when its data is absent."""
    from matplotlib.figure import Figure

    thr, proj = out / "throughput.json", out / "projection.json"
    if not (thr.is_file() or proj.is_file()):
        return
    fig = Figure(figsize=(11.5, 3.6))
    axes = fig.subplots(1, 2, sharey=True)
    if thr.is_file():
        data = json.loads(thr.read_text())
        by_budget: dict[tuple[str, int], dict[bool, str]] = {}  # (draft, D) -> {is a chain: "draft:spec"}
        for pair in data["pairs"]:
            draft, _, name = pair.partition(":")
            spec = SpecConfig.parse(name)
            by_budget.setdefault((draft, spec.num_draft_tokens), {})[spec.topk == 1] = pair
        pairs = {key: (p[True], p[False]) for key, p in sorted(by_budget.items(), key=lambda kv: -kv[0][1])
                 if len(p) == 2}  # the budgets measured as both a chain and a tree
        for i, ((draft, d), (chain, tree)) in enumerate(pairs.items()):
            rows = [(b["batch"], b["methods"]) for b in data["batches"]
                    if chain in b["methods"] and tree in b["methods"]]
            gain = [100 * (m[tree]["tokens_per_s"] / m[chain]["tokens_per_s"] - 1) for _, m in rows]
            axes[0].plot([b for b, _ in rows], gain, marker="o", color=f"C{i}",
                         label=f"{LABEL[draft]} D={d}: {tree.split(':')[1]} vs {chain.split(':')[1]}")
        axes[0].set_title("measured, this CPU (one quiet pinned core)", fontsize=9)
    if proj.is_file():
        rows = json.loads(proj.read_text())
        for draft in LABEL:
            for i, d in enumerate(sorted({r["D"] for r in rows if r["draft"] == draft})):
                pts = sorted((r["batch"], 100 * (r["tree_over_chain"] - 1))
                             for r in rows if r["draft"] == draft and r["D"] == d)
                axes[1].plot([b for b, _ in pts], [g for _, g in pts], marker="o", ms=3, color=f"C{i}",
                             ls="-" if draft == "one-step" else "--", label=f"{LABEL[draft]} D={d}")
        axes[1].set_title("projected, v4-flash on 8 x H200 (cost model)", fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 16, 64], ["1", "4", "16", "64"])
        ax.set_xlabel("batch")
        ax.axhline(0, color="k", lw=0.6)
    axes[0].legend(fontsize=6)
    axes[1].legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    axes[0].set_ylabel("tree over chain, tokens/s (%)")
    fig.tight_layout()
    fig.savefig(out / "fig4_throughput.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", default="results/report_regime/tau.jsonl")
    p.add_argument("--acceptance", default="results/report_regime/acceptance.json")
    p.add_argument("--out", default="results/report_regime")
    p.add_argument("--depths", default="5,6,7,8,12,16")
    args = p.parse_args()
    out = Path(args.out)
    records = read_records(args.records)
    acc = json.loads(Path(args.acceptance).read_text()) if Path(args.acceptance).is_file() else None
    recs = latest(records, MAIN)
    he = latest(records, ["humaneval"])
    depths = [int(x) for x in args.depths.split(",")]
    rng = np.random.default_rng(0)
    text, rows_by_draft = [], {}
    for draft in LABEL:
        lines, rows = table1(recs, acc, draft, depths, MAIN, rng)
        rows_by_draft[draft] = rows
        text += lines + [""]
        if any(dr == draft for dr, _ in he):
            he_lines, he_rows = table1(he, acc, draft, depths, ["humaneval"], rng)
            text += [he_lines[0] + " -- HumanEval (code never trained on)", *he_lines[1:], ""]
            rows_by_draft[f"{draft}/humaneval"] = he_rows
    for draft in LABEL:
        text += all_specs(recs, acc, draft, MAIN) + [""]
    text += spread(records, MAIN) + [""]
    (out / "tables.md").write_text("\n".join(text) + "\n")
    (out / "table1.json").write_text(json.dumps(rows_by_draft, indent=1) + "\n")
    figures(rows_by_draft, acc, out)
    fig4(out)
    print("\n".join(text))


if __name__ == "__main__":
    main()
