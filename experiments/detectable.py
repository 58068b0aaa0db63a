"""The power of each "no difference" of a study: for every head-to-head comparison of its report, the smallest
true difference it could have found significant at 80% power, after Holm over the report's family.

    python experiments/detectable.py experiments/results/an4_depth_plateau
    python experiments/detectable.py experiments/results/an4_cpu_plateau --only model.bn=none,post,input,skip,seqwise

It reads the runs as the report does (the same rows, the same comparisons, `--only` as in the report) and takes the
standard error from the same two-level bootstrap, seeds then test utterances (stats.detectable says how).
"""
import argparse
import sys
from pathlib import Path

from batchrnn.study.report.stats import detectable
from batchrnn.study.report.summary import FilterError, build, errors_of


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--only", action="append", default=[], metavar="SETTING=V1,V2")
    parser.add_argument("--power", type=float, default=0.8)
    args = parser.parse_args(argv)
    only = {}
    for item in args.only:
        key, _, values = item.partition("=")
        only.setdefault(key, []).extend(v for v in values.split(",") if v)
    try:
        summary = build(args.sweep_dir, only=only or None)
    except (FileNotFoundError, FilterError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    rows = {r["label"]: r for r in summary.rows}
    tests = sum(c["p"] is not None for c in summary.comparisons)
    print(f"{summary.study}: {tests} comparisons (Holm's family), {args.power:.0%} power; WER points")
    print("| comparison | n | ΔWER [95% interval] | Holm p | detectable |")
    print("|---|---|---:|---:|---:|")
    for c in summary.comparisons:
        a, b = rows[c["a"]], rows[c["b"]]
        d = detectable(errors_of(a), errors_of(b), tests, args.power)
        if d is None or c["p_holm"] is None:
            continue
        print(f"| {c['group']}: {c['a_name']} vs {c['b_name']} | {a['n']}, {b['n']} | {100 * c['dwer']:+.1f} "
              f"[{100 * c['dwer_lo']:+.1f}, {100 * c['dwer_hi']:+.1f}] | {c['p_holm']:.2g} | {100 * d:.1f} |")


if __name__ == "__main__":
    main()
