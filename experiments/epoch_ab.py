"""Before and after: the same short training runs on an earlier commit and on the working tree, one after the other.

For each variant it trains `--epochs` epochs of the preset with the code of BEFORE (a commit, in a temporary `git
worktree`, run with this interpreter and PYTHONPATH at that worktree's src) and with the working tree's, alternately,
`--rounds` times. It prints each epoch's training loss side by side and checks that the change computes what the
code before it did: epoch 1 within 1e-5 relative (only float rounding differs), later epochs within 1e-3 (that
rounding grows as training goes on). Then each epoch's time (training only, as results.json records it) after over
before, and the speed-up of the median epoch. Exit status 1 when a loss is outside its bound.

    python experiments/epoch_ab.py main --root /work/main/data            # 3 epochs of gru-none and lstm-seqwise
    python experiments/epoch_ab.py HEAD~3 --preset smoke --epochs 2 --variants gru:none   # a check that it runs

Run it with nothing else on the machine: the times are only as good as the machine's quiet.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = (1e-5, 1e-3)  # relative: epoch 1, later epochs


def train(source: Path, out: Path, preset: str, rnn: str, bn: str, args) -> list[dict]:
    """One run of src/run.py from the checkout at `source`; its results.json's epochs."""
    command = [sys.executable, str(source / "src" / "run.py"), f"experiment={preset}", f"model.rnn={rnn}",
               f"model.bn={bn}", f"train.epochs={args.epochs}", f"train.threads={args.threads}", "logger.mode=disabled",
               f"hydra.run.dir={out}", *([f"data.root={Path(args.root).resolve()}"] if args.root else []),
               *args.overrides]
    env = os.environ | {"PYTHONPATH": str(source / "src"), "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command)} failed in {source} (exit {done.returncode}):\n{done.stderr[-2000:]}")
    (results,) = out.glob("*/results.json")
    return json.loads(results.read_text())["epochs"]


def same_kernel(ref: str, before: Path) -> None:
    """Both sides load the CPU GRU's kernel from the one build in the virtual environment, which torch's extension
    loader rebuilds whenever the source's path changes (40 s, inside the first epoch, and under any other process
    loading it then). So BEFORE runs the working tree's kernel modules (cpu_gru.py and extensions.py, which builds
    it) at the working tree's paths. That is honest only where BEFORE had the same kernel: the same
    csrc/onednn_gru.cpp, and the same cpu_gru.py from `available()` on (how it is built and loaded may differ)."""
    source, module = "src/batchrnn/layers/csrc/onednn_gru.cpp", "src/batchrnn/layers/cpu_gru.py"
    runtime = lambda text: text[text.index("def available()"):]  # noqa: E731
    then = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{module}"], capture_output=True, text=True).stdout
    if subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", ref, "--", source]).returncode != 0 \
            or "def available()" not in then or runtime(then) != runtime((ROOT / module).read_text()):
        sys.exit(f"error: the CPU GRU's kernel ({source}, or {module} from available() on) differs between {ref} and "
                 "the working tree, so the two sides would rebuild it in turn; compare commits with the same kernel")
    for name in ("cpu_gru.py", "extensions.py"):
        path = ROOT / "src" / "batchrnn" / "layers" / name
        (before / path.relative_to(ROOT)).write_text(
            f"__file__ = {str(path)!r}  # epoch_ab.py: the working tree's, at its path\n"
            f"exec(compile(open(__file__).read(), __file__, 'exec'))\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", help="the commit to compare with (a branch, tag or hash)")
    p.add_argument("overrides", nargs="*", help="further run.py overrides for both sides")
    p.add_argument("--preset", default="an4_cpu_plateau")
    p.add_argument("--variants", default="gru:none,lstm:seqwise", help="rnn:bn, comma-separated")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="before-after pairs per variant (default 1)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--root", help="data.root for both sides (default: the preset's, relative to each checkout)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="epoch_ab-") as tmp:
        before = Path(tmp) / "before"
        added = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before],
                               capture_output=True, text=True)
        if added.returncode != 0:
            sys.exit(f"error: cannot check out {args.before!r} into a worktree: {added.stderr.strip()}; "
                     "give a commit of this repository")
        try:
            same_kernel(args.before, before)
            return compare(args, {"before": before, "after": ROOT}, Path(tmp))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], capture_output=True)


def compare(args, sources: dict[str, Path], tmp: Path) -> int:
    failed = 0
    for variant in args.variants.split(","):
        rnn, bn = variant.split(":")
        runs = {side: [] for side in sources}
        for r in range(args.rounds):
            for side, source in sources.items():  # before, then after: one after the other
                runs[side].append(train(source, tmp / f"{rnn}-{bn}-{side}-{r}", args.preset, rnn, bn, args))
        print(f"{args.preset} {rnn}-{bn}, {args.epochs} epochs, {args.threads} thread(s), {args.rounds} round(s): "
              f"{args.before} against the working tree")
        print(f"{'epoch':>5} {'loss before':>13} {'loss after':>13} {'rel. diff':>10} {'bound':>7} "
              f"{'s before':>9} {'s after':>8} {'after/before':>13}")
        for e in range(args.epochs):
            loss = {side: runs[side][0][e]["train_loss"] for side in sources}
            seconds = {side: statistics.median(run[e]["epoch_time_s"] for run in runs[side]) for side in sources}
            diff = abs(loss["after"] - loss["before"]) / abs(loss["before"])
            bound = BOUNDS[0] if e == 0 else BOUNDS[1]
            failed += diff > bound
            print(f"{e + 1:>5} {loss['before']:13.7f} {loss['after']:13.7f} {diff:10.1e} {bound:7.0e}"
                  f"{' FAIL' if diff > bound else ''} {seconds['before']:9.2f} {seconds['after']:8.2f} "
                  f"{seconds['after'] / seconds['before']:13.3f}")
        median = {side: statistics.median(row["epoch_time_s"] for run in runs[side] for row in run) for side in sources}
        print(f"median epoch: before {median['before']:.2f} s, after {median['after']:.2f} s, "
              f"speed-up {median['before'] / median['after']:.3f}x\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
