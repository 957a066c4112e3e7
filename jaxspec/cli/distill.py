"""`jaxspec distill-data` and `jaxspec distill`: the frozen target's own continuations of train-split
prompts, then the MTP draft trained on them, unrolled as it drafts (target frozen). `--recipe
one-step` trains a fresh MTP block by DeepSeek's recipe instead (next-next token of train-split text,
teacher-forced at depth 1) and ships it as drafts/<name>/ beside the checkpoint."""

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
        "prompts are used only with --prompts unseen, and never those evaluation or tuning reads.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (with tokenizer)")
    add_data_arguments(p, 512, "train-split prompts")
    p.add_argument("--prompts", choices=("train", "unseen"), default="train",
                   help="train: train-split prompts (default); unseen: held-out-split prompts that no evaluation "
                        "or tune reads (the EVAL_RESERVE first and last are left out), which the target never "
                        "trained on, so its continuations are the text it writes for new prompts")
    p.add_argument("--new-tokens", type=int, default=128, help="continuation length (default 128)")
    p.add_argument("--temperatures", type=csv(float), default=(0.0, 1.0), help="default 0,1 (greedy and sampled)")
    p.add_argument("--chunk", type=int, default=64, help="prompts per chunk file (default 64)")
    p.add_argument("--seed", type=int, default=0, help="sampling / data-order seed")
    p.add_argument("--out", default="runs/distill-data", help="output folder (default runs/distill-data)")
    p.set_defaults(func=run_data)

    p = subparsers.add_parser(
        "distill",
        help="train the MTP draft on the target's continuations, unrolled as it drafts (target frozen)",
        description="Train the checkpoint's MTP block with KL(target || draft) at every draft depth on the "
        "`jaxspec distill-data` continuations, each depth fed the draft's own streams as drafting feeds them; "
        "orbax train states in --run-dir (--resume continues); the target + trained draft go to --out.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (target + draft to start from)")
    p.add_argument("--recipe", choices=RECIPES, default="distill",
                   help="distill: KL to the target at every unrolled depth on `distill-data`'s continuations (the "
                   "checkpoint's own draft, refined; written to --out); one-step: DeepSeek's MTP recipe, a fresh MTP "
                   "block trained on the next-next token of train-split text at depth 1 only, written to "
                   "CHECKPOINT/drafts/--draft-name/ (MTP parameters only)")
    p.add_argument("--draft-name", default="one-step", help="one-step: the draft's folder name (default one-step)")
    p.add_argument("--data", default="runs/distill-data", help="`jaxspec distill-data` folder (recipe distill)")
    p.add_argument("--data-root", default=None, metavar="DIR",
                   help="one-step: folder with gsm8k/ and mbpp/ (default $JAXSPEC_DATA, else ../shared/data)")
    p.add_argument("--depths", type=int, default=None,
                   help="draft steps S unrolled (default 4; one-step trains depth 1 and monitors 4)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (cosine schedule length)")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=256, help="chains per row (rows hold seq-len + depths tokens)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--ce-weight", type=float, default=0.0, help="weight of the draft's cross-entropy on the text")
    p.add_argument("--eval-every", type=int, default=50, help="held-out evaluation every N steps")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of sequences held out for monitoring")
    p.add_argument("--time-budget-minutes", type=float, default=None,
                   help="stop (and save) after this long (default: no limit)")
    p.add_argument("--run-dir", default=None, help="train states (default runs/<out name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest state in --run-dir (the default; kept for old command lines)")
    p.add_argument("--fresh", action="store_true", help="start over, ignoring the states in --run-dir")
    p.add_argument("--seed", type=int, default=0, help="sampling / data-order seed")
    p.add_argument("--out", default=None, help="recipe distill: shipped checkpoint folder (target + trained draft)")
    p.set_defaults(func=run_distill)


RECIPES = ("distill", "one-step")
MONITOR_DEPTHS = 4  # a one-step draft is trained at depth 1 and judged reused for this many steps


def run_data(args: argparse.Namespace, console: Console) -> int:
    from jaxspec.training.distill import generate_data

    for name in ("num_prompts", "new_tokens", "max_prompt_tokens", "chunk"):
        positive(name.replace("_", "-"), getattr(args, name))
    if any(t < 0 for t in args.temperatures):
        raise ValueError(f"--temperatures must be >= 0, got {list(args.temperatures)}")
    model = load_model(args, console, need_tokenizer="distill-data")
    prompts = train_prompts(args, model.tokenizer)
    which = "train-split" if args.prompts == "train" else "unseen held-out"
    console.print(f"{len(prompts)} {which} prompts x temperatures {list(args.temperatures)}, "
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
    from jaxspec.training.distill import ONE_STEP, DistillConfig, distill_loop

    one_step = args.recipe == "one-step"
    if args.depths is None:
        args.depths = 1 if one_step else 4
    for name in ("depths", "steps", "batch", "seq_len", "eval_every"):
        positive(name.replace("_", "-"), getattr(args, name))
    if not 0 < args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if one_step and args.depths != 1:
        raise ValueError(f"--recipe one-step trains depth 1 only, got --depths {args.depths}")
    if one_step and args.out is not None:
        raise ValueError("--recipe one-step writes CHECKPOINT/drafts/--draft-name/, not --out")
    if not one_step and args.out is None:
        raise ValueError("--recipe distill needs --out (the shipped checkpoint folder)")
    if one_step:
        dc = DistillConfig(**ONE_STEP, eval_steps=MONITOR_DEPTHS, lr=args.lr, warmup_steps=args.warmup,
                           steps=args.steps)
    else:
        dc = DistillConfig(num_steps=args.depths, lr=args.lr, warmup_steps=args.warmup, steps=args.steps,
                           ce_weight=args.ce_weight)
    model = load_model(args, console, need_tokenizer="distill")
    if one_step:
        width, data = args.seq_len + 2, _text_data(args, model.tokenizer, console)
    else:
        width, data = args.seq_len + args.depths, _continuation_data(args, console)
    name = args.draft_name if one_step else os.path.basename(os.path.normpath(args.out))
    run_dir = args.run_dir or os.path.join("runs", name)
    budget = None if args.time_budget_minutes is None else 60 * args.time_budget_minutes
    args.resume_hint = f"train states are saved in {run_dir}/ckpt at every evaluation: rerun the same command " \
                       "to continue"
    console.print(str(dc))
    bar, on_step = step_progress(console, "distill")
    with bar:
        distill_loop(model.params, model.cfg, dc, batch=args.batch, width=width, run_dir=run_dir, out=args.out,
                     tokenizer=model.tokenizer, resume=not args.fresh, time_budget_s=budget,
                     eval_every=args.eval_every, seed=args.seed, log=bar.console.print, on_step=on_step,
                     export=_draft_export(args, model.cfg) if one_step else None, **data)
    where = os.path.join(args.checkpoint, "drafts", args.draft_name) if one_step else args.out
    console.print(f"done: trained draft in {where}")
    return 0


def _continuation_data(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    import numpy as np

    from jaxspec.training.distill import load_data

    if not os.path.isdir(args.data):
        raise FileNotFoundError(f"no distillation data folder {args.data!r}; run `jaxspec distill-data` first")
    seqs = load_data(args.data)
    order = np.random.default_rng(args.seed).permutation(len(seqs))
    held = max(1, int(len(seqs) * args.eval_fraction))
    eval_seqs, train_seqs = [seqs[i] for i in order[:held]], [seqs[i] for i in order[held:]]
    console.print(f"{len(train_seqs)} training and {len(eval_seqs)} monitoring sequences")
    return dict(train_seqs=train_seqs, eval_seqs=eval_seqs)


def _text_data(args: argparse.Namespace, tokenizer: Any, console: Console) -> dict[str, Any]:
    """Packed rows of the train splits' text (as `jaxspec train` reads them) and the held-out rows of
    each dataset's evaluation split, for monitoring only."""
    import jax
    import numpy as np

    from jaxspec.training.packing import build_data

    sampler, held = build_data(tokenizer, args.seq_len, args.seed, root=args.data_root,
                               eval_rows_per_dataset=args.batch, console=console)

    def train_rows(step: int):
        rows = sampler.batch(step, args.batch)
        return rows, np.ones(rows.shape, bool)

    eval_batches = [(rows, np.ones(rows.shape, bool)) for _, rows in sorted(held.items())]
    return dict(train_seqs=(), eval_seqs=(), train_rows=train_rows, eval_batches=eval_batches,
                fresh=jax.random.key(args.seed))


def _draft_export(args: argparse.Namespace, cfg: Any):
    """Save the MTP block alone as CHECKPOINT/drafts/NAME/ in the checkpoint's stored dtypes."""
    from jaxspec.checkpoint.drafts import save_draft
    from jaxspec.checkpoint.errors import read_json
    from jaxspec.training.plots import plot_distill_history

    stored = cfg.replace(dtype=read_json(os.path.join(args.checkpoint, "config.json"))["dtype"])

    def export(mtp, record):
        folder = save_draft(args.checkpoint, args.draft_name, stored, mtp,
                            {"recipe": args.recipe, "argv": vars_for_json(args), **record})
        if record["history"]:
            plot_distill_history(record["history"], os.path.join(folder, "distill.png"))

    return export


def vars_for_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
