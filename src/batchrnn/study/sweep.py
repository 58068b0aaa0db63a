"""Sweeps: each job's share of the cores, and a sweep's exit status whichever launcher ran its jobs.

A job that fails on its own (diverged, damaged run folder) lets the sweep go on; it leaves its exit status
in the sweep folder, because joblib and submitit run jobs in other processes, and `SweepStatus` (a Hydra
callback, conf/config.yaml) turns those into the sweep's exit status once every job is done. Each sweep keeps
its records apart, under an id its jobs get in their environment: two sweeps in one folder, at once or one
after the other, each exit by their own jobs.
"""
import contextlib
import os
import shutil
import socket
import sys
import time
from functools import reduce
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, flag_override

from batchrnn.errors import worst

# In the sweep folder: a folder per sweep, named by its SWEEP_ID, holding a file per failed job (named by job
# number, holding its status)
FAILED_DIR = ".failed_jobs"
# In each job's environment (hydra.job.env_set, which travels with the job to joblib's and submitit's processes):
# the id of the sweep it belongs to, <host>-<pid>-<start>
SWEEP_ID = "BATCHRNN_SWEEP_ID"


def jobs_at_once(launcher: DictConfig, cores: int) -> int | None:
    """How many jobs a local launcher runs at once: joblib's n_jobs (-1: one per core, -2: every core but one),
    the basic launcher's one; None for a cluster launcher (submitit), whose jobs do not share these cores."""
    target = str(launcher.get("_target_", ""))
    if target.endswith("JoblibLauncher"):
        n = launcher.get("n_jobs") or 1
        return max(1, cores + 1 + n if n < 0 else n)
    return 1 if target.endswith("BasicLauncher") else None


def job_threads(launcher: DictConfig, cores: int, ranks: int = 1) -> int:
    """torch threads for one job when train.threads=0: the cores shared among the jobs that run at once, and
    among a data-parallel job's ranks on this machine (`ranks`, torchrun's LOCAL_WORLD_SIZE).

    joblib runs n_jobs at once, so each gets cores // n_jobs; submitit gets the cpus_per_task it asked for (per
    task, so per rank); the basic launcher runs one job at a time and keeps torch's default (0), or with several
    ranks gives each cores // ranks.
    """
    if str(launcher.get("_target_", "")).endswith("JoblibLauncher"):
        return max(1, cores // jobs_at_once(launcher, cores) // ranks)
    if launcher.get("cpus_per_task"):
        return launcher.cpus_per_task
    return max(1, cores // ranks) if ranks > 1 else 0


def record_failed_job(status: int) -> None:
    """Called inside a sweep job that stopped early, in whatever process the launcher gave it."""
    if not (sweep := os.environ.get(SWEEP_ID)):  # a sweep without SweepStatus: nobody reads the record
        return
    hydra = HydraConfig.get()
    failed = Path(hydra.sweep.dir) / FAILED_DIR / sweep
    failed.mkdir(parents=True, exist_ok=True)
    (failed / str(hydra.job.num)).write_text(f"{status}\n")


STOP_FILE = "BATCHRNN_STOP_FILE"  # set by the study's scheduler for each run it starts (batchrnn.study.scheduler.Pool)


def record_stop(message: str) -> None:
    """Called by a run that stopped on an error every other run would meet too (bad settings, no corpus):
    tells the study's scheduler, when one started it, to start no more runs."""
    if os.environ.get(STOP_FILE):
        Path(os.environ[STOP_FILE]).write_text(message + "\n")


class StudyFolder(Callback):
    """hydra.run.dir or hydra.sweep.dir made before Hydra makes it: one that names a file, or lies where this
    process may not write, ends in one error line and exit status 2, not in a traceback from Hydra."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        make_folder(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        make_folder(config.hydra.sweep.dir, "hydra.sweep.dir")


def make_folder(path: str, key: str) -> None:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        what = "names a file, not a folder" if Path(path).exists() else f"cannot be made ({e.strerror})"
        print(f"error: {key}={path}: {what}; give a folder that can be written", file=sys.stderr)
        sys.exit(2)


class SweepStatus(Callback):
    """Exit status of a sweep: that of its worst failed job (errors.worst: 2, a damaged folder or a protocol
    stage that cannot run, says more than 3, diverged), else 0."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.sweep = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        # Each job is composed again from these overrides (in the process that runs it), so the id reaches it
        with flag_override(config, ["readonly", "struct"], [False, False]):
            config.hydra.overrides.hydra.append(f"++hydra.job.env_set.{SWEEP_ID}='{self.sweep}'")  # quoted: a string
        records = Path(config.hydra.sweep.dir) / FAILED_DIR
        for record in records.iterdir() if records.is_dir() else []:
            if record.is_file():  # an older version's record, of a sweep long gone
                record.unlink()
            elif abandoned(record.name):
                shutil.rmtree(record, ignore_errors=True)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        failed = Path(config.hydra.sweep.dir) / FAILED_DIR / self.sweep
        statuses = [int(f.read_text()) for f in failed.iterdir()] if failed.is_dir() else []
        shutil.rmtree(failed, ignore_errors=True)
        with contextlib.suppress(OSError):  # another sweep's records are still there
            failed.parent.rmdir()
        if statuses:
            print(f"error: {len(statuses)} runs of this sweep stopped early; their 'error:' lines above say why",
                  file=sys.stderr)
            sys.exit(reduce(worst, statuses))


def abandoned(sweep: str) -> bool:
    """Whether the sweep of that id was stopped before its end (a signal, a crash) on this machine: its records
    have no reader. Those of other machines' sweeps are left alone."""
    host, pid, _ = (sweep.rsplit("-", 2) + ["", ""])[:3]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        return False
    return False
