"""Tree over chain, greedy tau, with a paired bootstrap 95% interval per dataset.

    python experiments/calibration/gain_ci.py RECORDS.jsonl CHAIN_SPEC TREE_SPEC [--draws 10000]

Reads two records of `tau.py` (the latest of each spec) that carry `per_sequence` (same prompts,
same order) and resamples prompts with replacement within each dataset, the same draw for both
specs: tau = (accepted + cycles) / cycles over the drawn prompts, gain = tree tau / chain tau - 1.
"""
import argparse
import json

import numpy as np


def main():
    p = argparse.ArgumentParser(description="tree over chain tau with a paired bootstrap interval")
    p.add_argument("records")
    p.add_argument("chain_spec")
    p.add_argument("tree_spec")
    p.add_argument("--draws", type=int, default=10000)
    args = p.parse_args()
    chain_spec, tree_spec, draws = args.chain_spec, args.tree_spec, args.draws
    recs = {}
    for line in open(args.records):
        if line.strip():
            r = json.loads(line)
            if "per_sequence" in r:
                recs[r["spec"]] = r
    chain, tree = recs[chain_spec], recs[tree_spec]
    names = np.asarray(chain["per_sequence"]["dataset"])
    if names.tolist() != tree["per_sequence"]["dataset"]:
        raise SystemExit("the two records were measured on different prompts")
    rng = np.random.default_rng(0)
    print(f"{tree_spec} over {chain_spec}, {chain['prompts_per_dataset']} prompts per dataset, "
          f"{chain['new_tokens']} new tokens; paired bootstrap over prompts, {draws} draws")
    print("| dataset | chain tau | tree tau | gain | 95% interval |\n|---|---:|---:|---:|---|")
    for ds in [*dict.fromkeys(names.tolist()), "all"]:
        sel = np.ones(len(names), bool) if ds == "all" else names == ds
        a = {k: np.asarray(r["per_sequence"]["accepted"])[sel] for k, r in (("c", chain), ("t", tree))}
        c = {k: np.asarray(r["per_sequence"]["cycles"])[sel] for k, r in (("c", chain), ("t", tree))}
        tau = {k: (a[k].sum() + c[k].sum()) / c[k].sum() for k in "ct"}
        idx = rng.integers(0, sel.sum(), size=(draws, sel.sum()))
        boot = {k: (a[k][idx].sum(1) + c[k][idx].sum(1)) / c[k][idx].sum(1) for k in "ct"}
        lo, hi = np.percentile(100 * (boot["t"] / boot["c"] - 1), [2.5, 97.5])
        print(f"| {ds} | {tau['c']:.3f} | {tau['t']:.3f} | {100 * (tau['t'] / tau['c'] - 1):+.1f}% | "
              f"{lo:+.1f}% .. {hi:+.1f}% |")


if __name__ == "__main__":
    main()
