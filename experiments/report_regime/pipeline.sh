#!/usr/bin/env bash
# Everything of docs/report_regime.md in priority order, one step after another on core 1 (each step
# resumable: a rerun skips what its records already hold). Log: runs/pipeline.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD JAXSPEC_DATA=${JAXSPEC_DATA:-/work/shared/data}
export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false"
E=experiments/report_regime
step() { echo "== $(date +%T) $*"; }
step train; taskset -c 1 python -m jaxspec distill --recipe one-step --checkpoint checkpoints/tiny-v4 \
    --draft-name one-step --steps ${TRAIN_STEPS:-240} --batch 8 --seq-len 256 --lr 2e-3 --warmup 40 --eval-every 100 \
    --run-dir runs/one-step
[ -f checkpoints/tiny-v4/drafts/one-step/calibration.json ] || { step calibrate; taskset -c 1 python -m jaxspec calibrate \
    --checkpoint checkpoints/tiny-v4 --draft one-step --num-prompts 32 --temperatures 1.0 --cycles 12 --batch-size 48 \
    --heldout 16 --figure checkpoints/tiny-v4/drafts/one-step/calibration_reliability.png; }
step grid one-step d5-8; bash $E/grid.sh one-step d5-8
step grid default d5-8; bash $E/grid.sh default d5-8
for d in one-step default; do step acceptance $d; taskset -c 1 python $E/acceptance.py --draft $d --prompts 16 --cycles 12; done
step report; python $E/report.py > /dev/null
tree8=$(python -c "import json; print([r['tree'] for r in json.load(open('results/report_regime/table1.json'))['one-step'] if r['D'] == 8][0])")
step spread one-step s7_k1_d8,$tree8; SPECS=s7_k1_d8,$tree8 bash $E/grid.sh one-step spread
step spread default s7_k1_d8; SPECS=s7_k1_d8 bash $E/grid.sh default spread
step grid one-step d12-16; bash $E/grid.sh one-step d12-16
step grid default d12-16; bash $E/grid.sh default d12-16
step humaneval one-step; bash $E/grid.sh one-step humaneval
step humaneval default; SPECS=s4_k1_d5,s5_k1_d6,s6_k1_d7,s7_k1_d8,s7_k2_d8,s3_k2_d8 bash $E/grid.sh default humaneval
[ -f checkpoints/tiny-v4/drafts/one-step/tune.json ] || { step tune; taskset -c 1 python $E/tune_draft.py one-step \
    --checkpoint checkpoints/tiny-v4 --num-prompts 2 --batch-sizes 1,4,16,64 --iters 4 --new-tokens 64 \
    --candidates s3_k1_d4,s7_k1_d8,s3_k2_d8,s4_k2_d8; }
step report; python $E/report.py > /dev/null; python $E/cost_projection.py > /dev/null
step done
