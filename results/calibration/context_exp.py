"""Experiment (docs/calibration.md, "The context feature"): one greedy map per context bin, the
sequence's mean min(accepted, 8) per cycle so far; held-out tau of calibrated trees under them.

Needs the engine patch beside it (the loop hands the bin to drafting through a module global):

    git apply results/calibration/context_exp.patch      # on 7561276
    python results/calibration/context_exp.py s15_k2_d16,s31_k2_d32 out.jsonl
"""
import json, sys, time
import numpy as np
from tau import DATASETS, heldout_prompts, load_shipped, measure
import jaxspec as js
from jaxspec import calibration as C
from jaxspec.data import TRAIN_SPLITS, load_dataset
from jaxspec.eval import encode_prompts
from jaxspec.tree import values as V

specs, out_path = sys.argv[1].split(","), sys.argv[2]
m = load_shipped()
train = []
for ds in DATASETS:
    train += encode_prompts(m.tokenizer, load_dataset(ds, TRAIN_SPLITS[ds])[:32], 192)
prompts, names = heldout_prompts(m, 16)
t = time.time()
s = C.collect(m.params, m.cfg, train, 0.0, cycles=12, batch_size=48, num_steps=10, topk=4)
print("collected", s["label"].size, round(time.time() - t), "s; ctx counts", np.bincount(s["ctx"]).tolist(), flush=True)
pooled = V.fit_map("greedy", 0.0, s["depth"], s["rank"], s["own_prob"], s["label"])
per = []
for c in range(len(V.CTX_EDGES) + 1):
    sel = s["ctx"] == c
    mp = V.fit_map("greedy", 0.0, s["depth"][sel], s["rank"][sel], s["own_prob"][sel], s["label"][sel])
    per.append(mp)
    tab = mp.array()
    print("ctx", c, "n", int(sel.sum()), "rank0 d1-4 bins 0/6:", np.round(tab[:4, 0, [0, 6]], 2).tolist(),
          "rank1:", np.round(tab[:4, 1, [0, 6]], 2).tolist(), flush=True)
cal = V.ContextCalibration(V.draft_fingerprint(m.params, m.cfg), pooled, (), (), tuple(per))
for name in specs:
    rec = {"spec": name, "ctx_edges": list(V.CTX_EDGES), **measure(m, prompts, names, js.SpecConfig.parse(name), 64, calibration=cal)}
    print(json.dumps(rec), flush=True)
    with open(out_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
