"""Held-out greedy tau: chain vs raw-ranked vs calibrated trees (one process, one batch of prompts).

    python experiments/calibration/tau.py SPEC:SCORES[,...] PROMPTS_PER_DATASET NEW_TOKENS OUT.jsonl
"""
import argparse
import json
import sys
import time

import numpy as np

import jaxspec as js
from jaxspec.cli.common import load_model
from jaxspec.harness.eval import encode_prompts
from jaxspec.speculation.values import CONTEXT_CAP
from jaxspec.training.data import HELDOUT_SPLITS, load_dataset

DATASETS = ("gsm8k", "mbpp", "sharegpt")


def load_shipped():
    return load_model(argparse.Namespace(checkpoint="checkpoints/tiny-v4", preset=None), None, need_tokenizer="x")


def heldout_prompts(m, n):
    """-> (prompts, dataset name per prompt): the first n test-split prompts of each dataset."""
    prompts, names = [], []
    for ds in DATASETS:
        ex = load_dataset(ds, HELDOUT_SPLITS[ds])[:n]
        prompts += encode_prompts(m.tokenizer, ex, 192)
        names += [ds] * len(ex)
    return prompts, np.asarray(names)


def measure(m, prompts, names, spec, new, calibration=None):
    """-> {tau_all, tau per dataset, seconds} of one greedy speculative_generate over the batch."""
    t = time.time()
    out = js.speculative_generate(m.params, m.cfg, prompts, spec, max_new_tokens=new, calibration=calibration)
    ps = out.stats["per_sequence"]
    acc, cyc = np.asarray(ps["accepted"]), np.asarray(ps["cycles"])
    rec = {"scores": out.stats["scores"], "tau_all": float((acc.sum() + cyc.sum()) / cyc.sum()),
           "seconds": time.time() - t,
           # per prompt, in prompt order: what gain_ci.py resamples for a confidence interval
           "per_sequence": {"dataset": names.tolist(), "accepted": acc.tolist(), "cycles": cyc.tolist()}}
    for ds in DATASETS:
        sel = names == ds
        rec[ds] = float((acc[sel].sum() + cyc[sel].sum()) / cyc[sel].sum())
    return rec


def main():
    specs = sys.argv[1].split(",")
    n, new, out_path = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    m = load_shipped()
    prompts, names = heldout_prompts(m, n)
    for name in specs:
        spec_name, scores = name.split(":")
        s = js.SpecConfig.parse(spec_name)
        spec = js.SpecConfig(s.num_steps, s.topk, s.num_draft_tokens, scores)
        rec = {"spec": spec_name, "D": s.num_draft_tokens, "prompts_per_dataset": n, "new_tokens": new,
               **measure(m, prompts, names, spec, new)}
        if rec["scores"] == "calibrated":  # which greedy values ranked it (generate.loop_context)
            rec["values"] = "per-context" if s.num_steps >= CONTEXT_CAP else "pooled"
        print(json.dumps(rec), flush=True)
        with open(out_path, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
