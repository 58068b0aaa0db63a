"""The conv front end's training BatchNorm + Hardtanh on the CPU as C++ loops (csrc/front_end.cpp), a torch extension
that `make venv` builds: folds.MaskedBNHardtanh's stages, each one pass over x, where torch's operations take a pass
per elementwise operation (about eight a direction). Where it cannot be built, torch's operations run, with one
warning; BATCHRNN_CPU_FRONT_END=aten chooses them on purpose. results.json records which ran (`front_end_kernel`)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from batchrnn.layers.extensions import chosen, compile_extension, venv_directory

ENV = "BATCHRNN_CPU_FRONT_END"  # native (the default) or aten
SOURCE = Path(__file__).with_name("csrc") / "front_end.cpp"
NAME = "batchrnn_front_end"
WHAT, INSTEAD = "conv front end's CPU kernel", "its BatchNorm and Hardtanh run as torch operations instead"
FIX = "reinstall with `make venv` (it builds the kernel; it needs a C++ compiler), or set BATCHRNN_CPU_FRONT_END=aten"


def build_directory() -> Path:
    return venv_directory(NAME)


def build(verbose: bool = False):
    """Compile (when the source, flags or torch changed) and import the extension; raises with the reason."""
    # -fopenmp-simd: the row loops' `omp simd` reductions vectorise (no OpenMP runtime); each is compiled for
    # AVX-512, AVX2 and the baseline (target_clones), so one build runs on every x86-64 CPU
    return compile_extension(NAME, [SOURCE], build_directory(), WHAT, verbose,
                             cflags=("-O3", "-fopenmp-simd"))


@functools.cache
def extension():
    """The loaded extension, or None: BATCHRNN_CPU_FRONT_END=aten, or it could not be built (one warning, why)."""
    return chosen(ENV, "native", lambda: build(), WHAT, INSTEAD, FIX)


DTYPES = (torch.float32, torch.float64)


def runs(device_type: str, dtype: torch.dtype):
    """The extension, where the front end's tensors on this device and in this dtype go through it; else None."""
    return extension() if device_type == "cpu" and dtype in DTYPES else None


def kernel_name(device_type: str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """What the front end's training BatchNorm + Hardtanh runs on this device and in this dtype (under bf16
    autocast the convolutions' outputs are bf16), as results.json records it."""
    return "native" if runs(device_type, dtype) is not None else "aten"


def takes(x: torch.Tensor, mask: torch.Tensor, channel_dim: int):
    """The extension, where it computes this call: x a CPU float32 or float64 (N, C, F, T) with channels at dim 1
    and mask (N, 1, 1, T), as the conv front end has them; None otherwise (the torch operations run)."""
    if x.dim() != 4 or channel_dim % 4 != 1 or mask.shape != (x.shape[0], 1, 1, x.shape[3]):
        return None
    return runs(x.device.type, x.dtype)
