"""Batch-1 greedy tokens/s of fixed-width trees vs per-cycle widths vs AR, held-out prompts cut to
their last 48 tokens (docs/calibration.md, "Width chosen per cycle"). One process: every method
runs once on every prompt first (compiles), then the timed pass goes over the prompts one by one,
methods round-robin per prompt (load changes hit all alike).

    python experiments/widths/batch1.py PROMPTS_PER_DATASET NEW_TOKENS OUT.jsonl SPEC[:THRESHOLD] ...
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

import jaxspec as js

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "calibration"))
from tau import heldout_prompts, load_shipped  # noqa: E402

PROMPT_TOKENS = 48  # each prompt's last 48 tokens at most
n, new, out_path, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
m = load_shipped()
cfg, params = m.cfg, m.params  # float32 on a CPU (load_model casts)
prompts, datasets = heldout_prompts(m, n)
prompts = [p[-PROMPT_TOKENS:] for p in prompts]


def spec_of(name):
    spec_name, _, threshold = name.partition(":")
    spec = js.SpecConfig.parse(spec_name)
    if threshold:
        spec = js.SpecConfig(spec.num_steps, spec.topk, spec.num_draft_tokens, widths=spec.widths,
                             width_threshold=float(threshold))
    return spec


methods = {"ar": None, **{name: spec_of(name) for name in names}}


def run(spec, prompt):
    if spec is None:
        return js.generate(params, cfg, [prompt], max_new_tokens=new)
    return js.speculative_generate(params, cfg, [prompt], spec, max_new_tokens=new)


for spec in methods.values():  # compile every length bucket the prompts fall in, untimed
    for prompt in prompts:
        run(spec, prompt)
seconds = {k: 0.0 for k in methods}
stats = {k: [] for k in methods}
for prompt in prompts:
    for key, spec in methods.items():
        t = time.perf_counter()
        out = run(spec, prompt)
        np.asarray(out.tokens)
        seconds[key] += time.perf_counter() - t
        stats[key].append(out.stats)
for key in methods:
    rec = {"method": key, "prompts": len(prompts), "new_tokens": new, "seconds": seconds[key],
           "tokens_per_s": len(prompts) * new / seconds[key], "x_ar": seconds["ar"] / seconds[key]}
    if key != "ar":
        st = stats[key]
        cycles = sum(s["cycles"] for s in st)
        rec |= {"tau": sum(s["mean_accepted_length"] * s["cycles"] for s in st) / cycles,
                "mean_verified": sum(s["mean_verified"] * s["cycles"] for s in st) / cycles,
                "threshold": methods[key].width_threshold if methods[key].widths else None}
    print(json.dumps(rec), flush=True)
    with open(out_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
