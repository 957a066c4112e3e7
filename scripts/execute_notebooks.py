"""Execute the notebooks in place with their own parameters, so the repository shows their outputs
and figures; stamp each with the hash of its code cells (tests/test_notebooks.py fails when a code
cell changes and the outputs were not refreshed).

    python scripts/execute_notebooks.py [NAME.ipynb ...]     # default: every notebook

Run from the repository root on a quiet machine (each notebook takes a minute or a few).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from notebook_stamp import STAMP_KEY, code_hash  # noqa: E402


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    start = time.perf_counter()
    client.execute(env=dict(os.environ), cwd=str(ROOT))
    nb.metadata[STAMP_KEY] = {"code_hash": code_hash(nb)}
    nb.metadata.pop("widgets", None)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main() -> int:
    names = sys.argv[1:] or sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    for name in names:
        seconds = execute(ROOT / "notebooks" / Path(name).name)
        print(f"{name}: executed in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
