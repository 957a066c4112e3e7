"""The `jaxspec` command line (also `python -m jaxspec`).

    jaxspec demo [--preset tiny] [--checkpoint PATH] [--batch 4] [--new-tokens 64] [--seed 0]

Subcommands are argparse subparsers: add one with a `_add_<name>(subparsers)` builder that sets
`func=<handler(args, console) -> int>`, and list it in `_build_parser`.
Bad input raises ValueError / OSError inside a handler; `main` turns it into a one-line
`jaxspec: error: ...` on stderr and a non-zero exit status, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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
    p.set_defaults(func=_run_demo)


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
        return cfg, params, tokenizer, f"checkpoint {path} (loaded in {time.perf_counter() - t0:.1f} s)"
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
    texts = [DEMO_TEXT_PROMPTS[i % len(DEMO_TEXT_PROMPTS)] for i in range(batch)]
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
    )

    compiles_before = compile_count()
    t0 = time.perf_counter()
    out = generate(params, cfg, prompts, **kwargs)  # cold: compile + run
    cold_s = time.perf_counter() - t0
    compiled = compile_count() - compiles_before
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
    if jax.default_backend() == "cpu":
        console.print("[dim]these are CPU numbers[/]")
    return 0


# ---- entry point ------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Tree-structured speculative decoding for DeepSeek-V4-style models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(subparsers)
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
