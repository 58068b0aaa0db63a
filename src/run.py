"""Entry point: compose the Hydra config, validate it, name the run's folder, hand it to the trainer.

    python src/run.py experiment=smoke
    python src/run.py -m model.rnn=gru,lstm model.bn=seqwise,post,none

Without `experiment=`, the preset of the machine at hand: an4_gpu_plateau with CUDA, else an4_cpu_plateau. Each run
writes to runs/<study>/<its name from its resolved settings>/ (batchrnn.training.identity.run_name).

A problem the user can fix ends in one `error: ...` line and exit status 2 (3: training diverged); a
sweep goes on past a run that diverged or has a damaged folder and exits with that status at the end,
whichever launcher ran it (batchrnn.study.sweep).
"""
import contextlib
import logging
import math
import multiprocessing
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from batchrnn.config import ConfigError, register_configs, to_container, with_device_preset
from batchrnn.validation import validate
from batchrnn.errors import DIVERGED
from batchrnn.study.sweep import job_threads, record_failed_job, record_stop
from batchrnn.training import stopping

register_configs()
log = logging.getLogger("batchrnn")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        return run(cfg)
    except SystemExit as e:
        if e.code in (130, 143) and multiprocessing.current_process().name.startswith("LokyProcess"):
            # A joblib worker (hydra/launcher=parallel) would take SystemExit for this job's result and wait for
            # the next job, busy, though its sweep is gone: end the process, the run's files being complete.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.code)
        raise


def run(cfg: DictConfig) -> float:
    stopping.install()  # SIGTERM: the run leaves between two steps; signals' frames on an alternate stack
    try:
        validate(cfg)
    except ConfigError as e:
        log.error("error: %s", e)
        record_stop(str(e))
        sys.exit(2)
    from batchrnn.training import distributed  # after validation: a bad value fails before torch loads

    distributed.from_submitit()  # hydra.launcher.tasks_per_node > 1: the ranks from submitit's job environment
    if cfg.train.threads == 0:  # the job's share of the cores (a rank's, with several), recorded in results.json
        cfg.train.threads = job_threads(HydraConfig.get().launcher, len(os.sched_getaffinity(0)),
                                        distributed.local_world_size())
    from batchrnn.data.corpus import DataError
    from batchrnn.data.manifest import pin_content
    from batchrnn.study.protocol import ProtocolError, nothing_to_train, stage_settings
    from batchrnn.training.identity import run_name
    from batchrnn.training.rundir import RunError, RunFolder
    from batchrnn.training.loop import TrainingDiverged, train
    from batchrnn.training.distributed import DistributedError

    try:
        pin_content(cfg.data)  # data=manifest: the manifests' content is part of the run's identity
    except DataError as e:
        log.error("error: %s", e)
        record_stop(str(e))
        sys.exit(2)
    hydra_cfg = HydraConfig.get()
    study_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        # final: the rate (SpecAugment, patience) the tuning stages chose for this variant; augment: that rate with
        # SpecAugment off; widen: one more rate past the grid's edge, if its best lies there; patience: the chosen
        # settings with the schedule doubled once more, if the more patient won so far
        chosen = stage_settings(study_dir, to_container(cfg))
        if chosen is None:
            log.info("%s", nothing_to_train(to_container(cfg)))
            return math.nan
        for key, value in chosen.items():
            OmegaConf.update(cfg, key, value)
        folder = RunFolder(study_dir / run_name(to_container(cfg)))
    # this variant's tuning is missing or all diverged, or its folder cannot be made: a sweep goes on with the others
    except (ProtocolError, RunError) as e:
        log.error("error: %s", e)
        if hydra_cfg.mode is not RunMode.MULTIRUN:
            sys.exit(2)
        record_failed_job(2)
        return math.nan
    with contextlib.ExitStack() as held:
        try:
            if distributed.lead():  # a second process on this run is refused before its log is touched
                held.enter_context(folder.lock())
            held.enter_context(folder.logging(distributed.rank()))  # run.log, and rank<N>.log of every other rank
            results = train(cfg, folder.path, hydra_cfg.runtime.choices.get("experiment"))
        except (ConfigError, DataError) as e:  # every later job of a sweep would meet it too: stop here
            log.error("error: %s", e)
            record_stop(str(e))
            sys.exit(2)
        except (RunError, TrainingDiverged, DistributedError) as e:  # this run's own trouble: a sweep goes on
            log.error("error: %s: %s", folder.path, e)
            code = DIVERGED if isinstance(e, TrainingDiverged) else 2
            if hydra_cfg.mode is not RunMode.MULTIRUN:
                sys.exit(code)
            record_failed_job(code)
            return math.nan
        except KeyboardInterrupt:
            log.warning("interrupted; run the same command again to resume from the last complete epoch")
            sys.exit(130)
    return results["best_val_wer"]


if __name__ == "__main__":
    given, sys.argv[1:] = sys.argv[1:], with_device_preset(sys.argv[1:])
    if sys.argv[1:] != given:
        print(f"no experiment= given: {sys.argv[-1]}, the preset for this machine (experiment=null: the bare "
              "schema defaults, deepspeech.pytorch's AN4 settings)", file=sys.stderr)
    main()
