"""The GPU path proven in one command (issue 9): `pytest -m gpu`, bench_rnn.py at the size of an4_gpu's
model in bf16 autocast and float32, and two epochs of experiment=an4_gpu per variant, timed per epoch.

    python experiments/gpu_check.py --prepare-only   # AN4 and its features only (seconds, no GPU)
    python experiments/gpu_check.py [--out DIR]      # on one GPU, at most about 8 minutes
    python experiments/gpu_check.py --dry-run        # the same steps on the CPU at tiny sizes

Each step is one JSON line in OUT/steps.jsonl (default OUT: gpu_check/<timestamp>), written as it ends;
OUT/summary.md holds a row per step and the bench and training tables; OUT/steps.log every step's output.
Exit status: 0 all passed, 1 the first failure (its output is shown, later steps are not run), 3 stopped
by the time guard (--budget-s) with what was done reported.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

TRAIN_RNN = ("gru", "lstm")
TRAIN_BN = ("none", "input", "seqwise", "ln", "wn")  # ln_full, a step loop, is timed by the bench only
# DS2 size on the GPU (batch 32, a few hundred frames after the front end's time stride 2); tiny on the CPU.
BENCH = {"gpu": ["--batch", "32", "--frames", "300", "--repeats", "5", "--warmup", "2"],
         "dry": ["--batch", "2", "--frames", "8", "--repeats", "1", "--warmup", "0"]}
EXIT_FAILED, EXIT_TIME = 1, 3


def compose(experiment: str, data_root: str):
    from hydra import compose as hydra_compose, initialize_config_dir

    from batchrnn.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=[f"experiment={experiment}", f"data.root={data_root}"])


def environment(dry_run: bool) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except OSError:  # the device machine's copy of the tree may come without git
        commit = "unknown"
    return {"mode": "dry run (CPU)" if dry_run else "gpu", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None, "commit": commit,
            "started": datetime.now().isoformat(timespec="seconds")}


def prepare(cfg) -> dict:
    """The corpus and the feature cache the runs read, computed before any GPU step."""
    from batchrnn.data.corpus import prepare_corpus
    from batchrnn.data.features import cache_path, frames_path, load_features

    corpus = prepare_corpus(cfg.data)
    sizes = {s: len(load_features(corpus, s, cfg.data)) for s in corpus.splits}
    caches = [cache_path(corpus, s, cfg.data) for s in corpus.splits]
    return {"utterances": sizes, "features": [str(c) for c in caches],
            "features_mb": round(sum(frames_path(c).stat().st_size + c.stat().st_size for c in caches) / 2**20, 1)}


def plan(args, cfg) -> list[dict]:
    """Every step, in order: a name, and for all but prepare the command that runs it."""
    from batchrnn.data.features import Featurizer
    from batchrnn.model import ConvFrontEnd

    mode, py, device = ("dry" if args.dry_run else "gpu"), sys.executable, ("cpu" if args.dry_run else "cuda")
    m = cfg.model  # the bench's layers are the experiment's recurrent stack, first input width included
    width = ConvFrontEnd(m, Featurizer(cfg.data).num_features).output_size
    bench = [py, "experiments/bench_rnn.py", "--device", device, "--rnn", ",".join(TRAIN_RNN), "--layers",
             str(m.num_layers), "--hidden", str(m.hidden_size), "--input", str(width), *BENCH[mode]]
    # One sweep, so the runs share one process start (and one CUDA context); each keeps its own folder.
    train = [py, "src/run.py", "-m", f"experiment={args.experiment}", f"train.epochs={args.epochs}",
             f"model.rnn={','.join(TRAIN_RNN)}", f"model.bn={','.join(TRAIN_BN)}", f"train.device={device}",
             f"data.root={args.data_root}", "logger.mode=disabled", "train.rerun=true", f"hydra.sweep.dir={args.runs}"]
    return [{"step": "prepare"},
            # Only the gpu lane's module: collecting the others imports wandb, which a GPU image may lack.
            {"step": "pytest-gpu", "cmd": [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                           "tests/test_gpu.py"]},
            {"step": "bench-bf16", "cmd": [*bench, "--amp"]},
            {"step": "train", "cmd": train},
            {"step": "bench-fp32", "cmd": bench}]  # last: the one a short lease can best do without


def measured(step: dict, output: str, runs: Path) -> dict:
    """What a step's command measured, as far as it got."""
    if step["step"].startswith("pytest"):
        return {"counts": {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                                             output)}}
    if step["step"].startswith("bench"):
        return {"rows": [json.loads(line) for line in output.splitlines() if line.startswith("{")]}
    found = {}
    for path in runs.rglob("results.json"):  # where a run's folder lies under the sweep is the trainer's business
        r = json.loads(path.read_text())
        if r.get("status") == "finished":
            found[(r["rnn"], r["bn"])] = {
                "rnn": r["rnn"], "bn": r["bn"], "results": str(path), "device": r["device"], "params": r["params"],
                "test_wer": r["test_wer"],
                "epochs": [{k: e[k] for k in ("epoch", "epoch_time_s", "peak_mem_mb", "val_wer")} for e in r["epochs"]]}
    return {"runs": [found[v] for v in variants() if v in found]}


def problem(step: dict, record: dict, dry_run: bool) -> str | None:
    """Why a step whose command exited 0 still failed, if it did."""
    if "counts" in record and not dry_run and record["counts"].get("skipped"):
        return f"{record['counts']['skipped']} gpu tests skipped: CUDA is not visible to pytest"
    if "runs" in record:
        done = {(r["rnn"], r["bn"]) for r in record["runs"]}
        missing = [f"{rnn}-{bn}" for rnn, bn in variants() if (rnn, bn) not in done]
        return f"no finished results.json for {', '.join(missing)}" if missing else None
    return None


def variants() -> list[tuple[str, str]]:
    return [(rnn, bn) for rnn in TRAIN_RNN for bn in TRAIN_BN]


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_step(step: dict, record: dict, args, cfg, env: dict, deadline: float, log) -> None:
    """Runs one step, filling its record as far as it gets (status included); raises for a real failure."""
    if step["step"] == "prepare":
        if not args.dry_run and env["device"] == "cpu":
            raise RuntimeError("CUDA is not available; on a machine without a GPU use --dry-run")
        record |= prepare(cfg) | {"status": "ok"}
        return
    record["command"] = " ".join(step["cmd"])
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    try:
        done = subprocess.run(step["cmd"], cwd=ROOT, env=os.environ | {"PYTHONPATH": path}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=deadline - time.monotonic())
        output, rc = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:  # its partial output comes as bytes whatever text= says
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        rc = None
    log.write(f"=== {step['step']}: {record['command']}\n{output}\n")
    record |= measured(step, output, args.runs)  # also what a failed or stopped step got done
    if rc is None:
        record["status"] = "stopped (time guard)"
    elif why := (f"exit status {rc}" if rc else problem(step, record, args.dry_run)):
        raise RuntimeError(f"{why}\n{tail(output)}")
    else:
        record["status"] = "ok"


def run(args) -> int:
    cfg = compose(args.experiment, args.data_root)
    env = environment(args.dry_run)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "steps.jsonl").unlink(missing_ok=True)
    records, deadline, code = [], time.monotonic() + args.budget_s, 0
    with open(args.out / "steps.log", "w") as log:
        for step in plan(args, cfg):
            record = {"step": step["step"]}
            if code or time.monotonic() >= deadline:
                code = code or EXIT_TIME
                record["status"] = "not run (time guard)" if code == EXIT_TIME else "not run"
            else:
                start = time.monotonic()
                try:
                    run_step(step, record, args, cfg, env, deadline, log)
                    code = EXIT_TIME if record["status"].startswith("stopped") else 0
                except Exception as e:  # noqa: BLE001 - any failure is the check's finding: record, show, stop
                    record["status"], record["error"], code = "failed", str(e), EXIT_FAILED
                    print(f"error: {step['step']}: {e}", file=sys.stderr)
                record["seconds"] = round(time.monotonic() - start, 1)
            records.append(record)
            with open(args.out / "steps.jsonl", "a") as f:  # line by line: a killed check keeps what it did
                f.write(json.dumps(record) + "\n")
            print(f"{record['step']:12} {record['status']:22} {record.get('seconds', '')}", flush=True)
    (args.out / "summary.md").write_text(summary(env, records, args))
    print(f"{args.out / 'summary.md'}: {sum(r['status'] == 'ok' for r in records)} of {len(records)} steps ok")
    return code


def summary(env: dict, records: list[dict], args) -> str:
    ok = sum(r["status"] == "ok" for r in records)
    lines = [f"# GPU check ({env['mode']})", "",
             f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
             f"commit {env['commit']}, started {env['started']}; {ok} of {len(records)} steps ok.", "",
             "| step | status | s | result |", "|---|---|---:|---|"]
    for r in records:
        lines.append(f"| {r['step']} | {r['status']} | {r.get('seconds', '')} | {result(r)} |")
    bench = {(row["rnn"], row["bn"], row["impl"], row["amp"]): row for r in records for row in r.get("rows", [])}
    if bench:
        lines += ["", "bench_rnn.py, forward + backward of the recurrent stack (× none: of the same rnn and dtype):",
                  "",
                  "| rnn | bn | impl | bf16 ms | × none | bf16 MB | × none | fp32 ms | × none | fp32 MB | × none |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for key in dict.fromkeys(k[:3] for k in bench):
            cells = list(key)
            for amp in (True, False):
                b = bench.get((*key, amp))
                cells += [f"{b['ms']:.1f}", f"{b['time_ratio']:.2f}", f"{b['peak_mb']:,.0f}", f"{b['mem_ratio']:.2f}"] \
                    if b else [""] * 4
            lines.append(f"| {' | '.join(cells)} |")
    runs = [run for r in records for run in r.get("runs", [])]
    if runs:
        lines += ["", f"experiment={args.experiment}, {args.epochs} epochs (epoch time and peak memory of training; "
                  "× none: of the same rnn, last epoch):", "",
                  "| rnn | bn | epoch s | peak MB | time × none | mem × none | val WER % | test WER % |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        last = {(r["rnn"], r["bn"]): r["epochs"][-1] for r in runs}
        for r in runs:
            e, base = last[(r["rnn"], r["bn"])], last.get((r["rnn"], "none"))
            times = ", ".join(f"{x['epoch_time_s']:.1f}" for x in r["epochs"])
            ratios = [f"{e[k] / base[k]:.2f}" if base else "" for k in ("epoch_time_s", "peak_mem_mb")]
            cells = [r["rnn"], r["bn"], times, f"{max(x['peak_mem_mb'] for x in r['epochs']):,.0f}", *ratios,
                     f"{100 * e['val_wer']:.1f}", f"{100 * r['test_wer']:.1f}"]
            lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def result(r: dict) -> str:
    """One cell: what the step found."""
    if "error" in r:
        return r["error"].splitlines()[0].replace("|", "/")
    if "utterances" in r:
        sizes = "/".join(map(str, r["utterances"].values()))
        return f"{sizes} utterances (train/val/test), features {r['features_mb']} MB"
    if "counts" in r:
        return ", ".join(f"{n} {k}" for k, n in r["counts"].items())
    if "rows" in r:
        return f"{len(r['rows'])} variants"
    if "runs" in r:
        return f"{len(r['runs'])} of {len(variants())} runs finished"
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, experiment=smoke, 1 epoch")
    p.add_argument("--prepare-only", action="store_true", help="prepare the corpus and its features, then stop")
    p.add_argument("--out", type=Path, help="output folder (default gpu_check/<timestamp>)")
    p.add_argument("--runs", type=Path, help="the training runs' folders (default OUT/runs; large on the GPU: "
                   "checkpoints of about 1 GB)")
    p.add_argument("--data-root", default="data", help="data.root of the runs (default data)")
    p.add_argument("--budget-s", type=float, default=480, help="time guard: no step starts or runs past it")
    args = p.parse_args()
    args.experiment, args.epochs = ("smoke", 1) if args.dry_run else ("an4_gpu", 2)
    args.data_root = str(Path(args.data_root).resolve())  # the same folder for this process and the runs
    if args.prepare_only:
        from batchrnn.data.corpus import DataError

        try:
            print(json.dumps(prepare(compose(args.experiment, args.data_root)), indent=1))
        except DataError as e:
            sys.exit(f"error: {e}")
        return
    args.out = (args.out or ROOT / "gpu_check" / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
    args.runs = (args.runs or args.out / "runs").resolve()
    sys.exit(run(args))


if __name__ == "__main__":
    main()
