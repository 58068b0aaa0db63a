"""python -m batchrnn.report SWEEP_DIR [--out DIR] [--wandb]: report.md, report.json and the plots."""
import argparse
import logging
import sys
from pathlib import Path

from batchrnn.config import LoggerMode
from batchrnn.report import write_report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The study report of a sweep folder, finished or still running.")
    parser.add_argument("sweep_dir", type=Path, help="the sweep's folder (searched recursively)")
    parser.add_argument("--out", type=Path, help="where to write the report (default: SWEEP_DIR)")
    parser.add_argument("--wandb", action="store_true",
                        help="also log the tables and plots as a W&B run of job_type report in the study's "
                             "group (online with an API key, else offline under OUT/wandb-report)")
    args = parser.parse_args(argv)
    logging.basicConfig(format="warning: %(message)s", level=logging.WARNING)
    try:
        path = write_report(args.sweep_dir, args.out, LoggerMode.auto if args.wandb else None)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)  # as the trainer and the other entry points exit on a problem the user can fix
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
