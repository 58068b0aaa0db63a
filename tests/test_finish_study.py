"""experiments/finish_study.py, the end of a pinned study: which verdict runs train again for the LM, when it refuses,
and the order of its steps (training and decoding stand in: the real ones run at a study's end)."""
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
    config = {"model": {"rnn": "gru", "bn": bn}, "protocol": {"reuse_needs_model": ["none", "seqwise", "ln"]}}
    (path / "results.json").write_text(json.dumps({"preset": "an4_cpu_patience", "seed": seed, "status": status,
                                                   "config": config}))
    if best:
        (path / "best.pt").write_bytes(b"weights")
    return path


def test_only_the_lm_placements_runs_without_best_pt_train_again(tmp_path):
    paths = [run_folder(tmp_path, "none-s1", "none", 1),  # finished, best.pt gone: afresh
             run_folder(tmp_path, "none-s2", "none", 2, best=True),  # decodable as it is
             run_folder(tmp_path, "post-s1", "post", 1),  # greedy family only: left as it is
             run_folder(tmp_path, "seqwise-s3", "seqwise", 3, status="running")]  # stopped half-way: resumes
    todo = dict(finish.retrains(paths))
    assert sorted(p.name for p in todo) == ["none-s1", "seqwise-s3"]
    assert todo[tmp_path / "none-s1"] == ["experiment=an4_cpu_patience", "model.rnn=gru", "model.bn=none",
                                          "protocol.stage=final", "seed=1", "train.threads=1",
                                          "hydra.run.dir=${hydra.sweep.dir}", "train.rerun=true"]
    assert "train.rerun=true" not in todo[tmp_path / "seqwise-s3"] and "seed=3" in todo[tmp_path / "seqwise-s3"]


def report(**changes) -> dict:
    base = {"running": 0, "stopped": 0, "preregistered": {"seeds": [1, 2]},
            "tuning": [{"label": "gru-none", "lr": 0.001, "missing": [], "augment_missing": [], "patience_missing": []}],
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


@pytest.fixture
def study(tmp_path, monkeypatch):
    """A pinned checkout whose study has ended: gru-none seeds 1 (best.pt gone) and 2, gru-post seed 1 (no best.pt,
    greedy only), each kept in the main checkout; every subprocess recorded, training writing best.pt."""
    dir_, kept = tmp_path / "study", tmp_path / "kept"
    runs = dir_ / "runs" / "an4_cpu_patience"
    paths = [run_folder(runs, "gru-none-s1", "none", 1), run_folder(runs, "gru-none-s2", "none", 2, best=True),
             run_folder(runs, "gru-post-s1", "post", 1)]
    for p in paths:
        (kept / "an4_cpu_patience" / p.name).mkdir(parents=True)
    monkeypatch.setattr(finish, "KEPT", kept)
    monkeypatch.setattr(finish, "report_json", lambda runs_dir: report(verdict_runs=[{"path": str(p)} for p in paths]))
    calls = []

    def fake_run(cmd, cwd=None, **kwargs):
        calls.append(([str(c) for c in cmd], cwd))
        if "src/run.py" in cmd:  # training writes best.pt and the results the decoding then adds to
            (runs / "gru-none-s1" / "best.pt").write_bytes(b"weights")
        if "decode" in cmd:
            for p in paths:
                result = json.loads((p / "results.json").read_text())
                (p / "results.json").write_text(json.dumps(result | {"decoded": p.name}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(finish.subprocess, "run", fake_run)
    return dir_, kept, calls


def test_finishing_trains_again_then_decodes_then_keeps_and_reports(study):
    dir_, kept, calls = study
    assert finish.main([str(dir_), "--", "--inference", "bench.jsonl"]) == 0
    (train, train_cwd), (decode, _), (report_cmd, _) = calls
    assert train[:2] == [str(dir_ / ".venv" / "bin" / "python"), "src/run.py"] and train_cwd == dir_
    assert "model.bn=none" in train and "seed=1" in train and "train.rerun=true" in train
    assert decode[-4:] == ["decode", str(dir_ / "runs" / "an4_cpu_patience"), "--data-root", str(dir_ / "data")]
    assert report_cmd[-3:] == [str(kept / "an4_cpu_patience"), "--inference", "bench.jsonl"]
    for name in ("gru-none-s1", "gru-none-s2", "gru-post-s1"):
        assert json.loads((kept / "an4_cpu_patience" / name / "results.json").read_text())["decoded"] == name
    assert "finish: copied 3 results.json" in (dir_ / "commands.log").read_text()
    first = json.loads((dir_ / "runs" / "an4_cpu_patience" / "gru-none-s1" / finish.BEFORE).read_text())
    assert first["status"] == "finished" and "decoded" not in first, "the first training's results, kept"
    calls.clear()
    assert finish.main([str(dir_)]) == 0, "run again: nothing left to train, decoding and the report again"
    assert not any("src/run.py" in cmd for cmd, _ in calls)


def test_a_retraining_that_fails_stops_before_decoding_and_says_where_its_log_is(study, monkeypatch, capsys):
    dir_, kept, calls = study
    monkeypatch.setattr(finish.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 1))
    assert finish.main([str(dir_)]) == 1
    assert len(calls) == 1, "no decoding after a failed retraining"
    assert f"see {dir_ / 'finish-gru-none-s1.log'}" in capsys.readouterr().out


def test_it_refuses_a_study_with_runs_to_come_or_a_folder_that_is_not_one(study, monkeypatch, capsys, tmp_path):
    dir_, kept, calls = study
    monkeypatch.setattr(finish, "report_json", lambda runs_dir: report(stopped=2, verdict_runs=[]))
    with pytest.raises(SystemExit):
        finish.main([str(dir_)])
    assert "not finished: 2 runs running or stopped half-way" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        finish.main([str(tmp_path / "elsewhere")])
    assert "elsewhere/runs/an4_cpu_patience does not exist" in capsys.readouterr().err
    assert calls == []
