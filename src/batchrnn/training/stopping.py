"""SIGTERM (a study's stop, `kill`, a cluster's warning before preemption) ends a run between two steps.

src/run.py calls `install()`. While a run trains (inside `deferred()`), the handler only records the signal, and
the loop calls `check()` before each batch of training and scoring: the run leaves there, exit status 128 + the
signal, with its last complete epoch's checkpoint in place. Outside it (reading the corpus, computing features),
the handler leaves at once, as there is nothing to finish. Why not raise at once: Python runs a handler at the next
bytecode of the main thread, which can be anywhere in a step (a custom autograd Function's backward, AdamW's
update, a checkpoint being written); a step boundary is a state the run can leave cleanly.

Why `install()` also gives the main thread an alternate signal stack: oneDNN's generated GEMM kernels (in torch's
CPU LSTM and in the CPU GRU kernel, batchrnn.layers.cpu_gru) point the stack register at a heap buffer while they
run, and Linux writes a signal's frame below the stack register of the thread it interrupts. A signal that
came then wrote over the heap, and the run died soon after in glibc's "corrupted size vs. prev_size" or a SIGSEGV
(oneDNN issue 4845, fixed in oneDNN 3.11.2; torch 2.11.0's oneDNN 3.10.2 and PyPI's onednn-cpu-gomp 2023.2.0 predate
it): 5 of the pinned study's 17 stops in sessions 17-23 and one CI's smoke run (experiments/converged.md, the
Study log). CPython installs every handler with SA_ONSTACK, so with an alternate stack the frame goes there instead.
`python experiments/signal_frames.py` shows both: SIGTERM every 0.5 ms crashes a GRU or an LSTM step loop within
about a second without the alternate stack, and leaves it training, every gradient unchanged, with it. Linux
gives a signal sent to the process to its main thread unless that thread blocks it, is exiting, or already has a
signal pending while off the CPU, so the main thread's stack is the one that matters. The other threads (OpenMP's,
with train.threads > 1) have none: a second signal that comes before the main thread took the first can still
land on one of them.

With several ranks the ranks agree: every rank calls `check()` at the same points, and all leave there if any of them
had a signal. A signal reaches the ranks at different moments (or only one rank); a rank that left on its own would
end the others in an error at their next collective ("another rank ... has gone": gloo sees the connection reset at
once, another backend may wait for train.dist_timeout_s).
"""
import contextlib
import faulthandler
import logging
import signal
import sys
import threading

log = logging.getLogger("batchrnn")

# signum: a signal that came while deferring, not yet acted on; again: what the stop line says a rerun does
_state = {"deferring": 0, "signum": None, "again": "resume from the last complete epoch"}


def install(again: str | None = None) -> None:
    """A run process's signal set-up (src/run.py): an alternate signal stack for this thread, and `on_signal` for
    SIGTERM, where nobody else handles it (submitit's own handler turns SIGTERM into a SLURM requeue). again: what
    running the command again does, for the line a stop prints (`python -m batchrnn.data` gives its own)."""
    _state["again"] = again or _state["again"]
    # faulthandler's alternate stack (sized for this CPU's vector state; given to the thread that first enables it,
    # here the main thread) takes signals' frames off oneDNN's kernels (above); and a crash prints every thread's
    # Python stack to the log
    faulthandler.enable()
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, on_signal)  # while training, acted on between two steps


def on_signal(signum: int, frame) -> None:
    if _state["deferring"]:
        _state["signum"] = _state["signum"] or signum
    else:
        leave(signum)


def leave(signum: int) -> None:
    log.warning("stopped by %s; run the same command again to %s", signal.Signals(signum).name, _state["again"])
    sys.exit(128 + signum)


def check() -> None:
    """Leave here if a signal came since the run began deferring (a no-op otherwise). With several ranks it is a
    collective (one all-reduce of the signal's number): every rank leaves here if any rank had a signal."""
    from batchrnn.training import distributed  # here, not above: src/run.py imports this module before torch loads

    signum = _state["signum"] or 0
    if distributed.active():
        signum = int(distributed.largest(signum))
    if signum:
        leave(signum)


@contextlib.contextmanager
def deferred():
    """The run's training and scoring: a signal is acted on at the next `check()`, or at the end. Nothing stays
    pending after it, so a later `score()` in the same process (evaluate, a test) is not stopped by it."""
    outermost = not _state["deferring"]
    _state["deferring"] += 1
    try:
        yield
    finally:
        _state["deferring"] -= 1
        pending = _state["signum"]
        if outermost:
            _state["signum"] = None
    if pending is not None:  # one that came after the last check (reached only when the body returned)
        leave(pending)
