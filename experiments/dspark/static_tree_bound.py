"""The best fixed-shape tree a drafter's measured rates allow, against its chain (Sequoia-style bound).

From experiments/dspark/heldout.json: the DSpark chain's per-depth acceptance gives the conditional rate
p_k = P(the rank-0 child at depth k is right | its parent was); the K = 2 tree's depth-1 acceptance gives
the sibling share s = P(the rank-1 child is right | the rank-0 child is wrong) at depth 1. A node's value is
P(the walk reaches it) = the product of its path's rates (rank 0: p_k, rank r >= 1: s_r (1 - p_k)); values
only fall along a path, so the best tree of D - 1 drafted nodes is the D - 1 highest values, and its tau is 1
plus their sum. The same shape every cycle: what per-cycle values add beyond it is what the measured tree
gains over this bound. `--share` overrides s (what-if), `--share2` gives rank-2 children a share too.

    python experiments/dspark/static_tree_bound.py [--budget 8] [--share 0.4]
"""

from __future__ import annotations

import argparse
import heapq
import json

DATASETS = ("gsm8k", "mbpp", "sharegpt", "humaneval")


def best_static_tau(rates: list[float], budget: int, share: float, share2: float = 0.0) -> float:
    """1 + the sum of the `budget - 1` highest node values of the rank-0/1/2 tree over `rates` (p_k per depth)."""
    heap = [(-rates[0], 0), (-share * (1 - rates[0]), 0), (-share2 * (1 - rates[0]), 0)]
    total = 0.0
    for _ in range(budget - 1):
        value, depth = heapq.heappop(heap)
        total -= value
        if depth + 1 < len(rates):
            p = rates[depth + 1]
            for child in (p, share * (1 - p), share2 * (1 - p)):
                heapq.heappush(heap, (value * child, depth + 1))
    return 1.0 + total


def gain(tau: float, chain: float) -> str:
    return f"{round(100 * (tau / chain - 1), 1) + 0.0:+.1f}%"  # + 0.0: no "-0.0%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="?", default="experiments/dspark/heldout.json")
    ap.add_argument("--budget", type=int, default=8, help="verify budget D (root included)")
    ap.add_argument("--share", type=float, default=None, help="sibling share s (default: measured at depth 1)")
    ap.add_argument("--share2", type=float, default=0.0, help="rank-2 share (default 0)")
    args = ap.parse_args()
    records = json.load(open(args.records))
    chain_spec, tree_spec = f"s{args.budget - 1}_k1_d{args.budget}", f"s{args.budget - 1}_k2_d{args.budget}"

    def record(dataset: str, spec: str) -> dict | None:
        return next((r for r in records if r["dataset"] == dataset and r["draft"] == "dspark" and r["spec"] == spec),
                    None)

    print(f"| dataset | chain {chain_spec} tau | tree {tree_spec} tau (measured) | sibling share s | "
          "best static tree tau | static tree over chain | measured tree over chain |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dataset in DATASETS:
        chain, tree = record(dataset, chain_spec), record(dataset, tree_spec)
        if chain is None or tree is None:
            continue
        reach = chain["per_depth_acceptance"]
        rates = [reach[0]] + [reach[k] / reach[k - 1] for k in range(1, len(reach))]
        share = args.share
        if share is None:
            share = (tree["per_depth_acceptance"][0] - reach[0]) / (1 - reach[0])
        bound = best_static_tau(rates, args.budget, share, args.share2)
        print(f"| {dataset} | {chain['tau']:.2f} | {tree['tau']:.2f} | {share:.2f} | {bound:.2f} | "
              f"{gain(bound, chain['tau'])} | {gain(tree['tau'], chain['tau'])} |")


if __name__ == "__main__":
    main()
