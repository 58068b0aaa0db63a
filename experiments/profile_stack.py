"""Where one forward + backward of bench_rnn.py's recurrent stack spends its device time, per kernel
(issue 9's findings: the GRU gains little from bf16 autocast on an H200; seqwise costs about 1.3x of none
in an an4_gpu epoch).

    python experiments/profile_stack.py [--variants gru:none,lstm:none,lstm:seqwise] [--amp] [bench sizes]

Prints, per variant, the profiler's table of the top kernels by device time (CUDA) or CPU ops, and the
number of device operations (kernels and memsets) of one step. Sizes as bench_rnn.py's flags (default: an4_gpu's stack).
"""
import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rnn import Stack, step, sync  # noqa: E402

from batchrnn.config import BNMode, Impl  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="gru:none,lstm:none,lstm:seqwise")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--input", type=int, default=1312)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--rows", type=int, default=12)
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    x = torch.randn(args.frames, args.batch, args.input, device=device)
    lengths = torch.full((args.batch,), args.frames, device=device)
    for variant in args.variants.split(","):
        rnn, bn = variant.split(":")
        model = Stack(rnn, BNMode(bn), Impl.fused, args).to(device).train()
        for _ in range(2):
            step(model, x, lengths, args.amp)
        sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            step(model, x, lengths, args.amp)
            sync(device)
        events = prof.key_averages()
        key = "device_time_total" if cuda else "self_cpu_time_total"
        device_ops = sum(e.count for e in events if cuda and e.device_type.name == "CUDA")
        print(f"=== {rnn} {bn}{' bf16 autocast' if args.amp else ''}: {device_ops} device operations "
              "(kernels and memsets)", flush=True)
        print(events.table(sort_by=key, row_limit=args.rows, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
