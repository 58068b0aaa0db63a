"""What each row costs to serve (`--inference`): the inference bench's time over none's
(experiments/bench_inference.py --json) beside the training cost, for the report's model size.
"""
import json
from pathlib import Path

from batchrnn.config import Impl
from batchrnn.study.report.summary import Summary

HIDDEN = "model.hidden_size"
# The way one ships: the folded model where the variant folds, else its eval-mode model (ln_full, rbn)
SHIPPED = ("folded", "eval")
SERVER = (1, 1)  # batch, threads: one utterance at a time on one thread, as a server; else the file's first
KEYS = {"layers", "hidden", "rnn", "bn", "way", "batch", "threads", "time_ratio"}
BENCH = "python experiments/bench_inference.py"


class BenchError(ValueError):
    """An --inference file that is no bench output, or holds no row of the runs' model size."""


def read_bench(path: Path) -> list[dict]:
    """The rows of a bench_inference.py --json file; FileNotFoundError or BenchError, naming the fix."""
    if not path.is_file():
        raise FileNotFoundError(f"--inference {path}: no such file; write it with {BENCH} --json {path}")
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not (isinstance(row, dict) and KEYS <= row.keys()):
            raise BenchError(f"--inference {path}: line {n} is no bench row (a JSON object with "
                             f"{', '.join(sorted(KEYS))}); pass the file that {BENCH} --json PATH writes")
        rows.append(row)
    if not rows:
        raise BenchError(f"--inference {path}: no rows; pass the file that {BENCH} --json PATH writes")
    return rows


def size_of(row: dict) -> tuple:
    """(layers, hidden) of a report row's model."""
    return row["num_layers"], row["_runs"][0]["settings"].get(HIDDEN)


def listed(sizes: set) -> str:
    """3 x 256, 5 x 1024: model sizes as layers x hidden."""
    return ", ".join(f"{layers} x {hidden}" for layers, hidden in sorted(sizes))


def attach(summary: Summary, path: Path) -> None:
    """Gives each summary row serve_ratio (None where the file has no row of its variant and size) and serve_way,
    and the summary the configuration, machine and file they come from; BenchError where the file has no row of
    the runs' model size."""
    path = Path(path)
    bench = read_bench(path)
    sizes = {size_of(row) for row in summary.rows}
    ours = [b for b in bench if (b["layers"], b["hidden"]) in sizes]
    if summary.rows and not ours:
        theirs = {(b["layers"], b["hidden"]) for b in bench}
        raise BenchError(f"--inference {path}: no row of the runs' model size ({listed(sizes)}); the file has "
                         f"{listed(theirs)}; run {BENCH} --json {path} with --sizes, --layers and --hidden that "
                         "match the runs'")
    configs = [(b["batch"], b["threads"]) for b in ours]
    batch, threads = SERVER if SERVER in configs or not configs else configs[0]
    for row in summary.rows:
        found = {b["way"]: b for b in ours if row["impl"] == Impl.fused.value  # the bench times the fused kernels
                 and (b["layers"], b["hidden"], b["rnn"], b["bn"], b["batch"], b["threads"])
                 == (*size_of(row), row["rnn"], row["bn"], batch, threads)}
        way = next((w for w in SHIPPED if w in found), None)
        row["serve_ratio"], row["serve_way"] = (found[way]["time_ratio"], way) if way else (None, None)
    env = ours[0] if ours else {}  # bench_inference.py writes the same in every row
    summary.inference = {"file": str(path), "batch": batch, "threads": threads,
                         **{k: env.get(k, "not recorded") for k in ("machine", "cpus", "torch", "onnxruntime", "date")}}
