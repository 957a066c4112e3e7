"""`jaxspec distill-data` and `jaxspec distill`: the frozen target's own continuations of train-split
prompts, then the MTP draft trained on them, unrolled as it drafts (target frozen)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich.console import Console

from jaxspec.cli.common import add_data_arguments, csv, load_model, positive, step_progress, train_prompts


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "distill-data",
        help="the target's continuations of train-split prompts (greedy and sampled), for draft training",
        description="Generate the frozen target's continuations of train-split prompts of the datasets at each "
        "temperature and write them in chunks to --out; a stopped run resumes where it stopped. Held-out "
        "prompts are never used.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (with tokenizer)")
    add_data_arguments(p, 512, "train-split prompts")
    p.add_argument("--new-tokens", type=int, default=128, help="continuation length (default 128)")
    p.add_argument("--temperatures", type=csv(float), default=(0.0, 1.0), help="default 0,1 (greedy and sampled)")
    p.add_argument("--chunk", type=int, default=64, help="prompts per chunk file (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/distill-data", help="output folder (default runs/distill-data)")
    p.set_defaults(func=run_data)

    p = subparsers.add_parser(
        "distill",
        help="train the MTP draft on the target's continuations, unrolled as it drafts (target frozen)",
        description="Train the checkpoint's MTP block with KL(target || draft) at every draft depth on the "
        "`jaxspec distill-data` continuations, each depth fed the draft's own streams as draft_tree feeds them; "
        "orbax train states in --run-dir (--resume continues); the target + trained draft go to --out.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (target + draft to start from)")
    p.add_argument("--data", default="runs/distill-data", help="`jaxspec distill-data` folder")
    p.add_argument("--depths", type=int, default=4, help="draft steps S unrolled (default 4)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (cosine schedule length)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256, help="chains per row (rows hold seq-len + depths tokens)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ce-weight", type=float, default=0.0, help="weight of the draft's cross-entropy on the text")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of sequences held out for monitoring")
    p.add_argument("--time-budget-minutes", type=float, default=None)
    p.add_argument("--run-dir", default=None, help="train states (default runs/<out name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest state in --run-dir (the default; kept for old command lines)")
    p.add_argument("--fresh", action="store_true", help="start over, ignoring the states in --run-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="shipped checkpoint folder (target + trained draft)")
    p.set_defaults(func=run_distill)


def run_data(args: argparse.Namespace, console: Console) -> int:
    from jaxspec.distill import generate_data

    for name in ("num_prompts", "new_tokens", "max_prompt_tokens", "chunk"):
        positive(name.replace("_", "-"), getattr(args, name))
    if any(t < 0 for t in args.temperatures):
        raise ValueError(f"--temperatures must be >= 0, got {list(args.temperatures)}")
    model = load_model(args, console, need_tokenizer="distill-data")
    prompts = train_prompts(args, model.tokenizer)
    console.print(f"{len(prompts)} train-split prompts x temperatures {list(args.temperatures)}, "
                  f"{args.new_tokens} new tokens -> {args.out}")
    args.resume_hint = f"finished chunks are kept in {args.out}: rerun the same command to continue"
    bar, on_chunk = step_progress(console, "generating")
    with bar:
        chunks = generate_data(model.params, model.cfg, prompts, args.out, max_new_tokens=args.new_tokens,
                               chunk_size=args.chunk, temperatures=args.temperatures, seed=args.seed,
                               progress=on_chunk)
    console.print(f"{chunks} chunks in {args.out}")
    return 0


def run_distill(args: argparse.Namespace, console: Console) -> int:
    import numpy as np

    from jaxspec.distill import DistillConfig, distill_loop, load_data

    for name in ("depths", "steps", "batch", "seq_len", "eval_every"):
        positive(name.replace("_", "-"), getattr(args, name))
    if not 0 < args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if not os.path.isdir(args.data):
        raise FileNotFoundError(f"no distillation data folder {args.data!r}; run `jaxspec distill-data` first")
    dc = DistillConfig(num_steps=args.depths, lr=args.lr, warmup_steps=args.warmup, steps=args.steps,
                       ce_weight=args.ce_weight)
    model = load_model(args, console, need_tokenizer="distill")
    seqs = load_data(args.data)
    order = np.random.default_rng(args.seed).permutation(len(seqs))
    held = max(1, int(len(seqs) * args.eval_fraction))
    eval_seqs, train_seqs = [seqs[i] for i in order[:held]], [seqs[i] for i in order[held:]]
    console.print(f"{len(train_seqs)} training and {len(eval_seqs)} monitoring sequences; {dc}")
    run_dir = args.run_dir or os.path.join("runs", os.path.basename(os.path.normpath(args.out)))
    budget = None if args.time_budget_minutes is None else 60 * args.time_budget_minutes
    args.resume_hint = f"train states are saved in {run_dir}/ckpt at every evaluation: rerun the same command " \
                       "to continue"
    bar, on_step = step_progress(console, "distill")
    with bar:
        distill_loop(model.params, model.cfg, dc, train_seqs, eval_seqs, batch=args.batch,
                     width=args.seq_len + args.depths, run_dir=run_dir, out=args.out, tokenizer=model.tokenizer,
                     resume=not args.fresh, time_budget_s=budget, eval_every=args.eval_every, seed=args.seed,
                     log=bar.console.print, on_step=on_step)
    console.print(f"done: target + trained draft in {args.out}")
    return 0
