#!/usr/bin/env bash
# Create .venv (once) and install jaxspec with its test extras. Sourced by run.sh and test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PY" -m venv "$ROOT/.venv"
fi
# shellcheck disable=SC1091
. "$ROOT/.venv/bin/activate"
STAMP="$ROOT/.venv/.jaxspec-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  LOG="$ROOT/.venv/setup.log"
  echo "setup: installing jaxspec and its test dependencies into .venv (log: $LOG)"
  if ! { python -m pip install -q --upgrade pip && python -m pip install -q -e "$ROOT[test]"; } >"$LOG" 2>&1; then
    tail -30 "$LOG"; echo "setup: pip install failed (see $LOG)" >&2; exit 1
  fi
  # HF parity tests compare against transformers' DeepSeek-V4; the pinned CPU torch wheel avoids
  # a multi-GB CUDA download. Without them those tests skip with a reason.
  if ! python -m pip install -q "torch==2.13.0" "transformers>=5.24" >>"$LOG" 2>&1; then
    echo "setup: torch/transformers unavailable; HF parity tests will skip"
  fi
  touch "$STAMP"
fi
