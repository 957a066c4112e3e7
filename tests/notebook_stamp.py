"""The stamp an executed notebook carries: a hash of its code cells' sources, written by
scripts/execute_notebooks.py and checked by tests/test_notebooks.py (outputs older than the code
that made them are stale)."""

from __future__ import annotations

import hashlib
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
