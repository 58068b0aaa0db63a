#!/usr/bin/env bash
# Beside a long study: copy each ended run's results.json (status finished or diverged) from runs/ into
# experiments/results/ as it ends, so that a session which ends (or a machine replaced) loses no ended run.
# Usage: bash experiments/keep_results.sh [seconds between passes, default 120] &   (stop it with kill)
#        bash experiments/keep_results.sh once                                     (one pass)
# KEEP_TO=DIR copies into DIR instead of this checkout's experiments/results: a study run from a second
# checkout pinned to one commit keeps its results in the main checkout (KEEP_TO=/path/to/main/experiments/results).
# Study folders and where they are kept: runs/an4_cpu -> an4_cpu_protocol, runs/an4_depth -> an4_depth_protocol
# (the exponential-schedule studies), runs/an4_cpu_plateau and runs/an4_depth_plateau under their own names (the
# converged protocol, issue 28), and runs/an4_cpu_patience (issue 52). On a new machine, the reverse puts the ended runs back, and the study skips them:
#   mkdir -p runs/an4_cpu_plateau runs/an4_depth_plateau
#   cp -rn experiments/results/an4_cpu_plateau/* runs/an4_cpu_plateau/
#   cp -rn experiments/results/an4_depth_plateau/* runs/an4_depth_plateau/
set -uo pipefail
cd "$(dirname "$0")/.."
every="${1:-120}"
keep_to="${KEEP_TO:-experiments/results}"
while true; do
  for pair in an4_cpu:an4_cpu_protocol an4_depth:an4_depth_protocol an4_cpu_plateau:an4_cpu_plateau \
              an4_depth_plateau:an4_depth_plateau an4_cpu_patience:an4_cpu_patience; do
    src="runs/${pair%%:*}" dst="$keep_to/${pair##*:}"
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
