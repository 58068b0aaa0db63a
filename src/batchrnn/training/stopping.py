"""SIGTERM (a study's stop, `kill`, a cluster's warning before preemption) ends a run between two steps.

src/run.py installs `on_signal`. While a run trains (inside `deferred()`), the handler only records the signal, and
the loop calls `check()` before each batch of training and scoring: the run leaves there, exit status 128 + the
signal, with its last complete epoch's checkpoint in place. Outside it (reading the corpus, computing features),
the handler leaves at once, as there is nothing to finish.

Why not raise at once: Python runs a handler at the next bytecode of the main thread, which can be anywhere in a
step (a custom autograd Function's backward, AdamW's update, a checkpoint being written). Four of the pinned
study's fourteen stops under that handler ended a run in glibc's "corrupted size vs. prev_size" abort, one of them
in a backward pass (experiments/converged.md, the study log). A step boundary is a state the run can leave cleanly.
That did not end those crashes: under this handler too, a SIGTERM that came during a backward pass once crashed a
run (SIGSEGV in torch's autograd engine, before the run could leave); the cause is open (the same page).

With several ranks the ranks agree: every rank calls `check()` at the same points, and all leave there if any of them
had a signal. A signal reaches the ranks at different moments (or only one rank); a rank that left on its own would
end the others in an error at their next collective ("another rank ... has gone": gloo sees the connection reset at
once, another backend may wait for train.dist_timeout_s).
"""
import contextlib
import logging
import signal
import sys

log = logging.getLogger("batchrnn")

_state = {"deferring": 0, "signum": None}  # signum: a signal that came while deferring, not yet acted on


def on_signal(signum: int, frame) -> None:
    if _state["deferring"]:
        _state["signum"] = _state["signum"] or signum
    else:
        leave(signum)


def leave(signum: int) -> None:
    log.warning("stopped by %s; run the same command again to resume from the last complete epoch",
                signal.Signals(signum).name)
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
