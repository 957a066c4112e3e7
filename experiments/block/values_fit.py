"""Fit block node values (jaxspec/harness/calibrate_block.py) for the shipped checkpoint on train-split
prompts at T = 1.0 and 0.6 and write them into its calibration beside the greedy and sampling maps, which
stay as they are (docs/block_verification.md §4).

    JAXSPEC_DATA=../shared/data python experiments/block/values_fit.py [--prompts 32] [--out FILE]
"""

import argparse
import json
import time

import numpy as np

from jaxspec.cli.common import load_model
from jaxspec.harness.calibrate_block import collect_block, fit_block, with_block
from jaxspec.harness.eval import encode_prompts
from jaxspec.speculation.values import load_calibration
from jaxspec.training.data import TRAIN_SPLITS, load_dataset

DATASETS = ("gsm8k", "mbpp", "sharegpt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    p.add_argument("--prompts", type=int, default=32, help="train-split prompts per dataset")
    p.add_argument("--temperatures", default="1.0,0.6")
    p.add_argument("--steps", type=int, default=10, help="chain depth drafted per cycle")
    p.add_argument("--out", default=None, help="calibration file (default: the checkpoint's calibration.json)")
    args = p.parse_args()
    m = load_model(argparse.Namespace(checkpoint=args.checkpoint, preset=None), None, need_tokenizer="x")
    train = []
    for ds in DATASETS:
        train += encode_prompts(m.tokenizer, load_dataset(ds, TRAIN_SPLITS[ds])[: args.prompts], 192)
    maps = []
    for t in (float(x) for x in args.temperatures.split(",")):
        t0 = time.time()
        s = collect_block(m.params, m.cfg, train, t, cycles=12, batch_size=48, num_steps=args.steps, topk=4, replays=8,
                          draft=m.draft)
        fitted = fit_block(s, t)
        maps.append(fitted)
        table = fitted.array()
        by_rank = [float(np.sum((s["label"] * s["weight"])[s["rank"] == r]) / np.sum(s["weight"][s["rank"] == r]))
                   for r in range(4)]
        print(json.dumps({"T": t, "samples": int(s["label"].size), "seconds": round(time.time() - t0),
                          "value_by_rank": [round(v, 4) for v in by_rank]}), flush=True)
        for d in range(table.shape[0]):
            print(f"  depth bin {d} rank0", table[d, 0].round(2).tolist())
            print("              rank1", table[d, 1].round(2).tolist())
    shipped = load_calibration(args.checkpoint)
    out = with_block(shipped, maps)
    meta = dict(out.meta)
    meta["block_values"] = (f"experiments/block/values_fit.py: train-split prompts {args.prompts} per dataset, "
                            f"T {args.temperatures}, s{args.steps}_k1 chains under the block rule, "
                            "12 cycles, 8 replays")
    out = out.__class__(**{**out.__dict__, "meta": tuple(sorted(meta.items()))})
    print(out.save(args.out or args.checkpoint))


if __name__ == "__main__":
    main()
