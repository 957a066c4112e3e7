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
  python -m pip install -q --upgrade pip
  python -m pip install -q -e "$ROOT[test]"
  # HF parity tests compare against transformers' DeepSeek-V4; the pinned CPU torch wheel avoids
  # a multi-GB CUDA download. Without them those tests skip with a reason.
  python -m pip install -q "torch==2.13.0" "transformers>=5.24" || echo "setup: torch/transformers unavailable; HF parity tests will skip"
  touch "$STAMP"
fi
