"""Held-out calibration of the shipped greedy map per dataset: mean predicted vs observed acceptance
of rank-0 and rank-1 children by depth (docs/calibration.md, "Other designs tried").

    python experiments/calibration/per_dataset.py OUT.json
"""
import json
import sys

from tau import DATASETS, heldout_prompts, load_shipped

from jaxspec.harness import calibrate as C
from jaxspec.harness.fit_values import predict


def main():
    m = load_shipped()
    cal = m.draft.calibration  # the checkpoint's calibration.json, carried by its draft
    prompts, names = heldout_prompts(m, 16)
    out = {}
    for ds in DATASETS:
        chosen = [p for p, n in zip(prompts, names, strict=True) if n == ds]
        s = C.collect(m.params, m.cfg, chosen, 0.0, cycles=12, batch_size=16, seed=1)
        pred = predict(cal.greedy, s["depth"], s["rank"], s["own_prob"])
        rows = {}
        for rank in (0, 1):
            for lo, hi in ((1, 3), (4, 6), (7, 10)):
                sel = (s["rank"] == rank) & (s["depth"] >= lo) & (s["depth"] <= hi)
                rows[f"rank{rank}_depth{lo}-{hi}"] = {"n": int(sel.sum()), "predicted": float(pred[sel].mean()),
                                                      "observed": float(s["label"][sel].mean())}
        out[ds] = rows
        print(ds, json.dumps(rows), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
