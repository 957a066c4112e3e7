"""`jaxspec sweep`: tree vs. linear speculation over datasets, specs and batch sizes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from jaxspec.cli.common import (
    add_data_arguments,
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
    from jaxspec.harness.eval import LINEAR_SPECS, TREE_SPECS

    p = subparsers.add_parser(
        "sweep",
        help="tree vs. linear speculation over datasets, specs and batch sizes",
        description="Run the tree-vs-linear evaluation (accepted length, tokens/s, Sequoia tau*) on a checkpoint; "
        "writes runs.jsonl, table.md and the gain figures to --out. Data-parallel over all local devices, or sharded "
        "over --mesh.",
    )
    p.add_argument("--checkpoint", help="checkpoint folder (with tokenizer); not needed with --merge")
    add_data_arguments(p, 64, "held-out prompts")
    p.add_argument("--specs", type=csv(str), default=LINEAR_SPECS + TREE_SPECS,
                   help="e.g. s5_k1_d6,s3_k2_d6 (AR always runs; 'ar' alone runs only AR)")
    p.add_argument("--batch-sizes", type=csv(int), default=(1, 4, 16, 64), help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--out", default="runs/sweep", help="output folder")
    add_measure_arguments(p)
    add_weights_args(p, checkpoint=True)
    add_mesh_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--resume", action="store_true",
                   help="keep the (dataset, batch) groups --out/runs.jsonl already finished and run the rest "
                        "(the default; kept for old command lines)")
    p.add_argument("--fresh", action="store_true", help="run every group again, discarding --out/runs.jsonl")
    p.add_argument("--merge", type=csv(str), default=None, metavar="RUNS,RUNS",
                   help="run nothing: join the complete (dataset, batch) groups of these runs.jsonl files into --out")
    p.add_argument("--before", default=None, metavar="RUNS",
                   help="with --merge: another draft's runs.jsonl; also draws acceptance_before_after.png "
                        "(per-depth and per-rank acceptance of --acceptance-spec, that draft vs. these runs)")
    p.add_argument("--acceptance-spec", default="s4_k2_d8", help="the spec of that figure (default s4_k2_d8)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    if not args.merge:
        pin_from_args(args, console)  # before the first computation
    import jax

    from jaxspec.harness.eval import SweepConfig, merge_runs, run_sweep
    from jaxspec.harness.report import plot_acceptance, write_report

    if args.before is not None and not args.merge:
        raise ValueError("--before goes with --merge (a figure of finished runs)")
    if args.merge:
        missing = [p for p in args.merge if not Path(p).is_file()]
        if missing:
            raise ValueError(f"no such runs file: {missing[0]}")
        records, left_out = merge_runs(args.merge)
        for dataset, batch in left_out:
            console.print(f"left out: {dataset} batch {batch} (AR or a spec missing: a stopped run)")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        write_report(records, args.out)
        if args.before is not None:
            if not Path(args.before).is_file():
                raise ValueError(f"no such runs file: {args.before}")
            before = [json.loads(line) for line in Path(args.before).read_text().splitlines() if line.strip()]
            figure = plot_acceptance(before, records, args.acceptance_spec,
                                     Path(args.out) / "acceptance_before_after.png")
            console.print(f"acceptance of {args.acceptance_spec} before / after: {figure}")
        console.print((Path(args.out) / "table.md").read_text())
        console.print(f"{len(records)} runs from {len(args.merge)} file(s) written to {args.out}/runs.jsonl")
        return 0
    if args.checkpoint is None:
        raise ValueError("sweep needs --checkpoint (or --merge)")
    for name in ("num_prompts", "new_tokens", "max_prompt_tokens"):
        positive(name.replace("_", "-"), getattr(args, name))
    sweep = SweepConfig(
        datasets=args.datasets, specs=tuple(s for s in args.specs if s != "ar"), batch_sizes=args.batch_sizes,
        num_prompts=args.num_prompts, max_new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
        repeats=args.repeats, sampling=sampling_from_args(args),
    )
    mesh = mesh_from_args(args)
    model = load_model(args, console, need_tokenizer="the sweep", mesh=mesh)
    where = f"mesh {args.mesh} (data,tensor,expert)" if mesh is not None else f"{len(jax.local_devices())} device(s)"
    console.print(f"sweep on {where}: {sweep}")
    if args.fresh and args.resume:
        raise ValueError("--fresh and --resume contradict each other")
    args.resume_hint = f"finished (dataset, batch) groups are kept in {args.out}/runs.jsonl: rerun the same command " \
                       "to continue"
    records = run_sweep(model.params, model.cfg, model.tokenizer, sweep, args.out, resume=not args.fresh,
                        data_root=args.data_root, draft=model.draft, devices=mesh)
    console.print((Path(args.out) / "table.md").read_text())
    loaded = {(r["dataset"], r["batch_size"]): r["measurement"]["reasons"] for r in records
              if r.get("measurement") and not r["measurement"]["clean"]}
    for (dataset, batch), reasons in sorted(loaded.items()):
        console.print(f"[bold red]LOADED[/] {dataset} batch {batch}: {'; '.join(reasons)}: its tokens/s are not a "
                      "clean figure")
    if loaded and not args.allow_loaded:
        raise ValueError(f"{len(loaded)} group(s) were measured on a loaded machine (above); their tau stands, their "
                         "speed does not: rerun on a quiet machine, or pass --allow-loaded to keep them")
    console.print(f"{len(records)} runs written to {args.out}/runs.jsonl")
    return 0
