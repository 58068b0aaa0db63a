"""The end of a study run from a pinned checkout (pinned_study.sh), once its last run has ended, in one resumable
command (docs/protocol.md, the patience study's end):

    python experiments/finish_study.py ../study-patience [--study an4_cpu_patience] [--jobs 2] [-- REPORT ARGS]

1. Refuses while the study runs in DIR, or while any variant's tuning or verdict has runs to come; writes the
   verdict's run folders down (DIR/finish-verdict-runs.json) for the steps after it.
2. Trains again each verdict run that has no best.pt where the LM family needs one (protocol.reuse_needs_model's
   placements: their runs of early sessions lost it with the checkout), in DIR at its commit, as stage final with
   the run's seed; a finished run with train.rerun=true, one stopped half-way resumes. Two 1-thread jobs at once.
3. Decodes every finished run with the word LM from this checkout (python -m batchrnn.evaluate decode), so that
   every run is decoded by today's rule (the LM grid widening past an edge came after some pinned commits).
4. Copies each run's results.json over the one kept in experiments/results/STUDY, and writes the report there
   (python -m batchrnn.report, with REPORT ARGS, e.g. --inference FILE).

Each step skips what is done, so running it again after a stop resumes. What ran goes to DIR/commands.log.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MAIN = Path(__file__).resolve().parents[1]
KEPT = MAIN / "experiments" / "results"
BEFORE = "results-first-training.json"  # a retrained run's results.json as its first training left it


def log(dir_: Path, line: str) -> None:
    print(line, flush=True)
    with open(dir_ / "commands.log", "a") as f:
        f.write(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ} finish: {line}\n")


def study_running(dir_: Path) -> list[int]:
    """The `python -m batchrnn.study` processes whose working directory is dir_ (as pinned_study.sh stop finds them)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"batchrnn.study" in (proc / "cmdline").read_bytes() \
                    and Path(os.readlink(proc / "cwd")) == dir_.resolve():
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def unfinished(report: dict) -> list[str]:
    """What the study has still to run, from its report.json: an empty list once every run of it has ended."""
    going = report["running"] + report["stopped"]
    left = [f"{going} runs running or stopped half-way"] if going else []
    for t in report["tuning"]:
        if t["lr"] is None or t["missing"] or t["augment_missing"] or t["patience_missing"]:
            left.append(f"{t['label']}: tuning")
    seeds = len(report["preregistered"]["seeds"]) if report.get("preregistered") else None
    for row in report["rows"]:
        if seeds is not None and len(row["seeds"]) + row["diverged"] < seeds:
            left.append(f"{row['label']}: {len(row['seeds']) + row['diverged']} of {seeds} seeds")
    if not report["rows"]:
        left.append("no verdict yet")
    return left


def retrains(paths: list[Path]) -> list[tuple[Path, list[str]]]:
    """(run folder, src/run.py overrides) of each verdict run to train again: its placement needs best.pt for the LM
    (protocol.reuse_needs_model) and it has none. train.rerun=true only for a finished run: one stopped half-way by
    an earlier call resumes from its last epoch."""
    out = []
    for path in paths:
        result = json.loads((path / "results.json").read_text()) if (path / "results.json").exists() else None
        if result is None:
            raise SystemExit(f"error: {path} has no results.json; the verdict names it, so the report is out of "
                             "date: run this again")
        config = result["config"]
        if config["model"]["bn"] not in config["protocol"].get("reuse_needs_model", []) or (path / "best.pt").exists():
            continue
        overrides = [f"experiment={result['preset']}", f"model.rnn={config['model']['rnn']}",
                     f"model.bn={config['model']['bn']}", "protocol.stage=final", f"seed={result['seed']}",
                     "train.threads=1", "hydra.run.dir=${hydra.sweep.dir}"]
        out.append((path, overrides + ["train.rerun=true"] * (result.get("status") == "finished")))
    return out


def same_figures(path: Path) -> str:
    """The retrained run's test WER beside the first training's (the same on the machine that first ran it)."""
    if not (path / BEFORE).exists():
        return "no earlier figures kept"
    before, after = (json.loads((path / name).read_text()).get("test_wer") for name in (BEFORE, "results.json"))
    return f"test WER {before} first, {after} now" + (" (the same)" if before == after else "")


def report_json(study_dir: Path, extra: list[str] = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "batchrnn.report", str(study_dir), "--out", tmp, *extra], check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads((Path(tmp) / "report.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="arguments after -- go to python -m batchrnn.report (e.g. --inference FILE)")
    p.add_argument("dir", type=Path, help="the pinned checkout the study ran in (pinned_study.sh's DIR)")
    p.add_argument("--study", default="an4_cpu_patience", help="the study's folder under DIR/runs (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=2, help="retraining runs at once, 1 thread each (default: %(default)s)")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    dir_ = args.dir.resolve()
    runs, kept = dir_ / "runs" / args.study, KEPT / args.study
    if not runs.is_dir():
        p.error(f"{runs} does not exist: give the pinned checkout the study ran in, and its folder with --study")
    if pids := study_running(dir_):
        p.error(f"the study is still running in {dir_} (processes {pids}): finish it once it has ended (it writes "
                f"{runs / 'report.md'} then)")
    # The verdict's runs are read once, from a study that has ended, and written down: a retraining stopped half-way
    # takes its run out of the verdict until it ends, so a later call goes on from the list
    listed = dir_ / "finish-verdict-runs.json"
    if not listed.exists():
        report = report_json(runs)
        if left := unfinished(report):
            p.error(f"the study has runs to come, so it is not finished: {'; '.join(left)}. Resume it "
                    "(make patience-study COMMIT=...) and finish once its report says every variant's verdict is in")
        listed.write_text(json.dumps([v["path"] for v in report["verdict_runs"]], indent=1))
    todo = retrains([Path(v) for v in json.loads(listed.read_text())])
    log(dir_, f"{len(todo)} verdict runs to train again for the LM (no best.pt)")
    python = dir_ / ".venv" / "bin" / "python"

    def retrain(job: tuple[Path, list[str]]) -> tuple[Path, int]:
        path, overrides = job
        if "train.rerun=true" in overrides:  # kept for the check: on the machine it first ran on, the same figures
            shutil.copy2(path / "results.json", path / BEFORE)
        log(dir_, f"train again {path.name}: {' '.join(overrides)}")
        with open(dir_ / f"finish-{path.name}.log", "a") as out:
            code = subprocess.run([str(python), "src/run.py", *overrides], cwd=dir_, stdout=out, stderr=out,
                                  env=os.environ | {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "10000"}).returncode
        return path, code

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for path, code in pool.map(retrain, todo):
            if code or not (path / "best.pt").exists():
                log(dir_, f"{path.name}: exit status {code}, best.pt {'there' if (path / 'best.pt').exists() else 'missing'}"
                          f"; see {dir_ / f'finish-{path.name}.log'}")
                return 1
            log(dir_, f"{path.name}: trained again, best.pt written; {same_figures(path)}")

    log(dir_, f"decode with the LM: {runs}")
    subprocess.run([sys.executable, "-m", "batchrnn.evaluate", "decode", str(runs), "--data-root", str(dir_ / "data")],
                   check=True)
    copied = 0
    for result in sorted(runs.glob("*/results.json")):
        if (kept / result.parent.name).is_dir():
            shutil.copy2(result, kept / result.parent.name / "results.json")
            copied += 1
    log(dir_, f"copied {copied} results.json into {kept}")
    subprocess.run([sys.executable, "-m", "batchrnn.report", str(kept), *extra], check=True)
    log(dir_, f"report written in {kept} (report args: {' '.join(extra) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
