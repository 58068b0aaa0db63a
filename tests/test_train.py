"""The trainer end to end on the generated smoke corpus: results, resume, W&B offline, sweeps."""
import json
import logging
import subprocess
import sys

import pytest

from batchrnn.layers import cpu_front_end, cpu_gru
from batchrnn.training.checkpoint import load_model
from batchrnn.metrics import error_rates
from batchrnn.training.rundir import BEST, CHECKPOINT, LOG, RESULTS, RunFolder
from batchrnn.training.loop import code_commit, train
from conftest import ROOT, killed_after
from wandb_offline import read_offline_run

FINAL_KEYS = {"test_wer", "test_cer", "best_val_wer", "epoch_time_s", "peak_mem_mb", "params", "device",
              "torch_version"}


@pytest.fixture
def smoke(make_config, smoke_root):
    def make(*overrides):
        return make_config("experiment=smoke", f"data.root={smoke_root}", *overrides)

    return make


def test_smoke_run_writes_results(smoke, tmp_path):
    results = train(smoke("model.bn=seqwise"), tmp_path)
    saved = json.loads((tmp_path / RESULTS).read_text())
    assert saved["status"] == "finished" and FINAL_KEYS <= saved.keys()
    assert saved["config"]["model"]["bn"] == "seqwise" and saved["bn"] == "seqwise"
    assert [e["epoch"] for e in saved["epochs"]] == [1, 2]
    for row in saved["epochs"]:
        assert {"train_loss", "val_loss", "val_wer", "val_cer", "epoch_time_s", "peak_mem_mb", "utt_per_s"} <= row.keys()
    refs, hyps = zip(*((u["ref"], u["hyp"]) for u in saved["test_utterances"]))
    assert (saved["test_wer"], saved["test_cer"]) == pytest.approx(error_rates(list(refs), list(hyps)))  # scored once, kept
    assert saved["params"] == sum(p.numel() for p in load_model(tmp_path / BEST)[0].parameters())
    assert saved["device"] == "cpu" and saved["machine"]
    assert saved["rnn"] == "gru" and saved["recurrence_kernel"] == cpu_gru.kernel_name()  # identity cannot see it
    assert saved["front_end_kernel"] == cpu_front_end.kernel_name()
    assert saved["preset"] is None  # named by src/run.py from the experiment choice
    assert len(saved["test_utterances"]) == 12
    assert results["test_wer"] == saved["test_wer"]


def test_training_learns_the_generated_corpus(smoke, tmp_path):
    """The generated corpus is learnable (each character a fixed tone pair): 60 epochs of a 64-wide smoke model
    (about 10 s here) take validation WER from 100% to under 50% and the training loss under half its first
    epoch's. Zeroed gradients, shifted CTC labels or a decoder that drops letters would fail it; so does the same
    run with a rate too small to learn (the control, which shows the check can fail)."""
    learnt = train(smoke("model.hidden_size=64", "train.epochs=60"), tmp_path / "learnt")
    losses = [e["train_loss"] for e in learnt["epochs"]]
    assert learnt["best_val_wer"] < 0.5 and losses[-1] < losses[0] / 2, (learnt["best_val_wer"], losses)
    still = train(smoke("model.hidden_size=64", "train.epochs=10", "train.lr=1e-9"), tmp_path / "control")
    assert still["best_val_wer"] > 0.9


def test_resumed_run_equals_uninterrupted_run(smoke, tmp_path):
    whole = train(smoke("train.epochs=3"), tmp_path / "whole")
    part = tmp_path / "part"
    with killed_after(1):  # after epoch 1's checkpoint, before the run finished
        train(smoke("train.epochs=3"), part)
    resumed = train(smoke("train.epochs=3"), part)
    assert [e["train_loss"] for e in resumed["epochs"]] == pytest.approx([e["train_loss"] for e in whole["epochs"]])
    assert resumed["test_wer"] == pytest.approx(whole["test_wer"])
    assert (part / CHECKPOINT).exists()


def test_finished_run_is_not_run_again(smoke, tmp_path):
    first = train(smoke(), tmp_path)
    mtime = (tmp_path / CHECKPOINT).stat().st_mtime_ns
    assert train(smoke(), tmp_path) == first
    assert (tmp_path / CHECKPOINT).stat().st_mtime_ns == mtime
    rerun = train(smoke("train.rerun=true"), tmp_path)
    assert (tmp_path / CHECKPOINT).stat().st_mtime_ns != mtime and rerun["status"] == "finished"


def test_a_finished_run_of_another_study_with_the_same_settings_is_taken_not_retrained(smoke, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with RunFolder(tmp_path / "grid" / "run").logging():  # as run.py runs it: the run's log in its folder
        grid = train(smoke("study=grid"), tmp_path / "grid" / "run")
    with RunFolder(tmp_path / "depth" / "run").logging():
        taken = train(smoke("study=depth", f"protocol.reuse_from={tmp_path / 'grid'}"), tmp_path / "depth" / "run")
    # the source's log, then the line that says where it came from (written to the copy, not a replaced file)
    source_log, log = (tmp_path / "grid" / "run" / LOG).read_text(), (tmp_path / "depth" / "run" / LOG).read_text()
    assert "epoch 1:" in source_log and log.startswith(source_log) and "taken, not trained again" in log[len(source_log):]
    assert taken["reused_from"] == str(tmp_path / "grid" / "run") and taken["study"] == "depth"
    # filed under the taking study's protocol, so that it counts as one of its runs; the commit stays the source's
    assert taken["config"]["protocol"]["reuse_from"] == str(tmp_path / "grid") and taken["commit"] == grid["commit"]
    assert {k: taken[k] for k in FINAL_KEYS | {"epochs", "test_utterances"}} == \
        {k: grid[k] for k in FINAL_KEYS | {"epochs", "test_utterances"}}
    assert (tmp_path / "depth" / "run" / BEST).exists() and not (tmp_path / "depth" / "run" / CHECKPOINT).exists()
    # other settings under the same folder name (a changed default, a hand-made name): trained, not taken
    other = train(smoke("study=depth", "train.lr=0.01", f"protocol.reuse_from={tmp_path / 'grid'}"),
                  tmp_path / "other" / "run")
    assert "reused_from" not in other and (tmp_path / "other" / "run" / CHECKPOINT).exists()
    # a placement that must keep its model (protocol.reuse_needs_model) is trained here once its best.pt is gone
    (tmp_path / "grid" / "run" / BEST).unlink()
    needs = f"protocol.reuse_needs_model=[{taken['config']['model']['bn']}]"
    again = train(smoke("study=depth", f"protocol.reuse_from={tmp_path / 'grid'}", needs), tmp_path / "lm" / "run")
    assert "reused_from" not in again and (tmp_path / "lm" / "run" / BEST).exists()
    kept = train(smoke("study=depth", f"protocol.reuse_from={tmp_path / 'grid'}", "protocol.reuse_needs_model=[rbn]"),
                 tmp_path / "other_bn" / "run")
    assert kept["reused_from"] == str(tmp_path / "grid" / "run"), "another placement is taken without its best.pt"


def test_wandb_offline_run_holds_the_logged_metrics(smoke, tmp_path):
    results = train(smoke("logger.mode=offline"), tmp_path)
    run = read_offline_run(tmp_path)
    history = [h for h in run["history"] if "epoch" in h]
    assert len(history) == len(results["epochs"])
    for h, row in zip(history, results["epochs"]):  # W&B's epoch rows are results.json's, key for key
        assert {k: h[k] for k in row} == pytest.approx(row)
    assert run["summary"]["test_wer"] == pytest.approx(results["test_wer"])
    assert run["config"]["model"]["bn"] == "none"
    # flat columns to sort by, and a job type beside the study's report run
    assert {k: run["summary"][k] for k in ("rnn", "bn", "impl", "seed")} == {"rnn": "gru", "bn": "none",
                                                                           "impl": "fused", "seed": 0}
    assert (run["run"]["group"], run["run"]["job_type"], run["run"]["name"]) == ("smoke", "train", "gru-none-s0")


def test_sweep_runs_one_job_per_combination_in_a_folder_named_by_its_settings(tmp_path, smoke_root):
    run_py = [sys.executable, str(ROOT / "src" / "run.py"), "experiment=smoke", f"data.root={smoke_root}"]
    run = subprocess.run([run_py[0], run_py[1], "-m", *run_py[2:], "model.rnn=gru,lstm", "model.bn=seqwise,none", f"hydra.sweep.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    folders = sorted(p.parent.name for p in tmp_path.rglob(RESULTS))
    assert [f.split("-")[:2] for f in folders] == [["gru", "none"], ["gru", "seqwise"], ["lstm", "none"],
                                                   ["lstm", "seqwise"]]
    for path in tmp_path.rglob(RESULTS):
        saved = json.loads(path.read_text())
        assert saved["status"] == "finished" and saved["preset"] == "smoke"
    # The same run typed three other ways (an explicit default, no override, the default seed) is found
    # and skipped: a run is its resolved settings, not its command line.
    for typed in (["model.bn=none"], [], ["seed=0", "model.rnn=gru"]):
        again = subprocess.run([*run_py, *typed, f"hydra.run.dir={tmp_path}"], capture_output=True, text=True,
                               timeout=120)
        assert again.returncode == 0 and "is finished; train.rerun=true runs it again" in again.stdout, again.stderr
    assert sorted(p.parent.name for p in tmp_path.rglob(RESULTS)) == folders


def scripted_validation(monkeypatch, wers, losses):
    """The trainer's validation scores replaced by the given sequence (the test score after it)."""
    import batchrnn.training.loop as train_module

    rows = iter([{"loss": loss, "wer": wer, "cer": wer, "utterances": []} for wer, loss in zip(wers, losses)])
    monkeypatch.setattr(train_module, "score", lambda *a, **k: next(rows, {"loss": 1.0, "wer": 0.5, "cer": 0.5,
                                                                         "utterances": []}))


def test_patience_counts_epochs_without_a_better_validation_wer_or_loss(smoke, tmp_path, monkeypatch):
    # epochs 1-3 at blank output (100% WER) with a falling loss are progress; 4 is the best WER; 5-7 are not
    scripted_validation(monkeypatch, [1.0, 1.0, 1.0, 0.9, 0.95, 0.95, 0.95, 0.1], [5, 4, 3, 3.5, 3.6, 3.7, 3.8, 0.1])
    results = train(smoke("train.epochs=30", "train.patience=3"), tmp_path)
    assert [e["epoch"] for e in results["epochs"]] == [1, 2, 3, 4, 5, 6, 7]
    assert (results["stop"], results["best_epoch"], results["improving_at_cap"]) == ("patience", 4, False)


def test_a_drifting_validation_loss_is_not_progress(smoke, tmp_path, monkeypatch):
    # after epoch 2 the loss creeps down by 0.1-0.6% an epoch, 1.1% in all: under patience_loss_drop (2%)
    scripted_validation(monkeypatch, [0.5, 0.4, 0.45, 0.45, 0.45, 0.45], [1.0, 0.9, 0.895, 0.893, 0.891, 0.89])
    results = train(smoke("train.epochs=30", "train.patience=3"), tmp_path)
    assert [e["epoch"] for e in results["epochs"]] == [1, 2, 3, 4, 5] and results["stop"] == "patience"


def test_a_run_stopped_by_the_cap_while_improving_says_so(smoke, tmp_path, monkeypatch):
    scripted_validation(monkeypatch, [1.0, 0.8, 0.7], [5, 4, 3])
    results = train(smoke("train.epochs=3", "train.patience=5"), tmp_path)
    assert (results["stop"], results["best_epoch"], results["improving_at_cap"]) == ("cap", 3, True)


def test_results_name_the_commit_the_run_was_trained_at(smoke, tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert train(smoke(), tmp_path)["commit"] == head.strip() and len(head.strip()) == 40
    outside = tmp_path / "copied tree"  # not a git checkout (tmp_path lies outside any)
    outside.mkdir()
    assert code_commit(outside) == "unknown"
