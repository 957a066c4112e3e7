#!/usr/bin/env bash
# The test suite: set up, lint, then every test (CPU, float32).
set -euo pipefail
cd "$(dirname "$0")"
# The GPU lowering tests once more under jax 0.12 (.venv312, built once); JAXSPEC_JAX012=0 skips them.
# That leg installs into its own venv and runs while .venv installs (both mostly wait on downloads).
JAX012_PID="" CACHE_DIR=""
cleanup() { [ -z "$JAX012_PID" ] || kill "$JAX012_PID" 2>/dev/null || true; [ -z "$CACHE_DIR" ] || rm -rf "$CACHE_DIR"; }
trap cleanup EXIT
if [ "${JAXSPEC_JAX012:-1}" != 0 ]; then
  JAX012_LOG="$(mktemp)"
  bash scripts/test_jax012.sh -q >"$JAX012_LOG" 2>&1 &
  JAX012_PID=$!
fi
. scripts/setup.sh test
ruff check jaxspec tests bench notebooks experiments scripts
if [ -n "$JAX012_PID" ]; then
  rc=0; wait "$JAX012_PID" || rc=$?
  JAX012_PID=""
  cat "$JAX012_LOG"; rm -f "$JAX012_LOG"
  [ "$rc" = 0 ] || { echo "test.sh: the GPU lowering tests under jax 0.12 failed (exit $rc)" >&2; exit "$rc"; }
fi
# Compiling is most of the suite's time: LLVM without its expensive passes compiles the tiny test
# programs ~30% faster and runs them about as fast (the tests check values, never speed; the worker
# subprocesses already ran this way). One persistent XLA cache for this run, shared by both xdist
# workers and every subprocess, turns repeated compiles into file reads; removed at the end. (The
# worker segfaults once blamed on writing it came from the memory-map limit: tests/conftest.py.)
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  CACHE_DIR="$(mktemp -d)"
  JAX_COMPILATION_CACHE_DIR="$CACHE_DIR"
fi
export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=30 tests "$@"
