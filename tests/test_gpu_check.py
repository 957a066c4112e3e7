"""`scripts/gpu_check.sh OUTDIR --dry-run`: the one-shot GPU check, end to end on this CPU with tiny sizes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_its_reports(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, VIRTUAL_ENV=os.environ.get("VIRTUAL_ENV", "") or sys.prefix)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["dry_run"] and result["grouped_experts"] and result["stages"]
    assert all(r["rel_err_vs_dense"] <= 1e-5 for r in result["grouped_experts"])
    assert {r["attention"] for r in result["stages"]} == {"pallas", "xla"}
    assert all(r["sum_of_stages_ms"] > 0 for r in result["stages"])
    assert json.loads((tmp_path / "kernels.json").read_text())
    collected = re.search(r"gpu_check: (\d+) tests marked gpu collected", (tmp_path / "tests.txt").read_text())
    assert collected and int(collected.group(1)) >= 20  # tests/test_gpu.py: kernels compiled, bf16 identity
    summary = (tmp_path / "summary.md").read_text()
    assert "Grouped experts" in summary and "Stage split" in summary and "(exit 0)" in summary
