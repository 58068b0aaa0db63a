"""The report as a W&B run: job type "report" in the study's group, beside the study's training runs."""
from pathlib import Path

from batchrnn.config import LoggerConfig, LoggerMode
from batchrnn.tracking.dashboard import save_workspace
from batchrnn.study.report.summary import COMPUTED


def logger_of(runs_logger: dict, mode: LoggerMode) -> LoggerConfig:
    """The runs' own W&B project, entity and tags, so the report lands beside them."""
    return LoggerConfig(mode=mode, project=runs_logger.get("project", LoggerConfig.project),
                        entity=runs_logger.get("entity"), tags=runs_logger.get("tags", []))


def log_report(report: dict, out_dir: Path, logger: LoggerConfig) -> str:
    """Logs report.json's content (`report`) and its plots from out_dir: the tables report/table (a row
    per variant), report/head_to_head, report/tuning and (runs decoded with the word LM) report/lm_head_to_head, the
    plots as images, the counts and the
    significance sentence in the run's summary. The run lives in out_dir/wandb-report/, online or
    offline as start_tracking decides; running the report again updates it. Returns the tracking mode."""
    from batchrnn.tracking.tracker import start_tracking

    config = {k: report[k] for k in ("sweep_dir", "study", "preset", "devices", "protocol")}
    tracker = start_tracking(logger, Path(out_dir) / "wandb-report", "report", report["study"], config,
                             job_type="report")
    tables = {"table": report["rows"], "head_to_head": report["comparisons"], "tuning": report["tuning"],
              "lm_head_to_head": (report.get("lm") or {}).get("comparisons")}  # decoded with the word LM
    for name, rows in tables.items():
        if rows:
            columns = list(rows[0])
            tracker.log_table(f"report/{name}", columns, [[cell(row.get(c)) for c in columns] for row in rows])
    for plot in report["plots"]:
        tracker.log_image(f"report/{plot.removesuffix('.png')}", Path(out_dir) / plot)
    tracker.summary({k: report[k] for k in ("finished", "running", "stopped", "diverged", "significance", "splits")})
    tracker.finish()
    # The study's saved dashboard beside it (online only): the settings the study varies are the groupings.
    swept = [k for k, n in (("model.rnn", "rnn"), ("model.bn", "bn")) if len({r[n] for r in report["rows"]}) > 1]
    url = save_workspace(tracker.mode, logger.entity, logger.project, report["study"],
                         swept + [c for c in report["columns"] if c != COMPUTED] + ["seed"],  # W&B configs lack it
                         Path(out_dir) / "wandb-report" / "dashboard.url")
    if url:
        print(f"W&B: study dashboard {url}")
    where = Path(out_dir) / "wandb-report" / "wandb"
    print({"online": "W&B: report logged online",
           "offline": f"W&B: report logged offline, upload with `wandb sync {where}/offline-run-*`"}.get(
        tracker.mode, "W&B: could not start (see the warning above); the report is only on disk"))
    return tracker.mode


def cell(v):
    """A W&B table cell: lists joined, dicts as key=value, the rest as is."""
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in v.items())
    return ", ".join(map(str, v)) if isinstance(v, list) else v
