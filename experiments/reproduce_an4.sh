#!/usr/bin/env bash
# `make reproduce-an4`: prepare AN4, run the grid gru,lstm x none,post,input,skip,seqwise, write the report.
# PRESET (an4_gpu with CUDA, else an4_cpu) and SEEDS (comma-separated) can be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PRESET="${PRESET:-$($PY -c 'import torch; print("an4_gpu" if torch.cuda.is_available() else "an4_cpu")')}"
SEEDS="${SEEDS:-0}"
echo "reproduce-an4: preset $PRESET, seeds $SEEDS, runs in runs/$PRESET"
$PY -m batchrnn.data --root data  # fetch (or take $AN4_ARCHIVE), extract, verify, split: once
$PY src/run.py -m "experiment=$PRESET" model.rnn=gru,lstm model.bn=none,post,input,skip,seqwise "seed=$SEEDS"
$PY -m batchrnn.report "runs/$PRESET"
echo "reproduce-an4: report in runs/$PRESET/report.md"
