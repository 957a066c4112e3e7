"""The `jaxspec` command line (also `python -m jaxspec`).

    jaxspec demo  [--checkpoint PATH | --preset tiny] [--batch 4] [--new-tokens 64] [--spec auto] [--mesh D,T,E]
    jaxspec generate --checkpoint PATH (--prompt TEXT ... | --prompt-file TXT | --jsonl JSONL) [--spec auto] [--out OUT]
    jaxspec train [--preset tiny] [--steps 1000] [--out checkpoints/tiny-v4] [--resume]
    jaxspec distill-data --checkpoint PATH [--num-prompts 512] [--out runs/distill-data]
    jaxspec distill --checkpoint PATH --data runs/distill-data --out PATH [--depths 4] [--steps 1000] [--resume]
    jaxspec train-dspark --checkpoint PATH --data runs/distill-data [--stages 1] [--block-size 8] [--steps 3000]
    jaxspec sweep --checkpoint PATH [--datasets gsm8k,mbpp,sharegpt] [--specs ...] [--batch-sizes 1,4,16,64]
    jaxspec tune  --checkpoint PATH [--candidates ...] [--batch-sizes 1,4,16,64] [--compare RUNS_JSONL]
    jaxspec calibrate --checkpoint PATH [--datasets gsm8k,mbpp,sharegpt] [--num-prompts 64] [--temperatures 0.6,1.0]
    jaxspec plan  [--preset v4-flash] [--devices 8] [--mesh D,T,E] [--batch 16] [--context 65536]
    jaxspec cost  [--preset v4-flash] [--devices 8] [--specs s4_k1_d5,s4_k2_d8] [--batch-sizes 1,8,32,64] [--tau 2.5]

One module per subcommand, each with `add_parser(subparsers)` that sets `func=run(args, console) -> int`;
shared flag groups and the model loader live in `cli.common`. Bad input raises ValueError / OSError
inside a handler; `main` turns it into a one-line `jaxspec: error: ...` on stderr and a non-zero exit
status, without a traceback. Every command keeps XLA's compiled programs in a persistent cache
(`cli.common.enable_compile_cache`; --no-compile-cache or JAXSPEC_NO_COMPILE_CACHE=1 turns it off).
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from jaxspec.cli import calibrate, cost, demo, distill, generate, plan, serve, sweep, train, train_dspark, tune
from jaxspec.cli.common import add_compile_cache_arguments, enable_compile_cache

PROG = "jaxspec"
COMMANDS = (demo, generate, serve, train, distill, train_dspark, sweep, tune, calibrate, plan, cost)


class _Formatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.default is not argparse.SUPPRESS and action.nargs != 0
                and "default" not in text):
            shown = ",".join(map(str, action.default)) if isinstance(action.default, (tuple, list)) else action.default
            text += f" (default: {'none' if shown is None else shown})".replace("%", "%%")
        return text


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (`jaxspec: error: ...`) like every other error, and
    every option's help shows its default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        sys.exit(f"{PROG}: error: {message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Tree-structured speculative decoding for DeepSeek-V4-style models.")
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(subparsers)
    for sub in subparsers.choices.values():
        add_compile_cache_arguments(sub)
    return parser


def version_line() -> str:
    """`jaxspec X (jax Y, Python Z)` from the installed metadata (nothing imported)."""
    import platform
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"{PROG} {installed('jaxspec')} (jax {installed('jax')}, Python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    console = Console()
    try:
        args.compile_cache_dir = enable_compile_cache(args)
        return int(args.func(args, console) or 0)
    except BrokenPipeError:  # `jaxspec plan --format json | head`: the reader has gone, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (ValueError, OSError, FloatingPointError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        sys.exit(f"{PROG}: error: {message}")
    except KeyboardInterrupt:
        hint = getattr(args, "resume_hint", None)
        sys.exit(f"{PROG}: interrupted" + (f"; {hint}" if hint else ""))


if __name__ == "__main__":
    sys.exit(main())
