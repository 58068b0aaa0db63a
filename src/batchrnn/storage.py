"""Atomic, durable file writes: a reader sees the old file or the whole new one, and neither a crash
nor a power loss leaves less."""
import json
import os
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) into a sibling temporary file, then rename it over path (atomic on POSIX).

    The file is synced before the rename, or after a power loss the new name could point at blocks
    never written; the folder after it, or the rename itself could be lost."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    except OSError as e:
        if e.filename is None and e.errno is not None:  # a write's or fsync's, which name no file: this one
            raise type(e)(e.errno, e.strerror, str(path)) from e
        raise
    finally:
        tmp.unlink(missing_ok=True)


def atomic_save(path: Path, obj) -> None:
    """torch.save(obj) through atomic_write, into a Python file: on a full disk torch's own file writer raises an
    opaque RuntimeError ("unexpected pos"), a Python file the OSError (ENOSPC) that says what is wrong."""
    import torch  # here: storage is imported where torch need not load yet

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    atomic_write(path, write)


def fsync(path: Path) -> None:
    """Flush a file's or a folder's contents to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))
