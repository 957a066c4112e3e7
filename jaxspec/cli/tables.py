"""Tables that stay readable when piped (rich assumes 80 columns then): every column at least as
wide as its widest value, so rich wraps a header rather than cutting a number to `8.6...`; and the
`--format json` counterpart, the same numbers as one JSON document on stdout."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich import box


def compact(table: Any) -> Any:
    """`table` with its values kept whole: each column's min_width is its widest value (headers wrap
    instead), a light box and no edge padding; -> the table."""
    table.box = box.SIMPLE_HEAD
    table.pad_edge = False
    table.collapse_padding = True
    for column in table.columns:
        widths = [len(str(cell)) for cell in column._cells]
        column.min_width = max(widths, default=0)
        column.overflow = "fold"  # never "...": a value too wide even so wraps whole
    return table


def add_format_argument(p: Any) -> None:
    p.add_argument("--format", choices=("table", "json"), default="table",
                   help="table: for reading (fits 80 columns when piped); json: every number as one JSON document "
                   "on stdout")


def print_json(data: Any) -> None:
    """`data` as JSON on stdout (no rich markup or wrapping)."""
    json.dump(data, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def emit(args: Any, data: dict[str, Any]) -> None:
    """Every number of a command: to --json PATH when given, and to stdout with --format json."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    if args.format == "json":
        print_json(data)
