"""Atomic file writes: a reader sees the old file or the whole new one, and a crash loses neither."""
import json
import os
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) into a sibling temporary file, then rename it over path (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))
