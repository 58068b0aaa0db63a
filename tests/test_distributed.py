"""Data-parallel training on the CPU with gloo: 2 ranks started by torchrun (and by submitit's local executor with 2
tasks) compute what one process computes, gradients and BatchNorm's synchronised moments included; ranks killed
with -9 resume; a rank that stops answering ends the others with a clear error, not a hang."""
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from batchrnn.config import ConfigError, to_container
from batchrnn.data.corpus import prepare_corpus
from batchrnn.data.features import load_features
from batchrnn.data.text import LABELS
from batchrnn.model import DeepSpeech2
from batchrnn.study import report
from batchrnn.study.scheduler import Pool, jobs
from batchrnn.study.sweep import job_threads
from batchrnn.training import distributed
from batchrnn.training.identity import run_name
from batchrnn.training.loop import score, train
from batchrnn.training.rundir import BEST, CHECKPOINT, LOG, RESULTS
from conftest import ROOT
from ranks_gradient import gloo_threads, gradients
from test_sweeps import launcher_config

TORCHRUN = ([str(Path(sys.executable).with_name("torchrun"))] if Path(sys.executable).with_name("torchrun").exists()
            else [sys.executable, "-m", "torch.distributed.run"])
RANKS = [*TORCHRUN, "--standalone", "--nproc_per_node=2"]
RUN = [*RANKS, str(ROOT / "src" / "run.py")]
VARIANTS = ["none", "input", "post", "seqwise", "ln"]
AUGMENT = ["model.bn=seqwise", "train.spec_augment.per_utterance=true", "train.spec_augment.freq_masks=2",
           "train.spec_augment.time_masks=2"]
# The first conv's bias comes before its BatchNorm, which takes it away: its gradient is 0 but for float rounding,
# which AdamW turns into steps of the rate's size, so any other order of summation (2 ranks, or 2 torch threads in
# one process) moves it, and the running mean that follows it, differently. Training's outputs cannot see it;
# eval's running mean lags it, so validation loss differs by up to 0.6% after 3 smoke epochs (1 thread against 2 in
# one process: 0.1%). Every other parameter and buffer agrees to float rounding.
REDUNDANT = re.compile(r"front_end\.(layers\.\d+\.bias|norms\.\d+\.running_mean)$")


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


def nudged(shift: float) -> type:
    """DeepSpeech2 with the first conv's bias (REDUNDANT: BatchNorm takes it away) moved by shift, a few of AdamW's
    steps at the smoke rate: what 2 ranks do to it, whose rounding-level gradient they sum in another order. In real
    arithmetic it changes nothing; one process trained from it shows how far a difference of rounding carries."""

    class Nudged(DeepSpeech2):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            with torch.no_grad():
                self.front_end.layers[0].bias.add_(shift)

    return Nudged


@pytest.mark.parametrize("overrides", [[f"model.bn={bn}"] for bn in VARIANTS] + [AUGMENT],
                         ids=VARIANTS + ["seqwise-specaugment"])
def test_two_ranks_train_what_one_process_trains(two_ranks, smoke_root, tmp_path, overrides, monkeypatch):
    cfg = config(f"data.root={smoke_root}", "train.epochs=3", *overrides)
    name = run_name(to_container(cfg))
    one = train(cfg, tmp_path / name)
    # 2 ranks sum every gradient in another order than one process: a difference at the level of rounding. AdamW's
    # first step moves every weight by the rate times the sign of its gradient, so a weight whose gradient is within
    # rounding of 0 (on an Intel Xeon, gru-none's rnns.1.bias_ih[1, 70] at -5.8e-8) moves by +-3e-3 as that rounding
    # falls: a branch of the trajectory (there, 5e-4 in the third epoch's training loss). One process nudged both
    # ways says how far apart rounding can take the two; where it takes them nowhere the bounds are float rounding's.
    near = []  # (results, model state) of one process nudged each way
    for shift in (0.01, -0.01):
        with monkeypatch.context() as m:
            m.setattr("batchrnn.training.loop.DeepSpeech2", nudged(shift))
            folder = tmp_path / f"nudged{shift}" / name
            near.append((train(cfg, folder), state(folder)))
    two_dir = two_ranks / name  # the same folder name: N ranks train the same run
    two = json.loads((two_dir / RESULTS).read_text())
    assert (two["status"], two["world_size"], one["world_size"]) == ("finished", 2, 1)

    def close(key: str, rel: float, epoch: int, found: float) -> bool:
        """found within rel of one process's value of key at that epoch, plus 3x as far as a nudge moved it."""
        mine = one["epochs"][epoch][key]
        return abs(found - mine) <= rel * abs(mine) + 3 * max(abs(n["epochs"][epoch][key] - mine) for n, _ in near)

    for key, rel in (("train_loss", 1e-3), ("val_loss", 1e-2)):
        assert all(close(key, rel, i, e[key]) for i, e in enumerate(two["epochs"])), [e[key] for e in two["epochs"]]
    assert [u["id"] for u in two["test_utterances"]] == [u["id"] for u in one["test_utterances"]]
    # rank 0 alone wrote the run's files; rank 1 its log
    assert sorted(p.name for p in two_dir.iterdir()) == sorted([".lock", BEST, CHECKPOINT, RESULTS, LOG, "rank1.log"])
    assert "epoch 3:" in (two_dir / "rank1.log").read_text()
    # The models after 3 epochs: equal but for the redundant conv bias (REDUNDANT); with it (and the running mean
    # that follows it) taken from one process, the 2-rank model scores validation as one process's does.
    mine, theirs = state(tmp_path / name), state(two_dir)
    for key, value in mine.items():
        if value.is_floating_point() and not REDUNDANT.search(key):
            bound = 1e-4 * max(1.0, value.abs().max()) + 3 * max((n[key] - value).abs().max() for _, n in near)
            assert (theirs[key] - value).abs().max() <= bound, key
    val = load_features(prepare_corpus(cfg.data), "val", cfg.data)
    model = DeepSpeech2(cfg.model, val.num_features, len(LABELS))
    model.load_state_dict(theirs | {k: v for k, v in mine.items() if REDUNDANT.search(k)})
    scored = score(model, val, 8, torch.device("cpu"))["loss"]
    assert close("val_loss", 1e-4, -1, scored), (scored, one["epochs"][-1]["val_loss"])


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
    for overrides, one_found, two_found in zip(variants, gradients(variants), two):
        for batch, one in one_found.items():
            other = two_found[batch]
            assert other["loss"] == pytest.approx(one["loss"], rel=1e-6), (overrides, batch)
            assert other["norm"] == pytest.approx(one["norm"], rel=1e-4), (overrides, batch)
            for key, grad in one["grads"].items():
                diff = (other["grads"][key] - grad).abs().max()
                if REDUNDANT.search(key):  # its gradient is rounding alone
                    assert diff <= 1e-5 * one["norm"], (overrides, batch, key)
                else:
                    assert diff <= 1e-3 * grad.abs().max(), (overrides, batch, key)
            for key, buffer in one["buffers"].items():
                assert (other["buffers"][key].double() - buffer.double()).abs().max() <= 1e-5 * max(
                    1.0, buffer.double().abs().max()), (overrides, batch, key)


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
