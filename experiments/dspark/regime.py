"""A DSpark drafter against the acceptance DeepSeek's own drafter has (docs/dspark.md, "In DeepSeek's regime").

Reads `heldout_acceptance.py` records and sets the block's full chain (5 drafts: s5_k1_d6) of each named draft
beside V4-Flash-0731's published per-position reach (vLLM, greedy: 0.579 / 0.447 / 0.316 / 0.237 / 0.158,
accepted length 2.74): per dataset, the mean of GSM8K / MBPP / ShareGPT, the difference per position, and
the issue's bars (mean accepted length 2.74 +- 0.35, position 1 reached 0.48-0.68 of the cycles).

    python experiments/dspark/regime.py experiments/dspark/heldout_regime.json --drafts dspark-regime
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from cost_projection import MEAN_OVER  # run as a script: its folder is on the path
from cost_projection import PER_POSITION as RELEASE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--drafts", default="dspark-regime", help="comma-separated draft names")
    ap.add_argument("--spec", default="s5_k1_d6", help="the block's full chain")
    args = ap.parse_args()
    records = json.load(open(args.path))
    release_tau = 1 + sum(RELEASE)
    print(f"| draft | dataset | tau | P(reach k), k = 1..{len(RELEASE)} |")
    print("|---|---|---:|---|")
    print(f"| V4-Flash-0731 (vLLM) | - | {release_tau:.2f} | " + " / ".join(f"{r:.3f}" for r in RELEASE) + " |")
    for draft in args.drafts.split(","):
        rows = {r["dataset"]: r for r in records if r["draft"] == draft and r["spec"] == args.spec}
        for name in [d for d in MEAN_OVER if d in rows] + sorted(set(rows) - set(MEAN_OVER)):
            r = rows[name]
            print(f"| {draft} | {name} | {r['tau']:.2f} | "
                  + " / ".join(f"{a:.3f}" for a in r["per_depth_acceptance"]) + " |")
        if not all(d in rows for d in MEAN_OVER):
            continue
        reach = np.mean([rows[d]["per_depth_acceptance"][: len(RELEASE)] for d in MEAN_OVER], axis=0)
        tau = float(np.mean([rows[d]["tau"] for d in MEAN_OVER]))
        diff = reach - np.asarray(RELEASE)
        print(f"| {draft} | mean of three | {tau:.2f} | " + " / ".join(f"{a:.3f}" for a in reach) + " |")
        print(f"| {draft} | minus the release | {tau - release_tau:+.2f} | "
              + " / ".join(f"{a:+.3f}" for a in diff) + " |")
        bars = {"tau within 2.74 +- 0.35": abs(tau - release_tau) <= 0.35,
                "position 1 in 0.48-0.68": 0.48 <= reach[0] <= 0.68,
                "every position within +-0.05": bool(np.all(np.abs(diff) <= 0.05))}
        print(f"\n{draft}: " + "; ".join(f"{k}: {'yes' if v else 'no'}" for k, v in bars.items()) + "\n")


if __name__ == "__main__":
    main()
