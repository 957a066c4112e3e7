"""Tables of experiments/dspark/heldout.json (heldout_acceptance.py): tau per dataset for each draft and
spec, the best DSpark tree over the DSpark chain at each D, and per-position acceptance.

    python experiments/dspark/report.py [experiments/dspark/heldout.json]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from jaxspec.core.spec import SpecConfig


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "experiments/dspark/heldout.json"
    records = json.load(open(path))
    datasets = sorted({r["dataset"] for r in records})
    tau: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for r in records:
        tau[(r["draft"], r["spec"])][r["dataset"]] = r["tau"]
    print("| draft | spec | " + " | ".join(datasets) + " | mean |")
    print("|---|---|" + "---:|" * (len(datasets) + 1))
    for (draft, spec), row in sorted(tau.items(), key=lambda kv: (kv[0][0], SpecConfig.parse(kv[0][1]).num_draft_tokens,
                                                                    kv[0][1])):
        if len(row) == len(datasets):
            vals = [row[d] for d in datasets]
            print(f"| {draft} | {spec} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {sum(vals) / len(vals):.2f} |")
    print()
    print("| D | DSpark chain | best DSpark tree | tree over chain (mean of datasets) | per dataset |")
    print("|---:|---|---|---:|---|")
    by_d: dict[int, list[tuple[str, dict[str, float]]]] = defaultdict(list)
    for (draft, spec), row in tau.items():
        if draft == "dspark" and len(row) == len(datasets):
            by_d[SpecConfig.parse(spec).num_draft_tokens].append((spec, row))
    for d in sorted(by_d):
        chains = [(s, r) for s, r in by_d[d] if SpecConfig.parse(s).topk == 1]
        trees = [(s, r) for s, r in by_d[d] if SpecConfig.parse(s).topk > 1]
        if not chains or not trees:
            continue
        cs, cr = chains[0]
        ts, tr = max(trees, key=lambda x: sum(x[1].values()))
        gains = {ds: tr[ds] / cr[ds] - 1 for ds in datasets}
        mean = sum(gains.values()) / len(gains)
        print(f"| {d} | {cs} ({sum(cr.values()) / len(cr):.2f}) | {ts} ({sum(tr.values()) / len(tr):.2f}) | "
              f"{100 * mean:+.1f}% | " + " / ".join(f"{100 * gains[ds]:+.1f}%" for ds in datasets) + " |")
    print()
    print("| dataset | draft | spec | P(accepted path reaches depth k), k = 1.. | rank histogram |")
    print("|---|---|---|---|---|")
    for r in records:
        acc = " / ".join(f"{a:.2f}" for a in r["per_depth_acceptance"])
        print(f"| {r['dataset']} | {r['draft']} | {r['spec']} | {acc} | {r['rank_histogram']} |")


if __name__ == "__main__":
    main()
