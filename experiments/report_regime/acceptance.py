"""Per-depth and per-rank greedy acceptance of a draft on held-out prompts, per dataset.

    python experiments/report_regime/acceptance.py --draft one-step --prompts 32 --cycles 12 \
        --out results/report_regime/acceptance.json

P(the rank-k child at depth d is the target's argmax | its parent was accepted), read off chain
cycles (s10_k1, the draft's top-4 at every chain node) exactly as `jaxspec calibrate` collects its
samples (jaxspec/harness/calibrate.py): a tree node whose parent is accepted sees this chain's state.
Rows are depths 1..10, columns ranks 0..3; `counts` beside `rate`. The file keeps one entry per
(draft, dataset); a rerun replaces the drafts it measures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATASETS, DRAFTS, heldout_prompts, load  # noqa: E402

from jaxspec.harness.calibrate import COLLECT_STEPS, COLLECT_TOPK, collect  # noqa: E402


def rates(samples: dict[str, np.ndarray]) -> dict[str, list]:
    hits = np.zeros((COLLECT_STEPS, COLLECT_TOPK))
    counts = np.zeros((COLLECT_STEPS, COLLECT_TOPK), int)
    np.add.at(hits, (samples["depth"] - 1, samples["rank"]), samples["label"])
    np.add.at(counts, (samples["depth"] - 1, samples["rank"]), 1)
    return {"rate": (hits / np.maximum(counts, 1)).round(5).tolist(), "counts": counts.tolist()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", choices=DRAFTS, required=True)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--cycles", type=int, default=12)
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default="results/report_regime/acceptance.json")
    args = p.parse_args()
    m = load(args.draft)
    out = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    out[args.draft] = {"prompts_per_dataset": args.prompts, "cycles": args.cycles}
    pooled = []
    for ds in args.datasets.split(","):
        prompts, _ = heldout_prompts(m.tokenizer, args.prompts, [ds])
        samples = collect(m.params, m.cfg, prompts, 0.0, args.cycles, args.batch, seed=1)
        pooled.append(samples)
        out[args.draft][ds] = rates(samples)
        print(args.draft, ds, "rank-0 by depth", np.round(np.asarray(out[args.draft][ds]["rate"])[:, 0], 3).tolist(),
              "rank-1", np.round(np.asarray(out[args.draft][ds]["rate"])[:, 1], 3).tolist(), flush=True)
    out[args.draft]["all"] = rates({k: np.concatenate([s[k] for s in pooled]) for k in pooled[0]})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
