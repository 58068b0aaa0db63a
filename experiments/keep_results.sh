#!/usr/bin/env bash
# Beside a long study: copy each ended run's results.json (status finished or diverged) from runs/ into
# experiments/results/ as it ends, so that a session which ends (or a machine replaced) loses no ended run.
# Usage: bash experiments/keep_results.sh [seconds between passes, default 120] &   (stop it with kill)
#        bash experiments/keep_results.sh once                                     (one pass)
# On a new machine, the reverse puts the ended runs back, and the study skips them:
#   mkdir -p runs/an4_cpu runs/an4_depth
#   cp -rn experiments/results/an4_cpu_protocol/* runs/an4_cpu/
#   cp -rn experiments/results/an4_depth_protocol/* runs/an4_depth/
set -uo pipefail
cd "$(dirname "$0")/.."
every="${1:-120}"
while true; do
  for pair in an4_cpu:an4_cpu_protocol an4_depth:an4_depth_protocol; do
    src="runs/${pair%%:*}" dst="experiments/results/${pair##*:}"
    for f in "$src"/*/results.json; do
      [ -f "$f" ] || continue
      run="$(basename "$(dirname "$f")")"
      [ -f "$dst/$run/results.json" ] && continue
      grep -Eq '"status": "(finished|diverged)"' "$f" || continue
      mkdir -p "$dst/$run" && cp "$f" "$dst/$run/results.json" && echo "$(date +%T) kept $dst/$run"
    done
  done
  [ "$every" = once ] && exit 0
  sleep "$every"
done
