#!/usr/bin/env bash
# The speed issue's measurements, in one quiet window (nothing else running; pinned to core 0).
# Writes every record under results/speed/ and tune.json beside the checkpoint.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
OUT=results/speed
CK=checkpoints/tiny-v4
python bench/roofline.py --checkpoint $CK --prompt-len 32 --core 0 --json $OUT/roofline_p32.json
python bench/roofline.py --checkpoint $CK --prompt-len 128 --core 0 --json $OUT/roofline_p128.json
python bench/spec_vs_ar.py --checkpoint $CK --specs s1_k1_d2 s3_k1_d4 s7_k1_d8 --new-tokens 64 --repeats 5 \
    --stage-iters 10 --fused-cycle --core 0 --json $OUT/spec_vs_ar_b1.json
python -m jaxspec tune --checkpoint $CK --core 0 "$@"
