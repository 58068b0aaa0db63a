"""The study report: one summary of a sweep's results (batchrnn.study.report.summary), read by the tables of
report.md and report.json (render), the plots (plots) and the W&B report run (wandb_run).

    python -m batchrnn.report SWEEP_DIR [--out DIR] [--only SETTING=V1,V2 ...] [--against EARLIER_DIR]
        [--inference BENCH_JSON] [--wandb]
"""
import os
from pathlib import Path

from batchrnn.config import LoggerMode
from batchrnn.study.report import against as versus, plots, render, serving
from batchrnn.study.report.summary import build

GUIDE = Path(__file__).resolve().parents[4] / "docs" / "report.md"  # what each report's legend links to


def write_report(sweep_dir: Path, out_dir: Path | None = None, wandb: LoggerMode | None = None,
                 only: dict[str, list[str]] | None = None, against: Path | None = None,
                 inference: Path | None = None) -> Path:
    """Writes report.md, report.json and the PNGs for the results.json files under sweep_dir (default
    out_dir: sweep_dir; only: the runs with these settings, summary.build), with against (an earlier study's
    folder, the same `only`) against.md and its plot, with inference (bench_inference.py --json's file) each row's
    cost to serve, and with a wandb mode logs them to W&B too; returns the path of report.md."""
    import json

    summary = build(sweep_dir, only=only)
    if inference is not None:
        serving.attach(summary, inference)
    earlier = build(against, only=only) if against is not None else None  # fails before anything is written
    out_dir = Path(out_dir) if out_dir else Path(sweep_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = plots.draw(summary, out_dir)
    path = out_dir / "report.md"
    path.write_text(render.markdown(summary, drawn, os.path.relpath(GUIDE, out_dir.resolve())))
    report = render.as_json(summary, drawn)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if earlier is not None:
        (out_dir / "against.md").write_text(versus.markdown(earlier, summary, versus.draw(earlier, summary, out_dir)))
    if wandb is not None:
        from batchrnn.study.report.wandb_run import log_report, logger_of

        log_report(report, out_dir, logger_of(summary.logger, wandb))
    return path
