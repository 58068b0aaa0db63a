"""A study under the fair protocol, in one resumable command: tune each variant's rate, then its seeds.

    python -m batchrnn.study experiment=an4_cpu model.rnn=gru,lstm model.bn=none,input,seqwise [--wandb]

Stage tune sweeps every variant over protocol.lrs with protocol.tune_seeds; stage widen (protocol.widen
times) tunes each variant whose best rate is an edge of its grid at one rate past it; stage final runs
protocol.seeds at the rate each variant's validation WER chose (batchrnn.protocol.choose_lrs); then the
report. Finished runs are skipped, so running it again resumes; a tuning run at the chosen rate is that
seed's final run. Under a local launcher (the basic one, or hydra/launcher=parallel's n_jobs at once) the
study schedules the runs itself: a job waits only for its own variant's earlier stages, so a free slot
never idles while another variant finishes a stage. A cluster launcher (submitit) gets each stage as one
sweep, a job array, stage after stage.
"""
import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from batchrnn.config import ConfigError, register_configs, to_container, validate, with_device_preset
from batchrnn.errors import DIVERGED, one_line, worst
from batchrnn.protocol import LR, SEED, ProtocolError, can_widen, mismatch, nothing_to_widen, run_name, stage_lr
from batchrnn.rundir import RESULTS
from batchrnn.sweep import job_threads, jobs_at_once

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, str(ROOT / "src" / "run.py"), "-m"]


def composed(overrides: list[str], fixed_only: bool = True):
    """The composed config with Hydra's own section, from the overrides that are not sweeps (all of them:
    fixed_only=False, for one job's). A refused override ends the study in one line, before any run."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    fixed = [o.input_line for o in parsed if not (fixed_only and o.is_sweep_override())]
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=fixed, return_hydra_config=True)
            validate(compose(config_name="config", overrides=fixed))
    except (HydraException, OmegaConfBaseException, ConfigError) as e:  # before any run: one line, as run.py
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    return cfg


def protocol_of(overrides: list[str]):
    """The composed protocol section and study folder, from the overrides that are not sweeps."""
    cfg = composed(overrides)
    return cfg.protocol, Path(cfg.hydra.sweep.dir)


def as_list(values) -> str:
    return ",".join(str(v) for v in values)


def stages(overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(name, the run.py -m arguments) of each stage, in order."""
    p, _ = protocol_of(overrides)
    if not p.lrs:
        return [("runs", [*overrides, f"seed={as_list(p.seeds)}"])]
    widen = [(f"widen {i}" if p.widen > 1 else "widen", [*overrides, "protocol.stage=widen", f"seed={as_list(p.tune_seeds)}"])
             for i in range(1, p.widen + 1)] if can_widen(p.lrs) else []
    return [("tune", [*overrides, "protocol.stage=tune", f"train.lr={as_list(p.lrs)}", f"seed={as_list(p.tune_seeds)}"]),
            *widen, ("final", [*overrides, "protocol.stage=final", f"seed={as_list(p.seeds)}"])]


def exit_status(code: int) -> int:
    """A child's return code as a shell would show it: killed by signal N (-N) is 128 + N."""
    return 128 - code if code < 0 else code


PER_RUN = (SEED, LR, "protocol.stage")  # what a stage sets for each run; the rest of a job's overrides is its variant


@dataclass
class Job:
    stage: str  # the stage's name: tune, widen [i], final
    rank: int  # the stage's place: a job waits until its variant's jobs of lower rank have ended
    variant: tuple[str, ...]  # the job's overrides but PER_RUN: what the rate is chosen for
    overrides: list[str]  # one run's, as a sweep of the stage would give that job
    cfg: DictConfig  # composed from them and validated, before any job runs


def expand(overrides: list[str]) -> list[list[str]]:
    """One list of overrides per job of a sweep, in the order Hydra's basic sweeper gives them: a key's
    last value wins, keys keep their first place, the first key varies slowest."""
    by_key = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise HydraException(f"{o.input_line}: a study sweeps lists of values only (a,b,c), not ranges or intervals")
        by_key[key] = ([f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                       else [f"{key}={o.get_value_element_as_str()}"])
    return [list(job) for job in itertools.product(*by_key.values())]


def jobs(overrides: list[str]) -> list[Job]:
    """Every job of every stage, in the order the stages' sweeps would run them: each stage's overrides
    (and the preset's hydra.sweeper.params, before them as Hydra puts them) expanded as Hydra's sweeper does.
    Each is composed and validated here, so a bad value anywhere in a sweep stops the study before any run."""
    params = composed(overrides).hydra.sweeper.params or {}
    swept = [f"{key}={value}" for key, value in params.items()]
    out, plan = [], stages(overrides)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for rank, (stage, args) in enumerate(plan):
            for job in expand(swept + args):
                try:
                    cfg = compose(config_name="config", overrides=job)
                    validate(cfg)
                except (HydraException, OmegaConfBaseException, ConfigError) as e:
                    print(f"error: {one_line(e)}", file=sys.stderr)
                    sys.exit(2)
                variant = tuple(o for o in job if o.split("=", 1)[0].lstrip("+~") not in PER_RUN)
                out.append(Job(stage, rank, variant, job, cfg))
    return out


def finished(path: Path, config: dict) -> bool:
    """The run in `path` is finished with these settings (any other case, src/run.py handles and explains)."""
    try:
        done = json.loads((path / RESULTS).read_text())
        return done.get("status") == "finished" and not mismatch(done["config"], config)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return False


class Pool:
    """The study's runs on a local machine, `slots` at once: each job starts when a slot is free and its
    variant's earlier stages have ended. A job that needs no training (finished, nothing to widen, no rate
    to take) is settled here without a process; the others run as `src/run.py` with the job's overrides."""

    def __init__(self, plan: list[Job], slots: int, study_dir: Path, threads: int):
        self.plan, self.slots, self.study_dir, self.threads = plan, slots, study_dir, threads
        self.pending, self.running, self.ended = list(plan), {}, set()  # running: Popen -> job; ended: ids
        self.status, self.trained, self.settled, self.stopped = 0, 0, 0, None

    def ready(self, job: Job) -> bool:
        return all(id(o) in self.ended for o in self.plan if o.variant == job.variant and o.rank < job.rank)

    def settle(self, job: Job) -> int | None:
        """The job's exit status when it needs no process, else None. Mirrors src/run.py's choice of rate."""
        config = to_container(job.cfg)
        try:
            lr = stage_lr(self.study_dir, config)
        except ProtocolError as e:  # this variant alone has no rate: the others go on, the status says so
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        if lr is None:
            print(f"study: {nothing_to_widen(config)}", flush=True)
            return 0
        config["train"]["lr"] = lr
        path = self.study_dir / run_name(config)
        if not job.cfg.train.rerun and finished(path, config):
            print(f"study: {path} is finished; train.rerun=true runs it again", flush=True)
            return 0
        return None

    def command(self, job: Job) -> list[str]:
        threads = [f"train.threads={self.threads}"] if self.threads else []
        return [sys.executable, str(ROOT / "src" / "run.py"), *job.overrides, f"hydra.run.dir={self.study_dir}", *threads]

    def start(self, job: Job) -> None:
        print(f"study: stage {job.stage}: src/run.py {' '.join(job.overrides)}", flush=True)
        self.running[subprocess.Popen(self.command(job))] = job

    def end(self, job: Job, code: int) -> None:
        self.ended.add(id(job))
        self.status = worst(self.status, code)
        if code not in (0, 2, DIVERGED) and self.stopped is None:  # a crash or a signal: start nothing more
            self.stopped = code
            print(f"study: a run ended with exit status {code}; starting no more runs, waiting for the others",
                  file=sys.stderr, flush=True)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            while self.pending or self.running:
                for job in [j for j in self.pending if self.ready(j)]:
                    if self.stopped is not None or len(self.running) >= self.slots:
                        break
                    self.pending.remove(job)
                    code = self.settle(job)
                    if code is None:
                        self.start(job)
                        self.trained += 1
                    else:
                        self.end(job, code)
                        self.settled += 1
                if self.stopped is not None and not self.running:
                    break
                time.sleep(0.5 if self.running else 0)
                for child, job in list(self.running.items()):
                    if child.poll() is not None:
                        del self.running[child]
                        self.end(job, exit_status(child.returncode))
        except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C or SIGTERM: every run stops at its last epoch
            for child in self.running:
                child.send_signal(signal.SIGTERM)
            for child in self.running:
                child.wait()
            sys.exit(130 if isinstance(e, KeyboardInterrupt) else e.code)
        print(f"study: {self.trained} runs started, {self.settled} needed none", flush=True)
        return self.status


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides and sweeps, as for src/run.py -m")
    parser.add_argument("--wandb", action="store_true", help="log the report to W&B as well")
    args = parser.parse_args(argv)
    args.overrides = with_device_preset(args.overrides)
    cfg = composed(args.overrides)
    study_dir = Path(cfg.hydra.sweep.dir)
    cores = len(os.sched_getaffinity(0))
    slots = jobs_at_once(cfg.hydra.launcher, cores)
    status = 0
    if slots is not None:  # a local launcher: the study schedules the jobs itself
        threads = cfg.train.threads or job_threads(cfg.hydra.launcher, cores)
        status = Pool(jobs(args.overrides), slots, study_dir, threads).run()
        if status not in (0, 2, DIVERGED):
            sys.exit(status)
    else:
        plan = stages(args.overrides)
        for i, (name, stage) in enumerate(plan):
            print(f"study: stage {name}: src/run.py -m {' '.join(stage)}", flush=True)
            code = exit_status(subprocess.run([*RUN, *stage]).returncode)
            # 3: some runs diverged, which the rate choice counts as lost. Anything else stops before the final
            # stage; after it (a variant with no rate to take, a damaged run folder), the report still shows
            # what finished, and the exit status says that something did not.
            if code not in (0, DIVERGED) and i < len(plan) - 1:
                sys.exit(code)
            status = worst(status, code)
    report = [sys.executable, "-m", "batchrnn.report", str(study_dir)] + ["--wandb"] * args.wandb
    status = worst(status, exit_status(subprocess.run(report).returncode))
    print(f"study: report in {study_dir / 'report.md'}")
    sys.exit(status)


if __name__ == "__main__":
    main()
