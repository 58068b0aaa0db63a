"""experiments/keep_results.sh: an ended run's results.json (finished or diverged) is copied into
experiments/results/ (a running one is not, and a copy already kept is never overwritten), so that a session
which ends loses no ended run."""
import json
import subprocess

from conftest import ROOT


def _run(root, study, name, status):
    folder = root / "runs" / study / name
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"status": status, "seed": 1}, indent=1))
    (folder / "checkpoint.pt").write_bytes(b"not kept")


def test_keep_results_copies_ended_runs_only(tmp_path):
    (tmp_path / "experiments").mkdir()
    script = tmp_path / "experiments" / "keep_results.sh"
    script.write_text((ROOT / "experiments" / "keep_results.sh").read_text())
    _run(tmp_path, "an4_depth", "gru-none-L1-lr0.001-s1-aaaa", "finished")
    _run(tmp_path, "an4_depth", "gru-none-L7-lr0.001-s1-bbbb", "running")
    _run(tmp_path, "an4_cpu", "gru-ln-L3-lr0.002-s1-cccc", "finished")
    _run(tmp_path, "an4_cpu", "gru-wn-L3-lr0.002-s1-dddd", "diverged")
    kept_before = tmp_path / "experiments" / "results" / "an4_cpu_protocol" / "gru-ln-L3-lr0.002-s1-cccc"
    kept_before.mkdir(parents=True)
    (kept_before / "results.json").write_text("kept earlier")

    done = subprocess.run(["bash", str(script), "once"], capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    results = tmp_path / "experiments" / "results"
    kept = sorted(str(p.relative_to(results)) for p in results.rglob("*") if p.is_file())
    assert kept == ["an4_cpu_protocol/gru-ln-L3-lr0.002-s1-cccc/results.json",
                    "an4_cpu_protocol/gru-wn-L3-lr0.002-s1-dddd/results.json",
                    "an4_depth_protocol/gru-none-L1-lr0.001-s1-aaaa/results.json"]
    assert json.loads((results / kept[2]).read_text())["status"] == "finished"
    assert json.loads((results / kept[1]).read_text())["status"] == "diverged"
    assert (kept_before / "results.json").read_text() == "kept earlier"
    assert done.stdout.count("kept ") == 2


def test_keep_results_knows_the_converged_studies_and_keeps_them_where_it_is_told(tmp_path):
    """A study run from a second checkout pinned to one commit keeps its ended runs in the main checkout."""
    study, main = tmp_path / "study", tmp_path / "main" / "experiments" / "results"
    (study / "experiments").mkdir(parents=True)
    script = study / "experiments" / "keep_results.sh"
    script.write_text((ROOT / "experiments" / "keep_results.sh").read_text())
    _run(study, "an4_cpu_plateau", "lstm-none-L3-lr0.002-s1-eeee", "finished")
    _run(study, "an4_depth_plateau", "gru-none-L7-lr0.001-s1-ffff", "diverged")
    _run(study, "an4_cpu_plateau", "lstm-post-L3-lr0.002-s1-gggg", "running")

    done = subprocess.run(["bash", str(script), "once"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "KEEP_TO": str(main)})

    assert done.returncode == 0, done.stderr
    kept = sorted(str(p.relative_to(main)) for p in main.rglob("*") if p.is_file())
    assert kept == ["an4_cpu_plateau/lstm-none-L3-lr0.002-s1-eeee/results.json",
                    "an4_depth_plateau/gru-none-L7-lr0.001-s1-ffff/results.json"]
    assert not (study / "experiments" / "results").exists()

