"""The CPU GRU's fused kernel: oneDNN's lbr_gru (csrc/onednn_gru.cpp), built as a torch C++ extension.

torch sends only its LSTM to oneDNN; its CPU GRU runs ATen's step loop, about 1.7x the LSTM's time at the
an4_cpu shape. oneDNN's lbr_gru ("linear before reset") is exactly torch's GRU and runs a direction's whole time
loop in one call, forward and backward. It comes from PyPI's onednn-cpu-gomp (the library, on GNU OpenMP like
torch, so both share torch's one thread pool) and onednn-devel-cpu-gomp (its headers); `make venv` builds the
extension into the virtual environment, and a process that finds it unbuilt builds it once (about 40 s).

Where it cannot be built or loaded, the CPU GRU falls back to torch's own kernel with one warning saying why.
BATCHRNN_CPU_GRU=aten chooses torch's kernel on purpose (to compare the two); results.json records which ran.
Only float32 goes through oneDNN (its RNNs have no float64): float64, as the exactness tests use, runs torch's.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from batchrnn.layers.extensions import chosen, compile_extension, venv_directory

ENV = "BATCHRNN_CPU_GRU"  # onednn (the default) or aten
SOURCE = Path(__file__).with_name("csrc") / "onednn_gru.cpp"
NAME = "batchrnn_onednn_gru"
WHAT, INSTEAD = "oneDNN CPU GRU kernel", "the CPU GRU runs torch's step loop instead, about 2x slower"
FIX = ("reinstall with `make venv` (it installs onednn-cpu-gomp, onednn-devel-cpu-gomp and ninja and builds the "
       "kernel), or set BATCHRNN_CPU_GRU=aten to silence this")


def build_directory() -> Path:
    return venv_directory(NAME)


def build(verbose: bool = False):
    """Compile (when the source, flags or torch changed) and import the extension; raises with the reason."""
    prefix = Path(sys.prefix)
    if not (prefix / "include" / "oneapi" / "dnnl" / "dnnl.hpp").exists():
        raise RuntimeError(f"oneDNN's headers are not in {prefix / 'include'} (onednn-devel-cpu-gomp is not installed)")
    if not any((prefix / "lib").glob("libdnnl.so*")):
        raise RuntimeError(f"oneDNN's library is not in {prefix / 'lib'} (onednn-cpu-gomp is not installed)")
    return compile_extension(NAME, [SOURCE], build_directory(), WHAT, verbose,
                             include=(prefix / "include",),
                             ldflags=(f"-L{prefix / 'lib'}", "-ldnnl", f"-Wl,-rpath,{prefix / 'lib'}"))


@functools.cache
def extension():
    """The loaded extension, or None: BATCHRNN_CPU_GRU=aten, or it could not be built (one warning, naming why)."""
    return chosen(ENV, "onednn", lambda: build(), WHAT, INSTEAD, FIX)


def available() -> bool:
    return extension() is not None


def kernel_name() -> str:
    """What the CPU GRU's float32 recurrence runs, as results.json records it."""
    ext = extension()
    return f"onednn lbr_gru {ext.version()}" if ext is not None else "aten"


class Workspaces:
    """Spare oneDNN workspaces, handed back by each backward for the next forward. A workspace holds a
    direction's gates and states for every step (30 MB at the an4_cpu shape). Allocated fresh, blocks that large
    come from the OS page by page on every step, which cost the GRU a tenth of its time. Each is as large as the
    largest yet asked for, so that one fits every batch length. A new one is made only when none is spare, so
    the pool never holds more than were once in use at the same time; a forward whose backward never runs (a
    skipped step, a dropped graph) just lets its workspace go. One thread, as CPU autograd runs backward on
    the thread that called it."""

    def __init__(self):
        self.spare: list[torch.Tensor] = []
        self.largest = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.spare and self.spare[-1].numel() >= nbytes:
            return self.spare.pop()
        self.largest = max(self.largest, nbytes)
        return torch.empty(self.largest, dtype=torch.uint8)

    def clear(self) -> None:
        """Lets every spare go (a memory measurement that counts what a step allocates starts from here)."""
        self.spare.clear()

    def give(self, workspace: torch.Tensor) -> None:
        if workspace.numel() == self.largest:  # smaller ones would not fit the longest batches
            self.spare.append(workspace)
        self.spare = [w for w in self.spare if w.numel() == self.largest]


WORKSPACES = Workspaces()


class LbrGRU(torch.autograd.Function):
    """One direction, h0 = 0, over the padded (T, N, D) batch: nn.GRU's function, through oneDNN."""

    @staticmethod
    def forward(ctx, x, w_ih, w_hh, b_ih, b_hh):
        spare = WORKSPACES.take(extension().workspace_bytes(*x.shape, w_hh.shape[1]))  # recurrence(): backward comes
        y, workspace = extension().forward(x, w_ih, w_hh, b_ih, b_hh, True, spare)
        ctx.save_for_backward(x, w_ih, w_hh, b_ih, b_hh, y)
        ctx.workspace = workspace
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        if ctx.workspace is None:
            raise RuntimeError("LbrGRU: backward ran twice through one forward (retain_graph=True), but its "
                               "workspace went back to the pool after the first; run the forward again")
        grads = extension().backward(grad, *ctx.saved_tensors, ctx.workspace)
        WORKSPACES.give(ctx.workspace)
        ctx.workspace = None
        return tuple(grads)


def recurrence(x, w_ih, b_ih, w_hh, b_hh) -> torch.Tensor:
    """y (T, N, H) of one direction (fused_recurrence's argument order); float32 CPU tensors."""
    args = [t.contiguous() for t in (x, w_ih, w_hh, b_ih, b_hh)]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in args)):  # no backward: no workspace
        return extension().forward(*args, False, None)[0]
    return LbrGRU.apply(*args)

