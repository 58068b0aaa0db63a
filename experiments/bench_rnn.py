"""Forward plus backward time and peak memory of every model.bn variant and implementation against
bn=none of the same rnn, in one process with the variants' runs interleaved, so slow drift of the
machine (other load, turbo, thermal) hits every variant alike.

    python experiments/bench_rnn.py                       # batch 16, 200 frames, 3 layers, hidden 256
    python experiments/bench_rnn.py --device cuda --hidden 1024 --layers 5 --amp
    python experiments/bench_rnn.py --quick               # 10-20 s: checks the script, numbers mean little
    python experiments/bench_rnn.py --kernels             # GRU/LSTM and GFLOP/s at the an4_cpu shape, 2 and 1 threads

The defaults take about 3 minutes on 2 CPU cores; after its first round it prints its own estimate.

Prints a table, then one JSON line per row: rnn, bn, impl, loop (a step loop: impl=cells, ln_full, rbn), ms,
peak_mb, time_ratio, mem_ratio, amp.
Memory: CUDA max allocated on a GPU; on the CPU the profiler's peak of live tensor bytes. Both count
the parameters and the input plus everything the step allocates.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from batchrnn.config import BNMode, Impl, RNNType  # noqa: E402
from batchrnn.model import build_recurrent_layer  # noqa: E402
from batchrnn.layers import LAYERS, backend  # noqa: E402
from batchrnn.layers.base import GATES

# Step loops (the cells reference, ln_full, rbn) after the fused variants; --no-cells skips them.
LOOPS = [(BNMode.seqwise, Impl.cells)] + [(bn, Impl.fused) for bn, layer in LAYERS.items() if not layer.fused]
VARIANTS = [(bn, Impl.fused) for bn, layer in LAYERS.items() if layer.fused] + LOOPS
AN4_CPU = {"frames": 67, "input": 512, "hidden": 256, "layers": 3, "batch": 16}  # --kernels: the an4_cpu stack
QUICK = {"frames": 20, "hidden": 32, "layers": 2, "repeats": 2, "warmup": 1}  # --quick; flags given still win


class Stack(nn.Module):
    def __init__(self, rnn, bn, impl, args):
        super().__init__()
        sizes = [args.input or args.hidden] + [args.hidden] * (args.layers - 1)
        self.layers = nn.ModuleList(
            build_recurrent_layer(rnn, bn.value, d_in, args.hidden, impl=impl.value) for d_in in sizes
        )

    def forward(self, x, lengths):
        for layer in self.layers:
            x = layer(x, lengths)
        return x


def step(model, x, lengths, amp=False):
    # bf16 autocast as the trainer's train.amp uses it: the forward pass only, the loss in float32
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        y = model(x, lengths)
    y.float().square().mean().backward()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def static_bytes(model, x) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + x.numel() * x.element_size()


@contextlib.contextmanager
def gpu_probe_silenced():
    """The profiler (Kineto) probes for a GPU once per process and, on a CUDA build of torch with no
    driver, logs `ERROR: ... gpuGetDeviceCount failed` straight to file descriptor 2: CUDA noise on a
    CPU run. The profiled step is one the timed rounds already ran, so it has nothing new to say."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_mb(model, x, lengths, device, amp) -> float:
    from batchrnn.layers import cpu_gru

    model.zero_grad(set_to_none=True)
    cpu_gru.WORKSPACES.clear()  # the GRU's pooled workspaces are the step's memory: allocated afresh, counted
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(model, x, lengths, amp)
        sync(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    # acc_events: keep the events past the profiler's exit, as read below (torch warns otherwise).
    with gpu_probe_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                       acc_events=True) as prof:
        step(model, x, lengths, amp)
    live = peak = 0  # allocations sit on op events, frees on "[memory]" events, in time order
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return (static_bytes(model, x) + peak) / 2**20


def gemm_gflops(device, size=2048, repeats=5) -> float:
    """A large float32 GEMM's GFLOP/s at the current thread count: what this machine's BLAS can reach."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    times = []
    for r in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        if r:
            times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def recurrence_flops(rnn, args) -> float:
    """Forward plus backward floating-point operations of a stack's recurrences: per layer and direction the
    multiply-adds of W x and U h over every padded frame (what the kernels compute), three times over (forward;
    the input and state gradients; the weight gradients), two flops each. Gate arithmetic and BN not counted."""
    gates = GATES[RNNType(rnn)] * args.hidden
    sizes = [args.input or args.hidden] + [args.hidden] * (args.layers - 1)
    macs = sum(args.frames * args.batch * gates * (d_in + args.hidden) for d_in in sizes)
    return 2 * 3 * 2 * macs  # flops per MAC, forward + 2 backward GEMMs, 2 directions


def kernels(args, device, x, lengths) -> None:
    """--kernels: the GRU against the LSTM, bn none and seqwise, interleaved in one run, at each thread count;
    with each stack's GFLOP/s beside a large GEMM's, and torch's own CPU GRU (what cpu_gru replaces)."""
    from unittest import mock

    from batchrnn.layers import cpu_gru
    rows = [("gru", BNMode.none), ("lstm", BNMode.none), ("gru", BNMode.seqwise), ("lstm", BNMode.seqwise)]
    models = {(rnn, bn): Stack(rnn, bn, Impl.fused, args).to(device).train() for rnn, bn in rows}
    torch_gru = device.type == "cpu" and cpu_gru.available()
    if torch_gru:  # the same weights through torch's kernel
        models[("gru-torch", BNMode.none)] = models[("gru", BNMode.none)]
    print(f"bench --kernels: GRU kernel {cpu_gru.kernel_name() if device.type == 'cpu' else 'cudnn'}; "
          f"batch {args.batch}, frames {args.frames} ({'ragged' if args.ragged else 'full'}), layers {args.layers}, "
          f"input {args.input or args.hidden}, hidden {args.hidden}, bidirectional, float32, "
          f"median of {args.repeats} interleaved rounds", flush=True)
    for threads in [int(t) for t in args.thread_list.split(",")]:
        torch.set_num_threads(threads)
        times = {k: [] for k in models}
        for r in range(args.warmup + args.repeats):
            for (rnn, bn), model in models.items():
                off = mock.patch.object(cpu_gru, "available", lambda: False) if rnn == "gru-torch" else contextlib.nullcontext()
                with off:
                    model.zero_grad(set_to_none=True)
                    sync(device)
                    start = time.perf_counter()
                    step(model, x, lengths)
                    sync(device)
                if r >= args.warmup:
                    times[(rnn, bn)].append(time.perf_counter() - start)
        ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
        gemm = gemm_gflops(device)
        print(f"threads {threads}: a 2048^3 float32 GEMM reaches {gemm:.0f} GFLOP/s")
        print(f"  {'rnn':9} {'bn':8} {'ms':>8} {'GFLOP/s':>8} {'of GEMM':>8} {'x lstm':>7}")
        for (rnn, bn), t in ms.items():
            gflops = recurrence_flops(rnn.split("-")[0], args) / (t / 1000) / 1e9
            ratio = t / ms[("lstm", bn)]
            print(f"  {rnn:9} {bn.value:8} {t:8.1f} {gflops:8.1f} {gflops / gemm:8.0%} {ratio:7.2f}")
            print(json.dumps({"threads": threads, "rnn": rnn, "bn": bn.value, "ms": round(t, 2),
                              "gflops": round(gflops, 1), "gemm_gflops": round(gemm, 1),
                              "ratio_to_lstm": round(ratio, 3)}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rnn", default="gru,lstm", help="comma-separated rnn types")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--input", type=int, default=0, help="first layer's input width (0: --hidden); an4_cpu's is 512")
    p.add_argument("--ragged", action="store_true", help="lengths spread over [frames/2, frames]")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds; each times every variant once")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    p.add_argument("--no-cells", action="store_true", help="skip the step loops: the cell reference, ln_full, rbn")
    p.add_argument("--bn", default="", help="comma-separated model.bn values to time (default: all; none always, "
                   "as the ratios' base)")
    quick = ", ".join(f"--{k} {v}" for k, v in QUICK.items())
    p.add_argument("--quick", action="store_true", help=f"a tiny run to check the script in seconds: {quick}")
    p.add_argument("--amp", action="store_true", help="bf16 autocast, as train.amp on CUDA (default: float32)")
    p.add_argument("--kernels", action="store_true", help="the GRU/LSTM ratio and GFLOP/s instead, bn none and "
                   f"seqwise at the an4_cpu shape ({', '.join(f'--{k} {v}' for k, v in AN4_CPU.items())}, ragged) "
                   "at each of --thread-list")
    p.add_argument("--thread-list", default="2,1", help="--kernels: the thread counts, each timed in turn")
    args = p.parse_args(argv)
    if args.kernels:
        p.set_defaults(**AN4_CPU, ragged=True, repeats=20, warmup=3)
        args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(args.frames, args.batch, args.input or args.hidden, device=device)
    lengths = torch.full((args.batch,), args.frames, device=device)
    if args.ragged:
        lengths = torch.linspace(args.frames // 2, args.frames, args.batch, device=device).long()
    if args.kernels:
        return kernels(args, device, x, lengths)
    chosen = {BNMode(b) for b in args.bn.split(",") if b} | {BNMode.none}
    variants = [v for v in VARIANTS if not (args.no_cells and v in LOOPS) and (not args.bn or v[0] in chosen)]
    rows = []
    rnns = args.rnn.split(",")
    started = time.perf_counter()
    for rnn in rnns:
        models = {v: Stack(rnn, *v, args).to(device).train() for v in variants}
        times = {v: [] for v in variants}
        for r in range(args.warmup + args.repeats):
            round_started = time.perf_counter()
            for v, model in models.items():  # interleaved: each round times every variant once
                model.zero_grad(set_to_none=True)
                sync(device)
                start = time.perf_counter()
                step(model, x, lengths, args.amp)
                sync(device)
                if r >= args.warmup:
                    times[v].append(time.perf_counter() - start)
            if r == 0:  # a step's peak is the same after one step as after many: measure it now, and
                # the first rnn's round and memory pass tell how long the whole run takes
                round_s = time.perf_counter() - round_started
                mem = {v: peak_mb(m, x, lengths, device, args.amp) for v, m in models.items()}
                if rnn == rnns[0]:
                    total = len(rnns) * (time.perf_counter() - started + (args.warmup + args.repeats - 1) * round_s)
                    print(f"bench: {round_s:.1f} s a round, {args.warmup + args.repeats} rounds per rnn, "
                          f"{len(rnns)} rnn types: about {total / 60:.1f} min in all", file=sys.stderr, flush=True)
        base = (BNMode.none, Impl.fused)
        for v in variants:
            ms = 1000 * statistics.median(times[v])
            loop = models[v].layers[0].step_loop
            rows.append({"rnn": rnn, "bn": v[0].value, "impl": v[1].value, "loop": loop, "ms": round(ms, 2),
                         "peak_mb": round(mem[v], 1), "time_ratio": round(ms / (1000 * statistics.median(times[base])), 3),
                         "mem_ratio": round(mem[v] / mem[base], 3)})
    print(f"device {device} ({torch.get_num_threads()} threads), torch {torch.__version__}, batch {args.batch}, "
          f"frames {args.frames}, layers {args.layers}, input {args.input or args.hidden}, hidden {args.hidden}, "
          f"bidirectional, {'bf16 autocast' if args.amp else 'float32'}, "
          f"{'ragged' if args.ragged else 'full'} lengths, median of {args.repeats} interleaved rounds")
    print(f"{'rnn':5} {'bn':8} {'impl':6} {'ms':>9} {'peak MB':>9} {'time x':>7} {'mem x':>7}")
    for r in rows:
        impl = backend(r["bn"], r["impl"])
        print(f"{r['rnn']:5} {r['bn']:8} {impl:6} {r['ms']:9.1f} {r['peak_mb']:9.1f} "
              f"{r['time_ratio']:7.2f} {r['mem_ratio']:7.2f}")
    for r in rows:
        print(json.dumps(r | {"device": device.type, "amp": args.amp}))


if __name__ == "__main__":
    main()
