"""`jaxspec tune`: choose the speculation config (or none) per batch bucket from end-to-end timings."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from jaxspec.cli.common import (
    add_data_arguments,
    add_draft_argument,
    add_measure_arguments,
    add_mesh_arguments,
    add_sampling_arguments,
    add_weights_args,
    csv,
    load_model,
    mesh_from_args,
    pin_from_args,
    positive,
    sampling_from_args,
)


def add_parser(subparsers: Any) -> None:
    from jaxspec.harness.tune import DEFAULT_CANDIDATES, PRUNE_BELOW

    p = subparsers.add_parser(
        "tune",
        help="choose the speculation config (or none) per batch size from end-to-end timings",
        description="Time plain decoding and every candidate's speculative_generate end to end, round-robin on one "
        "pinned core (jaxspec.core.measure), per batch bucket over held-out tuning prompts of each dataset (MBPP's "
        "validation split, the last test prompts of GSM8K / ShareGPT: disjoint from what sweeps report on); pick "
        "the most tokens/s per bucket ('ar' = no speculation) and save tune.json beside the checkpoint, where "
        "speculative_generate(spec='auto') reads it. A run on a loaded machine is measured again, then refused.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (with tokenizer)")
    add_draft_argument(p)
    add_data_arguments(p, 8, "tuning prompts (a bucket of batch b uses max(b, 8), cycled)")
    p.add_argument("--batch-sizes", type=csv(int), default=(1, 4, 16, 64),
                   help="comma-separated batch buckets to choose for")
    p.add_argument("--candidates", type=csv(str), default=DEFAULT_CANDIDATES, help="specs to choose from")
    p.add_argument("--new-tokens", type=int, default=128, help="generation length the choice is for")
    p.add_argument("--prune-below", type=float, default=PRUNE_BELOW, metavar="RATIO",
                   help=f"a candidate below RATIO x AR at one batch bucket is not measured at larger ones (default "
                   f"{PRUNE_BELOW}; 0 measures every candidate at every bucket)")
    add_measure_arguments(p)
    add_weights_args(p, checkpoint=True)
    add_mesh_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--projected", default=None, metavar="ACCELERATOR",
                   help="choose with the analytic cost model's projected step times on this accelerator (e.g. "
                   "h200) and the tau measured here, instead of this machine's times")
    p.add_argument("--projected-preset", default=None, metavar="PRESET",
                   help="with --projected: project the times of this preset (default: the checkpoint's model)")
    p.add_argument("--projected-mesh", default="1,1,1", metavar="D,T,E",
                   help="with --projected: the mesh (data,tensor,expert) the projection is for (default 1,1,1)")
    p.add_argument("--out", default=None, help="tuning file (default CHECKPOINT/tune.json, with --draft "
                   "CHECKPOINT/drafts/NAME/tune.json, with --draft all CHECKPOINT/drafts/tune.json)")
    p.add_argument("--fresh", action="store_true",
                   help="measure every group again (by default a rerun reuses the groups OUT.progress.jsonl holds "
                        "for the same model, prompts and candidates)")
    p.add_argument("--compare", default=None, metavar="RUNS_JSONL",
                   help="a `jaxspec sweep` runs.jsonl: report the choice's measured tokens/s against the best")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    pin_from_args(args, console)  # before the first computation
    from jaxspec.harness.eval import tuning_prompts
    from jaxspec.harness.report import comparison_table, tuning_table
    from jaxspec.harness.tune import compare_with_sweep, tune
    from jaxspec.speculation.auto import load_tuning

    for name in ("num_prompts", "new_tokens", "max_prompt_tokens"):
        positive(name.replace("_", "-"), getattr(args, name))
    for b in args.batch_sizes:
        positive("batch-sizes", b)
    if args.compare is not None and not os.path.isfile(args.compare):
        raise FileNotFoundError(f"--compare file {args.compare!r} does not exist")
    if args.projected_preset is not None and args.projected is None:
        raise ValueError("--projected-preset needs --projected ACCELERATOR")
    if args.projected is not None:
        from jaxspec.cost import hardware

        hardware(args.projected)  # unknown names fail before the model loads
    projected_cfg = None
    if args.projected_preset is not None:
        from jaxspec.core.config import ModelConfig

        projected_cfg = ModelConfig.preset(args.projected_preset)
    from jaxspec.sharding import parse_mesh

    projected_mesh = parse_mesh(args.projected_mesh)
    mesh = mesh_from_args(args)
    model = load_model(args, console, need_tokenizer="tuning", mesh=mesh)
    prompts = tuning_prompts(model.tokenizer, args.num_prompts, args.max_prompt_tokens, args.datasets, args.data_root)
    console.print(f"tuning on {', '.join(f'{len(p)} {name}' for name, p in prompts.items())} held-out tuning prompts, "
                  f"{len(args.candidates)} candidates, batch sizes {list(args.batch_sizes)}, {args.repeats} rounds")
    if args.out is None and args.draft is not None:
        from jaxspec.checkpoint.drafts import ALL_DRAFTS, DRAFTS, draft_dir

        folder = os.path.expanduser(args.checkpoint)
        folder = os.path.join(folder, DRAFTS) if args.draft == ALL_DRAFTS else draft_dir(folder, args.draft)
        args.out = os.path.join(folder, "tune.json")
    out = Path(args.out or os.path.expanduser(args.checkpoint))
    progress = (out.with_suffix("") if out.suffix == ".json" else out / "tune").with_suffix(".progress.jsonl")
    if args.fresh and progress.exists():
        progress.unlink()
    progress.parent.mkdir(parents=True, exist_ok=True)
    args.resume_hint = f"finished groups are kept in {progress}: rerun the same command to continue"
    tuning = tune(model.params, model.cfg, prompts, args.batch_sizes, args.candidates, args.new_tokens,
                  repeats=args.repeats, allow_loaded=args.allow_loaded, projected=args.projected,
                  projected_cfg=projected_cfg, projected_mesh=projected_mesh, resume=progress,
                  prune_below=args.prune_below or None, draft=model.draft, devices=mesh,
                  sampling=sampling_from_args(args))
    out = tuning.save(out)
    console.print(tuning_table(tuning))
    console.print("chosen: " + ", ".join(f"batch {b}: {name}" for b, name in tuning.choices.items()))
    console.print(f"saved to {out}")
    load_tuning(out)  # what speculative_generate(spec="auto") will read must parse
    if args.compare is not None:
        records = [json.loads(line) for line in open(args.compare) if line.strip()]
        table = comparison_table(compare_with_sweep(tuning, records))
        console.print(table)
        out.with_name(out.stem + "_vs_sweep.md").write_text(table)
    return 0
