#!/usr/bin/env bash
# `make reproduce-an4`: prepare AN4, run the grid gru,lstm x none,post,input,skip,seqwise over SEEDS, then the
# report (also logged to W&B). `make reproduce-depth` passes `depth`: DS2's Table 1 design, experiment=an4_depth.
# Usage: experiments/reproduce_an4.sh [grid|depth] [extra Hydra overrides, e.g. hydra/launcher=parallel]
# PRESET (an4_gpu with CUDA, else an4_cpu; the grid only) and SEEDS (comma-separated, default 1,2,3) can be
# set in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
SEEDS="${SEEDS:-1,2,3}"
STUDY="${1:-grid}"
shift || true
if [ "$STUDY" = depth ]; then
  PRESET=an4_depth
  SWEEP=runs/an4_depth
  GRID=(experiment=an4_depth)  # its sweep (1,3,5,7 layers x none,seqwise) is in conf/experiment/an4_depth.yaml
else
  PRESET="${PRESET:-$($PY -c 'import torch; print("an4_gpu" if torch.cuda.is_available() else "an4_cpu")')}"
  SWEEP="runs/$PRESET"
  GRID=("experiment=$PRESET" model.rnn=gru,lstm model.bn=none,post,input,skip,seqwise)
fi
echo "reproduce-an4: ${GRID[*]}, seeds $SEEDS, runs in $SWEEP"
# Fetch (or take $AN4_ARCHIVE), extract, verify, split and compute the preset's features: once, before any job.
$PY -m batchrnn.data --preset "$PRESET" --root data --features
status=0
$PY src/run.py -m "${GRID[@]}" "seed=$SEEDS" "$@" || status=$?  # runs that failed: report the others anyway
$PY -m batchrnn.report "$SWEEP" --wandb
echo "reproduce-an4: report in $SWEEP/report.md"
exit $status
