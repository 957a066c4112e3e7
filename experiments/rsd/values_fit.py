"""Fit residual node values (jaxspec/harness/calibrate_residual.py) for the shipped checkpoint on train-split
prompts at T = 1.0 and 0.6; write them, with the shipped greedy / sampling maps unchanged, to
results/rsd/residual_values.json (docs/sampling_values.md). Samples go to /tmp for inspection.

    JAXSPEC_DATA=/work/shared/data python experiments/rsd/values_fit.py [PROMPTS_PER_DATASET] [--refit]

--refit fits again from the samples a previous run left in /tmp (no model runs).
"""
import argparse
import json
import sys
import time

import numpy as np

from jaxspec.cli.common import load_model
from jaxspec.harness.calibrate_residual import collect_residual, fit_residual, with_residual
from jaxspec.harness.eval import encode_prompts
from jaxspec.speculation.values import load_calibration
from jaxspec.training.data import TRAIN_SPLITS, load_dataset

DATASETS = ("gsm8k", "mbpp", "sharegpt")
args = [a for a in sys.argv[1:] if a != "--refit"]
refit = "--refit" in sys.argv
n = int(args[0]) if args else 32
m = load_model(argparse.Namespace(checkpoint="checkpoints/tiny-v4", preset=None), None, need_tokenizer="x")
train = []
for ds in DATASETS:
    train += encode_prompts(m.tokenizer, load_dataset(ds, TRAIN_SPLITS[ds])[:n], 192)
maps = []
for t in (1.0, 0.6):
    t0 = time.time()
    if refit:
        s = dict(np.load(f"/tmp/exp21_samples_t{t}.npz"))
    else:
        s = collect_residual(m.params, m.cfg, train, t, cycles=12, batch_size=48, num_steps=10, topk=4, replays=8,
                             draft=m.draft)
        np.savez(f"/tmp/exp21_samples_t{t}.npz", **s)
    mp = fit_residual(s, t)
    maps.append(mp)
    tab = mp.array()
    print(json.dumps({"T": t, "samples": int(s["label"].size), "seconds": round(time.time() - t0),
                      "mean_label_by_rank": [round(float(s["label"][s["rank"] == r].mean()), 4) for r in range(4)],
                      "top1_percentiles_10_50_90": np.percentile(s["parent_top1"], [10, 50, 90]).round(3).tolist()}),
          flush=True)
    for d in range(tab.shape[0]):
        print(f"  depth bin {d} rank0", tab[d, 0].round(2).tolist())
        print("              rank1", tab[d, 1].round(2).tolist())
shipped = load_calibration("checkpoints/tiny-v4")
out = with_residual(shipped, maps)
out.save("results/rsd/residual_values.json")
print("wrote results/rsd/residual_values.json")
