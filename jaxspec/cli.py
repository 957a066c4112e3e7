"""The `jaxspec` command line (also `python -m jaxspec`).

    jaxspec demo [--preset tiny] [--checkpoint PATH] [--batch 4] [--new-tokens 64] [--seed 0]
                 [--mesh D,T,E] [--coordinator HOST:PORT --num-processes N --process-id I]
    jaxspec plan [--preset v4-flash] [--devices 8] [--mesh D,T,E] [--batch 16] [--context 65536]
    jaxspec sweep --checkpoint PATH [--datasets gsm8k,mbpp,sharegpt] [--specs ...] [--batch-sizes 1,4,16,64]
    jaxspec tune --checkpoint PATH [--candidates ...] [--batch-sizes 1,4,16,64] [--compare RUNS_JSONL]

Subcommands are argparse subparsers: add one with a `_add_<name>(subparsers)` builder that sets
`func=<handler(args, console) -> int>`, and list it in `_build_parser`.
Bad input raises ValueError / OSError inside a handler; `main` turns it into a one-line
`jaxspec: error: ...` on stderr and a non-zero exit status, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PROG = "jaxspec"
DEFAULT_PRESET = "tiny"
MAX_RANDOM_INIT_BYTES = 16 * 2**30

DEMO_TEXT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Speculative decoding speeds up generation by",
    "Once upon a time, in a land far away,",
    "The three laws of thermodynamics are",
    "JAX is a library for",
    "1, 1, 2, 3, 5, 8,",
    "Translate to German: good morning ->",
)


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (`jaxspec: error: ...`) like every other error."""

    def error(self, message: str):
        sys.exit(f"{PROG}: error: {message} (see `{self.prog} --help`)")


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")
    return value


# ---- demo -------------------------------------------------------------------------------------


def _add_demo(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="generate from a few built-in prompts and report tokens/s",
        description="Generate from a few built-in prompts with a checkpoint (or a randomly initialised "
        "preset) and report warm decode throughput and compile time.",
    )
    p.add_argument("--preset", default=None, help=f"model preset when no --checkpoint (default {DEFAULT_PRESET})")
    p.add_argument("--checkpoint", default=None, metavar="PATH", help="folder written by save_checkpoint")
    p.add_argument("--batch", type=int, default=4, help="number of prompts (default 4)")
    p.add_argument("--new-tokens", type=int, default=64, help="max new tokens per prompt (default 64)")
    p.add_argument("--seed", type=int, default=0, help="init / prompt / sampling seed (default 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--spec", default="s3_k2_d6", help="tree speculation to compare against (default s3_k2_d6); "
                   "'auto' takes the checkpoint's tune.json choice for this batch; 'none' skips speculation")
    _add_mesh_arguments(p)
    p.set_defaults(func=_run_demo)


def _add_mesh_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, metavar="D,T,E",
                   help="shard over a data,tensor,expert mesh, e.g. 1,8,1 (default: one device)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-host: process 0's address; run the same command on every host (jax.distributed)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of hosts")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this host's index")


def _mesh_from_args(args: argparse.Namespace) -> Any:
    """Join the cluster (multi-host) and build the --mesh; None without --mesh."""
    from jaxspec import sharding

    if args.coordinator is not None or args.num_processes is not None or args.process_id is not None:
        sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    return None if args.mesh is None else sharding.make_mesh(*sharding.parse_mesh(args.mesh))


def _load_model(args: argparse.Namespace, console: Console):
    """-> (cfg, params, tokenizer or None, description)."""
    import jax

    from jaxspec.config import ModelConfig
    from jaxspec.model import init_params

    if args.checkpoint is not None:
        path = os.path.expanduser(args.checkpoint)
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint folder {args.checkpoint!r} does not exist")
        if args.preset is not None:
            console.print(f"[yellow]note:[/] --preset {args.preset} ignored: the config comes from the checkpoint")
        from jaxspec.checkpoint import load_checkpoint

        t0 = time.perf_counter()
        cfg, params, tokenizer = load_checkpoint(path)
        note = ""
        if cfg.dtype != "float32" and jax.default_backend() == "cpu":
            cfg, params = _as_float32(cfg, params)  # bf16 matmuls are slow on CPU; stored bf16 for size
            note = ", cast to float32 for the CPU"
        return cfg, params, tokenizer, f"checkpoint {path} (loaded in {time.perf_counter() - t0:.1f} s{note})"
    preset = args.preset or DEFAULT_PRESET
    cfg = ModelConfig.preset(preset)
    abstract = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(args.seed))
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    if nbytes > MAX_RANDOM_INIT_BYTES:
        raise ValueError(
            f"preset {preset!r} needs {nbytes / 2**30:.0f} GiB of weights: too large for a random-init demo; "
            "pass --checkpoint or a smaller preset (test, tiny)"
        )
    params = init_params(cfg, jax.random.key(args.seed))
    return cfg, params, None, f"preset {preset!r}, [bold yellow]random init[/] (seed {args.seed}): output is noise"


def _demo_prompts(cfg, tokenizer, batch: int, seed: int) -> tuple[list[list[int]], list[str] | None]:
    import numpy as np

    if tokenizer is None:
        rng = np.random.default_rng(seed)
        lengths = rng.integers(4, 17, size=batch)
        return [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in lengths], None
    from jaxspec.data import gsm8k_prompt, mbpp_prompt, sharegpt_prompt

    kinds = [
        gsm8k_prompt("Tom has 3 boxes with 12 apples each. He gives away 10 apples. How many apples are left?"),
        mbpp_prompt("Write a function to find the maximum of two numbers.", ["assert max_of_two(3, 5) == 5"]),
        sharegpt_prompt("What are three tips for writing clear documentation?"),
        *DEMO_TEXT_PROMPTS,
    ]
    texts = [kinds[i % len(kinds)] for i in range(batch)]
    prompts = []
    for text in texts:
        ids = list(tokenizer.encode(text).ids)
        if cfg.bos_id is not None and (not ids or ids[0] != cfg.bos_id):
            ids = [cfg.bos_id, *ids]
        if not ids:
            raise ValueError(f"the tokenizer encoded the demo prompt {text!r} to no tokens")
        prompts.append(ids)
    return prompts, texts


def _run_demo(args: argparse.Namespace, console: Console) -> int:
    _positive("batch", args.batch)
    _positive("new-tokens", args.new_tokens)

    import jax
    import numpy as np

    from jaxspec.generate import compile_count, generate
    from jaxspec.sharding import sharded_compile_count

    mesh = _mesh_from_args(args)
    cfg, params, tokenizer, source = _load_model(args, console)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    console.print(f"[bold]jaxspec demo[/]: {source}")
    console.print(
        f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"{n_params / 1e6:.2f}M params, {cfg.dtype}; backend {jax.default_backend()} "
        f"({', '.join(str(d) for d in jax.devices())})"
    )

    prompts, texts = _demo_prompts(cfg, tokenizer, args.batch, args.seed)
    kwargs = dict(
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=cfg.eos_id,
        rng=jax.random.key(args.seed),
        mesh=mesh,
    )

    compiles_before = compile_count() + sharded_compile_count()
    t0 = time.perf_counter()
    out = generate(params, cfg, prompts, **kwargs)  # cold: compile + run
    cold_s = time.perf_counter() - t0
    compiled = compile_count() + sharded_compile_count() - compiles_before
    t0 = time.perf_counter()
    out = generate(params, cfg, prompts, **kwargs)  # warm: same shapes, no compile
    warm_s = time.perf_counter() - t0

    table = Table(title=f"{args.batch} prompt(s), up to {args.new_tokens} new tokens", show_lines=True)
    table.add_column("#", justify="right")
    table.add_column("prompt")
    table.add_column("output")
    table.add_column("new", justify="right")
    for i, prompt in enumerate(prompts):
        n = int(out.lengths[i])
        ids = out.tokens[i, :n].tolist()
        if tokenizer is not None:
            shown_prompt, shown_out = texts[i], tokenizer.decode(ids)
        else:
            shown_prompt, shown_out = " ".join(map(str, prompt)), " ".join(map(str, ids))
        table.add_row(str(i), shown_prompt, shown_out, str(n))
    console.print(table)

    generated = int(np.sum(out.lengths))
    console.print(
        f"warm run: {generated} tokens in {warm_s:.3f} s = [bold]{generated / warm_s:.1f} tokens/s[/] "
        f"(batch {args.batch}, {out.stats['decode_steps']} decode steps, "
        f"{1e3 * warm_s / max(out.stats['decode_steps'], 1):.2f} ms/step; prefill included, compile excluded)"
    )
    if compiled:
        console.print(
            f"compile: {max(cold_s - warm_s, 0.0):.2f} s "
            f"(first run {cold_s:.2f} s minus warm run; {compiled} program(s) compiled)"
        )
    else:
        console.print(f"compile: 0 s (program already compiled; first run {cold_s:.2f} s)")
    if args.spec.lower() != "none" and cfg.has_mtp and params.mtp is not None:
        _demo_speculative(args, console, cfg, params, prompts, kwargs, out, generated / warm_s)
    if jax.default_backend() == "cpu":
        console.print("[dim]these are CPU numbers[/]")
    return 0


def _demo_speculative(args, console, cfg, params, prompts, kwargs, reference, ar_tokens_per_s) -> None:
    """Same prompts with tree speculation: tau, per-depth acceptance and the measured speedup."""
    import numpy as np

    from jaxspec.config import SpecConfig
    from jaxspec.generate import speculative_generate

    if args.spec.lower() == "auto":
        if args.checkpoint is None:
            raise ValueError("--spec auto reads the checkpoint's tune.json: pass --checkpoint")
        spec = SpecConfig.auto(os.path.expanduser(args.checkpoint), len(prompts))
        if spec is None:
            console.print(f"tune.json chose no speculation for batch {len(prompts)}: autoregressive is fastest")
            return
        console.print(f"tune.json chose {spec.name} for batch {len(prompts)}")
    else:
        spec = SpecConfig.parse(args.spec)
    speculative_generate(params, cfg, prompts, spec, **kwargs)  # compile
    t0 = time.perf_counter()
    out = speculative_generate(params, cfg, prompts, spec, **kwargs)
    warm_s = time.perf_counter() - t0
    generated = int(np.sum(out.lengths))
    stats = out.stats
    same = np.array_equal(out.tokens, reference.tokens) and np.array_equal(out.lengths, reference.lengths)
    check = "identical to generate" if same else "differs from generate"
    if args.temperature > 0:
        check = "sampled (lossless: same distribution as generate, different draws)"
    console.print(
        f"tree speculation {spec.name}: {generated / warm_s:.1f} tokens/s = "
        f"[bold]{generated / warm_s / ar_tokens_per_s:.2f}x[/] autoregressive; "
        f"tau (mean accepted length) [bold]{stats['mean_accepted_length']:.2f}[/] over {stats['cycles']} cycles; "
        f"per-depth acceptance {', '.join(f'{x:.2f}' for x in stats['per_depth_acceptance'])}; output {check}"
    )


# ---- plan -------------------------------------------------------------------------------------


def _add_plan(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="per-device memory of parameters and decode state on a mesh",
        description="Per-device bytes of the parameters and of the decode state (batch sequences of "
        "`--context` tokens) under the default sharding rules, from abstract shapes (no devices needed).",
    )
    p.add_argument("--preset", default="v4-flash", help="model preset (default v4-flash)")
    p.add_argument("--devices", type=int, default=8, help="number of devices (default 8)")
    p.add_argument("--mesh", default=None, metavar="D,T,E", help="data,tensor,expert sizes (default: by devices)")
    p.add_argument("--batch", type=int, default=16, help="sequences (default 16)")
    p.add_argument("--context", type=int, default=65536, help="tokens per sequence (default 65536)")
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace, console: Console) -> int:
    from jaxspec import sharding
    from jaxspec.config import ModelConfig

    _positive("devices", args.devices)
    _positive("batch", args.batch)
    _positive("context", args.context)
    cfg = ModelConfig.preset(args.preset)
    if args.mesh is None:
        shape = sharding.default_mesh_shape(args.devices, cfg)
    else:
        shape = sharding.parse_mesh(args.mesh)
        used = shape[0] * shape[1] * shape[2]
        if used != args.devices:
            raise ValueError(f"--mesh {args.mesh} spans {used} devices but --devices is {args.devices}")
    plan = sharding.memory_plan(cfg, shape, args.batch, args.context)
    gib = 2.0**30
    console.print(
        f"[bold]jaxspec plan[/]: {args.preset} ({cfg.dtype}) on {args.devices} devices, mesh data={shape[0]} "
        f"tensor={shape[1]} expert={shape[2]}; batch {plan.batch}, context {plan.context}"
    )
    table = Table(show_lines=False)
    table.add_column("per device")
    table.add_column("bytes", justify="right")
    table.add_column("GiB", justify="right")
    for title, groups in (("parameters", plan.param_groups), ("decode state", plan.state_groups)):
        for name, n in groups.items():
            table.add_row(f"{title}: {name}", f"{n:,}", f"{n / gib:.3f}")
    console.print(table)
    for name, n in (("parameters", plan.param_bytes), ("decode state", plan.state_bytes),
                    ("total", plan.bytes_per_device)):
        console.print(f"{name} per device: {n:,} bytes ({n / gib:.2f} GiB)")
    console.print(
        f"[dim]unsharded: parameters {plan.total_param_bytes / gib:.1f} GiB, decode state "
        f"{plan.total_state_bytes / gib:.1f} GiB; activations and the speculation scratch are not included[/]"
    )
    return 0


# ---- sweep ------------------------------------------------------------------------------------


def _csv(kind):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return tuple(kind(x) for x in items)

    return parse


def _add_sweep(subparsers: Any) -> None:
    from jaxspec.eval import LINEAR_SPECS, TREE_SPECS

    p = subparsers.add_parser(
        "sweep",
        help="tree vs. linear speculation over datasets, specs and batch sizes",
        description="Run the tree-vs-linear evaluation (accepted length, tokens/s, Sequoia tau*) on a checkpoint; "
        "writes runs.jsonl, table.md and the gain figures to --out. Data-parallel over all local devices.",
    )
    p.add_argument("--checkpoint", help="orbax checkpoint folder (with tokenizer); not needed with --merge")
    p.add_argument("--datasets", type=_csv(str), default=("gsm8k", "mbpp", "sharegpt"))
    p.add_argument("--specs", type=_csv(str), default=LINEAR_SPECS + TREE_SPECS,
                   help="e.g. s5_k1_d6,s3_k2_d6 (AR always runs; 'ar' alone runs only AR)")
    p.add_argument("--batch-sizes", type=_csv(int), default=(1, 4, 16, 64))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=192)
    p.add_argument("--out", default="runs/sweep", help="output folder")
    p.add_argument("--resume", action="store_true",
                   help="keep the (dataset, batch) groups --out/runs.jsonl already finished; run the rest")
    p.add_argument("--merge", type=_csv(str), default=None, metavar="RUNS,RUNS",
                   help="run nothing: join the complete (dataset, batch) groups of these runs.jsonl files into --out")
    p.set_defaults(func=_run_sweep)


def _run_sweep(args: argparse.Namespace, console: Console) -> int:
    import jax

    from jaxspec.eval import SweepConfig, merge_runs, run_sweep, write_report

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
        console.print((Path(args.out) / "table.md").read_text())
        console.print(f"{len(records)} runs from {len(args.merge)} file(s) written to {args.out}/runs.jsonl")
        return 0
    if args.checkpoint is None:
        raise ValueError("sweep needs --checkpoint (or --merge)")
    sweep = SweepConfig(
        datasets=args.datasets, specs=tuple(s for s in args.specs if s != "ar"), batch_sizes=args.batch_sizes,
        num_prompts=args.num_prompts, max_new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
    )
    cfg, params, tokenizer = _load_text_checkpoint(args.checkpoint, "the sweep")
    console.print(f"sweep on {len(jax.local_devices())} device(s): {sweep}")
    records = run_sweep(params, cfg, tokenizer, sweep, args.out, resume=args.resume)
    console.print((Path(args.out) / "table.md").read_text())
    console.print(f"{len(records)} runs written to {args.out}/runs.jsonl")
    return 0


def _load_text_checkpoint(folder: str, user: str):
    """-> (cfg, params, tokenizer) of a checkpoint that has a tokenizer, float32 on a CPU."""
    import jax

    from jaxspec.checkpoint import load_checkpoint

    path = os.path.expanduser(folder)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder {folder!r} does not exist")
    cfg, params, tokenizer = load_checkpoint(path)
    if tokenizer is None:
        raise ValueError(f"checkpoint {folder!r} has no tokenizer.json; {user} encodes text prompts")
    if cfg.dtype != "float32" and jax.default_backend() == "cpu":
        # bf16 matmuls are slow on CPU; the shipped checkpoint is stored in bf16 only for size.
        cfg, params = _as_float32(cfg, params)
    return cfg, params, tokenizer


# ---- tune -------------------------------------------------------------------------------------


def _add_tune(subparsers: Any) -> None:
    from jaxspec.tune import DEFAULT_CANDIDATES, ESTIMATORS

    p = subparsers.add_parser(
        "tune",
        help="choose the speculation config (or none) per batch size from a calibration run",
        description="Measure the draft's per-rank acceptance and the step times of every candidate per batch "
        "bucket on calibration prompts (train splits), pick the config with the most expected tokens/s per "
        "bucket (Sequoia's objective; 'ar' = no speculation) and save it as tune.json beside the checkpoint, "
        "where speculative_generate(spec='auto', tuning=FOLDER) reads it.",
    )
    p.add_argument("--checkpoint", required=True, help="orbax checkpoint folder (with tokenizer)")
    p.add_argument("--datasets", type=_csv(str), default=("gsm8k", "mbpp", "sharegpt"))
    p.add_argument("--num-prompts", type=int, default=8, help="calibration prompts per dataset (default 8)")
    p.add_argument("--batch-sizes", type=_csv(int), default=(1, 4, 16, 64))
    p.add_argument("--candidates", type=_csv(str), default=DEFAULT_CANDIDATES, help="specs to choose from")
    p.add_argument("--new-tokens", type=int, default=128, help="generation length the choice is for")
    p.add_argument("--max-prompt-tokens", type=int, default=192)
    p.add_argument("--iters", type=int, default=16, help="timed cycles per measurement (median)")
    p.add_argument("--estimator", choices=ESTIMATORS, default="measured",
                   help="expected tokens per cycle: Sequoia's optimum from the per-rank acceptance, or the "
                   "mean accepted length measured on the calibration prompts")
    p.add_argument("--out", default=None, help="tuning file (default CHECKPOINT/tune.json)")
    p.add_argument("--compare", default=None, metavar="RUNS_JSONL",
                   help="a `jaxspec sweep` runs.jsonl: report the choice's measured tokens/s against the best")
    p.set_defaults(func=_run_tune)


def _run_tune(args: argparse.Namespace, console: Console) -> int:
    import json

    from jaxspec.data import TRAIN_SPLITS, load_dataset
    from jaxspec.eval import encode_prompts
    from jaxspec.tune import calibrate, compare_with_sweep, comparison_table, load_tuning, tuning_table

    for name in ("num_prompts", "new_tokens", "max_prompt_tokens", "iters"):
        _positive(name.replace("_", "-"), getattr(args, name))
    for b in args.batch_sizes:
        _positive("batch-sizes", b)
    if args.compare is not None and not os.path.isfile(args.compare):
        raise FileNotFoundError(f"--compare file {args.compare!r} does not exist")
    cfg, params, tokenizer = _load_text_checkpoint(args.checkpoint, "tuning")
    prompts = []
    for name in args.datasets:
        examples = load_dataset(name, TRAIN_SPLITS[name])[: args.num_prompts]
        prompts += encode_prompts(tokenizer, examples, args.max_prompt_tokens)
    console.print(f"calibrating on {len(prompts)} train-split prompts, {len(args.candidates)} candidates, "
                  f"batch sizes {list(args.batch_sizes)}")
    tuning = calibrate(
        params, cfg, prompts, args.batch_sizes, args.candidates, args.new_tokens, args.iters, args.estimator
    )
    out = tuning.save(args.out or os.path.expanduser(args.checkpoint))
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


def _as_float32(cfg, params):
    import jax
    import jax.numpy as jnp

    cast = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return cfg.replace(dtype="float32"), cast


# ---- entry point ------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Tree-structured speculative decoding for DeepSeek-V4-style models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(subparsers)
    _add_plan(subparsers)
    _add_sweep(subparsers)
    _add_tune(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    console = Console()
    try:
        return int(args.func(args, console) or 0)
    except (ValueError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        sys.exit(f"{PROG}: error: {message}")
    except KeyboardInterrupt:
        sys.exit(f"{PROG}: interrupted")


if __name__ == "__main__":
    sys.exit(main())
