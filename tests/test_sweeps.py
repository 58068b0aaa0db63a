"""Sweeps: the seed changes init and batch order, the report pools seeds, parallel launchers (joblib and
submitit's local executor) give the serial sweep's results, and the depth study composes."""
import json
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from batchrnn.study import report
from batchrnn.training import loop as train_module
from batchrnn.errors import worst
from batchrnn.study.sweep import FAILED_DIR, SweepStatus, job_threads
from batchrnn.training.rundir import RESULTS
from batchrnn.training.loop import Progress, Run, train_epoch
from batchrnn.tracking.tracker import Tracker
from conftest import ROOT

# What may differ between two runs of the same job: the clock, the memory, the machine.
TIMING = {"epoch_time_s", "peak_mem_mb", "utt_per_s", "device", "torch_version"}


def run_sweep(sweep_dir, *overrides) -> dict[str, dict]:
    """{run folder name: results} of `run.py -m experiment=smoke model.bn=seqwise seed=1,2 ...`: two jobs."""
    cmd = [sys.executable, str(ROOT / "src" / "run.py"), "-m", "experiment=smoke", "model.bn=seqwise", "seed=1,2",
           f"hydra.sweep.dir={sweep_dir}", *overrides]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.rglob(RESULTS)}


def leaves(x, path="") -> dict:
    """{"/epochs/0/train_loss": 3.2, ...}: a results file flattened, timing and memory left out."""
    if isinstance(x, dict):
        return {k: v for key, value in x.items() if key not in TIMING
                for k, v in leaves(value, f"{path}/{key}").items()}
    if isinstance(x, list):
        return {k: v for i, value in enumerate(x) for k, v in leaves(value, f"{path}/{i}").items()}
    return {path: x}


@pytest.fixture(scope="module")
def serial(tmp_path_factory, smoke_root):
    """The two jobs one after the other in one process: what a parallel sweep must reproduce. Run first,
    it also builds the smoke corpus, so parallel jobs never build it at the same time."""
    sweep_dir = tmp_path_factory.mktemp("serial")
    return sweep_dir, run_sweep(sweep_dir, f"data.root={smoke_root}")


def test_seed_changes_init_and_batch_order(make_config, smoke_root, tmp_path, monkeypatch):
    make_batches = train_module.make_batches
    weights, orders = [], []
    for seed in (1, 2):
        cfg = make_config("experiment=smoke", f"data.root={smoke_root}", f"seed={seed}")
        run = Run(cfg)
        weights.append(torch.cat([p.detach().flatten() for p in run.model.parameters()]))
        calls = []
        monkeypatch.setattr(train_module, "make_batches",
                            lambda *a, **k: calls.append(make_batches(*a, **k)) or calls[-1])
        train_epoch(run, Progress(epoch=2), Tracker())  # epoch 1 is SortaGrad's, in length order whatever the seed
        orders.append(calls[0])
    assert not torch.equal(*weights)
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])  # the same batches, reordered


def test_report_pools_the_seeds_of_a_variant(serial, tmp_path):
    sweep_dir, results = serial
    assert [name.split("-")[:5] for name in sorted(results)] == [["gru", "seqwise", "L2", "lr0.003", "s1"],
                                                                  ["gru", "seqwise", "L2", "lr0.003", "s2"]]
    first, second = (results[name] for name in sorted(results))
    assert first["epochs"] != second["epochs"]
    report.write_report(sweep_dir, tmp_path)
    (row,) = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert (row["label"], row["n"], row["seeds"]) == ("gru-seqwise", 2, [1, 2])
    assert row["test_wer_std"] is not None


@pytest.mark.parametrize("launcher", ["parallel", "slurm_local"])
def test_parallel_sweep_gives_the_serial_results(serial, launcher, smoke_root, tmp_path):
    # train.threads=0: each job takes its share of the cores. n_jobs = cores makes that share 1 thread, as
    # in the serial sweep (smoke sets 1), so the arithmetic is the same; slurm_local asks for 1 CPU a task.
    cores = len(os.sched_getaffinity(0))
    extra = [f"hydra.launcher.n_jobs={cores}"] if launcher == "parallel" else []
    parallel = run_sweep(tmp_path, f"hydra/launcher={launcher}", "train.threads=0", f"data.root={smoke_root}", *extra)
    _, serial_results = serial
    assert parallel.keys() == serial_results.keys()
    for name, result in parallel.items():
        assert result["status"] == "finished" and result["config"]["train"]["threads"] == 1
        assert leaves(result) == pytest.approx(leaves(serial_results[name]), abs=1e-6)


def launcher_config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True).hydra.launcher


@pytest.mark.parametrize(
    "overrides,cores,threads",
    [
        (["hydra/launcher=parallel"], 16, 8),  # n_jobs 2
        (["hydra/launcher=parallel", "hydra.launcher.n_jobs=3"], 2, 1),  # never 0
        (["hydra/launcher=joblib"], 16, 1),  # the plugin's own default, n_jobs=-1: one job per core
        (["hydra/launcher=joblib", "hydra.launcher.n_jobs=-3"], 16, 1),  # 14 at once
        (["hydra/launcher=slurm"], 64, 8),  # cpus_per_task
        (["hydra/launcher=slurm_local"], 16, 1),
        ([], 16, 0),  # the basic launcher: one job at a time, torch's default
    ],
)
def test_parallel_jobs_share_the_cores(overrides, cores, threads):
    assert job_threads(launcher_config(*overrides), cores) == threads


def test_launcher_configs_extend_the_plugins():
    slurm = launcher_config("hydra/launcher=slurm", "hydra.launcher.partition=gpu")
    assert slurm._target_.endswith("SlurmLauncher") and slurm.partition == "gpu" and slurm.gpus_per_node == 1
    assert launcher_config("hydra/launcher=slurm_local")._target_.endswith("LocalLauncher")
    assert launcher_config("hydra/launcher=parallel").n_jobs == 2


def test_depth_study_is_the_cpu_preset_swept_over_depth_and_bn():
    def composed(experiment):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose(config_name="config", overrides=[f"experiment={experiment}"], return_hydra_config=True)

    depth, cpu = composed("an4_depth"), composed("an4_cpu")
    assert OmegaConf.to_container(depth.hydra.sweeper.params) == {"model.num_layers": "1,3,5,7",
                                                                  "model.bn": "none,seqwise"}
    assert depth.study == "an4_depth"
    for key in ("data", "model", "train", "logger", "seed"):
        assert depth[key] == cpu[key], key


def test_a_sweep_exits_with_its_worst_job_status_not_the_largest(tmp_path):
    """A job that diverged (3) and one that could not run (2: a damaged folder, a variant with no rate) in one
    sweep: the sweep says 2, the one a user must act on; a crash or a signal says more than either."""
    assert [worst(0, 3), worst(3, 2), worst(2, 3), worst(2, 1), worst(143, 2), worst(0, 0)] == [3, 2, 2, 2, 143, 0]
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}, "overrides": {"hydra": []}}})
    sweep = SweepStatus()
    sweep.on_multirun_start(config)
    (tmp_path / FAILED_DIR / sweep.sweep).mkdir(parents=True)
    for job, status in ((0, 3), (1, 2), (2, 3)):
        (tmp_path / FAILED_DIR / sweep.sweep / str(job)).write_text(f"{status}\n")
    with pytest.raises(SystemExit) as stop:
        sweep.on_multirun_end(config)
    assert stop.value.code == 2
