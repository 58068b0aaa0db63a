#!/usr/bin/env bash
# `make reproduce-an4`: prepare AN4, then the study under the fair protocol (batchrnn.study): every variant
# of gru,lstm x none,post,input,skip,seqwise tuned over the preset's learning rates on validation, trained
# until validation stops improving, then SEEDS at its chosen rate; then the report (also logged to W&B).
# `make reproduce-depth` passes `depth`: DS2's Table 1 design, experiment=an4_depth, under the same protocol.
# `make reproduce-norms` passes `norms`: issue 12's ln, wn and ln_full beside the grid, in the grid's folder, so
# its report compares them with every BN placement (NORMS=ln,wn,ln_full,rbn adds Cooijmans's recurrent BN).
# `make studies` passes `all`: grid, depth, norms as one schedule (batchrnn.study's `then`): a later study's runs
# fill the slots an earlier one leaves free, and a study whose runs diverged or lack a rate (exit status 3 or
# 2, which its report explains) does not stop the next; a crash or a signal stops them all.
# Usage: experiments/reproduce_an4.sh [grid|depth|norms|all] [extra Hydra overrides, e.g. hydra/launcher=parallel]
# PRESET (an4_gpu with CUDA, else an4_cpu; the grid and the norms) and SEEDS (comma-separated, default the
# preset's protocol.seeds, 1,2,3) can be set in the environment. Run it again to resume: finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
STUDY="${1:-grid}"
shift || true
case "$STUDY" in
  grid|depth|norms) STUDIES=("$STUDY") ;;
  all) STUDIES=(grid depth norms) ;;
  *) echo "error: unknown study '$STUDY'; use grid, depth, norms or all" >&2; exit 2 ;;
esac
DEVICE_PRESET="${PRESET:-$($PY -c 'from batchrnn.config import with_device_preset; print(with_device_preset([])[0][11:])')}"
ARGS=() PRESETS=()
for s in "${STUDIES[@]}"; do
  if [ "$s" = depth ]; then
    p=an4_depth
    GRID=(experiment=an4_depth)  # its sweep (1,3,5,7 layers x none,seqwise) is in conf/experiment/an4_depth.yaml
  else
    p="$DEVICE_PRESET" BN=none,post,input,skip,seqwise
    [ "$s" = norms ] && BN="${NORMS:-ln,wn,ln_full}"
    GRID=("experiment=$p" model.rnn=gru,lstm "model.bn=$BN")
  fi
  [ -n "${SEEDS:-}" ] && GRID+=("protocol.seeds=[$SEEDS]")
  [ ${#ARGS[@]} -eq 0 ] || ARGS+=(then)
  ARGS+=("${GRID[@]}" "$@")
  [[ " ${PRESETS[*]} " == *" $p "* ]] || PRESETS+=("$p")
done
echo "reproduce-an4: ${ARGS[*]}"
# Fetch (or take $AN4_ARCHIVE), extract, verify, split and compute each preset's features: once, before any job.
for p in "${PRESETS[@]}"; do
  $PY -m batchrnn.data --preset "$p" --root data --features
done
exec $PY -m batchrnn.study "${ARGS[@]}" --wandb
