"""SIGTERM during oneDNN's RNN kernels, with and without an alternate signal stack (the crash at a study's stop).

oneDNN's generated GEMM kernels (x64, AVX2 and AVX-512) point the stack register at a heap buffer while they run.
The kernel writes a signal's frame (the registers and the vector state) below the stack register of the thread it
interrupts, so a signal that comes then writes over that heap buffer and what lies below it (oneDNN issue 4845,
fixed in oneDNN 3.11.2 and 3.12 by pull request 4855; torch 2.11.0's own oneDNN 3.10.2, which runs its CPU LSTM, and
PyPI's onednn-cpu-gomp 2023.2.0, which the CPU GRU kernel links, predate it). Where the thread has an alternate signal
stack and the handler was installed with SA_ONSTACK (as CPython installs every handler), the frame goes there.

Each case is one child process that trains one recurrent layer at the an4_cpu shape (on one thread unless
--threads says otherwise), forward and backward in a loop inside batchrnn.training.stopping.deferred() (as a run
trains), while this process sends it SIGTERM every --every-ms for --seconds. Each step's gradients are compared
with the first step's (the same input on the same threads: the same bits), so damage that does not crash shows
too. The cases (--stack):
  off  the handler alone (`signal.signal(SIGTERM, stopping.on_signal)`): the frame lands below the stack register;
  run  src/run.py's set-up (`stopping.install()`): the handler, and an alternate stack for the main thread.
A case ends clean with exit status 143 (the run leaves on the SIGTERMs it recorded) and 0 gradients changed.

    python experiments/signal_frames.py [--seconds 20] [--every-ms 0.5] [--rnn gru lstm] [--stack off run]
                                        [--threads 1]
"""
import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

SHAPE = {"T": 200, "N": 16, "D": 512, "H": 256}  # an4_cpu: 64 mels -> 16 x 32 = 512 after the convs; 256 units
CLEAN = 128 + signal.SIGTERM


def signal_stack() -> dict:
    """The calling thread's alternate signal stack, the least Linux asks of one on this CPU (AT_MINSIGSTKSZ: the
    frame with its vector state), and whether SIGTERM's handler was installed with SA_ONSTACK; Linux, glibc."""
    class Stack(ctypes.Structure):  # stack_t
        _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]

    class Action(ctypes.Structure):  # struct sigaction: handler, a 1024-bit mask, flags, restorer
        _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                    ("restorer", ctypes.c_void_p)]

    libc, stack, action = ctypes.CDLL(None, use_errno=True), Stack(), Action()
    libc.getauxval.restype = ctypes.c_ulong
    if libc.sigaltstack(None, ctypes.byref(stack)) or libc.sigaction(signal.SIGTERM, None, ctypes.byref(action)):
        raise OSError(ctypes.get_errno(), "sigaltstack or sigaction failed")
    ss_disable, sa_onstack, at_minsigstksz = 2, 0x08000000, 51
    return {"alternate stack": stack.size if not stack.flags & ss_disable else 0,
            "frame needs": libc.getauxval(at_minsigstksz), "SA_ONSTACK": bool(action.flags & sa_onstack)}


def child(rnn: str, stack: str, seconds: float, threads: int) -> None:
    import torch

    from batchrnn.training import stopping

    torch.set_num_threads(threads)
    if stack == "run":
        stopping.install()
    else:
        signal.signal(signal.SIGTERM, stopping.on_signal)
    torch.manual_seed(0)
    x = torch.randn(SHAPE["T"], SHAPE["N"], SHAPE["D"])
    layer = (torch.nn.LSTM if rnn == "lstm" else torch.nn.GRU)(SHAPE["D"], SHAPE["H"])
    if rnn == "lstm":  # torch sends its CPU LSTM to its own oneDNN
        forward = lambda: layer(x)[0]  # noqa: E731
    else:  # the project's CPU GRU kernel, on PyPI's oneDNN
        from batchrnn.layers import cpu_gru

        if not cpu_gru.available():
            raise SystemExit("the oneDNN CPU GRU kernel is unavailable (make venv builds it)")
        forward = lambda: cpu_gru.recurrence(x, layer.weight_ih_l0, layer.bias_ih_l0,  # noqa: E731
                                             layer.weight_hh_l0, layer.bias_hh_l0)
    first, steps, changed = None, 0, 0
    with stopping.deferred():  # each SIGTERM is recorded; the child leaves with 143 at the end of the block
        print("ready", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end or steps < 3:  # three steps at least, however slow the machine
            layer.zero_grad(set_to_none=True)
            forward().square().mean().backward()
            grads = torch.cat([p.grad.flatten() for p in layer.parameters()])
            if first is None:
                first = grads.clone()
            elif not torch.equal(grads, first):
                changed += 1
            steps += 1
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the rest is the report and the exit (143: one was recorded)
        print(json.dumps({"steps": steps, "gradients changed": changed, **signal_stack()}), flush=True)


def case(rnn: str, stack: str, seconds: float, every_ms: float, threads: int) -> dict:
    """Runs one child under SIGTERMs; its exit status, the signals sent, and what it reported."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", rnn, stack, str(seconds), str(threads)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.wait()
        raise SystemExit(f"the {rnn} child did not start: {proc.stderr.read()[-2000:]}")
    sent, began = 0, time.monotonic()
    while proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(every_ms / 1000)
    out, err = proc.communicate()
    result = {"rnn": rnn, "stack": stack, "exit": proc.returncode,
              "SIGTERMs sent": sent, "seconds": round(time.monotonic() - began, 1)}
    reports = [line for line in out.splitlines() if line.startswith("{")]
    if reports:
        result.update(json.loads(reports[-1]))
    result["clean"] = proc.returncode == CLEAN and result.get("gradients changed") == 0  # no report: not clean
    if proc.returncode != CLEAN:
        result["stderr"] = " | ".join(line for line in err.splitlines()[-3:] if line.strip())
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20, help="how long each case trains under SIGTERMs")
    parser.add_argument("--every-ms", type=float, default=0.5, help="the pause between two SIGTERMs")
    parser.add_argument("--rnn", nargs="+", default=["gru", "lstm"], choices=["gru", "lstm"])
    parser.add_argument("--stack", nargs="+", default=["off", "run"], choices=["off", "run"])
    parser.add_argument("--threads", type=int, default=1, help="torch's threads in each child (the study's runs: 1)")
    args = parser.parse_args()
    print(f"shape {SHAPE}, {args.threads} thread(s), SIGTERM every {args.every_ms} ms for up to "
          f"{args.seconds:.0f} s a case", flush=True)
    results = []
    for rnn in args.rnn:
        for stack in args.stack:
            results.append(case(rnn, stack, args.seconds, args.every_ms, args.threads))
            print(json.dumps(results[-1]), flush=True)
    sys.exit(0 if all(r["clean"] for r in results if r["stack"] == "run") else 1)


if __name__ == "__main__":
    main()
