#!/usr/bin/env bash
# The test suite: set up, lint, then every test (CPU, float32).
set -euo pipefail
cd "$(dirname "$0")"
. scripts/setup.sh test
ruff check jaxspec tests bench notebooks
exec python -m pytest -n 2 --durations=25 tests "$@"
