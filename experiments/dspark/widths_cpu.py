"""Does a narrower verify pay for a DSpark chain on a CPU? Batch-1 tokens/s of a DSpark chain verified
whole every cycle against the same chain with per-cycle widths (`SpecConfig.widths`: verify only the
nodes whose calibrated path value clears the threshold, in the smallest compiled width holding them),
and AR, end to end.

    python experiments/dspark/widths_cpu.py [--spec s7_k1_d8] [--widths 4:0.1 4:0.3 2.4.6:0.3 4:0.3:both]
        [--datasets gsm8k,mbpp,sharegpt] [--num-prompts 8] [--new-tokens 128] [--repeats 3] [--core 1]
        [--json experiments/dspark/widths_cpu.json]

A width is WIDTHS:THRESHOLD[:VALUES] (the compiled widths below D, dot-separated; VALUES a value
source the draft is calibrated for, default the spec's). Held-out tuning prompts as `jaxspec tune` takes
them, one prompt at a time, every method round-robin over --repeats rounds on one pinned core with a
verdict (`jaxspec.core.measure`); per dataset: x AR (medians summed over the prompts), tau, mean width.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from _common import console, prompt_rounds  # noqa: E402

from jaxspec.core import measure  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    ap.add_argument("--draft", default="dspark")
    ap.add_argument("--spec", default="s7_k1_d8")
    ap.add_argument("--widths", nargs="+", default=["4:0.1", "4:0.3", "2.4.6:0.3", "4:0.3:both"])
    ap.add_argument("--datasets", default="gsm8k,mbpp,sharegpt")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--core", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    measure.pin(args.core)  # before the first jax computation
    out = console()

    import numpy as np

    import jaxspec as js
    from jaxspec.harness.eval import run_batch, tuning_prompts

    ck = js.load_checkpoint(args.checkpoint, draft=args.draft, dtype="float32", cpu_experts=True)
    base = js.SpecConfig.parse(args.spec)
    methods = {"ar": None, args.spec: base}
    for w in args.widths:
        widths, threshold, *values = w.split(":")
        spec = dataclasses.replace(base, widths=tuple(int(x) for x in widths.split(".")) + (base.num_draft_tokens,),
                                   width_threshold=float(threshold), values=values[0] if values else base.values)
        methods[w] = spec
    prompts = tuning_prompts(ck.tokenizer, args.num_prompts, 192, args.datasets.split(","))
    records = []
    for dataset, ps in prompts.items():
        longest = max(len(p) for p in ps)

        def call(method, p, longest=longest):
            return run_batch(ck.params, ck.cfg, methods[method], [p], args.new_tokens, longest_prompt=longest,
                             pad_batch_to=1, draft=ck.draft)

        first, total, verdict = prompt_rounds(methods, ps, call, args.repeats)
        stats = {m: [r["stats"] for r in first[m]] for m in methods}
        rows = {m: {"x_ar": total["ar"] / total[m],
                    "tau": float(np.mean([s["mean_accepted_length"] for s in stats[m]])) if m != "ar" else 1.0,
                    "verified": float(np.mean([s["mean_verified"] for s in stats[m]])) if m != "ar" else 1.0}
                for m in methods}
        records.append({"dataset": dataset, "spec": args.spec, "draft": args.draft, "prompts": len(ps),
                        "new_tokens": args.new_tokens, "methods": rows, "verdict": verdict})
        out.print(f"[bold]{dataset}[/]: {measure.verdict_line(verdict)}")
        for m, row in rows.items():
            out.print(f"  {m:14s} x AR {row['x_ar']:.3f}  tau {row['tau']:.2f}  nodes verified {row['verified']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
