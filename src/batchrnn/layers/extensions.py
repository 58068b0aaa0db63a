"""The harness's C++ kernels (layers/csrc), compiled as torch extensions into the virtual environment: what
cpu_gru (oneDNN's GRU) and cpu_front_end (the conv front end's BatchNorm and Hardtanh) share."""
from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


def venv_directory(name: str) -> Path:
    """Inside the virtual environment, so that each checkout's .venv holds the kernels built from its own source."""
    return Path(sys.prefix) / "share" / "batchrnn" / name


def compile_extension(name: str, sources: list[Path], directory: Path, what: str, verbose: bool = False,
                      cflags: tuple[str, ...] = ("-O2",), include: tuple[Path, ...] = (),
                      ldflags: tuple[str, ...] = ()):
    """Compile (when a source, the flags or torch changed) and import the extension; raises with the reason."""
    try:  # PyPI's ninja puts its binary beside the interpreter's scripts, which need not be on PATH
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    quiet = logging.getLogger("torch.utils.cpp_extension")  # "No CUDA runtime is found": true, and beside the point
    level, quiet.level = quiet.level, logging.ERROR
    try:
        from torch.utils.cpp_extension import load
    finally:
        quiet.setLevel(level)

    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.glob(f"{name}*.so")):
        log.warning("building the %s into %s (once per environment, about a minute)", what, directory)
    return load(name, [str(s) for s in sources], build_directory=str(directory), verbose=verbose,
                extra_cflags=list(cflags), extra_include_paths=[str(p) for p in include], extra_ldflags=list(ldflags))


def chosen(env: str, default: str, build: Callable, what: str, instead: str, fix: str):
    """The extension build() returns, or None: the environment variable `env` says aten (torch's operations, on
    purpose), or it could not be built: a missing compiler, library or header, said in one warning with the fix."""
    choice = os.environ.get(env, default)
    if choice not in (default, "aten"):
        raise ValueError(f"{env}={choice!r}: expected {default} (the default) or aten")
    if choice == "aten":
        return None
    try:
        return build()
    except Exception as e:  # the run goes on with torch's operations
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else e
        warnings.warn(f"batchrnn: the {what} is unavailable ({type(e).__name__}: {reason}); {instead}. Fix: {fix}.",
                      RuntimeWarning, stacklevel=3)
        return None
