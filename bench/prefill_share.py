"""Where a batch-1 generation's time goes: the prompt's prefill against the decode, AR against speculation.

    python bench/prefill_share.py [--checkpoint checkpoints/tiny-v4] [--runs default:s3_k1_d4 dspark:s5_k1_d6 ...]
                                  [--num-prompts 8] [--new-tokens 128] [--repeats 3] [--core 1] [--json PATH]

Per dataset (held-out tuning prompts, as `jaxspec tune` takes them: at most 192 tokens, padded to the
dataset's longest), one prompt at a time: `generate` of 1 token (the prefill and one step), `generate` of
--new-tokens, and `speculative_generate` of each draft:spec, round-robin over --repeats rounds on one
pinned core with a verdict (`jaxspec.core.measure`). Printed: prefill ms per prompt, tok/s, x AR end to end,
and x AR of the decode alone (each method's time less the 1-token run's).
"""

from __future__ import annotations

import argparse
import json

from _common import console, prompt_rounds

from jaxspec.core import measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    ap.add_argument("--runs", nargs="+", default=["default:s3_k1_d4", "dspark:s5_k1_d6", "dspark:s3_k1_d4"],
                    help="draft:spec pairs (draft: 'default' or a drafts/<name>/ of the checkpoint)")
    ap.add_argument("--datasets", default="gsm8k,mbpp,sharegpt")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--core", type=int, default=None, help="pin to this core (default: the last allowed)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    measure.pin(args.core)  # before the first jax computation
    out = console()

    import numpy as np

    import jaxspec as js
    from jaxspec.harness.eval import run_batch, tuning_prompts

    drafts = {}
    for run in args.runs:
        name = run.split(":")[0]
        if name not in drafts:
            drafts[name] = js.load_checkpoint(args.checkpoint, draft=None if name == "default" else name,
                                              dtype="float32", cpu_experts=True)
    ck = next(iter(drafts.values()))
    prompts = tuning_prompts(ck.tokenizer, args.num_prompts, 192, args.datasets.split(","))
    methods = {"prefill+1": (None, 1, None), "ar": (None, args.new_tokens, None)}
    for run in args.runs:
        name, spec = run.split(":")
        methods[run] = (js.SpecConfig.parse(spec), args.new_tokens, drafts[name].draft)
    records = []
    for dataset, ps in prompts.items():
        longest = max(len(p) for p in ps)

        def call(method, p, longest=longest):
            spec, n, draft = methods[method]
            return run_batch(ck.params, ck.cfg, spec, [p], n, longest_prompt=longest, pad_batch_to=1, draft=draft)

        first, total, verdict = prompt_rounds(methods, ps, call, args.repeats)
        taus = {m: [r["stats"]["mean_accepted_length"] for r in first[m]] for m in methods}
        generated = args.new_tokens * len(ps)
        prefill = total["prefill+1"]
        rows = {m: {"tokens_per_s": generated / total[m], "x_ar": total["ar"] / total[m],
                    "x_ar_decode": (total["ar"] - prefill) / (total[m] - prefill), "tau": float(np.mean(taus[m]))}
                for m in methods if m != "prefill+1"}
        record = {"dataset": dataset, "prompt_lengths": [len(p) for p in ps], "padded_to": longest,
                  "prefill_ms_per_prompt": 1e3 * prefill / len(ps), "methods": rows, "verdict": verdict}
        records.append(record)
        out.print(f"[bold]{dataset}[/] (prompts padded to {longest}): prefill + 1 step "
                      f"{record['prefill_ms_per_prompt']:.1f} ms a prompt; {measure.verdict_line(verdict)}")
        for m, row in rows.items():
            out.print(f"  {m:18s} {row['tokens_per_s']:6.0f} tok/s  x AR {row['x_ar']:.2f}  "
                          f"decode alone x AR {row['x_ar_decode']:.2f}  tau {row['tau']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
