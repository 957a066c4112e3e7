"""Which value source ranks DSpark's nodes best: the draft probability, the confidence head, or both.

Collects greedy node samples of the DSpark drafter's chain (`harness.calibrate.collect`, values="both":
each top-4 child of a chain node whose parent was accepted, with its own draft probability q_r, its
slot's confidence sigma(c) and whether it was the target's argmax) on train-split prompts, fits the three
greedy maps there (draft: q_r; confidence: sigma(c) q_r / q_0, the `_vc` feature; both, the `_vb` map:
rank 0 1 - q_1 / q_0, later ranks q_r / q_0, beside sigma(c)),
and scores them on held-out prompts: log loss and Brier score (lower is better) and AUC (how well the value
orders accepted above rejected nodes), over all nodes and per rank. Rank 1 is the decision a tree makes:
whether a sibling is worth a node.

    PYTHONPATH=. JAXSPEC_DATA=/work/shared/data XLA_FLAGS=--xla_cpu_multi_thread_eigen=false \
      taskset -c 0 python experiments/dspark/value_sources.py --out experiments/dspark/value_sources.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import jaxspec as js
from jaxspec.harness.calibrate import collect
from jaxspec.harness.eval import encode_prompts
from jaxspec.harness.fit_values import fit_map, predict
from jaxspec.speculation.values import both_first_feature
from jaxspec.training.data import HELDOUT_SPLITS, TRAIN_SPLITS, load_dataset


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """P(an accepted node outranks a rejected one), ties counted half (Mann-Whitney)."""
    pos, neg = score[label > 0.5], score[label <= 0.5]
    if not pos.size or not neg.size:
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(order.size)
    values = np.concatenate([pos, neg])[order]
    # average ranks over ties
    _, first, counts = np.unique(values, return_index=True, return_counts=True)
    average = first + (counts - 1) / 2.0 + 1
    ranks[order] = np.repeat(average, counts)
    return float((ranks[: pos.size].sum() - pos.size * (pos.size + 1) / 2) / (pos.size * neg.size))


def scores(pred: np.ndarray, label: np.ndarray) -> dict[str, float]:
    p = np.clip(pred, 1e-6, 1 - 1e-6)
    return {"log_loss": float(-np.mean(label * np.log(p) + (1 - label) * np.log(1 - p))),
            "brier": float(np.mean((p - label) ** 2)), "auc": auc(pred, label), "samples": int(label.size)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    ap.add_argument("--datasets", default="gsm8k,mbpp,sharegpt")
    ap.add_argument("--train-prompts", type=int, default=64, help="train-split prompts per dataset")
    ap.add_argument("--heldout-prompts", type=int, default=32, help="test-split prompts per dataset")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--draft", default="dspark", help="the checkpoint's DSpark draft folder name")
    ap.add_argument("--out", default="experiments/dspark/value_sources.json")
    ap.add_argument("--samples", default=None, help="also save the collected samples (.npz) there")
    args = ap.parse_args()
    ck = js.load_checkpoint(args.checkpoint, draft=args.draft, dtype="float32")
    splits = {"train": TRAIN_SPLITS, "heldout": HELDOUT_SPLITS}
    counts = {"train": args.train_prompts, "heldout": args.heldout_prompts}
    samples = {}
    for part in ("train", "heldout"):
        prompts = []
        for name in args.datasets.split(","):
            examples = load_dataset(name, splits[part][name])[: counts[part]]
            prompts += encode_prompts(ck.tokenizer, examples, 192)
        samples[part] = collect(ck.params, ck.cfg, prompts, 0.0, 24, 64, args.steps, 4, seed=int(part == "heldout"),
                                draft=ck.draft, values="both")
        print(f"{part}: {samples[part]['label'].size} nodes from {len(prompts)} prompts", flush=True)

    def features(s):
        vc = s["confidence"] * s["own_prob"] / s["parent_top1"]  # the `_vc` feature
        return {"draft": (s["own_prob"], None), "confidence": (vc, None),
                "both": (both_first_feature(s["rank"], s["own_prob"], s["parent_top1"], s["runner_up"]),
                         s["confidence"])}

    train, heldout = samples["train"], samples["heldout"]
    if args.samples:
        np.savez(args.samples, **{f"{part}_{k}": v for part, s in samples.items() for k, v in s.items()})
    result = {"draft": args.draft, "datasets": args.datasets, "steps": args.steps,
              "train_nodes": int(train["label"].size), "heldout_nodes": int(heldout["label"].size), "sources": {}}
    for source, (prob, second) in features(train).items():
        value_map = fit_map("greedy", 0.0, train["depth"], train["rank"], prob, train["label"], second)
        hp, hs = features(heldout)[source]
        pred = predict(value_map, heldout["depth"], heldout["rank"], hp, hs)
        rank, label = heldout["rank"], heldout["label"]
        result["sources"][source] = {"all": scores(pred, label),
                                     **{f"rank{r}": scores(pred[rank == r], label[rank == r]) for r in (0, 1, 2)}}
        row = result["sources"][source]
        print(f"{source:>10}: " + "  ".join(f"{k} loss {v['log_loss']:.4f} brier {v['brier']:.4f} auc {v['auc']:.3f}"
                                          for k, v in row.items()), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
