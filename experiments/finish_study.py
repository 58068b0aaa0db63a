"""The end of a study run from a pinned checkout (pinned_study.sh), once its last run has ended, in one resumable
command (docs/protocol.md, the patience study's end):

    python experiments/finish_study.py ../study-patience [--study an4_cpu_patience] [--rows 16] [--jobs 2] [-- REPORT ARGS]

1. Refuses while the study runs in DIR, or while any variant's tuning or verdict has runs to come (--rows: the
   verdict must have that many rows, the variants the study was started with). Writes down the verdict's runs to
   train again and each variant's choices (DIR/finish-verdict-runs.json), for the calls after a stop.
2. Trains again each verdict run without a usable best.pt whose placement needs one for the LM family
   (protocol.reuse_needs_model: runs of early sessions lost it with the checkout), unless it was decoded by this
   checkout's rule while it had one (--decode-ended; the kept results.json's `lm` goes back into DIR's run folder
   first, since the pinned study rewrites its own there), in DIR at its commit, at the
   run's own settings (rate, SpecAugment, schedule, seed; stage tune, which takes them as given, so that the run
   depends on no other): a finished run afresh (train.rerun=true, its first results kept beside it as
   results-first-training.json), one stopped half-way from its last epoch. Two 1-thread jobs at once; the first
   failure stops what has not started.
3. Refuses if the retraining changed any variant's choice of rate, SpecAugment or schedule (another machine's
   rounding can: then the verdict's rows are not the ones written down, and the study is not finished).
4. Keeps every ended run not yet kept, decodes the verdict's runs with the word LM from this checkout (python -m
   batchrnn.evaluate decode, cached per run), so that every one is decoded by today's rule (the LM grid's widening
   past an edge came after some pinned commits), copies their results.json (and results-first-training.json) over
   the kept ones in experiments/results/STUDY, and writes the report there (python -m batchrnn.report, REPORT
   ARGS, e.g. --inference FILE).

What ran goes to DIR/commands.log, each retraining's output to DIR/finish-RUN.log.

    python experiments/finish_study.py ../study-patience --decode-ended   (make patience-decode)

Before the machine goes (each session's end, the study stopped): decodes with the word LM, by this checkout's rule,
every finished run in DIR that has its best.pt and whose kept results.json holds no decoding by that rule (any
placement: the decoding costs seconds a run, a retraining an hour), and keeps its results.json. A verdict run so
decoded needs no retraining at the end, though its best.pt is gone with the machine.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from batchrnn.storage import write_json
from batchrnn.training.identity import AUGMENT, LR, SCHEDULE, flatten
from batchrnn.training.rundir import RunFolder

MAIN = Path(__file__).resolve().parents[1]
KEPT = MAIN / "experiments" / "results"
BEFORE = "results-first-training.json"  # a retrained run's results.json as its first training left it
LISTED = "finish-verdict-runs.json"  # in DIR: the runs to train again and the choices, from the ended study
ENDED = ("finished", "diverged")


def log(dir_: Path, line: str) -> None:
    print(line, flush=True)
    with open(dir_ / "commands.log", "a") as f:
        f.write(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ} finish: {line}\n")


def study_running(dir_: Path) -> list[int]:
    """The study's processes in dir_, as pinned_study.sh finds them (and stops them)."""
    out = subprocess.run(["bash", str(MAIN / "experiments" / "pinned_study.sh"), "running", str(dir_)],
                         capture_output=True, text=True, check=True).stdout
    return [int(pid) for pid in out.split()]


def unfinished(report: dict, rows: int | None = None) -> list[str]:
    """What the study has still to run, from its report.json: an empty list once every run of it has ended."""
    going = report["running"] + report["stopped"]
    left = [f"{going} runs running or stopped half-way"] if going else []
    for t in report["tuning"]:
        if t["lr"] is None or t["missing"] or t["augment_missing"] or t["patience_missing"]:
            left.append(f"{t['label']}: tuning")
    seeds = len(report["protocol"]["seeds"])  # the seeds the runs were made with (the same list for all, or refused)
    for row in report["rows"]:
        if len(row["seeds"]) + row["diverged"] < seeds:
            left.append(f"{row['label']}: {len(row['seeds']) + row['diverged']} of {seeds} seeds")
    if rows is not None and len(report["rows"]) < rows:
        left.append(f"{len(report['rows'])} of {rows} variants with a verdict")
    return left


def choices(report: dict) -> dict:
    """Each variant's tuned rate, SpecAugment and schedule, as the report chose them."""
    return {t["label"]: [t["lr"], t.get("augment"), t.get("patience")] for t in report["tuning"]}


def model_fault(path: Path, config: dict) -> str | None:
    """What makes the run's best.pt unusable for the LM decoding (missing, damaged, another model's), or None."""
    return RunFolder(path).best_fault(config)


def decoding():
    """The settings python -m batchrnn.evaluate decode runs with here: the schema's beam and grid, the built 3-gram."""
    from batchrnn.config import DecodeConfig
    from batchrnn.decoding.beam import Decoder

    return DecodeConfig(decoder=Decoder.beam)


@functools.cache
def today(data_root: str, data: str) -> dict:
    """This checkout's LM decoding rule (decoding(), the 3-gram built from the study's training transcripts under
    data_root), for runs of these data settings."""
    from batchrnn.data.corpus import prepare_corpus
    from batchrnn.decoding.beam import language_model
    from batchrnn.decoding.tuning import rule
    from batchrnn.evaluate import data_config

    cfg, settings = decoding(), data_config({"config": {"data": json.loads(data)}}, data_root)
    return rule(cfg, language_model(cfg, settings, prepare_corpus(settings)))


def lm_fault(path: Path, result: dict) -> str | None:
    """What makes the run's results.json `lm` other than this checkout's decoding (none, or another rule's), or None:
    then the run needs its best.pt no more (path: DIR/runs/STUDY/RUN, its data under DIR/data, which the LM's
    part of the rule reads only where the rest agrees, and never creates)."""
    from batchrnn.decoding.tuning import other_rule, rule

    if fault := other_rule(result.get("lm"), rule(decoding())):
        return fault
    data_root = path.resolve().parents[2] / "data"
    if not data_root.is_dir():  # a new machine before the study's checkout is made: make patience-study makes it
        return f"its LM unchecked: no {data_root} to build this checkout's LM from"
    return other_rule(result.get("lm"), today(str(data_root), json.dumps(result["config"]["data"], sort_keys=True)))


def needs_model(path: Path, result: dict) -> str | None:
    """Why the finished run still needs a usable best.pt for the LM family (none, and its `lm` not decoded by this
    checkout's rule), or None."""
    if (lm := lm_fault(path, result)) is None or (fault := model_fault(path, result["config"])) is None:
        return None  # the entry's check first: the model's loads best.pt
    return f"best.pt {fault}, {lm}"


def same_training(a: dict, b: dict) -> bool:
    """Whether two results.json of one run folder come from the same training (a copy kept before a retraining is
    not)."""
    return all(a.get(k) == b.get(k) for k in ("status", "best_epoch", "best_val_wer", "test_wer", "epochs"))


def adopt_kept_lm(dir_: Path, runs: Path, kept: Path) -> None:
    """Each run of DIR whose kept results.json holds this checkout's decoding, of the same training, and whose own
    does not (the pinned study writes its own decoding into a finished run it meets again) takes the kept `lm`."""
    adopted = 0
    for r in sorted(runs.glob("*/results.json")):
        mine = kept / r.parent.name / "results.json"
        if not mine.exists():
            continue
        result, kept_result = json.loads(r.read_text()), json.loads(mine.read_text())
        if same_training(result, kept_result) and lm_fault(r.parent, result) is not None \
                and lm_fault(r.parent, kept_result) is None:
            write_json(r, result | {"lm": kept_result["lm"]})
            adopted += 1
    if adopted:
        log(dir_, f"{adopted} runs took back the LM decoding by this checkout's rule from their kept results.json")


def to_retrain(verdict_runs: list[dict]) -> list[dict]:
    """{path, overrides} of each verdict run to train again: its placement needs best.pt for the LM
    (protocol.reuse_needs_model), it has no usable one, and it was not decoded by this checkout's rule while it
    had one (--decode-ended). The overrides give the run's own settings, so that it lands in its own folder and
    depends on no other run."""
    out = []
    for v in verdict_runs:
        path = Path(v["path"])
        result = json.loads((path / "results.json").read_text())
        config = result["config"]
        if config["model"]["bn"] not in config["protocol"].get("reuse_needs_model", []) \
                or needs_model(path, result) is None:
            continue
        flat = flatten(config)
        out.append({"path": str(path), "overrides": [
            f"experiment={result['preset']}", f"model.rnn={flat['model.rnn']}", f"model.bn={flat['model.bn']}",
            "protocol.stage=tune", f"seed={result['seed']}", *(f"{k}={json.dumps(flat[k])}" for k in (LR, AUGMENT, *SCHEDULE)),
            "train.threads=1"]})
    return out


def report_json(study_dir: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "batchrnn.report", str(study_dir), "--out", tmp], check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads((Path(tmp) / "report.json").read_text())


def status(path: Path) -> str | None:
    try:
        return json.loads((path / "results.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


def pending(path: Path) -> str | None:
    """Why the run still needs training (not finished, or neither a usable best.pt nor this checkout's decoding),
    or None."""
    try:
        result = json.loads((path / "results.json").read_text())
    except (OSError, ValueError):
        return "the run is without results"
    if result.get("status") != "finished":
        return f"the run is {result.get('status')}"
    return needs_model(path, result)


def same_figures(path: Path) -> str:
    """The retrained run's test WER beside the first training's (the same on the machine that first ran it)."""
    if not (path / BEFORE).exists():
        return "no earlier figures kept"
    before, after = (json.loads((path / name).read_text()).get("test_wer") for name in (BEFORE, "results.json"))
    return f"test WER {before} first, {after} now" + (" (the same)" if before == after else "")


def retrain_all(dir_: Path, entries: list[dict], jobs: int) -> bool:
    """Trains each entry whose best.pt is still unusable; False at the first failure (the rest not started)."""
    python = dir_ / ".venv" / "bin" / "python"

    def retrain(entry: dict) -> tuple[Path, int]:
        path, overrides = Path(entry["path"]), list(entry["overrides"])
        if status(path) == "finished":  # its first training, without a usable best.pt: afresh, its figures kept
            if not (path / BEFORE).exists():
                shutil.copy2(path / "results.json", path / BEFORE)
            overrides.append("train.rerun=true")
        log(dir_, f"train again {path.name}: {' '.join(overrides)}")
        with open(dir_ / f"finish-{path.name}.log", "a") as out:
            code = subprocess.run([str(python), "src/run.py", *overrides], cwd=dir_, stdout=out, stderr=out,
                                  env=os.environ | {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "10000"}).returncode
        return path, code

    todo = [e for e in entries if pending(Path(e["path"]))]
    log(dir_, f"{len(todo)} of {len(entries)} verdict runs to train again for the LM")
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = [pool.submit(retrain, e) for e in todo]
        for future in concurrent.futures.as_completed(futures):
            path, code = future.result()
            fault = pending(path)
            if code or fault:
                pool.shutdown(wait=False, cancel_futures=True)
                log(dir_, f"{path.name}: exit status {code}, {fault or 'best.pt usable'}; see "
                          f"{dir_ / f'finish-{path.name}.log'}; the retraining that had not started did not start, "
                          "one still going ends first")
                return False
            log(dir_, f"{path.name}: trained again, best.pt written; {same_figures(path)}")
    return True


def keep(source: Path, kept: Path) -> None:
    kept.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", BEFORE):
        if (source / name).exists():
            shutil.copy2(source / name, kept / name)


def decode_ended(dir_: Path, runs: Path, kept: Path) -> int:
    """--decode-ended: each finished run in runs with a usable best.pt whose kept results.json (or its own, not yet
    kept) holds no decoding by this checkout's rule, decoded with the LM and kept."""
    todo = []
    for r in sorted(runs.glob("*/results.json")):
        result = json.loads(r.read_text())
        if result.get("status") == "finished" and lm_fault(r.parent, result) is not None \
                and model_fault(r.parent, result["config"]) is None:  # adopt_kept_lm has run: DIR's copy says it
            todo.append(r.parent)
    log(dir_, f"{len(todo)} finished runs with their best.pt to decode with the LM by this checkout's rule")
    if not todo:
        return 0
    code = subprocess.run([sys.executable, "-m", "batchrnn.evaluate", "decode", *map(str, todo),
                           "--data-root", str(dir_ / "data")]).returncode  # writes each run's as it goes
    done = [path for path in todo if lm_fault(path, json.loads((path / "results.json").read_text())) is None]
    for path in done:
        keep(path, kept / path.name)
    log(dir_, f"kept {len(done)} of their results.json in {kept}: those runs need their best.pt no more")
    if left := [path.name for path in todo if path not in done]:
        log(dir_, f"not decoded by this checkout's rule (exit status {code}, its message above): {', '.join(left)}; "
                  "run it again")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="arguments after -- go to python -m batchrnn.report (e.g. --inference FILE)")
    p.add_argument("dir", type=Path, help="the pinned checkout the study ran in (pinned_study.sh's DIR)")
    p.add_argument("--study", default="an4_cpu_patience", help="the study's folder under DIR/runs (default: %(default)s)")
    p.add_argument("--rows", type=int, help="the verdict's rows: the variants the study was started with")
    p.add_argument("--jobs", type=int, default=2, help="retraining runs at once, 1 thread each (default: %(default)s)")
    p.add_argument("--decode-ended", action="store_true",
                   help="only decode with the LM, by this checkout's rule, each finished run that still has its "
                        "best.pt, and keep it (before the machine goes; the study stopped)")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    dir_ = args.dir.resolve()
    runs, kept = dir_ / "runs" / args.study, KEPT / args.study
    if not runs.is_dir():
        p.error(f"{runs} does not exist: give the pinned checkout the study ran in, and its folder with --study")
    if (pids := study_running(dir_)) and args.decode_ended:
        p.error(f"the study is running in {dir_} (processes {pids}): stop it first (bash experiments/pinned_study.sh "
                f"stop {dir_}; it resumes), so that decoding neither slows it nor meets a run it rewrites")
    if pids:
        p.error(f"the study is still running in {dir_} (processes {pids}): finish it once it has ended (it writes "
                f"{runs / 'report.md'} then)")
    adopt_kept_lm(dir_, runs, kept)
    if args.decode_ended:
        return decode_ended(dir_, runs, kept)
    listed = dir_ / LISTED
    if not listed.exists():  # read once from the ended study: a retraining stopped half-way leaves the verdict
        report = report_json(runs)
        if left := unfinished(report, args.rows):
            p.error(f"the study has runs to come, so it is not finished: {'; '.join(left)}. Resume it "
                    "(make patience-study COMMIT=...) and finish once its report says every variant's verdict is in")
        listed.write_text(json.dumps({"retrain": to_retrain(report["verdict_runs"]), "choices": choices(report)},
                                     indent=1))
    plan = json.loads(listed.read_text())
    if not retrain_all(dir_, plan["retrain"], args.jobs):
        return 1
    report = report_json(runs)
    if changed := {k: (v, choices(report).get(k)) for k, v in plan["choices"].items() if choices(report).get(k) != v}:
        p.error(f"retraining changed the tuning's choices ({changed}: [rate, SpecAugment, schedule] before and after), "
                f"so the verdict's runs are others than {listed} lists: the study is not finished. Remove {listed}, "
                "resume the study for the runs its new choices need, and finish again")
    if left := unfinished(report, args.rows):
        p.error(f"after the retraining the study still has runs to come: {'; '.join(left)}")

    verdict = [Path(v["path"]) for v in report["verdict_runs"]]
    ended = [r for r in sorted(runs.glob("*/results.json")) if status(r.parent) in ENDED
             and not (kept / r.parent.name / "results.json").exists()]
    for r in ended:
        keep(r.parent, kept / r.parent.name)
    log(dir_, f"kept {len(ended)} ended runs not kept before; decoding the verdict's {len(verdict)} runs with the LM")
    subprocess.run([sys.executable, "-m", "batchrnn.evaluate", "decode", *map(str, verdict),
                    "--data-root", str(dir_ / "data")], check=True)
    for path in verdict:
        keep(path, kept / path.name)
    log(dir_, f"copied the verdict's {len(verdict)} results.json into {kept}")
    subprocess.run([sys.executable, "-m", "batchrnn.report", str(kept), *extra], check=True)
    log(dir_, f"report written in {kept} (report args: {' '.join(extra) or 'none'})")
    listed.unlink()  # finished: a later call reads the study afresh
    return 0


if __name__ == "__main__":
    sys.exit(main())
