#!/usr/bin/env bash
# The GPU lowering tests again under jax 0.12 (Python 3.12, .venv312 built once by setup.sh):
# on jax >= 0.11 lowering for CUDA on a CPU host goes through an abstract mesh of CUDA devices.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh jax012
# Two workers, tests spread one by one: the lowerings are independent, and this leg runs before the main one.
exec python -m pytest -n 2 --dist load -m gpu_lowering -p no:cacheprovider tests/test_gpu_lowering.py "$@"
