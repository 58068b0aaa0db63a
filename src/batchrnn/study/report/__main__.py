"""python -m batchrnn.report SWEEP_DIR [--out DIR] [--only SETTING=V1,V2 ...] [--against EARLIER_DIR]
[--inference BENCH_JSON] [--wandb]: report.md, report.json and the plots (and against.md)."""
import argparse
import logging
import sys
from pathlib import Path

from batchrnn.config import LoggerMode
from batchrnn.study.report import write_report
from batchrnn.study.report.serving import BenchError
from batchrnn.study.report.summary import FilterError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The study report of a sweep folder, finished or still running.")
    parser.add_argument("sweep_dir", type=Path, help="the sweep's folder (searched recursively)")
    parser.add_argument("--out", type=Path, help="where to write the report (default: SWEEP_DIR)")
    parser.add_argument("--only", action="append", default=[], metavar="SETTING=V1,V2",
                        help="report only the runs with one of these values of a setting (repeatable), e.g. "
                             "--only model.bn=none,post,input,skip,seqwise for the grid of a folder that also "
                             "holds other normalisations; its comparisons are then the family Holm corrects over")
    parser.add_argument("--against", type=Path, metavar="EARLIER_DIR",
                        help="an earlier study's folder of the same variants (e.g. one under another schedule): "
                             "also write against.md, each variant's and each comparison's verdict in both, and "
                             "which held")
    parser.add_argument("--inference", type=Path, metavar="BENCH_JSON",
                        help="experiments/bench_inference.py --json's file: the results table gains each row's "
                             "inference time over none's (serve × none) at the runs' model size")
    parser.add_argument("--wandb", action="store_true",
                        help="also log the tables and plots as a W&B run of job_type report in the study's "
                             "group (online with an API key, else offline under OUT/wandb-report)")
    args = parser.parse_args(argv)
    only = {}
    for item in args.only:
        key, sep, values = item.partition("=")
        if not (sep and key and values):
            parser.error(f"--only {item}: write SETTING=V1,V2, e.g. --only model.bn=none,seqwise")
        only.setdefault(key, []).extend(v for v in values.split(",") if v)
    logging.basicConfig(format="warning: %(message)s", level=logging.WARNING)
    try:
        path = write_report(args.sweep_dir, args.out, LoggerMode.auto if args.wandb else None, only,
                            args.against, args.inference)
    except (FileNotFoundError, FilterError, BenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)  # as the trainer and the other entry points exit on a problem the user can fix
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
