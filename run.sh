#!/usr/bin/env bash
# The main job: set up, then generate with the shipped checkpoint (plain and tree-speculative, the spec
# its tune.json chose) and print the text, tau and the measured speed-up with its spread and verdict.
# Extra arguments go to `jaxspec demo` after run.sh's own defaults, so yours win (argparse keeps the
# last); --help shows both, --dry-run prints the command and stops.
set -euo pipefail
cd "$(dirname "$0")"
DEMO=(--batch 6 --new-tokens 128)  # run.sh's defaults, in place of `jaxspec demo`'s own (--batch 4 --new-tokens 64)
if [ -d checkpoints/tiny-v4 ] && [[ ! " $* " =~ \ --(checkpoint|preset)[=\ ] ]]; then
  DEMO=(--checkpoint checkpoints/tiny-v4 "${DEMO[@]}")
fi
ARGS=()
for a in "$@"; do
  case "$a" in
    --dry-run) echo "python -m jaxspec demo ${DEMO[*]}${ARGS[*]:+ ${ARGS[*]}}"; exit 0 ;;
    -h|--help) echo "./run.sh runs: python -m jaxspec demo ${DEMO[*]} [ARGS]"
               echo "(these replace the demo defaults shown below; ARGS replace them; --dry-run prints the command)"
               echo; ARGS+=("$a") ;;
    *) ARGS+=("$a") ;;
  esac
done
. scripts/setup.sh runtime
exec python -m jaxspec demo "${DEMO[@]}" ${ARGS[@]+"${ARGS[@]}"}
