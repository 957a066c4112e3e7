"""Does the block rule's extra pass cost anything end to end? Batch-1 tokens/s of sampled speculation under
the block rule and the token rule (`accept="residual"`), the same drafts, beside AR sampling at the same
settings, on one pinned core with a verdict (`jaxspec.core.measure`).

    python experiments/block/speed_cpu.py [--specs s4_k1_d5 s7_k1_d8] [--temperature 0.6] [--top-p 1.0]
        [--datasets gsm8k,mbpp,sharegpt] [--num-prompts 4] [--new-tokens 96] [--repeats 3] [--core 0]
        [--json results/block/speed_cpu.json]

Held-out tuning prompts as `jaxspec tune` takes them, one prompt at a time, every method round-robin over
--repeats rounds (`bench/_common.prompt_rounds`); per dataset: x AR (medians summed over the prompts) and tau.
Every run of a method samples with the same seed, so its rounds time the same draws.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from _common import console, prompt_rounds  # noqa: E402

from jaxspec.core import measure  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    ap.add_argument("--specs", nargs="+", default=["s4_k1_d5", "s7_k1_d8"])
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--datasets", default="gsm8k,mbpp,sharegpt")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--core", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    measure.pin(args.core)  # before the first jax computation
    out = console()

    import numpy as np

    import jaxspec as js
    from jaxspec.harness.eval import Sampled, run_batch, tuning_prompts

    ck = js.load_checkpoint(args.checkpoint, dtype="float32", cpu_experts=True)
    methods = {"ar": (None, Sampled(args.temperature, args.top_p))}
    for spec in args.specs:
        for rule in ("block", "residual"):
            methods[f"{spec}/{rule}"] = (js.SpecConfig.parse(spec), Sampled(args.temperature, args.top_p, rule))
    prompts = tuning_prompts(ck.tokenizer, args.num_prompts, 192, args.datasets.split(","))
    records = []
    for dataset, ps in prompts.items():
        longest = max(len(p) for p in ps)

        def call(method, p, longest=longest):
            spec, sampling = methods[method]
            return run_batch(ck.params, ck.cfg, spec, [p], args.new_tokens, longest_prompt=longest, pad_batch_to=1,
                             draft=ck.draft, sampling=sampling)

        first, total, verdict = prompt_rounds(methods, ps, call, args.repeats)
        rows = {m: {"x_ar": total["ar"] / total[m],
                    "tau": float(np.mean([r["stats"]["mean_accepted_length"] for r in first[m]])) if m != "ar" else 1.0}
                for m in methods}
        records.append({"dataset": dataset, "temperature": args.temperature, "top_p": args.top_p,
                        "prompts": len(ps), "new_tokens": args.new_tokens, "methods": rows, "verdict": verdict,
                        "ar_tokens_per_s": sum(int(r["lengths"].sum()) for r in first["ar"]) / total["ar"]})
        out.print(f"[bold]{dataset}[/]: {measure.verdict_line(verdict)}")
        for m, row in rows.items():
            out.print(f"  {m:20s} x AR {row['x_ar']:.3f}  tau {row['tau']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
