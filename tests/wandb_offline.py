"""Reads back what an offline W&B run wrote (its .wandb log), so tests check the real thing: history,
summary, config, the run's name and group, and what define_metric set (x axes, summaries).
"""
import json
import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

# The .wandb file is a LevelDB-style log of protobuf Records: a 7-byte file header, then 32 KiB blocks
# of chunks, each with a 7-byte header (crc32, length, type); a record may span several chunks.
# wandb >= 0.2x dropped its Python reader, so this is the few lines it takes to read one back.
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path):
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, record = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            return  # a run still writing (or killed) ends in a torn chunk: keep what came before
        record = chunk if kind in (_FULL, _FIRST) else record + chunk
        if kind in (_FULL, _LAST):
            r = pb.Record()
            r.ParseFromString(record)
            yield r


def _items(items) -> dict:
    """{key: value} from wandb's (key | nested_key, value_json) items, nesting dotted keys."""
    out = {}
    for item in items:
        keys = [item.key] if item.key else list(item.nested_key)
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = json.loads(item.value_json)
    return out


def _public(d: dict) -> dict:
    # wandb's own bookkeeping (_runtime, _timestamp, _wandb) is noise; _step is the step we logged.
    return {k: v for k, v in d.items() if k == "_step" or not k.startswith("_")}


def _metric(m) -> dict:
    """A define_metric record as {"step_metric": ..., "summary": ["min", ...]} (what it set, no more)."""
    return {"step_metric": m.step_metric or None,
            "summary": sorted(field.name for field, on in m.summary.ListFields() if on)}


def read_offline_run(run_dir: Path, prefix: str = "offline-run") -> dict:
    """{"history": [one dict per logged step], "summary": {...}, "config": {...}, "run": {name, group,
    job_type, tags}, "metrics": {name or glob: _metric}} of the offline W&B run under run_dir; a resumed
    run's several offline folders are read in order and merged. prefix="run" reads an online run's local
    copy instead."""
    # offline-run-YYYYMMDD_HHMMSS-<id>[-k]: wandb adds -k when a run restarts within the same second
    stamp = len(f"{prefix}-YYYYMMDD_HHMMSS")
    folders = sorted(Path(run_dir).glob(f"wandb/{prefix}-*"),
                     key=lambda p: (p.name[:stamp], len(p.name), p.name))
    files = [f for folder in folders for f in sorted(folder.glob("*.wandb"))]
    if not files:
        raise FileNotFoundError(f"{Path(run_dir) / 'wandb'}: no offline W&B run here; was the run "
                                "tracked with logger.mode=offline (or auto without an API key)?")
    history, summary, config, run, metrics = [], {}, {}, {}, {}
    for path in files:
        for r in _records(path):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                history.append(_public(_items(r.history.item)))
            elif kind == "summary":
                summary.update(_items(r.summary.update))
            elif kind == "run":
                config.update(_items(r.run.config.update))
                run = {"name": r.run.display_name, "group": r.run.run_group, "job_type": r.run.job_type,
                       "tags": list(r.run.tags)}
            elif kind == "config":
                config.update(_items(r.config.update))
            elif kind == "metric":
                metrics[r.metric.name or r.metric.glob_name] = _metric(r.metric)
    config.pop("_wandb", None)
    return {"history": history, "summary": _public(summary), "config": config, "run": run, "metrics": metrics}
