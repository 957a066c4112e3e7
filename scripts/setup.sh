#!/usr/bin/env bash
# Create .venv (once) and install what a command needs. Sourced by run.sh and test.sh:
#   . scripts/setup.sh runtime   the package and its runtime dependencies (the main job)
#   . scripts/setup.sh test      + the test extras, and torch + transformers for the HF parity tests
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHAT="${1:-runtime}"
case "$WHAT" in runtime|test) ;; *) echo "setup.sh: want 'runtime' or 'test', got '$WHAT'" >&2; exit 2 ;; esac
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PY" -m venv "$ROOT/.venv"
fi
# shellcheck disable=SC1091
. "$ROOT/.venv/bin/activate"
LOG="$ROOT/.venv/setup.log"
STAMP="$ROOT/.venv/.jaxspec-$WHAT"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  if [ "$WHAT" = runtime ]; then
    echo "setup: installing jaxspec and its runtime dependencies into .venv (log: $LOG)"
    TARGET="$ROOT"
  else
    echo "setup: installing jaxspec, its runtime and test dependencies into .venv (log: $LOG)"
    TARGET="$ROOT[test]"
  fi
  if ! { python -m pip install -q --upgrade pip && python -m pip install -q -e "$TARGET"; } >>"$LOG" 2>&1; then
    tail -30 "$LOG"; echo "setup: pip install failed (see $LOG)" >&2; exit 1
  fi
  if [ "$WHAT" = test ]; then
    # HF parity tests compare against transformers' DeepSeek-V4; the pinned CPU torch wheel avoids
    # a multi-GB CUDA download. Without them those tests skip with a reason.
    if ! python -m pip install -q "torch==2.13.0" "transformers>=5.24" >>"$LOG" 2>&1; then
      echo "setup: torch/transformers unavailable; HF parity tests will skip"
    fi
    touch "$ROOT/.venv/.jaxspec-runtime"
  fi
  touch "$STAMP"
fi
