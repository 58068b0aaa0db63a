#!/usr/bin/env bash
# `make reproduce-an4`: prepare AN4, then every study the README's headline table rests on, under the converged
# protocol (batchrnn.study, issue 28), then the report (also to W&B). Three studies as one schedule, in one folder:
#   grid:  gru,lstm x none,post,input,skip,seqwise, each variant tuned on validation (the rate over the preset's
#          grid, widened past an edge, then SpecAugment off against on at that rate), each run trained until its
#          own validation stops improving (train.schedule=plateau), then SEEDS (default the preset's 1,2,3);
#   norms: ln, wn and ln_full beside them, the same protocol (NORMS=ln,wn,ln_full,rbn adds Cooijmans's recurrent BN);
#   lstm6: seeds 4-6 of every LSTM variant of both, at the settings already chosen (LSTM_SEEDS, default 1,...,6;
#          pre-registered in experiments/converged.md before they ran).
# `make reproduce-norms` passes `norms`: the norms alone, in the grid's folder.
# `make reproduce-depth` passes `depth`: DS2's Table 1 design, experiment=an4_depth_plateau, the same protocol;
# its 3-layer runs are the grid's.
# `make studies` passes `all`: grid, norms, lstm6, depth as one schedule (batchrnn.study's `then`): a later study's
# runs fill the slots an earlier one leaves free, and a study whose runs diverged or lack a rate (exit status 3 or
# 2, which its report explains) does not stop the next; a crash or a signal stops them all.
# SCHEDULE=exponential runs the earlier studies instead (presets an4_cpu or an4_gpu, and an4_depth: the rate x0.9
# an epoch; experiments/archive/), in their own folders, in their order (grid, depth, norms), three seeds each.
# Usage: experiments/reproduce_an4.sh [grid|depth|norms|all] [extra Hydra overrides, e.g. hydra/launcher=parallel]
# PRESET (the grid's and the norms'; by default the one a run without experiment= takes on this machine:
# an4_gpu_plateau with CUDA, else an4_cpu_plateau), SEEDS and LSTM_SEEDS (comma-separated) can be set in the
# environment. Run it again to resume: finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
STUDY="${1:-grid}"
shift || true
SCHEDULE="${SCHEDULE:-plateau}"
case "$SCHEDULE" in
  plateau) SUFFIX=_plateau HEADLINE=(grid norms lstm6) ALL=(grid norms lstm6 depth) ;;
  exponential) SUFFIX= HEADLINE=(grid) ALL=(grid depth norms) ;;
  *) echo "error: SCHEDULE=$SCHEDULE: use plateau (the converged protocol, the default) or exponential" >&2; exit 2 ;;
esac
case "$STUDY" in
  grid) STUDIES=("${HEADLINE[@]}") ;;
  depth|norms) STUDIES=("$STUDY") ;;
  all) STUDIES=("${ALL[@]}") ;;
  *) echo "error: unknown study '$STUDY'; use grid, depth, norms or all" >&2; exit 2 ;;
esac
DEVICE_PRESET="${PRESET:-$($PY -c 'from batchrnn.config import with_device_preset; print(with_device_preset([])[0][11:])')}"
[ -n "${PRESET:-}" ] || DEVICE_PRESET="${DEVICE_PRESET%_plateau}$SUFFIX"
ARGS=() PRESETS=()
for s in "${STUDIES[@]}"; do
  if [ "$s" = depth ]; then
    p="an4_depth$SUFFIX"
    GRID=("experiment=$p")  # its sweep (1,3,5,7 layers x none,seqwise) is in conf/experiment/$p.yaml
  elif [ "$s" = lstm6 ]; then
    p="$DEVICE_PRESET"
    GRID=("experiment=$p" model.rnn=lstm "model.bn=none,post,input,skip,seqwise,${NORMS:-ln,wn,ln_full}"
          "protocol.seeds=[${LSTM_SEEDS:-1,2,3,4,5,6}]")
  else
    p="$DEVICE_PRESET" BN=none,post,input,skip,seqwise
    [ "$s" = norms ] && BN="${NORMS:-ln,wn,ln_full}"
    GRID=("experiment=$p" model.rnn=gru,lstm "model.bn=$BN")
  fi
  [ -n "${SEEDS:-}" ] && [ "$s" != lstm6 ] && GRID+=("protocol.seeds=[$SEEDS]")
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
