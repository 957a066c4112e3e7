"""`jaxspec train`: train a V4-style target and its MTP block jointly on GSM8K / MBPP / ShareGPT
(train splits), with a byte-level BPE trained on the same mixture; orbax train states with resume."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from rich.console import Console

from jaxspec.cli.common import positive, step_progress


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a target + MTP draft (CPU-sized) with resume",
        description="Train a DeepSeek-V4-style target + MTP block jointly on GSM8K/MBPP/ShareGPT (train splits), "
        "with a byte-level BPE trained on the same mixture; orbax checkpoints with resume.",
    )
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--steps", type=int, default=1000, help="total optimizer steps (cosine schedule length)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="target tokens per sequence T (rows hold T+2)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default 2e-3)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine schedule ends at this share of --lr")
    p.add_argument("--warmup", type=int, default=30, help="linear warmup steps (default 30)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (default 1.0)")
    p.add_argument("--mtp-weight", type=float, default=0.5, help="weight of the MTP loss (default 0.5)")
    p.add_argument("--unlikelihood-weight", type=float, default=0.0,
                   help="weight of the token-level unlikelihood term against repeating the context (default 0)")
    p.add_argument("--out", default="checkpoints/tiny-v4", help="shipped checkpoint folder")
    p.add_argument("--run-dir", default=None, help="train states, tokenizer, curve (default runs/<out name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest state in --run-dir (the default; kept for old command lines)")
    p.add_argument("--fresh", action="store_true", help="start over, ignoring the states in --run-dir")
    p.add_argument("--time-budget-minutes", type=float, default=None,
                   help="stop (and save) after this long (default: no limit)")
    p.add_argument("--eval-every", type=int, default=25, help="held-out eval every N steps (default 25)")
    p.add_argument("--save-every", type=int, default=None, help="save every N steps (default --eval-every)")
    p.add_argument("--eval-rows", type=int, default=8, help="held-out rows per dataset (default 8)")
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed")
    p.add_argument("--data-root", default=None, help="GSM8K/MBPP folder (default $JAXSPEC_DATA or ../shared/data)")
    p.add_argument("--tokenizer", default=None, help="use this tokenizer.json instead of training one")
    p.add_argument("--ship-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="dtype of the shipped params (auto: float32 unless > 60 MB, then bfloat16)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    import jax
    import numpy as np

    from jaxspec.core.config import ModelConfig
    from jaxspec.model.network import abstract_params
    from jaxspec.training import tokenizer as tok_lib
    from jaxspec.training.packing import build_data, tokenizer_texts, unigram_loss
    from jaxspec.training.train import OptConfig, train_loop

    for name in ("steps", "batch", "seq_len", "eval_every", "eval_rows"):
        positive(name.replace("_", "-"), getattr(args, name))
    if args.eval_rows < args.batch:
        raise ValueError(f"--eval-rows ({args.eval_rows}) must be >= --batch ({args.batch})")
    run_dir = args.run_dir or os.path.join("runs", os.path.basename(os.path.normpath(args.out)))
    os.makedirs(run_dir, exist_ok=True)
    base = ModelConfig.preset(args.preset)
    tok_path = os.path.join(run_dir, "tokenizer.json")
    t0 = time.time()
    if args.tokenizer is not None:
        tok = tok_lib.load_tokenizer(args.tokenizer)
    elif not args.fresh and os.path.isfile(tok_path):
        tok = tok_lib.load_tokenizer(tok_path)
    else:
        texts = tokenizer_texts(args.data_root, seed=args.seed)
        tok = tok_lib.train_tokenizer(texts, base.vocab_size)
        console.print(f"trained BPE tokenizer ({base.vocab_size} ids) on {len(texts)} texts in {time.time() - t0:.1f}s")
    tok_lib.check_tokenizer(tok, base.vocab_size)
    tok.save(tok_path)
    cfg = base.replace(bos_id=tok_lib.BOS_ID, eos_id=tok_lib.EOS_ID)
    init = None
    if cfg.v41 is not None and cfg.v41.engram_layers:
        # Engram hashes tokenizer-normalized classes: derive them from this tokenizer, as a release's are
        from jaxspec.checkpoint.v41_load import derive_token_map
        from jaxspec.model.network import init_params

        token_map = derive_token_map(tok_path)
        cfg = cfg.replace(v41=dataclasses.replace(cfg.v41, engram_compressed_vocab=int(token_map.max()) + 1))
        init = init_params(cfg, jax.random.key(args.seed)).replace(
            engram_token_map=jax.numpy.asarray(token_map, jax.numpy.int32))
        console.print(f"Engram: {cfg.v41.engram_compressed_vocab} normalized classes of {cfg.vocab_size} ids")
    opt = OptConfig(lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup, steps=args.steps,
                    weight_decay=args.weight_decay, clip=args.clip, mtp_weight=args.mtp_weight,
                    unlikelihood_weight=args.unlikelihood_weight)
    sampler, eval_rows = build_data(tok, args.seq_len, args.seed, args.data_root,
                                    eval_rows_per_dataset=args.eval_rows, console=console)
    train_rows = np.concatenate([sampler.batch(10**6 + i, 64) for i in range(8)])
    uni = unigram_loss(train_rows, np.concatenate(list(eval_rows.values())), cfg.vocab_size)
    console.print(f"unigram baseline (held-out, all datasets): {uni:.4f} nats")
    n_params = sum(x.size for x in jax.tree.leaves(abstract_params(cfg)))
    console.print(f"model {args.preset}: {n_params / 1e6:.2f}M params; batch {args.batch} x {args.seq_len} tokens; "
                  f"opt {opt}")
    budget = None if args.time_budget_minutes is None else 60 * args.time_budget_minutes
    args.resume_hint = f"train states are saved in {run_dir}/ckpt every --save-every steps: rerun the same command " \
                       "to continue"
    bar, on_step = step_progress(console, "train")
    with bar:
        train_loop(cfg, opt, sampler, eval_rows, batch=args.batch, run_dir=run_dir, out=args.out, tokenizer=tok,
                   resume=not args.fresh, time_budget_s=budget, eval_every=args.eval_every,
                   save_every=args.save_every, seed=args.seed, unigram=uni, ship_dtype=args.ship_dtype,
                   log=bar.console.print, on_step=on_step, init=init,
                   extra_meta={"argv": list(sys.argv[1:]), "preset": args.preset, "batch": args.batch,
                               "seq_len": args.seq_len})
    console.print(f"done: checkpoint in {args.out}, curve in {args.out}/loss.csv")
    return 0
