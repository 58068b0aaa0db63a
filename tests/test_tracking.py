"""Tracking: real offline W&B runs read back from disk; disabled writes nothing; auto and online fall
back to offline without a key or a server; a wandb that cannot start at all says so and what to do."""
import re
import tomllib

import pytest
import wandb

from batchrnn.tracking import tracker as tracking
from batchrnn.config import LoggerConfig, LoggerMode
from conftest import ROOT
from wandb_offline import read_offline_run

pytestmark = pytest.mark.usefixtures("wandb_env")
ROWS = [{"epoch": e, "train_loss": 3.0 / e, "val_wer": wer, "epoch_time_s": 1.5} for e, wer in
        ((1, 0.8), (2, 0.5), (3, 0.6))]


def log_three_epochs(tracker):
    for row in ROWS:
        for step in (2 * row["epoch"] - 1, 2 * row["epoch"]):
            tracker.log_step(step, {"grad_norm": 10.0 * step, "loss": 4.0 / step})
        tracker.log_epoch(row)
    tracker.log_table("test/utterances", ["id", "ref", "hyp"], [["a", "YES", "YES"], ["b", "NO", "GO"]])
    tracker.summary({"test_wer": 0.33, "best_epoch": 2})
    tracker.finish()


def test_offline_run_is_read_back(tmp_path):
    cfg = LoggerConfig(mode=LoggerMode.offline, tags=["unit"])
    run_dir = tmp_path / "run"
    config = {"model": {"rnn": "gru"}, "seed": 0}
    tracker = tracking.start_tracking(cfg, run_dir, "gru-none-s0", "unit", config)
    assert tracker.mode == "offline"
    log_three_epochs(tracker)

    run = read_offline_run(run_dir)
    epochs = [h for h in run["history"] if "epoch" in h]
    assert [{k: h[k] for k in ROWS[0]} for h in epochs] == ROWS
    steps = [h for h in run["history"] if "step" in h]
    assert [(h["step"], h["step/grad_norm"], h["step/loss"]) for h in steps] == [
        (s, 10.0 * s, 4.0 / s) for s in range(1, 7)]
    assert not any("epoch" in h for h in steps)  # two x axes, never mixed in one row
    assert "test/utterances" in run["history"][-1]
    wandb_steps = [h["_step"] for h in run["history"]]  # epoch rows, step rows and the table interleave
    assert wandb_steps == sorted(set(wandb_steps))
    assert run["summary"]["test_wer"] == 0.33 and run["summary"]["best_epoch"] == 2
    assert run["summary"]["val_wer"] == {"min": 0.5}  # the runs table shows the best, not the last
    assert run["config"] == config


def test_metrics_chart_against_epoch_and_step(tmp_path):
    tracker = tracking.start_tracking(LoggerConfig(mode=LoggerMode.offline), tmp_path / "run", "n", "g", {})
    log_three_epochs(tracker)
    metrics = read_offline_run(tmp_path / "run")["metrics"]
    assert metrics["val_wer"] == {"step_metric": "epoch", "summary": ["min"]}
    assert metrics["train_loss"] == metrics["epoch_time_s"] == {"step_metric": "epoch", "summary": []}
    assert metrics["step/*"] == {"step_metric": "step", "summary": []}


def test_resumed_run_keeps_its_id_and_history(tmp_path):
    cfg, run_dir = LoggerConfig(mode=LoggerMode.offline), tmp_path / "run"
    for row in ROWS[:2]:  # a run killed after epoch 1 and resumed into the same folder
        tracker = tracking.start_tracking(cfg, run_dir, "n", "g", {})
        tracker.log_epoch(row)
        tracker.finish()
    folders = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(tracking.run_id(run_dir) in f.name for f in folders)
    run = read_offline_run(run_dir)
    assert [(h["epoch"], h["val_wer"]) for h in run["history"]] == [(1, 0.8), (2, 0.5)]
    assert run["metrics"]["val_wer"]["step_metric"] == "epoch"  # defined again by the resumed run


def test_disabled_writes_nothing(tmp_path):
    tracker = tracking.start_tracking(LoggerConfig(mode=LoggerMode.disabled), tmp_path / "run", "n", "g", {})
    assert tracker.mode == "disabled"
    log_three_epochs(tracker)
    tracker.log_image("plot", tmp_path / "missing.png")
    assert not (tmp_path / "run").exists()


def test_auto_without_key_goes_offline(tmp_path):
    tracker = tracking.start_tracking(LoggerConfig(mode=LoggerMode.auto), tmp_path / "run", "n", "g", {})
    assert tracker.mode == "offline"
    tracker.finish()


def test_online_unreachable_falls_back_to_offline(tmp_path, monkeypatch, caplog, wandb_env):
    wandb_env("http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr(tracking, "INIT_TIMEOUT_S", 2)
    tracker = tracking.start_tracking(LoggerConfig(mode=LoggerMode.online), tmp_path / "run", "n", "g", {})
    assert tracker.mode == "offline"
    assert "W&B online init failed" in caplog.text
    tracker.log_epoch({"epoch": 1, "val_wer": 0.5})
    tracker.finish()
    history = read_offline_run(tmp_path / "run")["history"]
    assert [{k: h[k] for k in ("epoch", "val_wer")} for h in history] == [{"epoch": 1, "val_wer": 0.5}]


@pytest.mark.parametrize("mode", [LoggerMode.online, LoggerMode.offline])
def test_too_old_wandb_fails_loudly_and_training_goes_on(tmp_path, monkeypatch, caplog, mode):
    """A wandb older than MIN_WANDB refuses the settings (here: an unknown keyword, as a plain Settings
    class rejects it); the run is marked failed, not quietly disabled, and the warning says the fix."""
    real = wandb.Settings

    def old_settings(**kwargs):
        if "finish_timeout" in kwargs:
            raise TypeError("Settings.__init__() got an unexpected keyword argument 'finish_timeout'")
        return real(**kwargs)

    monkeypatch.setattr(wandb, "Settings", old_settings)
    monkeypatch.setattr(tracking.importlib.metadata, "version", lambda name: "0.26.1")
    tracker = tracking.start_tracking(LoggerConfig(mode=mode), tmp_path / "run", "n", "g", {})
    assert tracker.mode == "failed"
    log_three_epochs(tracker)  # the stand-in takes every call
    assert "W&B could not start, online or offline (Settings.__init__() got an unexpected keyword argument " \
           "'finish_timeout')" in caplog.text
    assert f"wandb 0.26.1 is installed and this harness needs wandb>={tracking.MIN_WANDB}: " \
           f"pip install 'wandb>={tracking.MIN_WANDB}'" in caplog.text
    assert "online init failed" not in caplog.text  # one warning, with the cause, not a misleading fallback


def test_failed_offline_start_is_failed_not_disabled(tmp_path, monkeypatch, caplog):
    def broken_init(**kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(wandb, "init", broken_init)
    tracker = tracking.start_tracking(LoggerConfig(mode=LoggerMode.offline), tmp_path / "run", "n", "g", {})
    assert tracker.mode == "failed"
    assert "(No space left on device); this run is NOT tracked" in caplog.text
    assert f"wandb {wandb.__version__} is installed" in caplog.text


def test_pyproject_pins_the_wandb_the_code_needs():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wandb_pin = next(d for d in dependencies if re.match(r"wandb\b(?!-)", d))
    assert f">={tracking.MIN_WANDB}" in wandb_pin


def test_missing_offline_run_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no offline W&B run"):
        read_offline_run(tmp_path)
