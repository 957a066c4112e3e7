#!/usr/bin/env bash
# Everything behind docs/report_regime.md for one draft, one step after another on one core; run the
# two drafts side by side:
#   bash experiments/report_regime/pipeline.sh one-step 1 &  bash experiments/report_regime/pipeline.sh default 0
# Every step is resumable (a rerun skips what its records or files already hold). Then:
#   python experiments/report_regime/report.py; python experiments/report_regime/cost_projection.py
set -euo pipefail
cd "$(dirname "$0")/../.."
draft=$1; export CORE=${2:-1}
export JAXSPEC_DATA=${JAXSPEC_DATA:-../shared/data} XLA_FLAGS="--xla_cpu_multi_thread_eigen=false"
E=experiments/report_regime
step() { echo "== $(date +%T) $draft: $*"; }
if [ "$draft" = one-step ]; then
  step train; taskset -c "$CORE" python -m jaxspec distill --recipe one-step --checkpoint checkpoints/tiny-v4 \
      --draft-name one-step --steps "${TRAIN_STEPS:-240}" --batch 8 --seq-len 256 --lr 2e-3 --warmup 40 \
      --eval-every 100 --run-dir runs/one-step
  [ -f checkpoints/tiny-v4/drafts/one-step/calibration.json ] || { step calibrate; taskset -c "$CORE" python -m \
      jaxspec calibrate --checkpoint checkpoints/tiny-v4 --draft one-step --num-prompts 32 --temperatures 1.0 \
      --cycles 12 --batch-size 48 --heldout 16 \
      --figure checkpoints/tiny-v4/drafts/one-step/calibration_reliability.png; }
fi
step grid d5-8; bash $E/grid.sh "$draft" d5-8
step acceptance; taskset -c "$CORE" python $E/acceptance.py --draft "$draft" --prompts 16 --cycles 12
step spread; SPECS=${SPREAD_SPECS:-s7_k1_d8,s3_k2_d8} bash $E/grid.sh "$draft" spread
step grid d12-16; bash $E/grid.sh "$draft" d12-16
step humaneval; bash $E/grid.sh "$draft" humaneval
step done
