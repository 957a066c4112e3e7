"""The `jaxspec` command line (also `python -m jaxspec`).

    jaxspec demo  [--checkpoint PATH | --preset tiny] [--batch 4] [--new-tokens 64] [--spec s3_k2_d6] [--mesh D,T,E]
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
status, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from jaxspec.cli import calibrate, cost, demo, distill, plan, sweep, train, train_dspark, tune

PROG = "jaxspec"
COMMANDS = (demo, train, distill, train_dspark, sweep, tune, calibrate, plan, cost)


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (`jaxspec: error: ...`) like every other error."""

    def error(self, message: str):
        sys.exit(f"{PROG}: error: {message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Tree-structured speculative decoding for DeepSeek-V4-style models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    console = Console()
    try:
        return int(args.func(args, console) or 0)
    except (ValueError, OSError, FloatingPointError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        sys.exit(f"{PROG}: error: {message}")
    except KeyboardInterrupt:
        hint = getattr(args, "resume_hint", None)
        sys.exit(f"{PROG}: interrupted" + (f"; {hint}" if hint else ""))


if __name__ == "__main__":
    sys.exit(main())
