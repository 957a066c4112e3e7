"""The research notebooks run top to bottom: each is executed in a fresh kernel (nbclient), from the
repository root, and any cell error fails the test.

03's sweep grid is its slow part (one XLA program per spec); CI runs every cell of it on a smaller
grid injected after its `parameters` cell (papermill's convention). JAXSPEC_FULL_NOTEBOOKS=1 runs
the notebook's own grid.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from notebook_stamp import STAMP_KEY, code_hash, has_figure, missing_figures

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHECKPOINT = ROOT / "checkpoints" / "tiny-v4"
FULL = bool(os.environ.get("JAXSPEC_FULL_NOTEBOOKS"))

CI_PARAMETERS = {
    "03_tree_vs_linear.ipynb": 'DATASETS = ("gsm8k",)\nSPECS = ("s4_k1_d5", "s3_k2_d5")\n',
}
NEEDS_CHECKPOINT = {"01_anatomy_of_a_cycle.ipynb", "03_tree_vs_linear.ipynb"}
TIMEOUT_S = 600  # per cell; a quiet 2-core CPU runs each notebook in about a minute (03's CI grid: ~80 s)


def _inject(nb, source: str) -> None:
    """Insert `source` as a code cell right after the cell tagged `parameters`."""
    for i, cell in enumerate(nb.cells):
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            nb.cells.insert(i + 1, nbformat.v4.new_code_cell(source))
            return
    raise AssertionError("notebook has no cell tagged 'parameters'")


def _execute(name: str):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    if not FULL and name in CI_PARAMETERS:
        _inject(nb, CI_PARAMETERS[name])
    env = dict(os.environ)
    # Compile time dominates these short CPU runs; LLVM level 0 roughly halves it (results unchanged).
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    client = nbclient.NotebookClient(
        nb, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    start = time.perf_counter()
    client.execute(env=env, cwd=str(ROOT))
    return nb, time.perf_counter() - start


def test_notebooks_hold_their_outputs_and_figures():
    """Committed notebooks are executed (a repository page shows what they compute), hold at least one
    figure and no error, and their stamp matches their code cells: outputs older than the code are stale
    (refresh: python scripts/execute_notebooks.py NAME)."""
    names = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert names == ["01_anatomy_of_a_cycle.ipynb", "02_branch_isolation.ipynb", "03_tree_vs_linear.ipynb"]
    for name in names:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.execution_count is not None for c in code), f"{name}: not executed"
        assert not [o for c in code for o in c.outputs if o.output_type == "error"], f"{name}: an error is committed"
        assert any(has_figure(c) for c in code), f"{name}: no figure"
        assert missing_figures(nb) == [], f"{name}: cells that draw hold no figure (re-execute the notebook)"
        stamp = nb.metadata.get(STAMP_KEY, {}).get("code_hash")
        assert stamp == code_hash(nb), f"{name}: outputs are stale (code changed since they were made)"


def test_library_plots_leave_a_notebooks_inline_figures_alone(tmp_path):
    """A library function that draws a PNG (the loss curve, the reliability diagram) must not switch
    matplotlib's global backend: once `matplotlib.use("Agg")` ran inside a kernel, every later inline
    figure of the notebook vanished (03 lost five). A kernel of three cells: inline figure, library
    plot, inline figure; each figure cell holds its figure."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([0, 1])\nplt.show()",
        "from jaxspec.training.train import write_curve\n"
        f"write_curve([{{'step': 1, 'train_main': 2.0}}], {str(tmp_path / 'c.csv')!r}, {str(tmp_path / 'c.png')!r})",
        "fig, ax = plt.subplots()\nax.plot([1, 0])\nplt.show()",
    )]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute(cwd=str(ROOT))
    assert (tmp_path / "c.png").is_file()
    assert missing_figures(nb) == []
    assert [has_figure(c) for c in nb.cells] == [True, False, True]


def test_figure_counting_sees_a_cell_that_lost_its_figure():
    cell = nbformat.v4.new_code_cell("fig, ax = plt.subplots()  # plt.figure( in a comment is not counted\nplt.show()")
    nb = nbformat.v4.new_notebook()
    nb.cells = [cell]
    [line] = missing_figures(nb)
    assert line.startswith("cell 0 (fig, ax = plt.subplots()") and line.endswith("draws 1, holds 0")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"image/png": "", "text/plain": "<Figure>"})]
    assert missing_figures(nb) == []


def test_the_stamp_notices_a_changed_cell():
    nb = nbformat.read(NOTEBOOKS / "02_branch_isolation.ipynb", as_version=4)
    before = code_hash(nb)
    next(c for c in nb.cells if c.cell_type == "code").source += "\n"
    assert code_hash(nb) != before


# Notebook 03 runs for four minutes (it speculates on the shipped checkpoint over held-out prompts) and 02
# for half a minute: the long tier runs them; CI runs 01 (the same executor and figure checks) and checks
# every notebook's committed outputs and figures per cell (test_notebooks_hold_their_outputs_and_figures).
@pytest.mark.parametrize(
    "name", ["01_anatomy_of_a_cycle.ipynb", pytest.param("02_branch_isolation.ipynb", marks=pytest.mark.long),
             pytest.param("03_tree_vs_linear.ipynb", marks=pytest.mark.long)]
)
def test_notebook_runs(name):
    """Every cell runs without error, and every cell whose committed output holds a figure draws one."""
    if name in NEEDS_CHECKPOINT and not (CHECKPOINT / "config.json").is_file():
        pytest.skip(f"{CHECKPOINT.relative_to(ROOT)} absent (the trained tiny checkpoint)")
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb, seconds = _execute(name)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors  # nbclient raises on the first error; this guards allow_errors cells
    drawn = {c.source for c in nb.cells if c.cell_type == "code" and has_figure(c)}
    missing = [c.source.splitlines()[0] for c in committed.cells if c.cell_type == "code" and has_figure(c)
               and c.source not in drawn]
    assert missing == [], f"{name}: cells that drew a figure when committed draw none now: {missing}"
    assert missing_figures(nb) == [], f"{name}: cells that draw hold no figure"
    print(f"{name}: {seconds:.0f} s")
