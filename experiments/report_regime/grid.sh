#!/usr/bin/env bash
# The report-regime grid for one draft (greedy tau, held-out, 32 prompts per dataset, batch 32):
#   bash experiments/report_regime/grid.sh DRAFT PART   PART: d5-8 | d12-16 | humaneval | spread
# LLVM's cheap passes and a persistent compile cache: compiling is most of a spec's cost on a CPU,
# and a chain's program is the same for both drafts (the parameters are arguments).
set -euo pipefail
draft=$1; part=$2
export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
export JAXSPEC_DATA=${JAXSPEC_DATA:-/work/shared/data} JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-runs/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
run() { taskset -c "${CORE:-1}" python experiments/report_regime/tau_grid.py --draft "$draft" --new-tokens 64 \
          --out results/report_regime/tau.jsonl "$@"; }
case $part in
  d5-8) run --prompts 32 --batch 32 --specs s4_k1_d5,s4_k2_d5,s2_k4_d5,s1_k4_d5,s5_k1_d6,s5_k2_d6,s3_k2_d6,s6_k1_d7,\
s6_k2_d7,s3_k2_d7,s7_k1_d8,s7_k2_d8,s3_k2_d8,s4_k2_d8,s3_k4_d8 ;;
  d12-16) run --prompts 32 --batch 32 --specs s11_k1_d12,s11_k2_d12,s5_k2_d12,s15_k1_d16,s15_k2_d16,s7_k2_d16 ;;
  humaneval) run --prompts 32 --batch 32 --datasets humaneval --specs ${SPECS:-s4_k1_d5,s4_k2_d5,s5_k1_d6,s5_k2_d6,\
s6_k1_d7,s6_k2_d7,s7_k1_d8,s7_k2_d8,s3_k2_d8} ;;
  spread) for b in 1 4 16 64; do run --prompts 32 --batch $b --specs "$SPECS"; done ;;
esac
