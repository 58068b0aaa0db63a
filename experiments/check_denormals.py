"""Do a model's values change its inference time? On x86, only subnormal floats can (and only on some CPUs), so
this times folded `none` against another folded variant (--bn, default seqwise) at DS2's size, with torch's flush
of subnormals to zero off, on, and off again. A model that pays for subnormals runs faster with the flush on.

    python experiments/check_denormals.py --data-root data               # LSTM, 5 x 1024, 4 utterances
    python experiments/check_denormals.py --data-root data --rnn gru --bn skip --reps 10

Weights as bench_inference.py makes them: a fresh initialisation, BatchNorm moments from three training batches.
After one untimed pass of each model, each setting runs --reps alternations of the two models (their order swapped
every other one) on one batch of the first --utterances test utterances, 1 thread, and prints each model's median
time and the median paired ratio.
How far none's own time moves between settings shows the machine's drift over minutes (issue 54, inference.md).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_inference as bench  # noqa: E402

from batchrnn.config import BNMode, ModelConfig  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default="data", help="the prepared corpus's folder (data.root); read only")
    p.add_argument("--size", default="an4_gpu")
    p.add_argument("--rnn", default="lstm")
    p.add_argument("--bn", default="seqwise", choices=["post", "input", "skip", "seqwise", "wn", "ln"],
                   help="the folded variant set against none")
    p.add_argument("--utterances", type=int, default=4)
    p.add_argument("--reps", type=int, default=6)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = bench.compose(args.size, args.data_root)
    model_cfg = bench.typed(ModelConfig, cfg.model)
    model_cfg.rnn = args.rnn
    feats, _ = bench.test_set(cfg, max(16, args.utterances))
    calibration = bench.batches(feats, 16)[-3:]
    data = bench.batches(feats[: args.utterances], len(feats))
    models = {}
    for bn in ("none", args.bn):
        model_cfg.bn = BNMode(bn)
        model = bench.fresh_model(model_cfg, feats[0].shape[1], calibration, seed=0)
        models[bn] = bench.ways_of(model, model_cfg, feats[0].shape[1], 1, ["folded"])["folded"][0]
    for model in models.values():  # first calls (allocations, oneDNN's primitives) untimed
        bench.transcribe_all(model, data)
    for flush in (False, True, False):
        if not torch.set_flush_denormal(flush) and flush:
            sys.exit("error: this CPU cannot flush subnormals (torch.set_flush_denormal needs SSE3)")
        times = {k: [] for k in models}
        for r in range(args.reps):
            for k in list(models)[:: 1 if r % 2 else -1]:
                start = time.perf_counter()
                bench.transcribe_all(models[k], data)
                times[k].append(time.perf_counter() - start)
        ratio = statistics.median(a / b for a, b in zip(times[args.bn], times["none"]))
        print(f"flush subnormals {'on ' if flush else 'off'}: " + ", ".join(
            f"{k} {statistics.median(v):.3f} s" for k, v in times.items()) + f"; {args.bn} / none {ratio:.3f}",
            flush=True)


if __name__ == "__main__":
    main()
