"""The stamp an executed notebook carries: a hash of its code cells' sources, written by
scripts/execute_notebooks.py and checked by tests/test_notebooks.py (outputs older than the code
that made them are stale)."""

from __future__ import annotations

import hashlib
import io
import re
import tokenize
from typing import Any

STAMP_KEY = "jaxspec"


def code_hash(nb: Any) -> str:
    digest = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode())
            digest.update(b"\0")
    return digest.hexdigest()[:16]


def has_figure(cell: Any) -> bool:
    return any("image/png" in getattr(o, "data", {}) for o in cell.get("outputs", []))


# Calls that put one figure on the page each (a notebook cell's own drawing): a new pyplot figure, or
# an image file displayed. A cell calling one of them must hold at least that many figures.
FIGURE_CALLS = re.compile(r"\bplt\.(?:subplots|figure|subplot_mosaic)\(|\bdisplay\(\s*Image\(")


def figure_count(cell: Any) -> int:
    """Figures a cell's outputs hold (one per image/png output)."""
    return sum("image/png" in getattr(o, "data", {}) for o in cell.get("outputs", []))


def figures_drawn(cell: Any) -> int:
    """Figures a code cell draws, by its source: one per FIGURE_CALLS call written in it (a call
    inside a loop counts once, the least it draws)."""
    return len(FIGURE_CALLS.findall(_without_comments(cell.source)))


def _without_comments(source: str) -> str:
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]  # magics
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(lines)).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    for t in tokens:
        if t.type == tokenize.COMMENT:  # one line each
            row, col = t.start
            lines[row - 1] = lines[row - 1][:col]
    return "\n".join(lines)


def missing_figures(nb: Any) -> list[str]:
    """'cell N (first line): draws K, holds M' for every code cell holding fewer figures than it draws."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and figure_count(cell) < figures_drawn(cell):
            first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
            out.append(f"cell {i} ({first[:50]}): draws {figures_drawn(cell)}, holds {figure_count(cell)}")
    return out
