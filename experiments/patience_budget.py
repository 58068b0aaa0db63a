"""What the patience study (conf/experiment/an4_cpu_patience.yaml, issue 52) costs, from the runs it can reuse.

    python experiments/patience_budget.py [experiments/results/an4_cpu_plateau]

Reads every results.json of the converged study, takes each variant's choices there (one tuning seed) and counts,
per stage, the runs the patience study reuses (the same folder name: protocol.reuse_from) and the runs it trains,
with their training hours: epochs x the variant's median epoch time (two 1-thread jobs at once, as that study ran).
Two cases bound it: the two-seed choices equal the one-seed ones and 3/6 is kept (fewest runs); 6/12 wins every
variant and 12/24 is tried everywhere (most). A run at k doublings is counted as its variant's mean best epoch plus
2^k times its mean epochs after the best (the tail that patience sets); the cap is not reached. No training.
"""
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from batchrnn.study.protocol import protocol_choice, schedule_of
from batchrnn.training.identity import variant_key
from batchrnn.training.rundir import read_study

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


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/results/an4_cpu_plateau"))
