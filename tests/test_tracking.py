"""Tracking: real offline W&B runs read back from disk; disabled writes nothing; auto and online fall
back to offline without a key or a server."""
import pytest

from batchrnn import tracking
from batchrnn.config import LoggerConfig, LoggerMode


@pytest.fixture(autouse=True)
def no_credentials(tmp_path, monkeypatch):
    """No API key anywhere wandb looks: env, ~/.netrc, ~/.config/wandb/settings."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))


def log_three_epochs(tracker):
    for epoch in (1, 2, 3):
        tracker.log({"train/loss": 3.0 / epoch, "val/wer": 1.0 - 0.2 * epoch}, step=epoch)
    tracker.log_table("test/utterances", ["id", "ref", "hyp"], [["a", "YES", "YES"], ["b", "NO", "GO"]])
    tracker.summary({"test/wer": 0.33, "best_epoch": 3})
    tracker.finish()


def test_offline_run_is_read_back(tmp_path):
    cfg = LoggerConfig(mode=LoggerMode.offline, tags=["unit"])
    run_dir = tmp_path / "run"
    config = {"model": {"rnn": "gru"}, "seed": 0}
    tracker = tracking.start_tracking(cfg, run_dir, "gru-none-s0", "unit", config)
    assert tracker.mode == "offline"
    log_three_epochs(tracker)

    run = tracking.read_offline_run(run_dir)
    assert [h["_step"] for h in run["history"]] == [1, 2, 3]
    assert [h["train/loss"] for h in run["history"]] == [3.0, 1.5, 1.0]
    assert [h["val/wer"] for h in run["history"]] == pytest.approx([0.8, 0.6, 0.4])
    assert "test/utterances" in run["history"][-1]  # the table joined the last step
    assert run["summary"]["test/wer"] == 0.33 and run["summary"]["best_epoch"] == 3
    assert run["config"] == config


def test_resumed_run_keeps_its_id_and_history(tmp_path):
    cfg, run_dir = LoggerConfig(mode=LoggerMode.offline), tmp_path / "run"
    for epoch in (1, 2):  # a run killed after epoch 1 and resumed into the same folder
        tracker = tracking.start_tracking(cfg, run_dir, "n", "g", {})
        tracker.log({"val/wer": 0.5 / epoch}, step=epoch)
        tracker.finish()
    folders = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(tracking.run_id(run_dir) in f.name for f in folders)
    assert [h["val/wer"] for h in tracking.read_offline_run(run_dir)["history"]] == [0.5, 0.25]


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


def test_online_unreachable_falls_back_to_offline(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr(tracking, "INIT_TIMEOUT_S", 2)
    tracker = tracking.start_tracking(LoggerConfig(mode=LoggerMode.online), tmp_path / "run", "n", "g", {})
    assert tracker.mode == "offline"
    assert "W&B online init failed" in caplog.text
    tracker.log({"val/wer": 0.5}, step=1)
    tracker.finish()
    assert tracking.read_offline_run(tmp_path / "run")["history"] == [{"_step": 1, "val/wer": 0.5}]


def test_missing_offline_run_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no offline W&B run"):
        tracking.read_offline_run(tmp_path)
