#!/usr/bin/env bash
# `make reproduce-an4`: prepare AN4, then the study under the fair protocol (batchrnn.study): every variant
# of gru,lstm x none,post,input,skip,seqwise tuned over the preset's learning rates on validation, trained
# until validation stops improving, then SEEDS at its chosen rate; then the report (also logged to W&B).
# `make reproduce-depth` passes `depth`: DS2's Table 1 design, experiment=an4_depth, under the same protocol.
# `make reproduce-norms` passes `norms`: issue 12's ln, wn and ln_full beside the grid, in the grid's folder, so
# its report compares them with every BN placement (NORMS=ln,wn,ln_full,rbn adds Cooijmans's recurrent BN). `make studies` passes `all`: grid, depth, norms in turn.
# Usage: experiments/reproduce_an4.sh [grid|depth|norms|all] [extra Hydra overrides, e.g. hydra/launcher=parallel]
# PRESET (an4_gpu with CUDA, else an4_cpu; the grid only) and SEEDS (comma-separated, default the preset's
# protocol.seeds, 1,2,3) can be set in the environment. Run it again to resume: finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
STUDY="${1:-grid}"
shift || true
if [ "$STUDY" = all ]; then
  # A study that ends with 3 (some runs diverged, which the protocol counts) or 2 (a variant it could not
  # finish, e.g. every rate diverged; its report says which) does not stop the next one, which does not
  # depend on it; a crash or a signal (anything else) stops them all. The exit status is the worst one.
  worst=0
  for s in grid depth norms; do
    code=0
    bash "$0" "$s" "$@" || code=$?
    case "$code" in
      0) ;;
      2|3) echo "reproduce-an4: the $s study ended with exit status $code (see above); going on" >&2
           [ "$worst" -eq 2 ] || worst=$code ;;
      *) exit "$code" ;;
    esac
  done
  exit "$worst"
fi
case "$STUDY" in
  grid|depth|norms) ;;
  *) echo "error: unknown study '$STUDY'; use grid, depth, norms or all" >&2; exit 2 ;;
esac
if [ "$STUDY" = depth ]; then
  PRESET=an4_depth
  GRID=(experiment=an4_depth)  # its sweep (1,3,5,7 layers x none,seqwise) is in conf/experiment/an4_depth.yaml
else
  PRESET="${PRESET:-$($PY -c 'from batchrnn.config import with_device_preset; print(with_device_preset([])[0][11:])')}"
  BN=none,post,input,skip,seqwise
  [ "$STUDY" = norms ] && BN="${NORMS:-ln,wn,ln_full}"
  GRID=("experiment=$PRESET" model.rnn=gru,lstm "model.bn=$BN")
fi
[ -n "${SEEDS:-}" ] && GRID+=("protocol.seeds=[$SEEDS]")
echo "reproduce-an4: ${GRID[*]} $*"
# Fetch (or take $AN4_ARCHIVE), extract, verify, split and compute the preset's features: once, before any job.
$PY -m batchrnn.data --preset "$PRESET" --root data --features
exec $PY -m batchrnn.study "${GRID[@]}" "$@" --wandb
