"""experiments/gpu_check.py --dry-run: the GPU check's steps on the CPU at tiny sizes, so it cannot rot
while no GPU is at hand; a failure and the time guard stop it with what was done written down."""
import json
import os
import subprocess
import sys

from conftest import BENCH_ROWS, ROOT

STEPS = ["prepare", "pytest-gpu", "bench-bf16", "train", "bench-fp32"]


def check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_check.py"), "--dry-run", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def without_wandb(tmp_path) -> dict:
    """An environment where `import wandb` fails, as on the GPU machine's image, which lacks it."""
    for name in ("wandb", "wandb_workspaces"):
        (tmp_path / "absent" / name).mkdir(parents=True)
        (tmp_path / "absent" / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed')\n")
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "absent"),
                                                                     os.environ.get("PYTHONPATH")]))}


def written(out) -> tuple[list[dict], str]:
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return records, (out / "summary.md").read_text()


def test_dry_run_records_every_planned_step_without_wandb(tmp_path, smoke_root):
    done = check("--out", str(tmp_path / "out"), "--data-root", str(smoke_root), env=without_wandb(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records, table = written(tmp_path / "out")
    assert [(r["step"], r["status"]) for r in records] == [(s, "ok") for s in STEPS]
    for step in STEPS:
        assert f"| {step} | ok |" in table
    steps = {r["step"]: r for r in records}
    assert steps["pytest-gpu"]["counts"]["skipped"] > 0 and "failed" not in steps["pytest-gpu"]["counts"]
    variants = [(rnn, bn, impl) for rnn in ("gru", "lstm") for bn, impl in BENCH_ROWS]
    for name, amp in (("bench-bf16", True), ("bench-fp32", False)):
        assert [(r["rnn"], r["bn"], r["impl"]) for r in steps[name]["rows"]] == variants
        assert all(r["amp"] is amp and r["ms"] > 0 for r in steps[name]["rows"])
    runs = steps["train"]["runs"]
    assert [(r["rnn"], r["bn"]) for r in runs] == [(rnn, bn) for rnn in ("gru", "lstm")
                                                   for bn in ("none", "input", "seqwise", "ln", "wn")]
    for r in runs:
        assert r["device"] == "cpu" and len(r["epochs"]) == 1
        assert r["epochs"][0]["epoch_time_s"] > 0 and r["epochs"][0]["peak_mem_mb"] > 0
        assert f"| {r['rnn']} | {r['bn']} | {r['epochs'][0]['epoch_time_s']:.1f} |" in table


def test_first_failure_stops_the_check_and_is_shown(tmp_path):
    (tmp_path / "file").touch()  # data.root that cannot be a folder
    done = check("--out", str(tmp_path / "out"), "--data-root", str(tmp_path / "file"))
    assert done.returncode == 1
    assert "error: prepare: " in done.stderr and "cannot create the data folder" in done.stderr
    records, table = written(tmp_path / "out")
    assert [r["status"] for r in records] == ["failed"] + ["not run"] * 4
    assert "| prepare | failed |" in table


def test_time_guard_reports_what_was_not_run(tmp_path, smoke_root):
    done = check("--out", str(tmp_path), "--data-root", str(smoke_root), "--budget-s", "0")
    assert done.returncode == 3
    records, table = written(tmp_path)
    assert [r["status"] for r in records] == ["not run (time guard)"] * 5
    assert "0 of 5 steps ok" in table
