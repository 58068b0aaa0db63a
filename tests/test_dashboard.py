"""The study's W&B dashboard, built offline: its panels, metrics and groupings, as wandb-workspaces would
send them; saving is tried only online and never raises. No test reaches a W&B server."""
import pytest
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from batchrnn.tracking import dashboard

SWEPT = ["model.rnn", "model.bn", "seed"]


@pytest.fixture
def workspace():
    return dashboard.build_workspace("me", "batchrnn", "an4_cpu", SWEPT)


def panels(workspace, kind):
    return [p for s in workspace.sections for p in s.panels if isinstance(p, kind)]


def test_runs_of_the_study_grouped_by_variant(workspace):
    runs = workspace.runset_settings
    assert (workspace.entity, workspace.project, workspace.name) == ("me", "batchrnn", "an4_cpu study")
    assert runs.filters == "Metric(\"Group\") == 'an4_cpu'"
    assert [g.name for g in runs.groupby] == ["model.bn", "model.rnn"]  # a variant; its seeds aggregate
    assert [s.name for s in workspace.sections] == ["Validation WER", "Cost per variant", "Settings into test WER",
                                                   "Report"]


def test_panels_chart_the_study(workspace):
    [wer] = panels(workspace, wr.LinePlot)
    assert (wer.x, wer.y, wer.groupby_aggfunc) == ("epoch", ["val_wer"], "mean")
    assert [b.metrics for b in panels(workspace, wr.BarPlot)] == [["epoch_time_s"], ["peak_mem_mb"]]
    [parallel] = panels(workspace, wr.ParallelCoordinatesPlot)
    assert [c.metric for c in parallel.columns] == [*map(wr.Config, SWEPT), wr.SummaryMetric("test_wer")]
    assert [t.table_name for t in panels(workspace, wr.WeavePanelSummaryTable)] == ["report/table"]


def test_spec_as_the_server_reads_it(workspace):
    # _spec is what save() uploads: the check that names reach W&B as the logged keys and config paths
    section = workspace._spec["spec"]["section"]
    [runset] = section["runSets"]
    assert [g["name"] for g in runset["grouping"]] == ["model.value.bn", "model.value.rnn"]
    assert [(f["key"], f["value"]) for f in runset["filters"]["filters"]] == [
        ({"section": "run", "name": "group"}, "an4_cpu")]
    configs = {p["viewType"]: p["config"] for s in section["panelBankConfig"]["sections"] for p in s["panels"]}
    assert configs["Run History Line Plot"]["xAxis"] == "epoch"
    assert configs["Run History Line Plot"]["metrics"] == ["val_wer"]
    assert [c["accessor"] for c in configs["Parallel Coordinates Plot"]["columns"]] == [
        "config:model.value.rnn", "config:model.value.bn", "config:seed.value", "summary:test_wer"]


def test_bn_groups_even_when_the_sweep_keeps_it_fixed():
    workspace = dashboard.build_workspace("me", "batchrnn", "an4_depth", ["model.num_layers", "seed"])
    assert [g.name for g in workspace.runset_settings.groupby] == ["model.bn", "model.num_layers"]


def test_offline_saves_nothing(tmp_path):
    url_file = tmp_path / "dashboard.url"
    assert dashboard.save_workspace("offline", "me", "batchrnn", "an4_cpu", SWEPT, url_file) is None
    assert not url_file.exists()


def test_failed_save_warns_and_returns_none(tmp_path, monkeypatch):
    def refused(self):
        raise ConnectionError("server unreachable")

    monkeypatch.setattr(ws.Workspace, "save", refused)
    with pytest.warns(UserWarning, match=r"W&B dashboard for an4_cpu not saved \(server unreachable\)"):
        assert dashboard.save_workspace("online", "me", "batchrnn", "an4_cpu", SWEPT, tmp_path / "d.url") is None


def test_saving_again_updates_the_saved_workspace(tmp_path, monkeypatch):
    url_file, url = tmp_path / "dashboard.url", "https://wandb.example/me/batchrnn?nw=abc"
    url_file.write_text(url + "\n")
    saved = dashboard.build_workspace("me", "batchrnn", "an4_cpu", ["seed"])  # as last time's report left it
    uploaded = []
    monkeypatch.setattr(ws.Workspace, "from_url", classmethod(lambda cls, u: saved if u == url else None))
    monkeypatch.setattr(ws.Workspace, "save", lambda self: uploaded.append(self) or self)
    monkeypatch.setattr(ws.Workspace, "url", property(lambda self: url))
    assert dashboard.save_workspace("online", "me", "batchrnn", "an4_cpu", SWEPT, url_file) == url
    assert uploaded == [saved]  # the same workspace, now with this sweep's panels
    assert [g.name for g in saved.runset_settings.groupby] == ["model.bn", "model.rnn"]
    assert url_file.read_text().strip() == url
