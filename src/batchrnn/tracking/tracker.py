"""Weights & Biases tracking that can never stop training: online when a key is configured, offline
otherwise, a no-op stand-in when disabled or when wandb cannot start. Epoch-level metrics are charted
against the epoch, step-level ones against the optimizer step.
"""
import contextlib
import hashlib
import importlib.metadata
import logging
from pathlib import Path

from batchrnn.config import LoggerConfig, LoggerMode
from batchrnn.errors import one_line

log = logging.getLogger(__name__)

# Online init waits this long for the server before falling back to offline (wandb's default is 90 s).
INIT_TIMEOUT_S = 30
# Online finish waits this long for the upload, then gives up, the data staying on disk for `wandb sync`.
# wandb's default waits forever: a server that goes away mid-run would hold a sweep at its first finish.
FINISH_TIMEOUT_S = 120
# The oldest wandb that takes every setting start_tracking passes: finish_timeout and
# finish_timeout_raises arrived in 0.27.0. pyproject.toml pins the same bound (a test checks).
MIN_WANDB = "0.27.0"
# What the runs table shows for an epoch-level metric, where the last value is the wrong one.
SUMMARIES = {"val_wer": "min", "val_cer": "min", "val_loss": "min"}
# Step-level metrics are logged as step/<name>, charted against STEP (the optimizer step).
STEP = "step"


class Tracker:
    """The no-op stand-in, same methods as a live run, so the trainer never branches. Its mode says why:
    "disabled" (logger.mode=disabled) or "failed" (wandb could not start; a warning said why)."""

    def __init__(self, mode: str = "disabled"):
        self.mode = mode

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
        self.failed = set()
        self.defined = {"epoch"}  # epoch-level keys given their x axis so far
        # No step= anywhere: wandb's own step just counts log calls, so epoch rows, step rows, tables and
        # images interleave and stay monotonic; the charts take their x axes from these definitions.
        self._safely("define_metric", self._define_axes)

    def _define_axes(self) -> None:
        self.run.define_metric("epoch")
        self.run.define_metric(STEP)
        self.run.define_metric(f"{STEP}/*", step_metric=STEP)

    def _safely(self, what: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            if what not in self.failed:
                self.failed.add(what)
                log.warning("W&B %s failed, continuing without it: %s", what, e)

    def log_epoch(self, row: dict) -> None:
        """One row per epoch, keyed as results.json's epochs (row["epoch"] is the x axis)."""
        for key in row.keys() - self.defined:  # the trainer's keys, so no second list of names here
            self._safely("define_metric", self.run.define_metric, key, step_metric="epoch",
                         summary=SUMMARIES.get(key))
            self.defined.add(key)
        self._safely("log_epoch", self.run.log, row)

    def log_step(self, step: int, metrics: dict) -> None:
        self._safely("log_step", self.run.log, {STEP: step} | {f"{STEP}/{k}": v for k, v in metrics.items()})

    def summary(self, metrics: dict) -> None:
        self._safely("summary", self.run.summary.update, metrics)

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        import wandb

        self._safely("log_table", lambda: self.run.log({name: wandb.Table(columns=columns, data=rows)}))

    def log_image(self, name: str, path: Path) -> None:
        import wandb

        self._safely("log_image", lambda: self.run.log({name: wandb.Image(str(path))}))

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

        # x_disable_stats: the harness measures time and memory itself, and the system-metrics sampler
        # would compete for the cores those measurements run on. console="off" leaves stdout alone.
        settings = wandb.Settings(silent=True, console="off", init_timeout=INIT_TIMEOUT_S,
                                  finish_timeout=FINISH_TIMEOUT_S, finish_timeout_raises=True,
                                  x_disable_stats=True)
    except Exception as e:  # noqa: BLE001 - a broken or too old wandb must not stop training either
        return start_failed(one_line(e))

    if mode is LoggerMode.auto:
        mode = LoggerMode.online if has_api_key() else LoggerMode.offline
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(project=cfg.project, entity=cfg.entity, group=group, name=name, config=config,
                  tags=list(cfg.tags), dir=run_dir, id=run_id(run_dir), resume="allow", job_type=job_type,
                  settings=settings)

    if mode is LoggerMode.online:
        try:
            return WandbTracker(wandb.init(mode="online", **kwargs), "online")
        except Exception as e:  # noqa: BLE001 - unreachable server, bad key, ...: go offline instead
            log.warning("W&B online init failed (%s); logging offline, upload later with "
                        "`wandb sync %s`", one_line(e), run_dir / "wandb" / "offline-run-*")
            with contextlib.suppress(Exception):
                wandb.teardown()  # the failed run still holds its id in wandb's service; free it
    try:
        return WandbTracker(wandb.init(mode="offline", **kwargs), "offline")
    except Exception as e:  # noqa: BLE001
        return start_failed(one_line(e))


def start_failed(reason: str) -> Tracker:
    """The stand-in for a run W&B could not track at all, said loudly: an old or broken wandb is the
    usual cause, and a quiet "disabled" would leave a sweep untracked with no one the wiser."""
    try:
        installed = f"wandb {importlib.metadata.version('wandb')} is installed"
    except importlib.metadata.PackageNotFoundError:
        installed = "wandb is not installed"
    log.warning("W&B could not start, online or offline (%s); this run is NOT tracked. %s and this harness "
                "needs wandb>=%s: pip install 'wandb>=%s' (or logger.mode=disabled to train without W&B)",
                reason, installed, MIN_WANDB, MIN_WANDB)
    return Tracker("failed")
