"""Held-out greedy tau: chain vs raw-ranked vs calibrated trees (one process, one batch of prompts)."""
import json, sys, time
import numpy as np
import argparse
from jaxspec.cli.common import load_model
from jaxspec.data import HELDOUT_SPLITS, load_dataset
from jaxspec.eval import encode_prompts
import jaxspec as js

specs = sys.argv[1].split(",")
n, new = int(sys.argv[2]), int(sys.argv[3])
out_path = sys.argv[4]
m = load_model(argparse.Namespace(checkpoint="checkpoints/tiny-v4", preset=None), None, need_tokenizer="x")
prompts, names = [], []
for ds in ("gsm8k", "mbpp", "sharegpt"):
    ex = load_dataset(ds, HELDOUT_SPLITS[ds])[:n]
    prompts += encode_prompts(m.tokenizer, ex, 192)
    names += [ds] * len(ex)
names = np.asarray(names)
for name in specs:
    spec_name, scores = name.split(":")
    s = js.SpecConfig.parse(spec_name)
    spec = js.SpecConfig(s.num_steps, s.topk, s.num_draft_tokens, scores)
    t = time.time()
    out = js.speculative_generate(m.params, m.cfg, prompts, spec, max_new_tokens=new)
    ps = out.stats["per_sequence"]
    acc, cyc = np.asarray(ps["accepted"]), np.asarray(ps["cycles"])
    rec = {"spec": spec_name, "scores": out.stats["scores"], "D": s.num_draft_tokens, "prompts_per_dataset": n,
           "new_tokens": new, "tau_all": float((acc.sum() + cyc.sum()) / cyc.sum()), "seconds": time.time() - t}
    for ds in ("gsm8k", "mbpp", "sharegpt"):
        sel = names == ds
        rec[ds] = float((acc[sel].sum() + cyc[sel].sum()) / cyc[sel].sum())
    print(json.dumps(rec), flush=True)
    with open(out_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
