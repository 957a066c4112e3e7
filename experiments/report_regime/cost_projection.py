"""Tree over chain throughput projected on 8 x H200 by the cost model (docs/cost_model.md,
"Projection tables"), with each draft's measured greedy tau (table1.json of report.py).

    python experiments/report_regime/cost_projection.py [--model v4-flash] [--mesh 1,8,1] \
        [--table results/report_regime/table1.json] [--out results/report_regime/projection.md]

Per draft, budget D and batch: the matched chain and the best calibrated tree (mean tau over
GSM8K / MBPP / ShareGPT, measured on the tiny target: a tiny draft's acceptance on V4's projected
cycle times, not a V4 draft's), their projected cycle (weights as released: FP8, FP4 experts;
`even` layout, context 4096, independent routing), speedup over AR (tau x AR step / cycle) and the
tree's throughput over the chain's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.cost import latency
from jaxspec.cost.project import row
from jaxspec.cost.terms import Setup

MAIN = ("gsm8k", "mbpp", "sharegpt")
LABEL = {"default": "distilled", "one-step": "one-step"}


def cycle_seconds(cfg, spec, batch, mesh, context):
    s = Setup(cfg, mesh, batch, context, "fp8", "fp4", 0.0, "even")
    return row(s, spec, latency.hardware("h200"), latency.H200).step_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="v4-flash")
    p.add_argument("--mesh", default="1,8,1")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--table", default="results/report_regime/table1.json")
    p.add_argument("--out", default="results/report_regime/projection.md")
    args = p.parse_args()
    cfg = ModelConfig.preset(args.model)
    mesh = tuple(int(x) for x in args.mesh.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    table = json.loads(Path(args.table).read_text())
    lines = [f"{args.model} on {mesh} x H200 (cost model), context {args.context}; tau = measured mean over "
             "GSM8K / MBPP / ShareGPT on the tiny target", "",
             "| draft | D | chain (tau) | tree (tau) | batch | AR ms | chain cycle ms | tree cycle ms | chain x AR "
             "| tree x AR | tree over chain |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    out = []
    for draft, rows in table.items():
        if "/" in draft:
            continue
        for r in rows:
            chain, tree = SpecConfig.parse(r["chain"]), SpecConfig.parse(r["tree"])
            tau_c = float(np.mean([r[f"chain_{ds}"] for ds in MAIN]))
            tau_t = float(np.mean([r[f"tree_{ds}"] for ds in MAIN]))
            for b in batches:
                ar = cycle_seconds(cfg, None, b, mesh, args.context)
                cc = cycle_seconds(cfg, chain, b, mesh, args.context)
                ct = cycle_seconds(cfg, tree, b, mesh, args.context)
                sc, st = tau_c * ar / cc, tau_t * ar / ct
                out.append({"draft": draft, "D": r["D"], "chain": chain.name, "tree": tree.name, "batch": b,
                            "tau_chain": tau_c, "tau_tree": tau_t, "ar_ms": 1e3 * ar, "chain_ms": 1e3 * cc,
                            "tree_ms": 1e3 * ct, "chain_speedup": sc, "tree_speedup": st, "tree_over_chain": st / sc})
                lines.append(f"| {LABEL[draft]} | {r['D']} | {chain.name} ({tau_c:.2f}) | {tree.name} ({tau_t:.2f}) | "
                             f"{b} | {1e3 * ar:.2f} | {1e3 * cc:.2f} | {1e3 * ct:.2f} | {sc:.2f}x | {st:.2f}x | "
                             f"{100 * (st / sc - 1):+.1f}% |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
