"""How fast is torch's own fused GRU and LSTM in each precision (issue 9's finding: on an H200 the DS2-size
GRU stack ran little or no faster under bf16 autocast than in float32, while the LSTM ran 2.8x faster)?

    python experiments/cudnn_dtypes.py [--device cuda] [--layers 5 --hidden 1024 --input 1312 --batch 32 --frames 300]

Times forward + backward of a plain nn.GRU / nn.LSTM stack (bidirectional, no normalisation, nothing of
batchrnn's) in: float32 with TF32 off, float32 with TF32 on (cuDNN's default), bf16 and fp16 autocast,
and the module cast to bf16. One JSON line per case: ms (median of --repeats), ratio to float32 without
TF32 of the same rnn. Ratios within one run of this script, on one machine.
"""
import argparse
import contextlib
import json
import statistics
import time

import torch
from torch import nn

CASES = ("fp32", "tf32", "autocast-bf16", "autocast-fp16", "bf16-module")


def case_context(case: str, device: torch.device):
    if case.startswith("autocast"):
        return torch.autocast(device.type, dtype=torch.bfloat16 if case.endswith("bf16") else torch.float16)
    return contextlib.nullcontext()


def timed(step, device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rnn", default="gru,lstm")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--input", type=int, default=1312)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    device = torch.device(args.device)
    cases = [c for c in CASES if device.type == "cuda" or c not in ("tf32", "autocast-fp16")]
    for rnn in args.rnn.split(","):
        base = None
        for case in cases:
            torch.manual_seed(0)
            kind = {"gru": nn.GRU, "lstm": nn.LSTM}[rnn]
            model = kind(args.input, args.hidden, args.layers, bidirectional=True).to(device)
            x = torch.randn(args.frames, args.batch, args.input, device=device)
            if case == "bf16-module":
                model, x = model.bfloat16(), x.bfloat16()
            x.requires_grad_()
            if device.type == "cuda":
                torch.backends.cudnn.allow_tf32 = case == "tf32"

            def step():
                with case_context(case, device):
                    y = model(x)[0]
                y.float().square().mean().backward()

            ms = timed(step, device, args.repeats, args.warmup)
            base = base or ms
            print(json.dumps({"rnn": rnn, "case": case, "ms": round(ms, 2), "x_fp32": round(ms / base, 3),
                              "device": str(device)}), flush=True)
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = True


if __name__ == "__main__":
    main()
