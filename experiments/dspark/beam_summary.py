"""What one drafter's beam holds for a D = 8 tree, from a held-out `beam_dump.py` dump: tau per dataset of
the beam's top-1 chain, of the tree its `_vb` values prune to 8 nodes, and of the oracle pruning (the
whole beam's accepted path); P(the rank-1 sibling is right | the top child is wrong, parent accepted);
and how well sigma(c) and the `_vb` values tell a right top child from a wrong one (AUC). Set two
drafters' dumps side by side to see whether a drafter's beam or its ranking limits its trees.

    PYTHONPATH=. python experiments/dspark/beam_summary.py beam_dspark.npz beam_dspark_greedy.npz
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from experiments.dspark.ranking_bound import auc, kept_tau, load, top_right_of


def summary(path: str) -> dict:
    he = load(path)
    datasets = sorted(set(he["dataset"].tolist()))
    main3 = [d for d in datasets if d != "humaneval"]
    scores = {"chain": np.where(he["off_chain"] == 0, -he["depth"], -1e9).astype(np.float64), "vb": he["score"],
              "oracle": np.where(he["on_path"], 1.0, 0.0) - 1e-3 * he["depth"]}
    out = {"cycles": int(len(he["dataset"])), "tau": {}}
    for name, s in scores.items():
        t = kept_tau(he, s)
        out["tau"][name] = {d: float(t[he["dataset"] == d].mean()) for d in datasets}
    chain = np.mean([out["tau"]["chain"][d] for d in main3])
    for row in out["tau"].values():
        row["over_chain"] = float(np.mean([row[d] for d in main3]) / chain - 1)
    sibling = he["parent_on"] & (he["rank"] == 1) & ~top_right_of(he)
    out["sibling_right_when_top_wrong"] = float(he["correct"][sibling].mean())
    top = he["parent_on"] & (he["rank"] == 0)
    out["top_child_right"] = float(he["correct"][top].mean())
    cond_vb = np.exp(he["score"] - np.take_along_axis(he["score"], he["parent"], 1))
    out["top_child_auc"] = {"sigma(c)": auc(he["confidence"][top], he["correct"][top]),
                            "vb": auc(cond_vb[top], he["correct"][top])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dumps", nargs="+", help="held-out beam_dump.py files")
    ap.add_argument("--out", default=None, help="JSON of every summary")
    args = ap.parse_args()
    results = {}
    for path in args.dumps:
        r = results[path] = summary(path)
        print(f"{path}: {r['cycles']} cycles; top child right {r['top_child_right']:.3f}, sibling right when the top "
              f"is wrong {r['sibling_right_when_top_wrong']:.3f}; top-child AUC sigma(c) "
              f"{r['top_child_auc']['sigma(c)']:.3f}, vb {r['top_child_auc']['vb']:.3f}")
        for name, row in r["tau"].items():
            cells = " ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "over_chain")
            print(f"  {name:7s} {cells}  over chain {100 * row['over_chain']:+.1f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
