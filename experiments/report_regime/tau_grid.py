"""Greedy tau of specs on held-out prompts, for one draft, at one batch size (records per prompt).

    python experiments/report_regime/tau_grid.py --draft one-step --specs s7_k1_d8,s7_k2_d8 \
        --prompts 32 --new-tokens 64 --batch 64 --out results/report_regime/tau.jsonl

One JSON line per (draft, spec, batch): tau per dataset and overall, per-depth acceptance (P(a cycle
accepts >= d draft tokens)) and the rank histogram per dataset, and per prompt the accepted tokens
and cycles (what gain_ci.py resamples). Prompts run in chunks of --batch rows (one compiled program
per spec); a rerun skips the (draft, spec, batch, prompts, new tokens, datasets) already recorded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATASETS, DRAFTS, append_record, heldout_prompts, load, read_records, tau_of  # noqa: E402

import jaxspec as js  # noqa: E402
from jaxspec.harness.eval import run_batch  # noqa: E402


def key(r: dict) -> tuple:
    return (r["draft"], r["spec"], r["batch"], r["prompts_per_dataset"], r["new_tokens"], tuple(r["datasets"]))


def measure(m, spec, prompts, names, batch, new_tokens) -> dict:
    longest = max(len(p) for p in prompts)
    acc, cyc, hits, ranks = [], [], [], []
    t0 = time.time()
    for start in range(0, len(prompts), batch):
        out = run_batch(m.params, m.cfg, spec, prompts[start : start + batch], new_tokens, longest_prompt=longest,
                        pad_batch_to=batch)
        ps = out["stats"]["per_sequence"]
        acc += ps["accepted"]
        cyc += ps["cycles"]
        hits += ps["depth_hits"]
        ranks += ps["rank_hist"]
    acc, cyc, hits, ranks = map(np.asarray, (acc, cyc, hits, ranks))
    rec = {"tau_all": tau_of(acc, cyc), "seconds": round(time.time() - t0, 1),
           "per_sequence": {"dataset": names.tolist(), "accepted": acc.tolist(), "cycles": cyc.tolist()}}
    for ds in dict.fromkeys(names.tolist()):
        sel = names == ds
        rec[ds] = tau_of(acc[sel], cyc[sel])
        rec[f"{ds}_per_depth"] = (hits[sel].sum(0) / max(cyc[sel].sum(), 1)).tolist()
        rec[f"{ds}_rank_hist"] = ranks[sel].sum(0).tolist()
        rec[f"{ds}_cycles"] = int(cyc[sel].sum())
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", choices=DRAFTS, required=True)
    p.add_argument("--specs", required=True, help="comma-separated sS_kK_dD names")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts per dataset")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated; humaneval too")
    p.add_argument("--out", default="results/report_regime/tau.jsonl")
    args = p.parse_args()
    datasets = args.datasets.split(",")
    m = load(args.draft)
    prompts, names = heldout_prompts(m.tokenizer, args.prompts, datasets)
    done = {key(r) for r in read_records(args.out)}
    for name in args.specs.split(","):
        spec = js.SpecConfig.parse(name)
        head = {"draft": args.draft, "spec": spec.name, "D": spec.num_draft_tokens, "S": spec.num_steps,
                "K": spec.topk, "batch": args.batch, "prompts_per_dataset": args.prompts,
                "new_tokens": args.new_tokens, "datasets": datasets}
        if key(head) in done:
            print(f"skip {name} (recorded)", flush=True)
            continue
        rec = {**head, **measure(m, spec, prompts, names, args.batch, args.new_tokens)}
        print(f"{args.draft} {name} batch {args.batch}: tau {rec['tau_all']:.3f} "
              + " ".join(f"{ds} {rec[ds]:.3f}" for ds in datasets) + f" ({rec['seconds']} s)", flush=True)
        append_record(args.out, rec)


if __name__ == "__main__":
    main()
