#!/usr/bin/env bash
# Runs (or resumes) `make studies` from a second checkout pinned to one commit, in the background, so that code
# changed meanwhile in this checkout never reaches a running study (issue 28's reruns).
# Usage: bash experiments/pinned_study.sh COMMIT [DIR, default ../study]   start or resume; prints what it did
#        bash experiments/pinned_study.sh COMMIT [DIR] -- OVERRIDES...   the same, running `python -m batchrnn.study
#                                                                        OVERRIDES` instead of `make studies`
#        bash experiments/pinned_study.sh stop [DIR]                     SIGTERM: every run stops at its last epoch
#        bash experiments/pinned_study.sh running [DIR]                  the study's processes there, one pid a line
# What it does, each step skipped where already done:
#   1. `git worktree add DIR COMMIT` (refused if DIR holds another commit: a study keeps one commit), and
#      `make venv` there (its own .venv: a shared one is an editable install of whichever checkout ran make last);
#   2. puts the ended runs kept in this checkout's experiments/results/ back into DIR/runs/ (a new machine);
#   3. starts experiments/keep_results.sh in DIR with KEEP_TO=this checkout's experiments/results/;
#   4. starts `make studies ARGS=hydra/launcher=parallel` in DIR (two 1-thread jobs on 2 cores), or, given
#      OVERRIDES after `--`, prepares the data of each `experiment=` preset among them and starts
#      `python -m batchrnn.study OVERRIDES --wandb` (say hydra/launcher=parallel yourself), AN4_ARCHIVE
#      absolute, GOMP_SPINCOUNT=10000, in its own session whose scheduler group gets nice -10: with the kernel's
#      autogroups, `nice` acts only inside a session, so a test suite started from another terminal would
#      otherwise take half the cores from the study; its processes may dump cores (ulimit -c at the hard limit).
# Logs: DIR/study.log (the study), DIR/keep.log (the results kept), DIR/commands.log (what ran, when, at which commit).
set -euo pipefail
MAIN="$(cd "$(dirname "$0")/.." && pwd)"
USAGE="usage: pinned_study.sh COMMIT [DIR] [-- STUDY OVERRIDES...] | stop [DIR] | running [DIR]"
ACTION="${1:?$USAGE}"
shift
DIR="$MAIN/../study"
if [ $# -gt 0 ] && [ "$1" != -- ]; then DIR="$1"; shift; fi
DIR="$(realpath -m "$DIR")"
STUDY=()  # empty: make studies
if [ $# -gt 0 ]; then
  [ "$1" = -- ] || { echo "error: unexpected '$1'; $USAGE" >&2; exit 2; }
  shift
  [ $# -gt 0 ] || { echo "error: nothing after --: give the study's overrides (python -m batchrnn.study's)," \
                         "or leave out -- to run make studies" >&2; exit 2; }
  [ "$ACTION" != stop ] && [ "$ACTION" != running ] || { echo "error: $ACTION takes no overrides; $USAGE" >&2
                                                          exit 2; }
  STUDY=("$@")
fi
in_dir() {  # the processes running $1 whose working directory is DIR
  for pid in $(pgrep -f "$1" || true); do [ "$(readlink "/proc/$pid/cwd")" != "$DIR" ] || echo "$pid"; done
}
if [ "$ACTION" = running ]; then  # what finish_study.py asks before it touches DIR's runs
  in_dir "python -m batchrnn.study"
  exit 0
fi
if [ "$ACTION" = stop ]; then
  pids="$(in_dir "python -m batchrnn.study")"
  [ -z "$pids" ] || { kill -TERM $pids; echo "study: stopped ($pids); its runs resume from their last epoch"; }
  pids="$(in_dir "keep_results.sh")"
  [ -z "$pids" ] || kill $pids
  [ ! -d "$DIR" ] || echo "$(date -u +%FT%TZ) stopped" >> "$DIR/commands.log"
  exit 0
fi
COMMIT="$(git -C "$MAIN" rev-parse --verify "$ACTION^{commit}")"
if [ -d "$DIR" ]; then
  have="$(git -C "$DIR" rev-parse HEAD)"
  [ "$have" = "$COMMIT" ] || { echo "error: $DIR is at $have, not $COMMIT; a study keeps one commit (stop it, then" \
                                    "git worktree remove $DIR to start another)" >&2; exit 2; }
else
  git -C "$MAIN" worktree add --detach "$DIR" "$COMMIT"
fi
cd "$DIR"
[ -n "$(ls .venv/.installed-* 2>/dev/null)" ] || make venv
if [ -n "$(in_dir "python -m batchrnn.study")" ]; then
  echo "study: already running in $DIR"; exit 0
fi
for study in an4_cpu_plateau an4_depth_plateau an4_cpu_patience; do
  [ -d "$MAIN/experiments/results/$study" ] || continue
  mkdir -p "runs/$study"
  cp -rn "$MAIN/experiments/results/$study"/*/ "runs/$study/" 2>/dev/null || true
done
ARCHIVE="$(realpath "${AN4_ARCHIVE:-$MAIN/../shared/data/an4_sphere.tar.gz}")"
RUNS="make studies ARGS=hydra/launcher=parallel"
[ ${#STUDY[@]} -eq 0 ] || RUNS="python -m batchrnn.study ${STUDY[*]} --wandb"
echo "$(date -u +%FT%TZ) start at $COMMIT on $(hostname) (boot $(cut -c1-8 /proc/sys/kernel/random/boot_id)): $RUNS" \
  >> commands.log
# the redirections on the whole list: the subshell that `&` makes of it would otherwise hold this script's output
# open as long as keep_results.sh runs, and a caller reading that output (a pipe, $(...)) would wait for it
{ [ -n "$(in_dir keep_results.sh)" ] || \
  KEEP_TO="$MAIN/experiments/results" setsid nohup bash experiments/keep_results.sh 120; } >> keep.log 2>&1 < /dev/null &
# A run process that dies of a signal leaves a core (where kernel.core_pattern says; "core" in DIR here) to read
# with gdb: 2 of 6 SIGTERM stops in session 18 printed glibc's heap-corruption message from a run at exit.
ulimit -S -c "$(ulimit -H -c)"
if [ ${#STUDY[@]} -eq 0 ]; then
  AN4_ARCHIVE="$ARCHIVE" GOMP_SPINCOUNT=10000 setsid nohup make studies ARGS=hydra/launcher=parallel \
    >> study.log 2>&1 < /dev/null &
else
  # as reproduce_an4.sh does: each preset's data once, before any job (two jobs would otherwise both fetch it)
  for arg in "${STUDY[@]}"; do
    [[ "$arg" != experiment=* ]] || AN4_ARCHIVE="$ARCHIVE" .venv/bin/python -m batchrnn.data \
      --preset "${arg#experiment=}" --root data --features >> study.log 2>&1 || \
      { echo "error: preparing the data of ${arg#experiment=} failed, so the study did not start; its" \
             "message is at the end of $DIR/study.log" >&2; exit 1; }
  done
  AN4_ARCHIVE="$ARCHIVE" GOMP_SPINCOUNT=10000 setsid nohup .venv/bin/python -m batchrnn.study "${STUDY[@]}" --wandb \
    >> study.log 2>&1 < /dev/null &
fi
sleep 2
echo -10 > "/proc/$!/autogroup" 2>/dev/null || echo "note: could not raise the study's scheduler group (not root?)"
echo "study: started in $DIR at $COMMIT (log: $DIR/study.log; results kept in $MAIN/experiments/results)"
