"""Tables of experiments/dspark/heldout.json (heldout_acceptance.py): tau per dataset for each draft and
spec, the best DSpark tree over the DSpark chain at each D (past the block's depth, over the deepest chain),
the best run of every draft at each D, and per-position acceptance. Means are over
GSM8K, MBPP and ShareGPT (the training mixture's held-out splits); HumanEval, never trained on, is its own
column beside them. The best tree at each D is chosen by that mean.

    python experiments/dspark/report.py [experiments/dspark/heldout.json] [--draft dspark]

--draft names the DSpark draft whose trees and chains the second table sets side by side.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from jaxspec.core.spec import SpecConfig

MEAN_OVER = ("gsm8k", "mbpp", "sharegpt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", nargs="?", default="experiments/dspark/heldout.json")
    ap.add_argument("--draft", default="dspark", help="the DSpark draft of the tree-over-chain table")
    args = ap.parse_args()
    records = json.load(open(args.path))
    present = {r["dataset"] for r in records}
    datasets = [d for d in MEAN_OVER if d in present] + sorted(present - set(MEAN_OVER))
    mean_over = [d for d in datasets if d in MEAN_OVER]

    def mean(row: dict[str, float]) -> float:
        return sum(row[d] for d in mean_over) / len(mean_over)

    tau: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for r in records:
        tau[(r["draft"], r["spec"])][r["dataset"]] = r["tau"]
    print("| draft | spec | " + " | ".join(datasets) + f" | mean of {', '.join(mean_over)} |")
    print("|---|---|" + "---:|" * (len(datasets) + 1))
    for (draft, spec), row in sorted(tau.items(), key=lambda kv: (kv[0][0], SpecConfig.parse(kv[0][1]).num_draft_tokens,
                                                                    kv[0][1])):
        if len(row) == len(datasets):
            vals = [row[d] for d in datasets]
            print(f"| {draft} | {spec} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {mean(row):.2f} |")
    print()
    print("| D | DSpark chain | best DSpark tree | tree over chain (mean of the three) | per dataset ("
          + " / ".join(datasets) + ") |")
    print("|---:|---|---|---:|---|")
    by_d: dict[int, list[tuple[str, dict[str, float]]]] = defaultdict(list)
    for (draft, spec), row in tau.items():
        if draft == args.draft and len(row) == len(datasets):
            by_d[SpecConfig.parse(spec).num_draft_tokens].append((spec, row))
    every_chain = sorted(((SpecConfig.parse(s).num_draft_tokens, s, r) for rows in by_d.values() for s, r in rows
                          if SpecConfig.parse(s).topk == 1), key=lambda x: x[0])
    for d in sorted(by_d):
        chains = [(s, r) for s, r in by_d[d] if SpecConfig.parse(s).topk == 1]
        trees = [(s, r) for s, r in by_d[d] if SpecConfig.parse(s).topk > 1]
        if not chains:  # deeper than the block lets a chain go: the deepest chain
            chains = [(s, r) for n, s, r in every_chain if n < d][-1:]
        if not chains or not trees:
            continue
        cs, cr = chains[0]
        ts, tr = max(trees, key=lambda x: mean(x[1]))
        gains = {ds: tr[ds] / cr[ds] - 1 for ds in datasets}
        gain = sum(gains[ds] for ds in mean_over) / len(mean_over)
        print(f"| {d} | {cs} ({mean(cr):.2f}) | {ts} ({mean(tr):.2f}) | "
              f"{100 * gain:+.1f}% | " + " / ".join(f"{100 * gains[ds]:+.1f}%" for ds in datasets) + " |")
    print()
    print("The best run of every draft at each D (mean of " + ", ".join(mean_over) + "):")
    print()
    drafts = sorted({draft for draft, _ in tau})
    print("| D | " + " | ".join(drafts) + " |")
    print("|---:|" + "---|" * len(drafts))
    full = {k: row for k, row in tau.items() if len(row) == len(datasets)}
    for d in sorted({SpecConfig.parse(spec).num_draft_tokens for _, spec in full}):
        cells = []
        for draft in drafts:
            runs = [(spec, row) for (dr, spec), row in full.items()
                    if dr == draft and SpecConfig.parse(spec).num_draft_tokens == d]
            spec, row = max(runs, key=lambda x: mean(x[1])) if runs else (None, None)
            cells.append("-" if spec is None else f"{spec} {mean(row):.2f}")
        print(f"| {d} | " + " | ".join(cells) + " |")
    print()
    print("| dataset | draft | spec | P(accepted path reaches depth k), k = 1.. | rank histogram |")
    print("|---|---|---|---|---|")
    for r in records:
        acc = " / ".join(f"{a:.2f}" for a in r["per_depth_acceptance"])
        print(f"| {r['dataset']} | {r['draft']} | {r['spec']} | {acc} | {r['rank_histogram']} |")


if __name__ == "__main__":
    main()
