#!/usr/bin/env bash
# Create .venv (once) and install what a command needs. Sourced by run.sh and test.sh:
#   . scripts/setup.sh runtime   the package and its runtime dependencies (the main job)
#   . scripts/setup.sh test      + the test extras (pinned), and the oracles: CPU torch, mlx, mlx-vlm (target and DSpark)
#   . scripts/setup.sh jax012    .venv312: Python 3.12, jax 0.12 and pytest (+ xdist) only (the GPU lowering tests)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHAT="${1:-runtime}"
case "$WHAT" in runtime|test|jax012) ;; *) echo "setup.sh: want 'runtime', 'test' or 'jax012', got '$WHAT'" >&2; exit 2 ;; esac
VENV="$ROOT/.venv"
if [ "$WHAT" = jax012 ]; then
  VENV="$ROOT/.venv312"
  PY="${PYTHON312:-python3.12}"
  # pyenv's shim refuses a version that is installed but not selected; take the interpreter itself
  if ! "$PY" -c pass 2>/dev/null; then PY="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"; fi
  if [ -z "$PY" ]; then echo "setup: no python3.12 found (set PYTHON312)" >&2; return 3 2>/dev/null || exit 3; fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || { echo "setup: '$PY -m venv $VENV' failed" >&2; exit 1; }
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
LOG="$VENV/setup.log"
STAMP="$VENV/.jaxspec-$WHAT"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$ROOT/scripts/setup.sh" -nt "$STAMP" ]; then
  if [ "$WHAT" = jax012 ]; then
    echo "setup: installing jaxspec with jax 0.12 into .venv312 (log: $LOG)"
    TARGET="$ROOT"
    python -m pip install -q "jax==0.12.*" "jaxlib==0.12.*" "pytest==9.2.0" "pytest-xdist==3.8.0" >>"$LOG" 2>&1 || { tail -30 "$LOG"; exit 1; }
  elif [ "$WHAT" = runtime ]; then
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
    # The oracles the tests import (a missing one fails CI, it does not skip): transformers'
    # DeepSeek-V4 on torch (tests/test_hf_parity.py; transformers is pinned in the test extras) and
    # mlx-vlm's on MLX's CPU build (tests/test_mlx_parity.py). torch is the CPU build, never the CUDA
    # one PyPI serves under the same version (several GB): a local wheel where pip's find-links has
    # one, else PyTorch's CPU index (a ~190 MB wheel). macOS wheels on PyPI are CPU builds already.
    TORCH="torch==2.13.0+cpu"
    [ "$(uname -s)" = Darwin ] && TORCH="torch==2.13.0"
    if ! python -m pip install -q "$TORCH" >>"$LOG" 2>&1 \
        && ! python -m pip install -q --extra-index-url https://download.pytorch.org/whl/cpu "$TORCH" >>"$LOG" 2>&1; then
      tail -30 "$LOG"; echo "setup: $TORCH could not be installed (see $LOG); the HF parity tests need it" >&2; exit 1
    fi
    if ! python -m pip install -q "mlx[cpu]==0.32.4" "mlx-vlm==0.7.10" >>"$LOG" 2>&1; then
      tail -30 "$LOG"; echo "setup: mlx / mlx-vlm could not be installed (see $LOG); the MLX parity tests need them" >&2
      exit 1
    fi
    touch "$ROOT/.venv/.jaxspec-runtime"
  fi
  touch "$STAMP"
fi
