#!/usr/bin/env bash
# The test suite: set up, lint, then every test (CPU, float32).
set -euo pipefail
cd "$(dirname "$0")"
. scripts/setup.sh test
ruff check jaxspec tests bench notebooks
# The GPU lowering tests once more under jax 0.12 (.venv312, built once); JAXSPEC_JAX012=0 skips them.
[ "${JAXSPEC_JAX012:-1}" = 0 ] || bash scripts/test_jax012.sh -q
exec python -m pytest -n 2 --dist loadfile --durations=30 tests "$@"
