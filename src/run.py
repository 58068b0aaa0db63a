"""Entry point: compose the Hydra config, validate it, hand it to the trainer.

    python src/run.py experiment=smoke
    python src/run.py -m model.rnn=gru,lstm model.bn=seqwise,post,none

A problem the user can fix ends in one `error: ...` line and exit status 2 (3: training diverged); a
sweep goes on past a run that diverged or has a damaged folder and, with the serial launcher, exits with
that status at the end.
"""
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from batchrnn.config import ConfigError, register_configs, validate

register_configs()
log = logging.getLogger("batchrnn")
FAILED: list[int] = []  # exit statuses of sweep jobs that failed on their own while the sweep went on


def job_threads(launcher: DictConfig, cores: int) -> int:
    """torch threads for one job when train.threads=0: the cores shared among the jobs that run at once.

    joblib runs n_jobs at once (-1: one per core), so each gets cores // n_jobs; submitit gets the
    cpus_per_task it asked for; the basic launcher runs one job at a time and keeps torch's default (0).
    """
    if str(launcher.get("_target_", "")).endswith("JoblibLauncher"):
        n = launcher.get("n_jobs") or 1
        at_once = cores + 1 + n if n < 0 else n  # joblib's convention: -2 is every core but one
        return max(1, cores // max(1, at_once))
    return launcher.get("cpus_per_task") or 0


def stop_on_sigterm(signum, frame):
    # Raised between two bytecodes of the main thread: a half-written file's temporary copy is removed
    # on the way out, and the last complete epoch's checkpoint is there for the next start.
    log.warning("stopped by SIGTERM; run the same command again to resume from the last complete epoch")
    sys.exit(128 + signum)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    # Only where nobody else handles it: submitit's own handler turns SIGTERM into a SLURM requeue.
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        validate(cfg)
    except ConfigError as e:
        log.error("error: %s", e)
        sys.exit(2)
    if cfg.train.threads == 0:  # the job's share of the cores, recorded in results.json
        cfg.train.threads = job_threads(HydraConfig.get().launcher, len(os.sched_getaffinity(0)))
    from batchrnn.data import DataError  # after validation: a bad value fails before torch loads
    from batchrnn.train import RunError, TrainingDiverged, train

    try:
        hydra_cfg = HydraConfig.get()
        results = train(cfg, Path(hydra_cfg.runtime.output_dir), hydra_cfg.runtime.choices.get("experiment"))
    except (ConfigError, DataError) as e:  # every later job of a sweep would meet it too: stop here
        log.error("error: %s", e)
        sys.exit(2)
    except (RunError, TrainingDiverged) as e:  # this run's own trouble: a sweep goes on with the next job
        log.error("error: %s", e)
        code = 3 if isinstance(e, TrainingDiverged) else 2
        if HydraConfig.get().mode is not RunMode.MULTIRUN:
            sys.exit(code)
        FAILED.append(code)
        return math.nan
    except KeyboardInterrupt:
        log.warning("interrupted; run the same command again to resume from the last complete epoch")
        sys.exit(130)
    return results["best_val_wer"]


if __name__ == "__main__":
    main()
    if FAILED:
        print(f"error: {len(FAILED)} runs of this sweep stopped early; their 'error:' lines above say why",
              file=sys.stderr)
        sys.exit(max(FAILED))
