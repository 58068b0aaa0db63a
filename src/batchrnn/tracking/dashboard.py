"""A study's W&B dashboard in code: a saved workspace of its group's runs, grouped by variant, with the
validation WER by epoch, each variant's cost, the swept settings into test WER and the report table.
Built offline (tests check its panels); saved only when the report is logged online.
"""
import warnings
from pathlib import Path

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from batchrnn.errors import one_line

BN, SEED = "model.bn", "seed"  # the study's question, and the key that repeats a variant


def build_workspace(entity: str, project: str, study: str, swept: list[str]) -> ws.Workspace:
    """The study's workspace: runs of its W&B group, grouped by variant (model.bn, then the other swept
    keys but the seed), so every chart shows one line or bar per variant, the mean over its seeds."""
    # Panels follow the runs table's grouping (wandb-workspaces always saves them so), hence the grouping
    # lives here once and the panels only say how to aggregate seeds.
    variant = [BN] + [k for k in swept if k not in (BN, SEED)]
    over_seeds = dict(groupby_aggfunc="mean", groupby_rangefunc="minmax")
    return ws.Workspace(
        entity=entity, project=project, name=f"{study} study",
        settings=ws.WorkspaceSettings(x_axis="epoch"),
        runset_settings=ws.RunsetSettings(
            filters=[ws.Metric("Group") == study],  # the training runs and the report run
            groupby=[ws.Config(k) for k in variant],
            order=[ws.Ordering(ws.Summary("test_wer"), ascending=True)],
            pinned_columns=[f"summary:{k}" for k in ("test_wer", "best_val_wer", "epoch_time_s", "peak_mem_mb")],
        ),
        sections=[
            ws.Section(name="Validation WER", is_open=True, panels=[
                wr.LinePlot(title="Validation WER by epoch", x="epoch", y=["val_wer"], **over_seeds),
            ]),
            ws.Section(name="Cost per variant", is_open=True, panels=[
                wr.BarPlot(title="Epoch time (s)", metrics=["epoch_time_s"], **over_seeds),
                wr.BarPlot(title="Peak memory (MB)", metrics=["peak_mem_mb"], **over_seeds),
            ]),
            ws.Section(name="Settings into test WER", is_open=True, panels=[
                wr.ParallelCoordinatesPlot(title="Swept settings into test WER", columns=[
                    *(wr.ParallelCoordinatesPlotColumn(metric=wr.Config(k)) for k in swept),
                    wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric("test_wer")),
                ], layout=wr.Layout(w=24, h=8)),
            ]),
            ws.Section(name="Report", is_open=True, panels=[
                # the report run's table: a row per variant with its interval and significance
                wr.WeavePanelSummaryTable(table_name="report/table", layout=wr.Layout(w=24, h=12)),
            ]),
        ],
    )


def save_workspace(mode: str, entity: str | None, project: str, study: str, swept: list[str],
                   url_file: Path) -> str | None:
    """Saves the study's workspace when the report run is online (mode is its tracker's) and returns its
    URL, also kept in url_file so the next report updates that workspace instead of adding another.
    None when offline, or on a failure, which warns: the report run itself is already logged."""
    if mode != "online":
        return None
    try:
        import wandb

        workspace = build_workspace(entity or wandb.Api().default_entity, project, study, swept)
        workspace = _as_saved(workspace, url_file).save()
        Path(url_file).write_text(workspace.url + "\n")
        return workspace.url
    except Exception as e:  # noqa: BLE001 - a dashboard is a convenience; the report is what matters
        warnings.warn(f"W&B dashboard for {study} not saved ({one_line(e)}); the report run is logged, and "
                      "the report with --wandb saves the dashboard when it runs again online")
        return None


def _as_saved(workspace: ws.Workspace, url_file: Path) -> ws.Workspace:
    """The workspace saved last time (its URL in url_file) with this one's contents, or this one when
    there is none or it is gone."""
    try:
        saved = ws.Workspace.from_url(Path(url_file).read_text().strip())
    except Exception:  # noqa: BLE001 - first save, or the workspace was deleted: save a new one
        return workspace
    for field in ("name", "settings", "runset_settings", "sections"):
        setattr(saved, field, getattr(workspace, field))
    return saved
