"""Teacher-forced held-out blocks of several DSpark drafters, side by side (float32): per position k the
argmax's hit rate (`match`), the runner-up's hit rate where the argmax missed (`sibling`: what a K = 2
tree's second child adds), P(the first k drafts all right) (`accept`), and how well the confidence head
tells a right argmax from a wrong one (AUC of sigma(c) against `match`, per position and pooled).

The blocks are a `jaxspec train-dspark` run's monitoring split (`RUN_DIR/cache_eval.npz`: sequences
held out from that run's training), so every drafter is read on the same blocks: anchors spread evenly
over every response token, or with `--decoding-anchors DRAFT` only those where DRAFT's greedy chain of
`--depth` starts its cycles (right after a token it got wrong: what decoding feeds every drafter).

    PYTHONPATH=. XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0 python experiments/dspark/recipes.py \
        --cache runs/dspark-greedy/cache_eval.npz --drafts dspark,dspark-greedy,dspark-gconf --out recipes.json
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

import jaxspec as js
from experiments.dspark.ranking_bound import auc
from jaxspec.training import dspark as train
from jaxspec.training import dspark_anchors


def read(ck, cache: train.Cache, max_blocks: int, batch: int) -> dict:
    cfg, target, draft = ck.cfg, ck.params, ck.draft
    dcfg, params = draft.drafter.config, draft.params
    g = dcfg.block_size
    fwd = jax.jit(train.block_forward, static_argnums=(2, 3))
    rows = cache.anchors[np.linspace(0, len(cache.anchors) - 1, min(max_blocks, len(cache.anchors))).astype(int)]
    top1, top2, conf, labels, valid = [], [], [], [], []
    for n, host in cache.batches(rows, batch, cfg.sliding_window, g):
        b = train.to_blocks(host)
        logits, c = fwd(params, target, cfg, dcfg, b.window, b.anchor_pos, b.tokens[:, :g])
        idx = np.asarray(jax.lax.top_k(logits, 2)[1])
        top1.append(idx[:n, :, 0])
        top2.append(idx[:n, :, 1])
        conf.append(np.asarray(jax.nn.sigmoid(c))[:n])
        labels.append(host["tokens"][:n, 1:])
        valid.append(host["valid"][:n])
    top1, top2, conf = np.concatenate(top1), np.concatenate(top2), np.concatenate(conf)
    labels, valid = np.concatenate(labels), np.concatenate(valid)
    match = (top1 == labels) & valid
    missed = valid & ~match
    full = valid[:, -1]
    accepted = np.cumprod(match, axis=1).astype(bool)
    out = {"blocks": int(len(rows)), "match": [], "sibling": [], "accept": [], "confidence_auc": []}
    for k in range(g):
        v = valid[:, k]
        out["match"].append(float(match[v, k].mean()))
        out["sibling"].append(float((top2[:, k] == labels[:, k])[missed[:, k]].mean()))
        out["accept"].append(float(accepted[full, k].mean()))
        out["confidence_auc"].append(auc(conf[v, k], match[v, k]))
    out["tau"] = [1 + float(np.sum(out["accept"][: k + 1])) for k in range(g)]  # tau{k+2}
    out["confidence_auc_pooled"] = auc(conf[valid], match[valid])
    # where decoding reads the confidence: nodes whose earlier drafts were all right (a tree's top
    # child under an accepted parent), the only ones a greedy verify ever reaches
    reached = valid & np.concatenate([np.ones_like(match[:, :1]), accepted[:, :-1]], axis=1)
    out["confidence_auc_reached"] = auc(conf[reached], match[reached])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    ap.add_argument("--cache", required=True, help="a train-dspark run's cache_eval.npz")
    ap.add_argument("--drafts", required=True, help="draft folder names, comma-separated")
    ap.add_argument("--decoding-anchors", default=None, metavar="DRAFT",
                    help="read the blocks where DRAFT's greedy chain starts its cycles (greedy data only)")
    ap.add_argument("--depth", type=int, default=8, help="that chain's depth D")
    ap.add_argument("--max-blocks", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cache = train.load_cache(args.cache)
    if args.decoding_anchors is not None:
        ck = js.load_checkpoint(args.checkpoint, draft=args.decoding_anchors, dtype="float32")
        rows = dspark_anchors.decoding_anchors(ck.draft.params, ck.params, ck.cfg, ck.draft.drafter.config, cache,
                                               args.depth)
        print(f"{len(rows)} decoding anchors of {args.decoding_anchors} (D = {args.depth}), "
              f"{len(cache.anchors) / len(rows):.2f} tokens a cycle")
        cache = dspark_anchors.with_anchors(cache, rows, 1.0)
    results = {}
    for name in args.drafts.split(","):
        ck = js.load_checkpoint(args.checkpoint, draft=name, dtype="float32")
        results[name] = read(ck, cache, args.max_blocks, args.batch)
        r = results[name]
        print(f"{name}: blocks {r['blocks']}")
        for key in ("match", "sibling", "accept", "confidence_auc"):
            print(f"  {key:15s} " + " / ".join(f"{x:.3f}" for x in r[key]))
        print(f"  tau8 {r['tau'][6]:.3f}  pooled confidence AUC {r['confidence_auc_pooled']:.3f}, over the nodes a "
              f"greedy verify reaches {r['confidence_auc_reached']:.3f}")
    with open(args.out, "w") as f:
        json.dump({"cache": args.cache, "decoding_anchors": args.decoding_anchors, "depth": args.depth,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
