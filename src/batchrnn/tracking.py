"""Weights & Biases tracking that can never stop training: online when a key is configured, offline
otherwise, a no-op stand-in when disabled. `read_offline_run` reads back what an offline run logged.
"""
import contextlib
import hashlib
import json
import logging
import struct
import zlib
from pathlib import Path

from batchrnn.config import LoggerConfig, LoggerMode

log = logging.getLogger(__name__)

# Online init waits this long for the server before falling back to offline (wandb's default is 90 s).
INIT_TIMEOUT_S = 30
# Online finish waits this long for the upload, then gives up, the data staying on disk for `wandb sync`.
# wandb's default waits forever: a server that goes away mid-run would hold a sweep at its first finish.
FINISH_TIMEOUT_S = 120


class Tracker:
    """The no-op stand-in (mode disabled): same methods as a W&B run, so the trainer never branches."""

    mode = "disabled"

    def log(self, metrics: dict, step: int) -> None:
        pass

    def log_epoch(self, row: dict) -> None:
        pass

    def log_step(self, step: int, metrics: dict) -> None:
        pass

    def summary(self, metrics: dict) -> None:
        pass

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def log_image(self, name: str, path: Path) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker(Tracker):
    """A live wandb run. A failing call warns once and is dropped: a lost metric beats a lost run."""

    def __init__(self, run, mode: str):
        self.run, self.mode = run, mode
        self.step = None  # tables and images join the last logged step, so W&B steps stay monotonic
        self.failed = set()

    def _safely(self, what: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            if what not in self.failed:
                self.failed.add(what)
                log.warning("W&B %s failed, continuing without it: %s", what, e)

    def log(self, metrics: dict, step: int) -> None:
        self.step = step
        self._safely("log", self.run.log, metrics, step=step)

    def log_epoch(self, row: dict) -> None:
        self.log(row, step=row["epoch"])

    def summary(self, metrics: dict) -> None:
        self._safely("summary", self.run.summary.update, metrics)

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        import wandb

        self._safely("log_table", lambda: self.run.log({name: wandb.Table(columns=columns, data=rows)},
                                                       step=self.step))

    def log_image(self, name: str, path: Path) -> None:
        import wandb

        self._safely("log_image", lambda: self.run.log({name: wandb.Image(str(path))}, step=self.step))

    def finish(self) -> None:
        import wandb

        try:
            self.run.finish()
        except Exception as e:  # noqa: BLE001 - finish_timeout's TimeoutError, a lost service, ...
            log.warning("W&B could not finish the run (%s); what it logged is on disk, upload it later with "
                        "`wandb sync %s`", e, getattr(self.run.settings, "sync_dir", "<run folder>/wandb/run-*"))
        # Stop wandb's service process too, so tests and sweeps leave nothing running and the next
        # start_tracking in this process reads the environment (WANDB_BASE_URL, keys) afresh.
        self._safely("teardown", wandb.teardown)


def run_id(run_dir: Path) -> str:
    """Stable W&B run id for an output folder: a resumed run continues the same W&B run."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def has_api_key() -> bool:
    """True when wandb finds credentials (WANDB_API_KEY, netrc, settings) without prompting."""
    import wandb

    try:
        return wandb.login(prompt=False, verify=False)
    except Exception:  # noqa: BLE001 - a malformed key means we cannot go online, nothing more
        return False


def start_tracking(cfg: LoggerConfig, run_dir: Path, name: str, group: str, config: dict,
                   job_type: str = "train") -> Tracker:
    mode = LoggerMode(cfg.mode)
    if mode is LoggerMode.disabled:
        return Tracker()
    try:
        import wandb
    except Exception as e:  # noqa: BLE001 - a broken wandb install must not stop training either
        log.warning("W&B unavailable (%s); training continues without tracking", e)
        return Tracker()

    if mode is LoggerMode.auto:
        mode = LoggerMode.online if has_api_key() else LoggerMode.offline
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(project=cfg.project, entity=cfg.entity, group=group, name=name, config=config,
                  tags=list(cfg.tags), dir=run_dir, id=run_id(run_dir), resume="allow", job_type=job_type)

    def init(mode: LoggerMode):
        # x_disable_stats: the harness measures time and memory itself, and the system-metrics sampler
        # would compete for the cores those measurements run on. console="off" leaves stdout alone.
        settings = wandb.Settings(silent=True, console="off", init_timeout=INIT_TIMEOUT_S,
                                  finish_timeout=FINISH_TIMEOUT_S, finish_timeout_raises=True,
                                  x_disable_stats=True)
        return WandbTracker(wandb.init(mode=mode.value, settings=settings, **kwargs), mode.value)

    if mode is LoggerMode.online:
        try:
            return init(LoggerMode.online)
        except Exception as e:  # noqa: BLE001 - unreachable server, bad key, ...: go offline instead
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("W&B online init failed (%s); logging offline, upload later with "
                        "`wandb sync %s`", reason, run_dir / "wandb" / "offline-run-*")
            with contextlib.suppress(Exception):
                wandb.teardown()  # the failed run still holds its id in wandb's service; free it
    try:
        return init(LoggerMode.offline)
    except Exception as e:  # noqa: BLE001
        log.warning("W&B offline init failed (%s); training continues without tracking", e)
        return Tracker()


# The .wandb file is a LevelDB-style log of protobuf Records: a 7-byte file header, then 32 KiB blocks
# of chunks, each with a 7-byte header (crc32, length, type); a record may span several chunks.
# wandb >= 0.2x dropped its Python reader, so this is the few lines it takes to read one back.
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

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


def read_offline_run(run_dir: Path, prefix: str = "offline-run") -> dict:
    """{"history": [one dict per logged step], "summary": {...}, "config": {...}, "run": {name, group,
    job_type, tags}} of the offline W&B run under run_dir; a resumed run's several offline folders are
    read in order and merged. prefix="run" reads an online run's local copy instead."""
    # offline-run-YYYYMMDD_HHMMSS-<id>[-k]: wandb adds -k when a run restarts within the same second
    stamp = len(f"{prefix}-YYYYMMDD_HHMMSS")
    folders = sorted(Path(run_dir).glob(f"wandb/{prefix}-*"),
                     key=lambda p: (p.name[:stamp], len(p.name), p.name))
    files = [f for folder in folders for f in sorted(folder.glob("*.wandb"))]
    if not files:
        raise FileNotFoundError(f"{Path(run_dir) / 'wandb'}: no offline W&B run here; was the run "
                                "tracked with logger.mode=offline (or auto without an API key)?")
    history, summary, config, run = [], {}, {}, {}
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
    config.pop("_wandb", None)
    return {"history": history, "summary": _public(summary), "config": config, "run": run}
