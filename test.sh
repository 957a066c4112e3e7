#!/usr/bin/env bash
# The test suite: set up, lint, then every test (CPU, float32).
set -euo pipefail
cd "$(dirname "$0")"
. scripts/setup.sh test
ruff check jaxspec tests bench notebooks experiments scripts
# The GPU lowering tests once more under jax 0.12 (.venv312, built once); JAXSPEC_JAX012=0 skips them.
[ "${JAXSPEC_JAX012:-1}" = 0 ] || bash scripts/test_jax012.sh -q
# Compiling is most of the suite's time: LLVM without its expensive passes compiles the tiny test
# programs ~30% faster and runs them about as fast (the tests check values, never speed; the worker
# subprocesses already ran this way). One persistent XLA cache for this run, shared by both xdist
# workers and every subprocess, turns repeated compiles into file reads; removed at the end.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d)"
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
python -m pytest -n 2 --dist loadfile --durations=30 tests "$@"
