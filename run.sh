#!/usr/bin/env bash
# The main job: set up, then generate with jaxspec and print tokens/s.
set -euo pipefail
cd "$(dirname "$0")"
. scripts/setup.sh
exec python -m jaxspec demo "$@"
