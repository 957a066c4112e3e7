"""Held-out acceptance of the DSpark drafter beside the distilled MTP draft (greedy, float32).

For each dataset's held-out split (GSM8K test, MBPP test, ShareGPT test), the first --num-prompts
prompts (at most --max-prompt-tokens tokens each) decode --new-tokens tokens with each (draft, spec);
the record holds tau (tokens per cycle, bonus included) and the per-position acceptance (P(the cycle's
accepted path reaches depth k)). With --exact N, the first N prompts' greedy outputs are checked
against `generate` for every (draft, spec). --calibration FILE ranks the runs whose value source is the
file's (`_vc` specs by a confidence calibration, `_vb` by a "both" one) by it instead of the draft folder's.
Every sequence decodes --new-tokens tokens past any end-of-text token (the benchmarks' convention), or
with --stop-at-eos stops after it, so that only the answer to the prompt is counted.

    PYTHONPATH=. JAXSPEC_DATA=/work/shared/data XLA_FLAGS=--xla_cpu_multi_thread_eigen=false \
      taskset -c 0 python experiments/dspark/heldout_acceptance.py --out experiments/dspark/heldout.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import jaxspec as js
from jaxspec.harness.eval import encode_prompts
from jaxspec.speculation.generate import summarize_stats
from jaxspec.speculation.values import load_calibration
from jaxspec.training.data import HELDOUT_SPLITS, load_dataset

RUNS = (("default", "s7_k1_d8"), ("dspark", "s7_k1_d8"), ("dspark", "s7_k2_d8"), ("dspark", "s7_k2_d8_vc"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    ap.add_argument("--datasets", default="gsm8k,mbpp,sharegpt")
    ap.add_argument("--runs", default=",".join(f"{d}:{s}" for d, s in RUNS), help="draft:spec,...")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--offset", type=int, default=0, help="skip this many prompts of each held-out split first")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--exact", type=int, default=4, help="prompts per dataset checked against generate")
    ap.add_argument("--out", default="experiments/dspark/heldout.json")
    ap.add_argument("--calibration", default=None, help="calibration.json for the runs of its value source")
    ap.add_argument("--stop-at-eos", action="store_true", help="stop each sequence after its end-of-text token")
    args = ap.parse_args()
    runs = [tuple(r.split(":")) for r in args.runs.split(",")]
    drafts = {name: js.load_checkpoint(args.checkpoint, draft=name, dtype="float32") for name in {d for d, _ in runs}}
    ck = next(iter(drafts.values()))
    eos = ck.cfg.eos_id if args.stop_at_eos else None
    calibration = None if args.calibration is None else load_calibration(args.calibration)
    records = json.load(open(args.out)) if os.path.isfile(args.out) else []
    done = {(r["dataset"], r["draft"], r["spec"]) for r in records}
    for dataset in args.datasets.split(","):
        examples = load_dataset(dataset, HELDOUT_SPLITS[dataset])[args.offset : args.offset + args.num_prompts]
        prompts = encode_prompts(ck.tokenizer, examples, args.max_prompt_tokens)
        reference = None
        for name, spec in runs:
            if (dataset, name, spec) in done:
                continue
            draft = drafts[name].draft
            t0 = time.time()
            sums = None
            tokens = []
            for start in range(0, len(prompts), args.batch):
                mine = calibration is not None and js.SpecConfig.parse(spec).values == calibration.feature
                out = js.speculative_generate(ck.params, ck.cfg, prompts[start : start + args.batch], spec,
                                              max_new_tokens=args.new_tokens, draft=draft, eos_id=eos,
                                              calibration=args.calibration if mine else None)
                per = {k: np.asarray(v) for k, v in out.stats["per_sequence"].items()
                       if k in ("cycles", "accepted", "verified", "depth_hits", "rank_hist")}
                sums = per if sums is None else {k: np.concatenate([sums[k], per[k]]) for k in per}
                tokens += [np.asarray(out.tokens[i, : int(out.lengths[i])]).tolist() for i in range(len(out.lengths))]
            stats = summarize_stats(sums, spec, 0, None)
            if args.exact:
                if reference is None:
                    ref = js.generate(ck.params, ck.cfg, prompts[: args.exact], max_new_tokens=args.new_tokens,
                                      eos_id=eos)
                    reference = [np.asarray(ref.tokens[i, : int(ref.lengths[i])]).tolist()
                                 for i in range(args.exact)]
                exact = [tokens[i] == reference[i] for i in range(args.exact)]
            rec = {"dataset": dataset, "draft": name, "spec": spec, "num_prompts": len(prompts),
                   **({"offset": args.offset} if args.offset else {}),
                   "new_tokens": args.new_tokens, "stop_at_eos": args.stop_at_eos,
                   "tokens": sum(map(len, tokens)), "tau": stats["mean_accepted_length"],
                   "per_depth_acceptance": stats["per_depth_acceptance"], "cycles": stats["cycles"],
                   "rank_histogram": stats["rank_histogram"], "exact_vs_generate": exact if args.exact else None,
                   **({"calibration": args.calibration} if mine else {}),
                   "wall_s": round(time.time() - t0, 1)}
            print(json.dumps({k: v for k, v in rec.items()}), flush=True)
            records.append(rec)
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
