"""Experiment (docs/calibration.md, "Other designs tried"): a greedy map fitted with other depth bins and a
deeper chain collection, and the held-out tau of calibrated trees under it.

    python results/calibration/deep_bins.py EDGES STEPS SPECS OUT.jsonl   e.g. 2,3,4,5,7,10,13,17,24 24 s15_k2_d16 out.jsonl

The bins are module constants (`tree.values.DEPTH_EDGES`), set here after the checkpoint is loaded
(its calibration.json was fitted with the shipped bins); the map is passed as `calibration=`."""
import json, sys, time, argparse
import numpy as np
from jaxspec.tree import values as V
edges = tuple(int(x) for x in sys.argv[1].split(","))
steps = int(sys.argv[2])
specs = sys.argv[3].split(",")
out_path = sys.argv[4]
from jaxspec import calibration as C
from jaxspec.cli.common import load_model
from jaxspec.data import HELDOUT_SPLITS, TRAIN_SPLITS, load_dataset
from jaxspec.eval import encode_prompts
import jaxspec as js
m = load_model(argparse.Namespace(checkpoint="checkpoints/tiny-v4", preset=None), None, need_tokenizer="x")
train, held, names = [], [], []
for ds in ("gsm8k", "mbpp", "sharegpt"):
    train += encode_prompts(m.tokenizer, load_dataset(ds, TRAIN_SPLITS[ds])[:32], 192)
    ex = load_dataset(ds, HELDOUT_SPLITS[ds])[:16]
    held += encode_prompts(m.tokenizer, ex, 192); names += [ds] * len(ex)
names = np.asarray(names)
V.DEPTH_EDGES = edges  # after load_checkpoint checked the shipped file's bins
t = time.time()
s = C.collect(m.params, m.cfg, train, 0.0, cycles=12, num_steps=steps, topk=4)
cal = C.fit({0.0: s}, V.draft_fingerprint(m.params, m.cfg))
print("collected", s["label"].size, "in", round(time.time() - t), "s", flush=True)
tab = cal.greedy.array()
print("rank0 by depth bin (prob bins 0,6,12):", np.round(tab[:, 0, [0, 6, 12]], 3).tolist())
print("rank1 by depth bin:", np.round(tab[:, 1, [0, 6, 12]], 3).tolist(), flush=True)
for name in specs:
    spec = js.SpecConfig.parse(name)
    t = time.time()
    out = js.speculative_generate(m.params, m.cfg, held, spec, max_new_tokens=64, calibration=cal)
    ps = out.stats["per_sequence"]
    acc, cyc = np.asarray(ps["accepted"]), np.asarray(ps["cycles"])
    rec = {"spec": name, "edges": list(edges), "steps": steps, "tau_all": float((acc.sum() + cyc.sum()) / cyc.sum()),
           "seconds": time.time() - t}
    for ds in ("gsm8k", "mbpp", "sharegpt"):
        sel = names == ds
        rec[ds] = float((acc[sel].sum() + cyc[sel].sum()) / cyc[sel].sum())
    print(json.dumps(rec), flush=True)
    with open(out_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
