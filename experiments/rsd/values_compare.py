"""Table of results/rsd/tau_values*.jsonl: tau, its standard error over prompts, per dataset, and each
tree's difference to the chain (K = 1) of the same D, temperature and seed with the standard error of
that difference (prompt-paired linearisation of the two ratio estimators).

    python experiments/rsd/values_compare.py results/rsd/tau_values.jsonl [more.jsonl ...]
"""
import json
import sys

import numpy as np


def linearised(r):
    a, c = (np.asarray(r["per_sequence"][k], np.float64) for k in ("accepted", "cycles"))
    return (a + c - r["tau"] * c) / c.sum()


records = [json.loads(line) for path in sys.argv[1:] for line in open(path) if line.strip()]
def d_of(r):
    return int(r["spec"].split("_d")[1])


chains = {(d_of(r), r["temperature"], r.get("seed", 0)): r for r in records if "_k1_" in r["spec"]}
print("| spec | values | T | seed | tau | se | gsm8k | mbpp | sharegpt | accepted by rank | tree - chain (se) |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
for r in sorted(records, key=lambda r: (-r["temperature"], r["spec"], str(r.get("calibration")), r.get("seed", 0))):
    chain = chains.get((d_of(r), r["temperature"], r.get("seed", 0)))
    diff = ""
    if chain is not None and r is not chain:
        e = linearised(r) - linearised(chain)
        n = len(e)
        diff = f"{r['tau'] - chain['tau']:+.3f} ({np.sqrt(n / (n - 1) * np.sum(e**2)):.3f})"
    names = {None: "prior", "results/rsd/residual_values.json": "residual top-1"}
    values = names.get(r.get("calibration"), "residual exp(-H)")
    d = r["tau_by_dataset"]
    print(f"| {r['spec']} | {values} | {r['temperature']} | {r.get('seed', 0)} | {r['tau']:.3f} | {r['tau_se']:.3f} | "
          f"{d['gsm8k']:.2f} | {d['mbpp']:.2f} | {d['sharegpt']:.2f} | {r['rank_histogram']} | {diff} |")
for d, t in sorted({k[:2] for k in chains}, reverse=True):
    taus = [chains[k]["tau"] for k in chains if k[:2] == (d, t)]
    if len(taus) > 1:
        print(f"chain D={d} T={t}: seeds {len(taus)}, mean {np.mean(taus):.3f}, sd {np.std(taus, ddof=1):.3f}")
