"""`jaxspec calibrate`: fit the draft's node values on train-split prompts, store calibration.json
beside the checkpoint (where `load_checkpoint` finds it), report held-out calibration error."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from rich.console import Console

from jaxspec.cli.common import (
    add_data_arguments,
    add_draft_argument,
    add_mesh_arguments,
    add_weights_args,
    csv,
    load_model,
    mesh_from_args,
    positive,
    train_prompts,
)


def add_parser(subparsers: Any) -> None:
    from jaxspec.core.spec import VALUE_SOURCES
    from jaxspec.harness.calibrate import COLLECT_STEPS, COLLECT_TOPK

    p = subparsers.add_parser(
        "calibrate",
        help="fit P(node accepted | parent accepted) for tree drafting and pruning",
        description="Run chain speculative cycles on train-split prompts, record the top-K children of every "
        "chain node whose parent was accepted, fit a binned monotone map from the draft's features (depth, rank, "
        "draft probability, the parent's top-1 probability) to acceptance, greedy and per sampling temperature, "
        "and save it as calibration.json beside the checkpoint: speculative_generate ranks tree candidates by it "
        "by default.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (with tokenizer)")
    add_draft_argument(p, every=False)
    add_data_arguments(p, 64, "train-split prompts")
    p.add_argument("--prompts", choices=("train", "unseen"), default="train",
                   help="fit on train-split prompts (default) or on held-out-split prompts that no evaluation or "
                        "tune reads (`distill-data --prompts unseen`): text the target never trained on")
    p.add_argument("--temperatures", type=csv(float), default=(0.6, 1.0),
                   help="sampling temperatures to fit a map for (greedy is always fitted)")
    p.add_argument("--cycles", type=int, default=24, help="speculative cycles recorded per prompt")
    p.add_argument("--steps", type=int, default=COLLECT_STEPS, help="chain depth drafted per cycle")
    p.add_argument("--topk", type=int, default=COLLECT_TOPK, help="ranks recorded per chain node")
    p.add_argument("--values", choices=VALUE_SOURCES, default="draft",
                   help="the node feature the maps read: 'draft' (its draft probability; specs sS_kK_dD) or "
                   "'confidence' (a DSpark drafter's confidence head; specs named ..._vc) or 'both' (the two "
                   "together in one map; specs named ..._vb)")
    p.add_argument("--batch-size", type=int, default=64, help="prompts run together")
    p.add_argument("--heldout", type=int, default=32,
                   help="held-out (test-split) prompts per dataset to measure calibration error on (0 = none)")
    add_weights_args(p, checkpoint=True)
    add_mesh_arguments(p)
    p.add_argument("--block-values", action=argparse.BooleanOptionalAction, default=True,
                   help="also fit the block rule's node values at each --temperatures (sampled trees; "
                        "docs/block_verification.md; draft-probability calibrations only)")
    p.add_argument("--figure", default=None, help="reliability diagram PNG (held-out; default none)")
    p.add_argument("--out", default=None, help="calibration file (default CHECKPOINT/calibration.json, with --draft "
                   "CHECKPOINT/drafts/NAME/calibration.json; --values confidence / both: calibration_confidence.json / "
                   "calibration_both.json there, beside the draft-probability one)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from jaxspec.checkpoint.drafts import draft_dir
    from jaxspec.harness.calibrate import calibration_errors, collect, fit, plot_reliability
    from jaxspec.harness.eval import encode_prompts
    from jaxspec.speculation.values import calibration_file, draft_fingerprint, load_calibration
    from jaxspec.training.data import DATASETS, HELDOUT_SPLITS, load_dataset

    for name in ("num_prompts", "max_prompt_tokens", "cycles", "batch_size", "steps", "topk"):
        positive(name.replace("_", "-"), getattr(args, name))
    for name in args.datasets:
        if name not in DATASETS:
            raise ValueError(f"--datasets: unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    if any(not t > 0 for t in args.temperatures):
        raise ValueError(f"--temperatures must be > 0 (greedy is always fitted), got {list(args.temperatures)}")
    sidecars = draft_dir(os.path.expanduser(args.checkpoint), args.draft)  # a bad name fails before the load
    mesh = mesh_from_args(args)
    model = load_model(args, console, need_tokenizer="calibrate", mesh=mesh)
    if model.draft is None:
        raise ValueError(f"checkpoint {args.checkpoint!r} has no draft: nothing to calibrate")
    temps = (0.0, *sorted(set(args.temperatures)))
    prompts = train_prompts(args, model.tokenizer)
    t0 = time.perf_counter()
    run_args = (args.cycles, args.batch_size, args.steps, args.topk)
    train = {t: collect(model.params, model.cfg, prompts, t, *run_args, draft=model.draft, mesh=mesh,
                        values=args.values) for t in temps}
    console.print(f"collected {sum(s['label'].size for s in train.values())} nodes from {len(prompts)} {args.prompts} "
                  f"prompts in {time.perf_counter() - t0:.0f} s")
    meta = {"datasets": ",".join(args.datasets), "prompts": args.prompts, "train_prompts_per_dataset": args.num_prompts,
            "cycles": args.cycles, "steps": args.steps, "topk": args.topk,
            "checkpoint": os.path.basename(os.path.normpath(args.checkpoint)), "draft": args.draft or "default"}
    calibration = fit(train, draft_fingerprint(model.draft.params, model.cfg), meta, feature=args.values)
    if args.block_values and args.values == "draft":
        from jaxspec.harness.calibrate_block import collect_block, fit_block, with_block

        t0 = time.perf_counter()
        block = [fit_block(collect_block(model.params, model.cfg, prompts, t, args.cycles, args.batch_size, args.steps,
                                         args.topk, draft=model.draft), t) for t in temps[1:]]
        calibration = with_block(calibration, block)
        console.print(f"block values at T = {', '.join(str(t) for t in temps[1:])} in {time.perf_counter() - t0:.0f} s")
    out = calibration.save(args.out or os.path.join(sidecars, calibration_file(args.values)))
    load_calibration(out, model.draft.params, model.cfg)  # what load_checkpoint will read must parse and match
    console.print(f"saved to {out}")
    if args.heldout:
        heldout_prompts = []
        for name in args.datasets:
            examples = load_dataset(name, HELDOUT_SPLITS[name], root=args.data_root)[: args.heldout]
            heldout_prompts += encode_prompts(model.tokenizer, examples, args.max_prompt_tokens)
        heldout = {t: collect(model.params, model.cfg, heldout_prompts, t, *run_args, seed=1, draft=model.draft,
                              values=args.values) for t in temps}
        errors = calibration_errors(calibration, heldout)
        console.print_json(data=errors)
        out.with_name(out.stem + "_heldout_ece.json").write_text(json.dumps(errors, indent=1) + "\n")
        if args.figure:
            plot_reliability(calibration, heldout, args.figure)
            console.print(f"reliability diagram: {args.figure}")
    return 0
