#!/usr/bin/env bash
# The main job: set up, then generate with the shipped checkpoint (plain and tree-speculative) and
# print the text, tau and the measured speedup. Extra arguments go to `jaxspec demo`.
set -euo pipefail
cd "$(dirname "$0")"
. scripts/setup.sh runtime
if [ -d checkpoints/tiny-v4 ]; then
  exec python -m jaxspec demo --checkpoint checkpoints/tiny-v4 --batch 6 --new-tokens 128 "$@"
fi
exec python -m jaxspec demo "$@"
