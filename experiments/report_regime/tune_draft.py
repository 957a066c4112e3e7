"""`jaxspec tune` for a draft of drafts/ (the tune command itself loads the checkpoint's own draft):
the same arguments, with the model loaded with --draft NAME and the result written to
CHECKPOINT/drafts/NAME/tune.json unless --out says otherwise.

    python experiments/report_regime/tune_draft.py one-step --checkpoint checkpoints/tiny-v4 \
        --num-prompts 4 --batch-sizes 1,4,16,64 --iters 4
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

from jaxspec.checkpoint.drafts import draft_dir
from jaxspec.cli import build_parser


def main() -> int:
    draft, argv = sys.argv[1], sys.argv[2:]
    args = build_parser().parse_args(["tune", *argv])
    args.draft = draft
    if args.out is None:
        args.out = os.path.join(draft_dir(os.path.expanduser(args.checkpoint), draft), "tune.json")
    return int(args.func(args, Console()) or 0)


if __name__ == "__main__":
    sys.exit(main())
