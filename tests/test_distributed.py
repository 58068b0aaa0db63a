"""Data-parallel training on the CPU with gloo: 2 ranks started by torchrun (and by submitit's local executor with 2
tasks) compute what one process computes, gradients and BatchNorm's synchronised moments included; ranks killed
with -9 resume; a rank that stops answering ends the others with a clear error, not a hang."""
import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from batchrnn.config import ConfigError, to_container
from batchrnn.study import report
from batchrnn.study.scheduler import Pool, jobs
from batchrnn.study.sweep import job_threads
from batchrnn.training import distributed
from batchrnn.training.identity import run_name
from batchrnn.training.loop import train
from batchrnn.training.rundir import BEST, CHECKPOINT, LOG, RESULTS
from conftest import ROOT
from planted_fault import FAULTS
from ranks_gradient import gloo_threads, gradients
from test_sweeps import launcher_config

TORCHRUN = ([str(Path(sys.executable).with_name("torchrun"))] if Path(sys.executable).with_name("torchrun").exists()
            else [sys.executable, "-m", "torch.distributed.run"])
RANKS = [*TORCHRUN, "--standalone", "--nproc_per_node=2"]
RUN = [*RANKS, str(ROOT / "src" / "run.py")]
VARIANTS = ["none", "input", "post", "seqwise", "ln"]
AUGMENT = ["model.bn=seqwise", "train.spec_augment.per_utterance=true", "train.spec_augment.freq_masks=2",
           "train.spec_augment.time_masks=2"]


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=smoke", *overrides])


def ranks(*args: str, timeout=300) -> subprocess.CompletedProcess:
    """src/run.py under `torchrun --standalone --nproc_per_node=2`."""
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=timeout)


def workers(agent: int) -> dict[int, int]:
    """{rank: pid} of a torchrun agent's worker processes."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            env = (stat.parent / "environ").read_bytes().split(b"\0") if ppid == agent else []
        except (OSError, IndexError):
            continue
        found |= {int(e[5:]): int(stat.parent.name) for e in env if e.startswith(b"RANK=")}
    return found


def wait_for(condition, what: str, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.05)


def rank_logs(study: Path) -> list[str]:
    """The texts of a 2-rank run's logs, rank 0's first (none until they exist)."""
    return [p.read_text() for p in (*study.glob(f"*/{LOG}"), *study.glob("*/rank1.log"))]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, smoke_root) -> Path:
    """A study folder of 2-rank runs: the five variants as one torchrun sweep, and seqwise with SpecAugment."""
    study = tmp_path_factory.mktemp("ranks")
    common = ["experiment=smoke", f"data.root={smoke_root}", "train.epochs=3"]
    swept = ranks("-m", *common, f"model.bn={','.join(VARIANTS)}", f"hydra.sweep.dir={study}")
    augmented = ranks(*common, *AUGMENT, f"hydra.run.dir={study}")
    for run in (swept, augmented):
        assert run.returncode == 0, run.stderr[-3000:]
        assert distributed.HELD not in run.stderr  # freed at exit, its threads ended (leave)
    return study


def state(path: Path) -> dict:
    return torch.load(path / CHECKPOINT, weights_only=False)["model"]


# One process with each batch's utterances in another order: the same sums in real arithmetic, in another float32
# order, as 2 ranks sum them (strided: each rank's share in turn). How far these runs drift apart is how far rounding
# carries on this machine: a weight whose gradient is within rounding of 0 takes AdamW's first step of the rate's
# size either way (on an Intel Xeon, gru-none's rnns.1.bias_ih[1, 70] at -5.8e-8), a branch of the trajectory. The
# first conv's bias, which its BatchNorm takes away, has a gradient of rounding alone: it, and the running mean that
# follows it, wander so, and eval's running mean lags it, so validation loss drifts too.
ORDERS = {"reversed": lambda indices: indices[::-1], "strided": lambda indices: indices[0::2] + indices[1::2]}
# The 2-rank run must lie within SPREAD times the largest distance between those runs (plus ULPS of the value, for
# what they happen to compute alike). On an AMD EPYC with AVX-512 (Zen 4) it lay within 3 times that distance, every
# variant (input's third validation loss); each planted fault (tests/planted_fault.py) 2.6e3 times or more, in its
# farthest quantity. 30 leaves a factor of 10 to another CPU's rounding either way.
SPREAD = 30
ULPS = 64 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, smoke_root):
    """trained(*overrides) -> (the run's name, [(results, model state)] of one process, each batch in its own order,
    then in each of ORDERS'), 3 smoke epochs; trained once per module."""
    found = {}

    def trained(*overrides: str):
        if overrides not in found:
            cfg = config(f"data.root={smoke_root}", "train.epochs=3", *overrides)
            name, runs = run_name(to_container(cfg)), []
            for order in [None, *ORDERS.values()]:
                folder = tmp_path_factory.mktemp("one") / name
                with pytest.MonkeyPatch.context() as m:
                    if order:
                        m.setattr(distributed, "share", order)  # one process: its batch is its share
                    runs.append((train(cfg, folder), state(folder)))
            found[overrides] = name, runs
        return found[overrides]

    return trained


def share_of_bound(theirs, values: list, scale: float) -> float:
    """How far the 2 ranks' number or tensor lies from one process's (values[0]), as a share of its bound: SPREAD
    times the largest distance between the one-process values (each batch summed in its own order and ORDERS'),
    plus ULPS of scale. Over 1: outside."""
    def distance(a, b) -> float:
        return float((a.double() - b.double()).abs().max()) if torch.is_tensor(a) else abs(a - b)

    spread = max(distance(a, b) for a, b in itertools.combinations(values, 2))
    return distance(theirs, values[0]) / (SPREAD * spread + ULPS * scale)


def against_bounds(runs: list[tuple[dict, dict]], two: tuple[dict, dict]) -> dict[str, float]:
    """share_of_bound of a 2-rank run (results, model state) against one process's runs, in each epoch's losses and
    each weight and buffer."""
    found, (results, model) = {}, two
    for i, epoch in enumerate(results["epochs"]):
        for key in ("train_loss", "val_loss"):
            values = [r["epochs"][i][key] for r, _ in runs]
            found[f"epoch {i + 1} {key}"] = share_of_bound(epoch[key], values, abs(values[0]))
    for key, value in runs[0][1].items():
        if value.is_floating_point():
            found[key] = share_of_bound(model[key], [m[key] for _, m in runs], max(1.0, float(value.abs().max())))
    return found


def farthest(shares: dict[str, float]) -> str:
    what = max(shares, key=shares.get)
    return f"{what} at {shares[what]:.3g} of its bound"


@pytest.mark.parametrize("overrides", [[f"model.bn={bn}"] for bn in VARIANTS] + [AUGMENT],
                         ids=VARIANTS + ["seqwise-specaugment"])
def test_two_ranks_train_what_one_process_trains(two_ranks, one_process, overrides):
    name, runs = one_process(*overrides)
    one = runs[0][0]
    two_dir = two_ranks / name  # the same folder name: N ranks train the same run
    two = json.loads((two_dir / RESULTS).read_text())
    assert (two["status"], two["world_size"], one["world_size"]) == ("finished", 2, 1)
    shares = against_bounds(runs, (two, state(two_dir)))
    assert max(shares.values()) <= 1, {what: share for what, share in shares.items() if share > 1}
    print(f"{name}: the farthest from one process, {farthest(shares)}")
    assert [u["id"] for u in two["test_utterances"]] == [u["id"] for u in one["test_utterances"]]
    # rank 0 alone wrote the run's files; rank 1 its log
    assert sorted(p.name for p in two_dir.iterdir()) == sorted([".lock", BEST, CHECKPOINT, RESULTS, LOG, "rank1.log"])
    assert "epoch 3:" in (two_dir / "rank1.log").read_text()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_rank_that_drops_or_double_counts_a_share_or_leaves_a_moment_unsynced_is_caught(
        one_process, smoke_root, tmp_path, fault):
    """The comparison above can fail: 2 ranks with a fault planted (tests/planted_fault.py) lie outside it."""
    name, runs = one_process("model.bn=none")
    run = subprocess.run([*RANKS, str(ROOT / "tests" / "planted_fault.py"), fault, "experiment=smoke",
                          f"data.root={smoke_root}", "train.epochs=3", "model.bn=none", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    shares = against_bounds(runs, (json.loads((tmp_path / name / RESULTS).read_text()), state(tmp_path / name)))
    assert max(shares.values()) > 10, farthest(shares)  # outside by a margin that another CPU's rounding cannot hide
    print(f"{fault}: {sum(share > 1 for share in shares.values())} of {len(shares)} outside, {farthest(shares)}")


def test_two_ranks_compute_the_gradient_of_one_process(tmp_path, smoke_root):
    """One step's gradient and BatchNorm running moments, each variant, through the synchronised moments' backward:
    a batch of 7 (shares of 4 and 3, ragged), and one of a single utterance, where rank 1 has no share. Then each
    rank leaves the process group as its exit handler does: gloo's worker threads end before the interpreter does
    (a thread freeing a collective's tensors during finalization aborted a rank, distributed.leave)."""
    variants = [[f"model.bn={bn}", f"data.root={smoke_root}"] for bn in VARIANTS + ["skip"]]
    variants.append([*AUGMENT, f"data.root={smoke_root}"])
    run = subprocess.run([*RANKS, str(ROOT / "tests" / "ranks_gradient.py"), str(tmp_path / "grads.pt"),
                          json.dumps(variants)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):  # each rank left the group with gloo's worker threads ended, before the interpreter's end
        left = json.loads((tmp_path / f"grads.pt.rank{rank}.json").read_text())
        assert left == {"freed": True, "threads_during": 2, "threads_after": 0}, (rank, left)
    two = torch.load(tmp_path / "grads.pt")
    ones = [gradients(variants)]
    for order in ORDERS.values():  # the same steps with each batch's utterances summed in another order
        with pytest.MonkeyPatch.context() as m:
            m.setattr(distributed, "share", order)
            ones.append(gradients(variants))
    shares = {}
    for v, (overrides, two_found) in enumerate(zip(variants, two)):
        for batch, other in two_found.items():
            found = [one[v][batch] for one in ones]
            where = f"{overrides[0]} {batch}"
            shares[f"{where} loss"] = share_of_bound(other["loss"], [f["loss"] for f in found], abs(found[0]["loss"]))
            shares[f"{where} norm"] = share_of_bound(other["norm"], [f["norm"] for f in found], found[0]["norm"])
            for key in found[0]["grads"]:  # a gradient that is 0 in exact arithmetic has no scale but the whole's
                shares[f"{where} {key}.grad"] = share_of_bound(other["grads"][key], [f["grads"][key] for f in found],
                                                               found[0]["norm"])
            for key, buffer in found[0]["buffers"].items():
                shares[f"{where} {key}"] = share_of_bound(other["buffers"][key], [f["buffers"][key] for f in found],
                                                          max(1.0, float(buffer.double().abs().max())))
    assert max(shares.values()) <= 1, {what: share for what, share in shares.items() if share > 1}
    print(f"one step: the farthest from one process, {farthest(shares)}")


def test_submitit_local_with_two_tasks_trains_as_torchrun_does(two_ranks, smoke_root, tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "src" / "run.py"), "-m", "experiment=smoke", "model.bn=seqwise",
                          f"data.root={smoke_root}", "train.epochs=3", "hydra/launcher=slurm_local",
                          "hydra.launcher.tasks_per_node=2", "train.threads=0", f"hydra.sweep.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (found,) = tmp_path.glob(f"*/{RESULTS}")
    tasks, torchrun = json.loads(found.read_text()), json.loads((two_ranks / found.parent.name / RESULTS).read_text())
    assert (tasks["world_size"], tasks["threads"]) == (2, 1)  # cpus_per_task 1: a rank's threads
    assert [e["train_loss"] for e in tasks["epochs"]] == pytest.approx([e["train_loss"] for e in torchrun["epochs"]],
                                                                       rel=1e-9)
    assert (found.parent / "rank1.log").exists()


def test_ranks_killed_with_minus_9_resume_and_end_as_if_never_killed(tmp_path, smoke_root):
    args = ["experiment=smoke", f"data.root={smoke_root}", "train.epochs=6", "model.bn=seqwise"]
    whole = ranks(*args, f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    study = tmp_path / "killed"
    with open(tmp_path / "out.log", "w") as out:
        agent = subprocess.Popen([*RUN, *args, f"hydra.run.dir={study}"], stdout=out, stderr=subprocess.STDOUT)
        # the checkpoint is written before results.json: a kill between them would leave nothing to count epochs by
        wait_for(lambda: list(study.glob(f"*/{CHECKPOINT}")) and list(study.glob(f"*/{RESULTS}")),
                 "a checkpoint and its results", agent)
        for pid in workers(agent.pid).values():
            os.kill(pid, signal.SIGKILL)
        agent.kill()
        agent.wait(timeout=60)
    (run,) = (p.parent for p in study.glob(f"*/{CHECKPOINT}"))
    epochs = len(json.loads((run / RESULTS).read_text())["epochs"])
    assert 1 <= epochs < 6
    resumed = ranks(*args, f"hydra.run.dir={study}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in (run / LOG).read_text() and "resumed" in (run / "rank1.log").read_text()
    results, reference = (json.loads((d / RESULTS).read_text()) for d in (run, tmp_path / "whole" / run.name))
    assert results["status"] == "finished" and [e["epoch"] for e in results["epochs"]] == [1, 2, 3, 4, 5, 6]
    for key in ("train_loss", "val_loss", "val_wer"):
        assert [e[key] for e in results["epochs"]] == pytest.approx([e[key] for e in reference["epochs"]], rel=1e-6)
    assert results["test_wer"] == reference["test_wer"]


def test_a_rank_that_stops_answering_ends_the_others_with_a_clear_error(tmp_path, smoke_root):
    """SIGSTOP, not a kill: torchrun ends the siblings of a rank that died by itself, which would prove nothing."""
    study, timeout = tmp_path / "study", 20
    with open(tmp_path / "out.log", "w") as out:
        agent = subprocess.Popen([*RUN, "experiment=smoke", f"data.root={smoke_root}", f"hydra.run.dir={study}",
                                  "train.epochs=1000", f"train.dist_timeout_s={timeout}"],
                                 stdout=out, stderr=subprocess.STDOUT)
        logs = lambda: rank_logs(study)  # noqa: E731
        try:
            wait_for(lambda: len(logs()) == 2 and all("epoch 1:" in text for text in logs()), "epoch 1", agent)
            stopped = workers(agent.pid)[1]
            os.kill(stopped, signal.SIGSTOP)
            start = time.monotonic()
            wait_for(lambda: "error:" in logs()[0], "error from rank 0", agent, seconds=timeout + 60)
            elapsed = time.monotonic() - start
        finally:
            if "stopped" in locals():
                os.kill(stopped, signal.SIGKILL)
            agent.wait(timeout=120)
    errors = [line for line in logs()[0].splitlines() if "error:" in line]
    assert len(errors) == 1 and f"rank 0 of 2: another rank did not answer within train.dist_timeout_s={timeout} s" \
        in errors[0] and "Run the same command again to resume" in errors[0], errors
    assert timeout - 5 < elapsed < timeout + 30, elapsed
    assert agent.returncode != 0
    print(f"rank 0 ended {elapsed:.1f} s after rank 1 was stopped (train.dist_timeout_s={timeout})")


def test_a_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, smoke_root):
    """A signal reaches the ranks at different moments, or (here) only one of them. They agree on it at the next step
    (batchrnn.training.stopping.check), so every rank stops there as if signalled. Were rank 1 to leave alone, rank 0
    would end in the error of the test above, in its next collective ("another rank ... has gone": gloo sees the
    connection reset at once; another backend may wait for train.dist_timeout_s)."""
    study, timeout = tmp_path / "study", 300
    with open(tmp_path / "out.log", "w") as out:
        agent = subprocess.Popen([*RUN, "experiment=smoke", f"data.root={smoke_root}", f"hydra.run.dir={study}",
                                  "train.epochs=1000", f"train.dist_timeout_s={timeout}"],
                                 stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: len(rank_logs(study)) == 2 and all("epoch 1:" in t for t in rank_logs(study)), "epoch 1",
                     agent)
            os.kill(workers(agent.pid)[1], signal.SIGTERM)
            agent.wait(timeout=120)
        finally:
            if agent.poll() is None:
                for pid in workers(agent.pid).values():
                    os.kill(pid, signal.SIGKILL)
                agent.kill()
                agent.wait(timeout=60)
    for rank, text in enumerate(rank_logs(study)):
        assert "stopped by SIGTERM" in text and "error:" not in text, (rank, text[-3000:])
    (run,) = (p.parent for p in study.glob(f"*/{CHECKPOINT}"))
    results = json.loads((run / RESULTS).read_text())
    assert results["status"] == "running" and len(results["epochs"]) >= 1  # it resumes from its last epoch


@pytest.mark.parametrize("abandoned", [False, True])
def test_leaving_ends_gloos_threads_unless_a_run_raised(tmp_path, monkeypatch, abandoned):
    """At exit, after runs that returned, the group is freed and gloo's worker threads end before Python does;
    after a run that raised, a queued collective may wait on another rank for the whole timeout: it only leaves."""
    monkeypatch.setattr(distributed, "_abandoned", abandoned)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))  # its reducer holds the group
        model(torch.ones(3, 2)).sum().backward()  # a collective, the gradients' all-reduce
        run = {"model": model}
        run["self"] = run  # held in a reference cycle, as a run's objects are: only a collection frees it
        del model, run
        assert gloo_threads() == 2
        assert distributed.leave() is not abandoned
        assert not torch.distributed.is_initialized()
        assert gloo_threads() == (2 if abandoned else 0)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        gc.collect()
    assert gloo_threads() == 0


def test_what_ranks_cannot_compute_as_one_process_is_refused(monkeypatch, smoke_root):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="model.bn=rbn with 2 ranks: its per-time-step moments are not"):
        distributed.check(config("model.bn=rbn"))
    with pytest.raises(ConfigError, match="train.spec_augment.per_utterance=false with 2 ranks: .* set "
                                          "train.spec_augment.per_utterance=true"):
        distributed.check(config("train.spec_augment.time_masks=2"))
    distributed.check(config(*AUGMENT))


@pytest.mark.parametrize("overrides,cores,ranks_here,threads", [
    ([], 16, 2, 8),  # torchrun --nproc_per_node=2: threads=0 is the cores over the ranks
    ([], 16, 1, 0),  # one process: torch's default, as before
    (["hydra/launcher=parallel"], 16, 2, 4),
    (["hydra/launcher=slurm"], 64, 4, 8),  # cpus_per_task is per task, so per rank
])
def test_threads_are_the_cores_over_the_local_ranks(overrides, cores, ranks_here, threads):
    assert job_threads(launcher_config(*overrides), cores, ranks_here) == threads


def test_a_study_starts_each_run_on_its_ranks_with_torchrun(smoke_root):
    (job, *_) = jobs(["experiment=smoke", f"data.root={smoke_root}", "train.threads=0"])
    command = Pool([job], 1, job_threads(launcher_config(), 16, 2), ranks=2).command(job)
    assert command[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert command[5].endswith("src/run.py") and command[-1] == "train.threads=8"
    assert Pool([job], 1, 0).command(job)[:2] == [sys.executable, str(ROOT / "src" / "run.py")]


def test_the_report_says_peak_memory_is_per_rank(two_ranks, tmp_path):
    report.write_report(two_ranks, tmp_path)
    assert "- Data-parallel: 6 runs on 2 ranks. Peak memory is per rank" in (tmp_path / "report.md").read_text()
