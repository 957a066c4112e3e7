"""Tokens/s of AR and of each (draft, spec), end to end, timed round-robin in one pinned process
(jaxspec/core/measure.py), per batch size; the verdict on the machine beside the ratios.

    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false python experiments/report_regime/throughput.py \
        --pairs default:s7_k1_d8,one-step:s7_k1_d8,one-step:s3_k4_d8,one-step:s4_k1_d5,one-step:s4_k2_d5 \
        --batches 1,4,16,64 --new-tokens 64 --repeats 3 --core 1 --out results/report_regime/throughput.json

For each batch size: the first B held-out prompts (GSM8K / MBPP / ShareGPT in turn), every method
compiled and run once before the timed rounds; tokens/s = generated tokens / median seconds of a
call; x AR from the same rounds. The lead's measurement: a LOADED verdict means the ratios are not
a clean figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", required=True, help="comma-separated DRAFT:SPEC (DRAFT: default | one-step)")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--core", type=int, default=None, help="core to pin to (default: the last allowed)")
    p.add_argument("--out", default="results/report_regime/throughput.json")
    args = p.parse_args()

    from jaxspec.core import measure

    pinned = measure.pin(args.core)  # before the first computation: XLA reads its flags at backend start
    import jax
    from common import DATASETS, heldout_prompts, load

    import jaxspec as js

    pairs = [tuple(x.split(":")) for x in args.pairs.split(",")]
    models = {d: load(d) for d in dict.fromkeys(d for d, _ in pairs)}
    base = next(iter(models.values()))
    n = max(int(b) for b in args.batches.split(","))
    per = -(-n // len(DATASETS))
    prompts, _ = heldout_prompts(base.tokenizer, per, DATASETS)
    order = [i for k in range(per) for i in range(k, len(prompts), per)]  # datasets in turn
    prompts = [prompts[i] for i in order]
    results = {"pinned": pinned, "pairs": [":".join(x) for x in pairs], "new_tokens": args.new_tokens,
               "repeats": args.repeats, "batches": []}
    for b in (int(x) for x in args.batches.split(",")):
        batch = prompts[:b]
        calls = {"ar": lambda batch=batch: js.generate(base.params, base.cfg, batch,
                                                       max_new_tokens=args.new_tokens).tokens}
        taus = {}
        for draft, name in pairs:
            m = models[draft]
            calls[f"{draft}:{name}"] = (lambda m=m, name=name, batch=batch: js.speculative_generate(
                m.params, m.cfg, batch, name, max_new_tokens=args.new_tokens).tokens)
            taus[f"{draft}:{name}"] = js.speculative_generate(
                m.params, m.cfg, batch, name, max_new_tokens=args.new_tokens).stats["mean_accepted_length"]
        for call in calls.values():  # compile + warm
            jax.block_until_ready(call())
        with measure.Watch() as watch:
            timings = measure.round_robin(calls, args.repeats)
        verdict = watch.verdict(timings["ar"])
        tokens = b * args.new_tokens
        ar = timings["ar"].median
        row = {"batch": b, "verdict": verdict, "methods": {
            k: {"tokens_per_s": tokens / t.median, "x_ar": ar / t.median, "spread": t.spread, "tau": taus.get(k),
                "seconds": list(t.seconds)} for k, t in timings.items()}}
        results["batches"].append(row)
        print(f"batch {b}: " + measure.verdict_line(verdict).replace("[green]", "").replace("[/]", "")
              .replace("[bold red]", ""), flush=True)
        for k, v in row["methods"].items():
            tau = "" if v["tau"] is None else f" tau {v['tau']:.2f}"
            print(f"  {k:24s} {v['tokens_per_s']:8.1f} tok/s  {v['x_ar']:.2f}x AR  spread "
                  f"{100 * v['spread']:.0f}%{tau}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
