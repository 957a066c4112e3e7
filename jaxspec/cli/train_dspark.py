"""`jaxspec train-dspark`: a DSpark block drafter for a checkpoint's frozen target, by DeepSpec's
recipe (training/dspark.py), on the target's own continuations (`jaxspec distill-data`), shipped as
CHECKPOINT/drafts/--draft-name/ (dspark/ + dspark.json + draft.json + dspark_train.png)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

from rich.console import Console

from jaxspec.cli.common import csv, load_model, positive, step_progress

if TYPE_CHECKING:
    from jaxspec.core.dspark import DSparkConfig

# Why the default sizes for a 6-layer target (written into draft.json for the sizes left at their default).
WHY = {
    "num_stages": "1: each stage is a full V4 block, so one stage already costs ~1/6 of a 6-layer target step "
                  "(V4-Flash: 3 stages / 43 layers, 7%); a second would make drafting 1/3 of a verify and halve "
                  "the steps a fixed training budget buys",
    "block_size": "8: a chain reaches D = 8 (s7_k1_d8, 7 drafts) and trees to depth 7 or 8 within one pass",
    "target_layers": "the last three layers, as V4-Flash takes 40-42 of 43 (the last includes the layer the "
                     "target's own head reads)",
    "markov_rank": "64: a rank-64 bigram over the 2048-token vocabulary, 2 x 2048 x 64 = 262k parameters "
                   "(~1/8 of the drafter); per drafted node one 64 x 2048 product, negligible next to the stage",
    "noise_token_id": "2, <|pad|>: a special token that encoding text never produces and the target never "
                      "emits (V4 uses the unused id 128799)",
}


def reasons(dcfg: DSparkConfig, num_layers: int, why: str | None) -> dict[str, str]:
    """draft.json's "why": WHY for each size left at its default, the value and --why for the others."""
    default = {"block_size": 8, "noise_token_id": 2, "markov_rank": 64, "num_stages": 1,
               "target_layers": tuple(range(num_layers - 3, num_layers))}
    said = f" ({why})" if why else ""
    out = {k: text if getattr(dcfg, k) == default[k] else f"{getattr(dcfg, k)}: set for this draft{said}"
           for k, text in WHY.items()}
    if why:
        out["draft"] = why
    return out


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train-dspark",
        help="train a DSpark block drafter for the frozen target (DeepSpec's recipe), shipped as drafts/<name>/",
        description="Train a DSpark drafter (stages, main_proj, heads; target, embedding and head frozen) on the "
        "`jaxspec distill-data` continuations: anchors uniform over response tokens, blocks [anchor, noise...] "
        "reading the target's captured rows in the drafter's window, loss 0.1 CE + 0.9 L1 to the target + "
        "confidence BCE with position decay (--ce-weight / --l1-weight change the first two). The target's rows "
        "are computed once (cached in --run-dir); train "
        "states go to --run-dir/ckpt at every evaluation and a rerun resumes; the drafter is written to "
        "CHECKPOINT/drafts/--draft-name/ at every evaluation.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (the frozen target)")
    p.add_argument("--data", default="runs/distill-data", help="`jaxspec distill-data` folder")
    p.add_argument("--draft-name", default="dspark", help="the draft's folder name (default dspark)")
    p.add_argument("--stages", type=int, default=1, help="draft stages (full V4 blocks; default 1)")
    p.add_argument("--block-size", type=int, default=8, help="block length γ (default 8)")
    p.add_argument("--target-layers", type=csv(int), default=None,
                   help="captured target layers (default: the last three)")
    p.add_argument("--markov-rank", type=int, default=64, help="rank r of the Markov head's bigram W1 W2^T")
    p.add_argument("--noise-token", type=int, default=2, help="noise slot token id (default 2, <|pad|>)")
    p.add_argument("--why", default=None, metavar="TEXT",
                   help="why this draft's sizes and budget, written into draft.json (default: none)")
    p.add_argument("--init", default="target",
                   help="target: stages start as copies of the target's last layers (default); random: fresh; "
                        "or the name of one of the checkpoint's DSpark drafts to fine-tune (its sizes are kept: "
                        "--stages / --block-size / --target-layers / --markov-rank / --noise-token are then ignored)")
    p.add_argument("--decoding-anchors", default=None, metavar="DRAFT",
                   help="sample --decoding-share of the anchors where this DSpark draft's greedy chain of "
                        "--decoding-depth starts its cycles on the data (right after a token it got wrong), the "
                        "rest uniform; needs greedy data (`distill-data --temperatures 0`)")
    p.add_argument("--decoding-depth", type=int, default=8, help="the chain depth D of --decoding-anchors (default 8)")
    p.add_argument("--decoding-share", type=float, default=0.5,
                   help="share of the anchors drawn from --decoding-anchors (default 0.5; 1: those only)")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps (cosine schedule length)")
    p.add_argument("--blocks", type=int, default=256, help="blocks (anchors) per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=60, help="linear warm-up steps")
    p.add_argument("--ce-weight", type=float, default=0.1,
                   help="weight of the block cross-entropy to the data's next tokens (default 0.1, DeepSpec's)")
    p.add_argument("--l1-weight", type=float, default=0.9,
                   help="weight of the L1 distance to the target's distribution (default 0.9, DeepSpec's)")
    p.add_argument("--confidence-target", choices=("l1", "greedy"), default="l1",
                   help="what the confidence head learns: l1, DeepSpec's 1 - L1/2 (a sampled draft's chance; "
                        "default), or greedy, whether the draft's argmax is the target's token")
    p.add_argument("--eval-every", type=int, default=200,
                   help="steps between held-out evaluations (each saves the states and ships the drafter)")
    p.add_argument("--eval-blocks", type=int, default=1024, help="held-out blocks per evaluation")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of sequences held out for monitoring")
    p.add_argument("--cache-batch", type=int, default=16, help="sequences per target pass when caching")
    p.add_argument("--time-budget-minutes", type=float, default=None, help="stop (resumably) after this much training")
    p.add_argument("--run-dir", default=None, help="cache and train states (default runs/<draft name>)")
    p.add_argument("--fresh", action="store_true", help="start over, ignoring the states in --run-dir")
    p.add_argument("--seed", type=int, default=0, help="initialization and block sampling seed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from jaxspec.checkpoint.drafts import save_draft
    from jaxspec.checkpoint.errors import read_json
    from jaxspec.core.dspark import DSparkConfig
    from jaxspec.training import dspark as train
    from jaxspec.training import dspark_anchors
    from jaxspec.training.plots import plot_dspark_history

    for name in ("stages", "block_size", "markov_rank", "steps", "blocks", "eval_every", "eval_blocks",
                 "cache_batch"):
        positive(name.replace("_", "-"), getattr(args, name))
    if min(args.ce_weight, args.l1_weight) < 0 or args.ce_weight + args.l1_weight == 0:
        raise ValueError(f"--ce-weight and --l1-weight must be >= 0 and not both 0, got {args.ce_weight}, "
                         f"{args.l1_weight}")
    if not 0 < args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if not os.path.isdir(args.data):
        raise FileNotFoundError(f"no distillation data folder {args.data!r}; run `jaxspec distill-data` first")
    if not 0 < args.decoding_share <= 1:
        raise ValueError(f"--decoding-share must be in (0, 1], got {args.decoding_share}")
    named = {flag: name for flag, name in (("--init", args.init), ("--decoding-anchors", args.decoding_anchors))
             if name not in (None, "target", "random")}
    for flag, name in named.items():
        _check_draft_name(args.checkpoint, name, flag)
    # the drafts named here come with the target in one load: one of them as the draft, two as a DraftSet
    args.draft = None if not named else next(iter(named.values())) if len(set(named.values())) == 1 else "all"
    model = load_model(args, console)
    console.print(model.description)
    cfg, target = model.cfg, model.params
    init = args.init
    if "--init" in named:
        init, dcfg = _dspark_draft(model.draft, init, "--init")
    else:
        layers = tuple(args.target_layers) if args.target_layers else tuple(range(cfg.num_layers - 3, cfg.num_layers))
        dcfg = DSparkConfig(block_size=args.block_size, noise_token_id=args.noise_token, target_layers=layers,
                            markov_rank=args.markov_rank, num_stages=args.stages)
    dcfg.validate_for(cfg)
    tc = train.DSparkTrainConfig(lr=args.lr, warmup_steps=args.warmup, steps=args.steps, blocks=args.blocks,
                                 ce_weight=args.ce_weight, l1_weight=args.l1_weight,
                                 confidence_target=args.confidence_target)
    run_dir = args.run_dir or os.path.join("runs", args.draft_name)
    os.makedirs(run_dir, exist_ok=True)
    if args.fresh and os.path.isdir(os.path.join(run_dir, "ckpt")):
        import shutil

        shutil.rmtree(os.path.join(run_dir, "ckpt"))
    args.resume_hint = f"the target's rows and train states are kept in {run_dir}: rerun the same command to continue"
    train_cache, eval_cache = _caches(args, console, target, cfg, dcfg, run_dir)
    if args.decoding_anchors is not None:
        rows = _decoding_rows(args, console, target, cfg, model.draft, train_cache, run_dir)
        console.print(f"{len(rows)} decoding anchors of {args.decoding_anchors} (chain D = {args.decoding_depth}, "
                      f"{len(train_cache.anchors) / len(rows):.2f} tokens a cycle), {args.decoding_share:.0%} of the "
                      "sampled anchors")
        train_cache = dspark_anchors.with_anchors(train_cache, rows, args.decoding_share)
    console.print(f"{dcfg}\n{tc}\n{len(train_cache.anchors)} training and {len(eval_cache.anchors)} monitoring "
                  f"anchors")
    stored = cfg.replace(dtype=read_json(os.path.join(args.checkpoint, "config.json"))["dtype"])

    def export(params, record):
        thin = [h for h in record["history"] if "heldout" in h or h["step"] % 10 == 0]
        info = {"recipe": "dspark (DeepSpec, docs/dspark.md)", "dspark_config": dataclasses.asdict(dcfg),
                "why": reasons(dcfg, cfg.num_layers, args.why), "init": args.init, "data": os.path.abspath(args.data),
                "argv": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
                **record, "history": thin}
        folder = save_draft(args.checkpoint, args.draft_name, stored, params, info, config=dcfg)
        if record["history"]:
            plot_dspark_history(record["history"], os.path.join(folder, "dspark_train.png"))

    budget = None if args.time_budget_minutes is None else 60 * args.time_budget_minutes
    bar, on_step = step_progress(console, "train-dspark")
    with bar:
        train.train_loop(target, cfg, dcfg, tc, train_cache, eval_cache, run_dir=run_dir, export=export,
                         init=init, resume=not args.fresh, time_budget_s=budget, eval_every=args.eval_every,
                         eval_blocks_max=args.eval_blocks, seed=args.seed, log=bar.console.print, on_step=on_step)
    console.print(f"done: DSpark drafter in {os.path.join(args.checkpoint, 'drafts', args.draft_name)}")
    return 0


def _check_draft_name(checkpoint, name, flag):
    """A one-line error, before anything loads, unless `name` is one of the checkpoint's drafts (a
    missing folder is left to the load, whose error names it)."""
    from jaxspec.checkpoint.drafts import draft_names

    if os.path.isdir(os.path.expanduser(checkpoint)) and name not in draft_names(os.path.expanduser(checkpoint)):
        raise ValueError(f"{flag} {name!r}: not target / random nor a draft of {checkpoint} "
                         f"({', '.join(draft_names(checkpoint)) or 'none'})")


def _dspark_draft(loaded, name, flag):
    """(params as stored, config) of the DSpark draft `name` among the loaded draft(s)."""
    from jaxspec.model.network import standard_layout
    from jaxspec.speculation.drafter import DraftSet

    draft = loaded[name] if isinstance(loaded, DraftSet) else loaded
    config = getattr(draft.drafter, "config", None)
    if config is None or not hasattr(config, "block_size"):
        raise ValueError(f"{flag} {name!r} is not a DSpark draft")
    return standard_layout(draft.params), config  # the CPU's per-expert leaves back to the stored stacking


def _decoding_rows(args, console, target, cfg, model_draft, train_cache, run_dir):
    """The training anchors where --decoding-anchors' chain starts its cycles (cached in run_dir)."""
    import numpy as np

    from jaxspec.training.dspark_anchors import decoding_anchors

    path = os.path.join(run_dir, f"decoding_anchors_{args.decoding_anchors}_d{args.decoding_depth}_"
                                 f"{len(train_cache.tokens)}.npy")  # the rows count names the cache it indexes
    if os.path.isfile(path):
        return np.load(path)
    params, dcfg = _dspark_draft(model_draft, args.decoding_anchors, "--decoding-anchors")
    bar, on_batch = step_progress(console, "decoding anchors")
    with bar:
        rows = decoding_anchors(params, target, cfg, dcfg, train_cache, args.decoding_depth, progress=on_batch)
    np.save(path, rows)
    return rows


def _caches(args, console, target, cfg, dcfg, run_dir):
    """The train / monitoring caches of the target's rows, built once per (data, capture, split) and
    reused by reruns (run_dir/cache_*.npz + cache.json)."""
    import numpy as np

    from jaxspec.training import dspark as train

    key = {"data": os.path.abspath(args.data), "target_layers": list(dcfg.target_layers),
           "window": cfg.sliding_window, "eval_fraction": args.eval_fraction, "seed": args.seed,
           "dtype": cfg.dtype}
    meta = os.path.join(run_dir, "cache.json")
    paths = {s: os.path.join(run_dir, f"cache_{s}.npz") for s in ("train", "eval")}
    if os.path.isfile(meta) and all(os.path.isfile(p) for p in paths.values()):
        with open(meta) as f:
            if json.load(f) == key:
                console.print(f"target rows from {run_dir}")
                return train.load_cache(paths["train"]), train.load_cache(paths["eval"])
    seqs, prompts = _sequences(args.data)
    order = np.random.default_rng(args.seed).permutation(len(seqs))
    held = max(1, int(len(seqs) * args.eval_fraction))
    caches = {}
    bar, on_batch = step_progress(console, "target rows")
    with bar:
        for split, idx in (("eval", order[:held]), ("train", order[held:])):
            caches[split] = train.build_cache(target, cfg, dcfg, [seqs[i] for i in idx], [prompts[i] for i in idx],
                                              batch=args.cache_batch, progress=on_batch)
            train.save_cache(caches[split], paths[split])
    with open(meta, "w") as f:
        json.dump(key, f)
    return caches["train"], caches["eval"]


def _sequences(folder: str):
    """Every (prompt + continuation) of a distill-data folder with its prompt length."""
    from pathlib import Path

    import numpy as np

    seqs, prompts = [], []
    paths = sorted(p for p in Path(folder).glob("chunk_*.npz") if ".tmp" not in p.name)
    if not paths:
        raise ValueError(f"no distillation data in {folder!r}; run `jaxspec distill-data` first")
    for path in paths:
        with np.load(path) as z:
            for row, n, pl in zip(z["tokens"], z["lengths"], z["prompt_lengths"], strict=True):
                seqs.append(row[:n])
                prompts.append(int(pl))
    return seqs, prompts
