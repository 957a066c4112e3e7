"""Experiment (docs/calibration.md, "Other designs tried"): a greedy map fitted with other depth bins
and a deeper chain collection on the train prompts, and the held-out tau of calibrated trees under it.

    python experiments/calibration/deep_bins.py EDGES STEPS SPECS OUT.jsonl
    e.g. 2,3,4,5,7,10,13,17,24 24 s15_k2_d16,s31_k2_d32 deep_bins.jsonl

The bins are module constants (`DEPTH_EDGES` of `speculation.values`, the lookup, and of `harness.fit_values`,
the fit), set here after the checkpoint is loaded (its calibration.json was fitted with the shipped bins); the
map is passed as `calibration=`.
"""
import json
import sys
import time

import numpy as np
from tau import DATASETS, heldout_prompts, load_shipped, measure

import jaxspec as js
from jaxspec.harness import calibrate as C
from jaxspec.harness import fit_values as F
from jaxspec.harness.eval import encode_prompts
from jaxspec.speculation import values as V
from jaxspec.training.data import TRAIN_SPLITS, load_dataset


def main():
    edges = tuple(int(x) for x in sys.argv[1].split(","))
    steps, specs, out_path = int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
    m = load_shipped()
    train = []
    for ds in DATASETS:  # as the shipped calibration: 32 train prompts per dataset, 12 cycles, top-4
        train += encode_prompts(m.tokenizer, load_dataset(ds, TRAIN_SPLITS[ds])[:32], 192)
    prompts, names = heldout_prompts(m, 16)
    V.DEPTH_EDGES = F.DEPTH_EDGES = edges  # the lookup's bins and the fit's
    t = time.time()
    s = C.collect(m.params, m.cfg, train, 0.0, cycles=12, num_steps=steps, topk=4)
    cal = C.fit({0.0: s}, V.draft_fingerprint(m.params, m.cfg))
    print("collected", s["label"].size, "in", round(time.time() - t), "s", flush=True)
    tab = cal.greedy.array()
    print("rank 0 by depth bin (prob bins 0, 6, 12):", np.round(tab[:, 0, [0, 6, 12]], 3).tolist())
    print("rank 1 by depth bin:", np.round(tab[:, 1, [0, 6, 12]], 3).tolist(), flush=True)
    for name in specs:
        rec = {"spec": name, "edges": list(edges), "steps": steps,
               **measure(m, prompts, names, js.SpecConfig.parse(name), 64, calibration=cal)}
        print(json.dumps(rec), flush=True)
        with open(out_path, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
