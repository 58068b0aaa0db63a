"""What the patience study (conf/experiment/an4_cpu_patience.yaml, issue 52) costs, from the runs it can reuse.

    python experiments/patience_budget.py [experiments/results/an4_cpu_plateau]
    python experiments/patience_budget.py --left experiments/results/an4_cpu_patience [--checkpoints DIR]

Reads every results.json of the converged study, takes each variant's choices there (one tuning seed) and counts,
per stage, the runs the patience study reuses (the same folder name: protocol.reuse_from) and the runs it trains,
with their training hours: epochs x the variant's median epoch time (two 1-thread jobs at once, as that study ran).
Two cases bound it: the two-seed choices equal the one-seed ones and 3/6 is kept (fewest runs); 6/12 wins every
variant and 12/24 is tried everywhere (most). A run at k doublings is counted as its variant's mean best epoch plus
2^k times its mean epochs after the best (the tail that patience sets); the cap is not reached. No training.

--left: what the study has still to train, from its runs so far (the kept ones, and the converged study's beside
them, which it takes over where the settings match, except for protocol.reuse_needs_model's placements, whose
best.pt are gone). Per variant, the rate its tuning seeds' mean now favours and the runs each stage has left, in
two cases. Fewest: the rate stays where the mean puts it, with one rate past the edge where it sits on one; 3/6 is
kept; the final seeds are taken over where they can be. Most: the rate widens to the limit past its edge (past
either edge where the grid is not done), is chosen there, and 6/12 and 12/24 both train, so every final seed trains.
A run's hours: the variant's mean over its runs so far (epochs x median epoch time, as they ran, two 1-thread jobs
at once), patience's as above. Apart: the tuning runs at the kept rate whose best.pt is no longer in --checkpoints
(the pinned study's run folders) and whose kept results.json holds no LM decoding by today's rule (make
patience-decode), which train again before the LM decoding (make patience-finish, docs/protocol.md). An estimate
to plan sessions by, not a measurement.
"""
import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from batchrnn.study.protocol import mean_of, protocol_choice, rate, schedule_of, val_wer_for_choice
from batchrnn.training.identity import variant_key
from batchrnn.training.rundir import read_study

from finish_study import needs_model as lm_needs_model  # beside this script

SEEDS, TUNE_SEEDS, DOUBLINGS = range(1, 7), (1, 2), 2


def main(folder: Path) -> None:
    results = [r for r in read_study(folder)[0] if r.get("status") == "finished"]
    p = results[0]["config"]["protocol"]
    choice = protocol_choice([r for r in results if r["seed"] == 1], p | {"tune_seeds": [1]},
                             schedule_of(results[0]["config"]))
    runs = defaultdict(dict)  # variant -> {(lr, SpecAugment on, seed): results}
    for r in results:
        t = r["config"]["train"]
        runs[variant_key(r["config"])][t["lr"], t["spec_augment"]["enabled"], r["seed"]] = r
    total = {"fewest": [0, 0.0, 0], "most": [0, 0.0, 0]}  # trained runs, their hours, reused runs
    print("| variant | chosen (one seed) | epoch s | epochs (best + tail) | reused | trained, fewest | most |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for key, c in sorted(choice.items(), key=lambda kv: label(runs[kv[0]])):
        have = runs[key]
        mine = list(have.values())
        epoch_s = statistics.median(r["epoch_time_s"] for r in mine)
        best = statistics.mean(r["best_epoch"] for r in mine)
        tail = statistics.mean(len(r["epochs"]) - r["best_epoch"] for r in mine)
        hours = lambda k: (best + 2 ** k * tail) * epoch_s / 3600  # noqa: E731
        lr, on = c["lr"], c["augment"]
        # base schedule (3/6): the grid at both tuning seeds with SpecAugment on, off at the chosen rate
        base = [(x, True, s) for x in c["grid"] for s in TUNE_SEEDS] + [(lr, False, s) for s in TUNE_SEEDS]
        reused = [k for k in base if k in have]
        finals = [(lr, on, s) for s in SEEDS if s not in TUNE_SEEDS]
        kept_final = [k for k in finals if k in have]  # 3/6 kept: the old seeds at the chosen settings
        fewest = (len(base) - len(reused)) + 2 + (len(finals) - len(kept_final))  # 6/12 once, at both seeds
        most = (len(base) - len(reused)) + 2 * DOUBLINGS + len(finals)
        h_fewest = (len(base) - len(reused) + len(finals) - len(kept_final)) * hours(0) + 2 * hours(1)
        h_most = (len(base) - len(reused)) * hours(0) + 2 * sum(hours(k) for k in range(1, DOUBLINGS + 1)) \
            + len(finals) * hours(DOUBLINGS)
        for case, n, h in (("fewest", fewest, h_fewest), ("most", most, h_most)):
            total[case][0] += n
            total[case][1] += h
        reused_n = len(reused) + len(kept_final)
        total["fewest"][2] += reused_n
        total["most"][2] += len(reused)
        print(f"| {label(have)} | lr {lr:g}, SpecAugment {'on' if on else 'off'} | {epoch_s:.1f} | "
              f"{best:.0f} + {tail:.0f} | {reused_n} | {fewest} ({h_fewest:.1f} h) | {most} ({h_most:.1f} h) |")
    for case, (n, h, reused) in total.items():
        print(f"{case}: {n} runs trained, {h:.0f} h of training epochs (about {h / 2:.0f} h of the 2-core machine "
              f"at two 1-thread jobs), {reused} runs reused")


def label(have: dict) -> str:
    """rnn-bn of a variant's runs."""
    config = next(iter(have.values()))["config"]["model"]
    return f"{config['rnn']}-{config['bn']}"


def settings_of(r: dict) -> tuple:
    """(rnn, bn, lr, SpecAugment on, plateau_wait, seed) of a run: what the two studies' runs of this grid differ in
    (the preset's other settings are the same, so a run is taken over where these are)."""
    t, m = r["config"]["train"], r["config"]["model"]
    return m["rnn"], m["bn"], rate(t["lr"]), t["spec_augment"]["enabled"], t["plateau_wait"], r["seed"]


def ended(folder: Path) -> dict:
    """The runs that will not train again (finished or diverged), by settings_of."""
    return {settings_of(r): r for r in read_study(folder)[0] if val_wer_for_choice(r) is not None}


def left(folder: Path, earlier: Path, checkpoints: Path | None) -> None:
    done, before = ended(folder), ended(earlier)
    p = next(iter(done.values()))["config"]["protocol"]
    grid, wait = sorted(p["lrs"]), 3
    ratio = grid[1] / grid[0]
    tune, finals = tuple(p["tune_seeds"]), [s for s in p["seeds"] if s not in p["tune_seeds"]]
    total = {"fewest": [0, 0.0], "most": [0, 0.0]}
    print("| variant | lr now (mean best val WER %) | grid runs to train | fewest: runs (h) | most: runs (h) | "
          "reruns for the LM |")
    print("|---|---|---:|---:|---:|---:|")
    for v in sorted({k[:2] for k in before} | {k[:2] for k in done}):
        mine = [r for k, r in done.items() if k[:2] == v and "epochs" in r] or \
            [r for k, r in before.items() if k[:2] == v and "epochs" in r]
        run_h = statistics.mean(len(r["epochs"]) * r["epoch_time_s"] / 3600 for r in mine)
        best = statistics.mean(r["best_epoch"] for r in mine)
        tail = statistics.mean(len(r["epochs"]) - r["best_epoch"] for r in mine)
        epoch_h = statistics.mean(r["epoch_time_s"] for r in mine) / 3600
        hours = lambda k: (best + 2 ** k * tail) * epoch_h  # noqa: E731
        needs_model = v[1] in p["reuse_needs_model"]  # the converged study's best.pt are gone
        # the runs to train: neither ended here nor to be taken from the converged study
        missing = lambda lr, on, w, seeds: [s for s in seeds if (*v, lr, on, w, s) not in done  # noqa: E731
                                            and (needs_model or (*v, lr, on, w, s) not in before)]
        means = {lr: mean_of([val_wer_for_choice(done[*v, lr, True, wait, s]) for s in tune])  # as the protocol ties
                 for lr in {k[2] for k in done if k[:2] == v} if all((*v, lr, True, wait, s) in done for s in tune)}
        grid_left = sum(len(missing(x, True, wait, tune)) for x in grid)
        chosen = min(means, key=lambda x: (means[x], x)) if means and grid_left == 0 else None
        # The rate: where the tuning seeds' mean puts it now (the grid done); the protocol widens only then, past
        # the edge it sits on, by protocol.widen rates at most. Fewest: one rate past that edge, and the rate stays;
        # most: every rate up to the limit (where the grid is not done, past the edge with more to train), the
        # last one chosen.
        if chosen is None:  # most: past whichever edge leaves more to train
            lr = grid[1]
            pasts = ([rate(edge * step ** k) for k in range(1, p["widen"] + 1)]
                     for edge, step in ((grid[0], 1 / ratio), (grid[-1], ratio)))
            rates = {"fewest": [], "most": max(pasts, key=lambda xs: sum(len(missing(x, True, wait, tune)) for x in xs))}
        else:
            lr, tried = chosen, sorted(set(grid) | set(means))
            step = 1 / ratio if lr == tried[0] else ratio if lr == tried[-1] else None
            edge = grid[0] if step and step < 1 else grid[-1]
            past = [rate(edge * step ** k) for k in range(1, p["widen"] + 1)] if step else []
            rates = {"fewest": [x for x in past if x not in means][:1], "most": [x for x in past if x not in means]}
        row = []
        for case in ("fewest", "most"):
            at = rates[case][-1] if case == "most" and rates[case] else lr
            n_tune = grid_left + sum(len(missing(x, True, wait, tune)) for x in rates[case])
            n_aug = len(missing(at, False, wait, tune))
            n_pat = sum(len(missing(at, True, wait * 2 ** k, tune)) for k in range(1, 2 if case == "fewest" else 3))
            if case == "fewest":
                n_final = len(missing(at, True, wait, finals))
                h = (n_tune + n_aug + n_final) * run_h + n_pat * hours(1)
            else:
                n_final = len(finals)
                h = (n_tune + n_aug) * run_h + sum(2 * hours(k) for k in (1, 2)) * n_pat / 4 + n_final * hours(2)
            n = n_tune + n_aug + n_pat + n_final
            total[case][0] += n
            total[case][1] += h
            row.append(f"{n} ({h:.1f} h)")
        # The tuning runs at the rate the fewest case keeps that the LM family lacks (finish_study.needs_model: their
        # best.pt gone, and not decoded by today's rule while they had it): these train again at the study's end
        # (make patience-finish); counted apart
        rerun = [k for k in done if k[:2] == v and k[2:5] == (lr, True, wait) and needs_model and checkpoints
                 and lm_needs_model(checkpoints / Path(done[k]["path"]).name, done[k])]
        now = f"{lr:g} ({100 * means[lr]:.1f})" if chosen is not None else "not tuned yet"
        print(f"| {v[0]}-{v[1]} | {now} | {grid_left} | {row[0]} | {row[1]} | {len(rerun) if checkpoints else '?'} |")
        total["rerun"] = total.get("rerun", 0) + len(rerun)
    for case in ("fewest", "most"):
        n, h = total[case]
        print(f"{case}: {n} runs left to train, {h:.0f} h of training epochs (about {h / 2:.0f} h of the 2-core "
              f"machine at two 1-thread jobs)")
    if checkpoints:
        print(f"and {total['rerun']} runs to train again for the LM decoding (their best.pt gone; make patience-finish), about "
              "as long as a tuning run each")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", type=Path, default=Path("experiments/results/an4_cpu_plateau"),
                        help="the converged study's runs (default: %(default)s)")
    parser.add_argument("--left", type=Path, metavar="PATIENCE_DIR",
                        help="the patience study's runs so far: print what it has left to train")
    parser.add_argument("--checkpoints", type=Path, metavar="RUNS_DIR",
                        help="with --left: the pinned study's run folders, to see which best.pt are still there")
    args = parser.parse_args()
    if args.left:
        left(args.left, args.folder, args.checkpoints)
    else:
        main(args.folder)
