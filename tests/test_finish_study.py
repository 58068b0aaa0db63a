"""experiments/finish_study.py, the end of a pinned study: which verdict runs train again for the LM and with what,
when it refuses, and the order of its steps (training, decoding and the report stand in here: the real ones run at
a study's end)."""
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("finish_study", ROOT / "experiments" / "finish_study.py")
finish = importlib.util.module_from_spec(spec)
spec.loader.exec_module(finish)


def run_folder(runs: Path, name: str, bn: str, seed: int, status: str = "finished", best: bool = False) -> Path:
    path = runs / name
    path.mkdir(parents=True)
    config = {"model": {"rnn": "gru", "bn": bn}, "protocol": {"reuse_needs_model": ["none", "seqwise", "ln"]},
              "train": {"lr": 5e-4, "spec_augment": {"enabled": False}, "plateau_wait": 6, "patience": 12,
                        "epochs": 300}}
    (path / "results.json").write_text(json.dumps({"preset": "an4_cpu_patience", "seed": seed, "status": status,
                                                   "test_wer": 0.1, "config": config}))
    if best:
        (path / "best.pt").write_bytes(b"weights")
    return path


TODAY = {"rule": "today"}  # a stand-in `lm` entry decoded by this checkout's rule (the real check: test_decoding)
REAL_LM_FAULT = finish.lm_fault  # before the fixture below stands in for it


@pytest.fixture(autouse=True)
def best_pt_by_presence(monkeypatch):
    """A stand-in best.pt is usable where it exists (the real check loads the model); an `lm` entry is today's
    decoding where it is TODAY's."""
    monkeypatch.setattr(finish, "model_fault", lambda path, config: None if (path / "best.pt").exists() else "missing")
    monkeypatch.setattr(finish, "lm_fault", lambda path, result: None if result.get("lm") == TODAY else "not today's")


def test_only_the_lm_placements_runs_without_best_pt_train_again_at_their_own_settings(tmp_path):
    paths = [run_folder(tmp_path, "none-s1", "none", 1),  # best.pt gone: trains again
             run_folder(tmp_path, "none-s2", "none", 2, best=True),  # decodable as it is
             run_folder(tmp_path, "post-s1", "post", 1)]  # greedy family only: left as it is
    todo = finish.to_retrain([{"path": str(p)} for p in paths])
    assert [Path(e["path"]).name for e in todo] == ["none-s1"]
    assert todo[0]["overrides"] == [
        "experiment=an4_cpu_patience", "model.rnn=gru", "model.bn=none", "protocol.stage=tune", "seed=1",
        "train.lr=0.0005", "train.spec_augment.enabled=false", "train.plateau_wait=6", "train.patience=12",
        "train.epochs=300", "train.threads=1"]


def test_a_run_decoded_by_todays_rule_while_it_had_its_best_pt_does_not_train_again(tmp_path):
    decoded = run_folder(tmp_path, "none-s3", "none", 3)  # best.pt gone with its machine, decoded before it went
    result = json.loads((decoded / "results.json").read_text())
    (decoded / "results.json").write_text(json.dumps(result | {"lm": TODAY}))
    pinned = run_folder(tmp_path, "none-s4", "none", 4)  # decoded by the pinned commit's rule only: trains again
    (pinned / "results.json").write_text(json.dumps(result | {"seed": 4, "lm": {"rule": "pinned"}}))
    todo = finish.to_retrain([{"path": str(p)} for p in (decoded, pinned)])
    assert [Path(e["path"]).name for e in todo] == ["none-s4"]
    assert finish.pending(decoded) is None and finish.pending(pinned) == "best.pt missing, not today's"


def test_decode_ended_decodes_and_keeps_each_finished_run_with_its_best_pt_not_yet_decoded_today(tmp_path,
                                                                                                  monkeypatch):
    dir_, kept = tmp_path / "study", tmp_path / "kept"
    runs = dir_ / "runs" / "an4_cpu_patience"
    fresh = run_folder(runs, "gru-none-s3", "none", 3, best=True)  # kept once, greedy and the pinned decoding
    (kept / "an4_cpu_patience" / fresh.name).mkdir(parents=True)
    (kept / "an4_cpu_patience" / fresh.name / "results.json").write_text(json.dumps({"lm": {"rule": "pinned"}}))
    unkept = run_folder(runs, "gru-post-s3", "post", 3, best=True)  # ended since the keeper's last pass
    done = run_folder(runs, "gru-ln-s3", "ln", 3, best=True)  # decoded today in an earlier call, which the pinned
    (kept / "an4_cpu_patience" / done.name).mkdir(parents=True)  # study then overwrote in its own folder
    result = json.loads((done / "results.json").read_text())
    (kept / "an4_cpu_patience" / done.name / "results.json").write_text(json.dumps(result | {"lm": TODAY}))
    (done / "results.json").write_text(json.dumps(result | {"lm": {"rule": "pinned"}}))
    run_folder(runs, "gru-wn-s3", "wn", 3)  # its best.pt gone: nothing to decode with
    run_folder(runs, "gru-ln_full-s3", "ln_full", 3, status="running", best=True)  # not finished
    monkeypatch.setattr(finish, "KEPT", kept)
    monkeypatch.setattr(finish, "study_running", lambda d: [])
    calls = []

    def fake_decode(cmd, **kwargs):
        calls.append([str(c) for c in cmd])
        for p in cmd[cmd.index("decode") + 1:-2]:
            result = json.loads((Path(p) / "results.json").read_text())
            (Path(p) / "results.json").write_text(json.dumps(result | {"lm": TODAY}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(finish.subprocess, "run", fake_decode)
    assert finish.main([str(dir_), "--decode-ended"]) == 0
    (decode,) = calls
    assert decode[-2:] == ["--data-root", str(dir_ / "data")] and decode[-4:-2] == [str(fresh), str(unkept)]
    for p in (fresh, unkept):
        assert json.loads((kept / "an4_cpu_patience" / p.name / "results.json").read_text())["lm"] == TODAY
    assert "2 finished runs with their best.pt to decode" in (dir_ / "commands.log").read_text()
    assert json.loads((done / "results.json").read_text())["lm"] == TODAY, "the kept decoding taken back"
    calls.clear()
    assert finish.main([str(dir_), "--decode-ended"]) == 0 and calls == [], "all decoded: nothing to do"


def test_a_decoding_that_fails_keeps_what_it_decoded_and_names_the_rest(tmp_path, monkeypatch):
    dir_, kept = tmp_path / "study", tmp_path / "kept"
    runs = dir_ / "runs" / "an4_cpu_patience"
    first, second = (run_folder(runs, f"gru-none-s{s}", "none", s, best=True) for s in (3, 4))
    monkeypatch.setattr(finish, "KEPT", kept)
    monkeypatch.setattr(finish, "study_running", lambda d: [])

    def decodes_one(cmd, **kwargs):  # the first run written, then a failure
        result = json.loads((first / "results.json").read_text())
        (first / "results.json").write_text(json.dumps(result | {"lm": TODAY}))
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(finish.subprocess, "run", decodes_one)
    assert finish.main([str(dir_), "--decode-ended"]) == 1
    assert json.loads((kept / "an4_cpu_patience" / first.name / "results.json").read_text())["lm"] == TODAY
    assert not (kept / "an4_cpu_patience" / second.name).exists()
    assert "not decoded by this checkout's rule (exit status 1, its message above): gru-none-s4; run it again" in \
        (dir_ / "commands.log").read_text()


def test_a_kept_decoding_of_another_training_is_not_taken_back(tmp_path, monkeypatch):
    dir_, kept = tmp_path / "study", tmp_path / "kept"
    path = run_folder(dir_ / "runs" / "an4_cpu_patience", "gru-none-s3", "none", 3)  # trained again since
    (kept / "an4_cpu_patience" / path.name).mkdir(parents=True)
    result = json.loads((path / "results.json").read_text())
    (kept / "an4_cpu_patience" / path.name / "results.json").write_text(json.dumps(result | {"test_wer": 0.2,
                                                                                              "lm": TODAY}))
    monkeypatch.setattr(finish, "KEPT", kept)
    finish.adopt_kept_lm(dir_, dir_ / "runs" / "an4_cpu_patience", kept / "an4_cpu_patience")
    assert "lm" not in json.loads((path / "results.json").read_text())


def test_the_rule_check_needs_no_corpus_for_another_rule_and_never_makes_the_study_folder(tmp_path):
    path = tmp_path / "study" / "runs" / "an4_cpu_patience" / "gru-none-s1"  # a new machine: no study folder yet
    config = {"data": {"corpus": "an4"}}
    pinned = {"beam_size": 50, "lm_weights": [0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0], "word_scores": [-1.0, 0.0, 1.0, 2.0]}
    assert REAL_LM_FAULT(path, {"config": config, "lm": pinned}) == "decoded by another rule (widen None, not 4)"
    assert REAL_LM_FAULT(path, {"config": config}) == "not decoded with the LM"
    fault = REAL_LM_FAULT(path, {"config": config, "lm": pinned | {"widen": 4}})
    assert fault == f"its LM unchecked: no {tmp_path / 'study' / 'data'} to build this checkout's LM from"
    assert not (tmp_path / "study").exists()


def test_decode_ended_refuses_while_the_study_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "runs" / "an4_cpu_patience").mkdir(parents=True)
    monkeypatch.setattr(finish, "study_running", lambda d: [4242])
    with pytest.raises(SystemExit):
        finish.main([str(tmp_path), "--decode-ended"])
    assert "stop it first (bash experiments/pinned_study.sh stop" in capsys.readouterr().err


def report(**changes) -> dict:
    base = {"running": 0, "stopped": 0, "protocol": {"seeds": [1, 2]},
            "tuning": [{"label": "gru-none", "lr": 0.001, "augment": True, "patience": 1, "missing": [],
                        "augment_missing": [], "patience_missing": []}],
            "rows": [{"label": "gru-none", "seeds": [1, 2], "diverged": 0}]}
    return base | changes


def test_a_study_with_runs_to_come_is_not_finished():
    assert finish.unfinished(report()) == []
    assert finish.unfinished(report(rows=[{"label": "gru-none", "seeds": [1], "diverged": 1}])) == []
    assert finish.unfinished(report(stopped=1)) == ["1 runs running or stopped half-way"]
    assert finish.unfinished(report(tuning=[{"label": "gru-post", "lr": None, "missing": [[5e-4, 1]],
                                             "augment_missing": [], "patience_missing": []}])) == ["gru-post: tuning"]
    assert finish.unfinished(report(rows=[{"label": "gru-none", "seeds": [1], "diverged": 0}])) == [
        "gru-none: 1 of 2 seeds"]
    assert finish.unfinished(report(), rows=2) == ["1 of 2 variants with a verdict"], "a variant never started"


@pytest.fixture
def study(tmp_path, monkeypatch):
    """A pinned checkout whose study has ended: gru-none seeds 1 (best.pt gone) and 2, gru-post seed 1 (no best.pt,
    greedy only), gru-none s1 and gru-post s1 kept in the main checkout; every subprocess recorded, training writing
    best.pt and new figures, decoding adding its own."""
    dir_, kept = tmp_path / "study", tmp_path / "kept"
    runs = dir_ / "runs" / "an4_cpu_patience"
    paths = [run_folder(runs, "gru-none-s1", "none", 1), run_folder(runs, "gru-none-s2", "none", 2, best=True),
             run_folder(runs, "gru-post-s1", "post", 1)]
    for p in (paths[0], paths[2]):
        (kept / "an4_cpu_patience" / p.name).mkdir(parents=True)
        (kept / "an4_cpu_patience" / p.name / "results.json").write_text("{}")
    monkeypatch.setattr(finish, "KEPT", kept)
    monkeypatch.setattr(finish, "study_running", lambda d: [])  # tests/test_pinned_study.py checks the real one
    reports = []
    monkeypatch.setattr(finish, "report_json", lambda runs_dir: reports.append(1) or report(
        verdict_runs=[{"path": str(p)} for p in paths]))
    calls = []

    def fake_run(cmd, cwd=None, **kwargs):
        calls.append(([str(c) for c in cmd], cwd))
        if "src/run.py" in cmd:
            assert "train.rerun=true" in cmd, "the first training finished: afresh"
            result = json.loads((runs / "gru-none-s1" / "results.json").read_text())
            (runs / "gru-none-s1" / "results.json").write_text(json.dumps(result | {"test_wer": 0.09}))
            (runs / "gru-none-s1" / "best.pt").write_bytes(b"weights")
        if "decode" in cmd:
            for p in cmd[cmd.index("decode") + 1:-2]:
                result = json.loads((Path(p) / "results.json").read_text())
                (Path(p) / "results.json").write_text(json.dumps(result | {"decoded": Path(p).name}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(finish.subprocess, "run", fake_run)
    return dir_, kept, calls, paths


def test_finishing_trains_again_then_decodes_then_keeps_and_reports(study):
    dir_, kept, calls, paths = study
    assert finish.main([str(dir_), "--", "--inference", "bench.jsonl"]) == 0
    (train, train_cwd), (decode, _), (report_cmd, _) = calls
    assert train[:2] == [str(dir_ / ".venv" / "bin" / "python"), "src/run.py"] and train_cwd == dir_
    assert "model.bn=none" in train and "seed=1" in train and "train.lr=0.0005" in train
    assert decode[-2:] == ["--data-root", str(dir_ / "data")] and decode[-5:-2] == [str(p) for p in paths]
    assert report_cmd[-3:] == [str(kept / "an4_cpu_patience"), "--inference", "bench.jsonl"]
    for p in paths:  # the verdict's runs, decoded, kept; gru-none-s2 kept for the first time
        assert json.loads((kept / "an4_cpu_patience" / p.name / "results.json").read_text())["decoded"] == p.name
    first = json.loads((kept / "an4_cpu_patience" / "gru-none-s1" / finish.BEFORE).read_text())
    assert first["test_wer"] == 0.1 and "decoded" not in first, "the first training's figures, kept too"
    assert "gru-none-s1: trained again, best.pt written; test WER 0.1 first, 0.09 now" in (
        dir_ / "commands.log").read_text()
    assert not (dir_ / finish.LISTED).exists(), "finished: the next call reads the study afresh"
    calls.clear()
    assert finish.main([str(dir_)]) == 0, "run again: nothing left to train; decoding (cached) and the report again"
    assert not any("src/run.py" in cmd for cmd, _ in calls)


def test_a_retraining_that_fails_stops_before_decoding_and_the_next_call_goes_on_from_the_list(study, monkeypatch,
                                                                                                capsys):
    dir_, kept, calls, paths = study
    failed = []

    def fails(cmd, **kw):  # stopped in its first epoch: results.json gone with train.rerun, nothing written yet
        failed.append(cmd)
        (paths[0] / "results.json").unlink()
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(finish.subprocess, "run", fails)
    assert finish.main([str(dir_)]) == 1
    assert len(failed) == 1, "no decoding after a failed retraining"
    assert f"see {dir_ / 'finish-gru-none-s1.log'}" in capsys.readouterr().out
    assert (dir_ / finish.LISTED).exists()
    monkeypatch.setattr(finish.subprocess, "run", lambda cmd, **kw: failed.append(cmd) or (
        subprocess.CompletedProcess(cmd, 1)))
    assert finish.main([str(dir_)]) == 1
    assert "train.rerun=true" not in failed[-1] and "seed=1" in failed[-1], "resumed from the list, not afresh"


def test_a_retraining_that_changes_a_choice_is_refused(study, monkeypatch, capsys):
    dir_, kept, calls, paths = study
    before = report(verdict_runs=[{"path": str(p)} for p in paths])
    after = report(verdict_runs=[], tuning=[before["tuning"][0] | {"lr": 0.002}])
    answers = iter([before, after])
    monkeypatch.setattr(finish, "report_json", lambda runs_dir: next(answers))
    with pytest.raises(SystemExit):
        finish.main([str(dir_)])
    assert "retraining changed the tuning's choices ({'gru-none': ([0.001, True, 1], [0.002, True, 1])" in \
        capsys.readouterr().err
    assert not any("decode" in cmd for cmd, _ in calls)


def test_it_refuses_a_study_with_runs_to_come_or_a_folder_that_is_not_one(study, monkeypatch, capsys, tmp_path):
    dir_, kept, calls, paths = study
    monkeypatch.setattr(finish, "report_json", lambda runs_dir: report(stopped=2, verdict_runs=[]))
    with pytest.raises(SystemExit):
        finish.main([str(dir_)])
    assert "not finished: 2 runs running or stopped half-way" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        finish.main([str(tmp_path / "elsewhere")])
    assert "elsewhere/runs/an4_cpu_patience does not exist" in capsys.readouterr().err
    assert calls == [] and not (dir_ / finish.LISTED).exists()
