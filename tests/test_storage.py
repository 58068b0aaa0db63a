"""Atomic writes: the old file or the whole new one, synced so that a power loss keeps it."""
import json
import os
from pathlib import Path

import pytest

from batchrnn.storage import atomic_write, write_json


def test_file_is_synced_before_the_rename_and_its_folder_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path.resolve() / "results.json"
    path.write_text("old")
    write_json(path, {"epoch": 3})
    tmp = Path(events[0][1])
    assert events == [("fsync", str(tmp)), ("replace", str(path)), ("fsync", str(tmp_path.resolve()))]
    assert tmp.parent == path.parent and tmp.name != path.name
    assert json.loads(path.read_text()) == {"epoch": 3} and list(tmp_path.iterdir()) == [path]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_text("old")

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]
