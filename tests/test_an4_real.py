"""The real AN4 archive end to end (slow lane): AN4_ARCHIVE=path/to/an4_sphere.tar.gz pytest -m slow."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchrnn.study import report
from batchrnn.config import DataConfig
from batchrnn.data.corpus import prepare_corpus
from conftest import ROOT


def slow_lane_asked(config) -> bool:
    """`-m slow` (or any -m that selects slow without negating it), or CI: there a skip would pass the lane
    while it checked nothing."""
    marks = config.getoption("-m") or ""
    return bool(os.environ.get("CI")) or ("slow" in marks and "not slow" not in marks)


@pytest.fixture(scope="module")
def archive(request) -> str:
    path = os.environ.get("AN4_ARCHIVE")
    if not path or not Path(path).is_file():
        why = f"AN4_ARCHIVE={path!r} is not a file" if path else "AN4_ARCHIVE is not set"
        fix = "set AN4_ARCHIVE to a local an4_sphere.tar.gz (CI: ../shared/data/an4_sphere.tar.gz)"
        if slow_lane_asked(request.config):
            pytest.fail(f"the slow lane was asked for, but {why}: {fix}")
        pytest.skip(f"{why}: {fix}")
    return path


@pytest.mark.slow
def test_real_an4_counts_and_split(tmp_path, archive):
    corpus = prepare_corpus(DataConfig(archive=archive, root=str(tmp_path)))
    speakers = {s: {u.speaker for u in utts} for s, utts in corpus.splits.items()}
    assert len(corpus.splits["train"]) + len(corpus.splits["val"]) == 948
    assert len(speakers["train"] | speakers["val"]) == 74
    assert len(corpus.splits["test"]) == 130 and len(speakers["test"]) == 10
    assert speakers["val"] and not speakers["val"] & speakers["train"]
    assert corpus.summary["skipped"] == {s: {"no_audio": 0, "no_transcript": 0} for s in ("train", "test")}


@pytest.mark.slow
def test_cpu_preset_learns_on_real_an4_and_reports(tmp_path, archive):
    """What `make reproduce-an4` does for one job, cut to 4 epochs: the run learns words (blank-only
    output scores WER 1.0; seed 1 reached 0.72 at epoch 4 here) and the report reads its folder."""
    study = tmp_path / "runs"
    cmd = [sys.executable, str(ROOT / "src" / "run.py"), "experiment=an4_cpu", "model.rnn=gru", "model.bn=seqwise",
           "seed=1", "train.epochs=4", f"data.archive={archive}", f"data.root={tmp_path / 'data'}",
           "logger.mode=offline", f"hydra.run.dir={study}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = study.glob("*/results.json")  # the run's folder, named by its settings
    results = json.loads(path.read_text())
    assert results["status"] == "finished" and results["preset"] == "an4_cpu"
    losses = [e["train_loss"] for e in results["epochs"]]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0]
    assert results["best_val_wer"] < 0.9 and results["test_wer"] < 0.9
    assert len(results["test_utterances"]) == 130
    text = report.write_report(tmp_path / "runs").read_text()
    assert "| gru | seqwise | fused | 1" in text  # n, then † when the run was still improving at its last epoch
