"""A study under the fair protocol, in one resumable command: tune each variant's rate, then its seeds.

    python -m batchrnn.study experiment=an4_cpu model.rnn=gru,lstm model.bn=none,input,seqwise [--wandb]
    python -m batchrnn.study experiment=an4_depth then experiment=an4_cpu model.bn=ln,wn   # two studies

Several studies joined by `then` share one schedule: the first one's runs go first, and a later one's fill
the slots that the first leaves free; each study folder's report is written once every run in it has ended.

Stage tune sweeps every variant over protocol.lrs with protocol.tune_seeds; stage widen (protocol.widen
times) tunes each variant whose best rate is an edge of its grid at one rate past it; stage augment (with
protocol.tune_spec_augment) trains the tuning seeds at each variant's chosen rate with SpecAugment off; stage
patience (protocol.tune_patience times) trains them at the chosen settings with the schedule's waits and cap
doubled, again while the more patient wins; stage final runs protocol.seeds at the settings each variant's
validation WER chose
(batchrnn.study.protocol.choose_lrs); then the report. Finished runs are skipped, so running it again resumes;
a tuning run at the chosen settings is that seed's final run. Under a local launcher (the basic one, or hydra/launcher=parallel's n_jobs at once) the
study schedules the runs itself: a job waits only for its own variant's earlier stages, so a free slot
never idles while another variant finishes a stage. A cluster launcher (submitit) gets each stage as one
sweep, a job array, stage after stage.
"""
import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from batchrnn.config import ConfigError, register_configs, to_container, with_device_preset
from batchrnn.validation import validate
from batchrnn.errors import DIVERGED, one_line, worst
from batchrnn.study.protocol import ProtocolError, can_widen, nothing_to_train, stage_settings
from batchrnn.training.identity import run_name, variant_key
from batchrnn.study.sweep import STOP_FILE, job_threads, jobs_at_once

ROOT = Path(__file__).resolve().parents[3]
RUN = [sys.executable, str(ROOT / "src" / "run.py"), "-m"]


def composed(overrides: list[str]):
    """The composed config with Hydra's own section, from the overrides that are not sweeps. A refused override
    ends the study in one line, before any run."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=fixed, return_hydra_config=True)
            validate(compose(config_name="config", overrides=fixed))
    except (HydraException, OmegaConfBaseException, ConfigError) as e:  # before any run: one line, as run.py
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    return cfg


def as_list(values) -> str:
    return ",".join(str(v) for v in values)


def stages(overrides: list[str], cfg: DictConfig | None = None) -> list[tuple[str, list[str]]]:
    """(name, the run.py -m arguments) of each stage, in order; cfg: the study's composed(overrides), if at hand."""
    p = (cfg or composed(overrides)).protocol
    if not p.lrs:
        return [("runs", [*overrides, f"seed={as_list(p.seeds)}"])]
    widen = [(f"widen {i}" if p.widen > 1 else "widen",
              [*overrides, "protocol.stage=widen", f"seed={as_list(p.tune_seeds)}"])
             for i in range(1, p.widen + 1)] if can_widen(p.lrs) else []
    augment = [("augment", [*overrides, "protocol.stage=augment", f"seed={as_list(p.tune_seeds)}"])
               ] if p.tune_spec_augment else []
    patience = [(f"patience {i}" if p.tune_patience > 1 else "patience",
                 [*overrides, "protocol.stage=patience", f"seed={as_list(p.tune_seeds)}"])
                for i in range(1, p.tune_patience + 1)]
    return [("tune", [*overrides, "protocol.stage=tune", f"train.lr={as_list(p.lrs)}",
                      f"seed={as_list(p.tune_seeds)}"]),
            *widen, *augment, *patience, ("final", [*overrides, "protocol.stage=final", f"seed={as_list(p.seeds)}"])]


def exit_status(code: int) -> int:
    """A child's return code as a shell would show it: killed by signal N (-N) is 128 + N."""
    return 128 - code if code < 0 else code


@dataclass
class Job:
    stage: str  # the stage's name: tune, widen [i], augment, patience [i], final
    rank: int  # the stage's place: a job waits until its variant's jobs of lower rank have ended
    variant: str  # what the tuning chooses for (identity.variant_key): every setting but the seed, rate (SpecAugment)
    overrides: list[str]  # one run's, as a sweep of the stage would give that job
    cfg: DictConfig  # composed from them and validated, before any job runs
    study_dir: Path  # the study's folder, where the run's own folder goes (resolved)
    group: int = 0  # which of the studies joined by `then` it belongs to

    def waits_for(self, other: "Job") -> bool:
        """Whether this job may start only once `other` has ended: a job of its own variant in an earlier stage
        of its study; in another study of the schedule that shares its folder, or whose folder it takes
        finished runs from (protocol.reuse_from), in the same stage or an earlier one, so that one run is
        never trained twice, nor at once by two processes."""
        if other.variant != self.variant or other is self:
            return False
        if other.group == self.group:
            return other.rank < self.rank
        source = Path(self.cfg.protocol.reuse_from).resolve() if self.cfg.protocol.reuse_from else None
        return other.group < self.group and other.study_dir in (self.study_dir, source) and other.rank <= self.rank


def expand(overrides: list[str]) -> list[list[str]]:
    """One list of overrides per job of a sweep, in the order Hydra's basic sweeper gives them: a key's
    last value wins, keys keep their first place, the first key varies slowest."""
    by_key = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise HydraException(f"{o.input_line}: a study sweeps lists and ranges only (a,b,c or range(...)), "
                                 "not intervals")
        by_key[key] = ([f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                       else [f"{key}={o.get_value_element_as_str()}"])
    return [list(job) for job in itertools.product(*by_key.values())]


def jobs(overrides: list[str], group: int = 0, cfg: DictConfig | None = None) -> list[Job]:
    """Every job of every stage, in the order the stages' sweeps would run them: each stage's overrides
    (and the preset's hydra.sweeper.params, before them as Hydra puts them) expanded as Hydra's sweeper does.
    Each is composed and validated here, so a bad value anywhere in a sweep stops the study before any run.
    cfg: the study's composed(overrides), if at hand."""
    cfg = cfg or composed(overrides)
    params, study_dir = cfg.hydra.sweeper.params or {}, Path(cfg.hydra.sweep.dir).resolve()
    swept = [f"{key}={value}" for key, value in params.items()]
    out, plan = [], stages(overrides, cfg)
    from batchrnn.data.corpus import DataError  # torch: once the study's own overrides are checked
    from batchrnn.data.manifest import pin_content

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for rank, (stage, args) in enumerate(plan):
            try:
                for job in expand(swept + args):
                    cfg = compose(config_name="config", overrides=job)
                    validate(cfg)
                    pin_content(cfg.data)  # the manifests' hash, which names the run as src/run.py names it
                    out.append(Job(stage, rank, variant_key(to_container(cfg)), job, cfg, study_dir, group))
            except (HydraException, OmegaConfBaseException, ConfigError, DataError) as e:
                print(f"error: {one_line(e)}", file=sys.stderr)
                sys.exit(2)
    return out


class Pool:
    """The study's runs on a local machine, `slots` at once: each job starts when a slot is free and its
    variant's earlier stages have ended, earlier jobs of the plan first. A job that needs no training
    (finished, nothing to widen, no rate to take) is settled here without a process; the others run as
    `src/run.py` with the job's overrides. Each study folder's report is made once its jobs have ended."""

    def __init__(self, plan: list[Job], slots: int, threads: int, report=None, ranks: int = 1):
        self.plan, self.slots, self.threads, self.report = plan, slots, threads, report or (lambda study_dir: 0)
        self.ranks = ranks  # data-parallel processes per run (--ranks): each run started by torchrun
        self.pending, self.running, self.ended = list(plan), {}, set()  # running: Popen -> job; ended: ids
        self.earlier = {id(job): [id(o) for o in plan if job.waits_for(o)] for job in plan}
        self.status, self.trained, self.settled, self.stopped = 0, 0, 0, None

    def ready(self, job: Job) -> bool:
        return all(i in self.ended for i in self.earlier[id(job)])

    def settle(self, job: Job) -> int | None:
        """The job's exit status when it needs no process, else None. Mirrors src/run.py's choice of rate."""
        config = to_container(job.cfg)
        try:
            chosen = stage_settings(job.study_dir, config)
        except ProtocolError as e:  # this variant alone has no rate: the others go on, the status says so
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        if chosen is None:
            print(f"study: {nothing_to_train(config)}", flush=True)
            return 0
        cfg = job.cfg.copy()
        for key, value in chosen.items():
            OmegaConf.update(cfg, key, value)
        config = to_container(cfg)
        path = job.study_dir / run_name(config)
        from batchrnn.training.rundir import finished_run  # torch, which a refused override need not wait for

        if not job.cfg.train.rerun and finished_run(path, config) is not None:
            print(f"study: {path} is finished; train.rerun=true runs it again", flush=True)
            return 0
        return None

    def command(self, job: Job) -> list[str]:
        threads = [f"train.threads={self.threads}"] if self.threads and not job.cfg.train.threads else []
        ranks = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.ranks}"] * (self.ranks > 1)
        # the child resolves the study's folder from its own overrides, as a sweep's job would
        return [sys.executable, *ranks, str(ROOT / "src" / "run.py"), *job.overrides,
                "hydra.run.dir=${hydra.sweep.dir}", *threads]

    def start(self, job: Job) -> None:
        print(f"study: stage {job.stage}: src/run.py {' '.join(job.overrides)}", flush=True)
        self.running[subprocess.Popen(self.command(job), env=os.environ | {STOP_FILE: str(self.stop_file)})] = job

    def end(self, job: Job, code: int) -> None:
        self.ended.add(id(job))
        self.status = worst(self.status, code)
        if self.stopped is None and self.stop_file.exists():  # bad settings or no corpus: every run would fail
            self.stopped = code
            print(f"study: starting no more runs: every one would stop on the error above "
                  f"({self.stop_file.read_text().strip()})", file=sys.stderr, flush=True)
        elif code not in (0, 2, DIVERGED) and self.stopped is None:  # a crash or a signal: start nothing more
            self.stopped = code
            print(f"study: a run ended with exit status {code}; starting no more runs, waiting for the others",
                  file=sys.stderr, flush=True)
        if self.stopped is None and all(id(o) in self.ended for o in self.plan if o.study_dir == job.study_dir):
            self.status = worst(self.status, self.report(job.study_dir))

    def step(self) -> None:
        """Starts (or settles) every ready job that a free slot allows, then collects the runs that ended."""
        while self.stopped is None and len(self.running) < self.slots:
            # the plan's first ready job, looked for again after each: one settled here can make the next one
            # of its variant ready, and that goes before a later study's jobs
            job = next((j for j in self.pending if self.ready(j)), None)
            if job is None:
                break
            self.pending.remove(job)
            code = self.settle(job)
            if code is None:
                self.start(job)
                self.trained += 1
            else:
                self.end(job, code)
                self.settled += 1
        time.sleep(0.5 if self.running else 0)
        for child, job in list(self.running.items()):
            if child.poll() is not None:
                del self.running[child]
                self.end(job, exit_status(child.returncode))

    def run(self) -> int:
        """Every job of the plan, or until a run crashes; the worst exit status (errors.worst)."""
        self.stop_file = Path(tempfile.mkdtemp(prefix="batchrnn-study-")) / "stop"  # a run's record_stop writes it
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            while (self.pending and self.stopped is None) or self.running:
                self.step()
        except KeyboardInterrupt:  # Ctrl-C: every run stops at its last complete epoch
            self.stop_all(signal.SIGINT)
            sys.exit(130)
        except SystemExit as e:  # SIGTERM: likewise
            self.stop_all(signal.SIGTERM)
            sys.exit(e.code)
        finally:
            signal.signal(signal.SIGTERM, previous)
            shutil.rmtree(self.stop_file.parent, ignore_errors=True)
        print(f"study: {self.trained} runs started, {self.settled} needed none", flush=True)
        return self.status

    def stop_all(self, signum: int) -> None:
        """The signal reached the runs too when it came to the process group (a terminal's Ctrl-C, kill -- -PGID):
        a run told twice could cut its own clean-up short, so only one still going after 5 s is told."""
        deadline = time.monotonic() + 5
        while any(child.poll() is None for child in self.running) and time.monotonic() < deadline:
            time.sleep(0.1)
        for child in self.running:
            if child.poll() is None:
                child.send_signal(signum)
        for child in self.running:
            child.wait()


def report(study_dir: Path, wandb: bool) -> int:
    code = exit_status(subprocess.run([sys.executable, "-m", "batchrnn.report", str(study_dir)]
                                      + ["--wandb"] * wandb).returncode)
    print(f"study: report in {study_dir / 'report.md'}", flush=True)
    return code


def staged(overrides: list[str], cfg: DictConfig, wandb: bool) -> int:
    """One study (cfg: its composed overrides) as a sweep per stage, stage after stage (a cluster launcher's
    job arrays), then its report."""
    status, plan, study_dir = 0, stages(overrides, cfg), Path(cfg.hydra.sweep.dir)
    for i, (name, stage) in enumerate(plan):
        print(f"study: stage {name}: src/run.py -m {' '.join(stage)}", flush=True)
        code = exit_status(subprocess.run([*RUN, *stage]).returncode)
        # 3: some runs diverged, which the rate choice counts as lost. Anything else stops before the final
        # stage; after it (a variant with no rate to take, a damaged run folder), the report still shows
        # what finished, and the exit status says that something did not.
        if code not in (0, DIVERGED) and i < len(plan) - 1:
            return code
        status = worst(status, code)
    return worst(status, report(study_dir, wandb))


def split_studies(argv: list[str]) -> list[list[str]]:
    """The overrides of each study, from a command line that joins studies with `then`."""
    groups = [[]]
    for a in argv:
        if a == "then":
            groups.append([])
        else:
            groups[-1].append(a)
    if any(not g for g in groups) and len(groups) > 1:
        print("error: `then` joins two studies: each side needs its overrides (experiment=... and the rest)",
              file=sys.stderr)
        sys.exit(2)
    return [with_device_preset(g) for g in groups]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides and sweeps, as for src/run.py -m; `then` "
                        "between two studies' overrides runs both in one schedule")
    parser.add_argument("--wandb", action="store_true", help="log each report to W&B as well")
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel processes per run on this machine, each "
                        "run started by torchrun (under hydra/launcher=slurm: hydra.launcher.tasks_per_node instead)")
    args = parser.parse_intermixed_args(argv)
    studies = split_studies(args.overrides)
    cfgs = [composed(study) for study in studies]  # every study's overrides refused before any run, if bad
    cores, launcher = len(os.sched_getaffinity(0)), cfgs[0].hydra.launcher
    if len({cfg.hydra.launcher.get("_target_") for cfg in cfgs}) > 1:
        print("error: studies joined by `then` share one schedule, so they need one launcher (hydra/launcher=...); "
              "give each the same, or run them as separate commands", file=sys.stderr)
        sys.exit(2)
    slots = jobs_at_once(launcher, cores)
    if args.ranks > 1 and slots is None:
        print("error: --ranks starts each run with torchrun on this machine; under a cluster launcher give "
              "hydra.launcher.tasks_per_node=N and hydra.launcher.gpus_per_node=N instead", file=sys.stderr)
        sys.exit(2)
    if slots is None:  # a cluster launcher: each study's stages as job arrays, one study after the other
        status = 0
        for study, cfg in zip(studies, cfgs):
            code = staged(study, cfg, args.wandb)
            if code not in (0, 2, DIVERGED):  # a crash or a signal stops them all; 2 and 3 are counted
                sys.exit(code)
            status = worst(status, code)
        sys.exit(status)
    plan = [job for i, (study, cfg) in enumerate(zip(studies, cfgs)) for job in jobs(study, i, cfg)]
    sys.exit(Pool(plan, slots, job_threads(launcher, cores, args.ranks), lambda d: report(d, args.wandb),
                  args.ranks).run())


if __name__ == "__main__":
    main()
