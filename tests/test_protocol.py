"""The fair protocol: a run's identity, the learning-rate rule, and the study driver and its stages (tune, widen, final)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from batchrnn.config import ConfigError, to_container
from batchrnn.validation import validate
from batchrnn.study.protocol import ProtocolError, choose_lrs, protocol_choice, stage_settings, tuned_lr
from batchrnn.training.identity import mismatch, run_name, setting_key, variant_key
from batchrnn.study.scheduler import Pool, expand, jobs, split_studies, stages
from batchrnn.training.rundir import RESULTS, read_study
from conftest import ROOT


@pytest.fixture
def config(make_config):
    def make(*overrides):
        return to_container(make_config("experiment=smoke", *overrides))

    return make


def test_run_name_is_the_settings_not_the_typing(config):
    base = run_name(config())
    assert run_name(config("model.bn=none", "seed=0")) == base
    # neutral settings: where data lives, the device, threads, logging, the study's bookkeeping
    assert run_name(config("data.root=/elsewhere", "train.threads=2", "logger.mode=offline",
                           "protocol.stage=tune", "study=other")) == base
    others = {run_name(config(o)) for o in ("seed=1", "train.lr=1e-3", "model.hidden_size=16", "train.epochs=3",
                                            "train.spec_augment.time_masks=2")}
    assert len(others) == 5 and base not in others
    assert run_name(config("train.lr=1e-3", "seed=2")).startswith("gru-none-L2-lr0.001-s2-")


def test_a_setting_added_later_with_its_default_keeps_old_names_and_folders(config):
    now = config()
    older = json.loads(json.dumps(now))
    del older["train"]["spec_augment"]  # as written by a version before the setting existed
    assert run_name(older) == run_name(now) and mismatch(older, now) == []
    assert setting_key(older) == setting_key(now) and variant_key(older) == variant_key(now)  # one setting
    assert mismatch(config("train.lr=1e-3"), now) == ["train.lr"]


def result(lr, seed, val, status="finished", bn="none"):
    return {"status": status, "best_val_wer": val,
            "config": {"model": {"bn": bn}, "train": {"lr": lr}, "seed": seed}}


def test_each_variant_gets_the_rate_with_the_lowest_mean_validation_wer():
    runs = [result(1e-3, 1, 0.30), result(1e-3, 2, 0.34), result(2e-3, 1, 0.28), result(2e-3, 2, 0.40),
            result(4e-3, 1, math.nan, "diverged"), result(4e-3, 2, 0.10, "diverged"),
            result(1e-3, 1, 0.5, bn="seqwise"), result(2e-3, 1, 0.5, bn="seqwise"), result(4e-3, 1, 0.2, bn="seqwise"),
            result(8e-3, 1, 0.01)]  # a rate outside the grid never wins
    (none, seqwise) = choose_lrs(runs, [1e-3, 2e-3, 4e-3], [1, 2]).values()
    assert none["lr"] == 1e-3 and none["by_lr"] == {1e-3: pytest.approx(0.32), 2e-3: pytest.approx(0.34),
                                                    4e-3: math.inf}  # diverged: that rate lost
    assert seqwise["lr"] is None and seqwise["missing"] == [(1e-3, 2), (2e-3, 2), (4e-3, 2)]
    tie = choose_lrs([result(1e-3, 1, 0.3), result(2e-3, 1, 0.3)], [2e-3, 1e-3], [1])
    assert [c["lr"] for c in tie.values()] == [1e-3]  # a tie goes to the smaller rate
    words = 514  # equal error counts over the seeds: a tie, though the ratios' float sums differ in the last bit
    assert (120 / words + 127 / words) / 2 > (121 / words + 126 / words) / 2
    tie = choose_lrs([result(1e-3, 1, 120 / words), result(1e-3, 2, 127 / words), result(2e-3, 1, 121 / words),
                      result(2e-3, 2, 126 / words)], [1e-3, 2e-3], [1, 2])
    assert [c["lr"] for c in tie.values()] == [1e-3]
    running = choose_lrs([result(1e-3, 1, 0.3), result(2e-3, 1, 0.1, "running")], [1e-3, 2e-3], [1])
    assert [c["lr"] for c in running.values()] == [None]
    twice = choose_lrs([result(1e-3, 1, 0.1, "running"), result(1e-3, 1, 0.3), result(2e-3, 1, 0.2)], [1e-3, 2e-3], [1])
    assert [c["lr"] for c in twice.values()] == [2e-3]  # the finished copy of a run counts, not the other
    diverged = choose_lrs([result(1e-3, 1, 0.3, "diverged"), result(2e-3, 1, 0.1, "diverged")], [1e-3, 2e-3], [1])
    assert [(c["lr"], c["missing"]) for c in diverged.values()] == [(None, [])]  # no rate to train seeds at
    for order in (1, -1):  # a diverged copy read first or last: the finished copy of the run counts
        copies = [result(1e-3, 1, 0.3, "diverged"), result(1e-3, 1, 0.1)][::order] + [result(2e-3, 1, 0.2)]
        assert [c["lr"] for c in choose_lrs(copies, [1e-3, 2e-3], [1]).values()] == [1e-3]


def augmented(lr, seed, val, on=True, status="finished", bn="none"):
    """A tuning run of a study that tunes SpecAugment (protocol.tune_spec_augment): on, or off (stage augment)."""
    r = result(lr, seed, val, status, bn)
    r["config"]["train"]["spec_augment"] = {"enabled": on}
    r["config"]["protocol"] = {"tune_spec_augment": True}
    return r


def test_spec_augment_is_chosen_at_the_chosen_rate_like_the_rate():
    lrs, on = [1e-3, 2e-3], [augmented(1e-3, s, v) for s, v in ((1, 0.30), (2, 0.32))] + [
        augmented(2e-3, s, v) for s, v in ((1, 0.20), (2, 0.24))]

    def only(runs):
        (choice,) = choose_lrs(runs, lrs, [1, 2], tune_augment=True).values()  # one variant: on and off alike
        return choice

    c = only(on)  # the rate is chosen over the runs with SpecAugment on; off not tried yet
    assert (c["lr"], c["augment"], c["augment_missing"]) == (2e-3, None, [1, 2])
    assert c["by_augment"] == {"on": pytest.approx(0.22), "off": None}
    off = [augmented(2e-3, 1, 0.18, on=False), augmented(2e-3, 2, 0.20, on=False)]
    c = only(on + off)
    assert (c["lr"], c["augment"]) == (2e-3, False) and c["by_augment"]["off"] == pytest.approx(0.19)
    # a run off at a better score but at another rate plays no part in the rate's choice
    assert only(on + off + [augmented(1e-3, 1, 0.01, on=False), augmented(1e-3, 2, 0.01, on=False)])["lr"] == 2e-3
    assert only(on + [augmented(2e-3, 1, 0.22, on=False), augmented(2e-3, 2, 0.22, on=False)])["augment"] is True  # tie
    assert only(on + off[:1])["augment"] is None and only(on + off[:1])["augment_missing"] == [2]
    diverged = [augmented(2e-3, 1, math.nan, on=False, status="diverged"), off[1]]
    assert only(on + diverged)["augment"] is True  # a diverged seed loses off, as it loses a rate
    assert only(on[:3])["augment_missing"] == [] and only(on[:3])["augment"] is None  # the rate not chosen yet
    # without tune_augment, off and on are two variants, each with its own rate
    assert len(choose_lrs([result(1e-3, 1, 0.3)] + [r | {"config": r["config"] | {"protocol": {}}} for r in off],
                          lrs, [1, 2])) == 2


def test_a_variant_whose_best_rate_is_an_edge_of_the_grid_is_tuned_one_rate_past_it():
    lrs = [1e-3, 2e-3, 4e-3]
    top = [result(1e-3, 1, 0.3), result(2e-3, 1, 0.2), result(4e-3, 1, 0.1)]

    def only(runs, widen, grid=lrs):
        (choice,) = choose_lrs(runs, grid, [1], widen).values()
        return choice

    assert only(top, 0)["lr"] == 4e-3  # never widened: the edge is taken
    c = only(top, 1)
    assert (c["grid"], c["missing"], c["lr"]) == ([1e-3, 2e-3, 4e-3, 8e-3], [(8e-3, 1)], None)
    thirds = [result(1e-3, 1, 0.3), result(3e-3, 1, 0.2), result(9e-3, 1, 0.1)]
    assert 9e-3 * 9e-3 / 3e-3 != 2.7e-2 and only(thirds, 1, [1e-3, 3e-3, 9e-3])["missing"] == [(2.7e-2, 1)]  # as typed
    assert only(top + [result(8e-3, 1, 0.15)], 1)["lr"] == 4e-3
    c = only(top + [result(8e-3, 1, 0.05)], 1)
    assert c["lr"] == 8e-3 and c["grid"][-1] == 8e-3  # widened once, as many times as allowed
    assert only(top + [result(8e-3, 1, 0.05)], 2)["missing"] == [(1.6e-2, 1)]
    assert only([result(1e-3, 1, 0.1), result(2e-3, 1, 0.2), result(4e-3, 1, 0.3)], 1)["missing"] == [(5e-4, 1)]
    inside = only([result(1e-3, 1, 0.3), result(2e-3, 1, 0.1), result(4e-3, 1, 0.3)], 1)
    assert inside["lr"] == 2e-3 and inside["grid"] == lrs
    assert only([result(1e-3, 1, 0.3), result(2e-3, 1, 0.1)], 1, [1e-3, 2e-3])["lr"] == 2e-3  # two rates: no inside
    assert only([result(lr, 1, 0.3, "diverged") for lr in lrs], 1)["missing"] == []  # nothing to widen from
    assert only(top[:2], 1)["missing"] == [(4e-3, 1)]  # tuning not complete: no widening yet


def test_the_study_widens_between_tuning_and_its_seeds():
    names = lambda *o: [name for name, _ in stages(["experiment=smoke", *o])]  # noqa: E731
    assert names("protocol.lrs=[1e-3,2e-3,4e-3]") == ["tune", "widen 1", "widen 2", "final"]  # default: twice
    assert names("protocol.lrs=[1e-3,2e-3,4e-3]", "protocol.widen=1") == ["tune", "widen", "final"]
    assert names("protocol.lrs=[1e-3,2e-3,4e-3]", "protocol.widen=0") == ["tune", "final"]
    assert names("protocol.lrs=[1e-3,3e-3]") == ["tune", "final"]
    (_, widen), _ = stages(["experiment=smoke", "protocol.lrs=[1e-3,2e-3,4e-3]", "protocol.widen=1"])[1:]
    assert "protocol.stage=widen" in widen and "seed=1" in widen and not any(o.startswith("train.lr") for o in widen)


def test_widen_stage_trains_only_the_variant_whose_best_rate_is_an_edge(tmp_path, smoke_root):
    """Tuning results as copies of one real run: none's best inside its grid (2e-3), post's at the top (4e-3).
    Stage widen trains post at 8e-3 and nothing for none; stage final then takes post's better of 4e-3, 8e-3."""
    base = [sys.executable, "src/run.py", "-m", "experiment=smoke", f"data.root={smoke_root}",
            f"hydra.sweep.dir={tmp_path}", "protocol.lrs=[1e-3,2e-3,4e-3]", "protocol.widen=1"]
    tune = subprocess.run([*base, "model.bn=none", "protocol.stage=tune", "train.lr=1e-3", "seed=1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert tune.returncode == 0, tune.stderr[-3000:]
    (path,) = tmp_path.rglob(RESULTS)
    real = json.loads(path.read_text())
    path.write_text(json.dumps(real | {"best_val_wer": 0.3}))
    for bn, lr, wer in [("none", 2e-3, 0.2), ("none", 4e-3, 0.3), ("post", 1e-3, 0.3), ("post", 2e-3, 0.2),
                        ("post", 4e-3, 0.1)]:
        copy = json.loads(json.dumps(real)) | {"best_val_wer": wer, "bn": bn}
        copy["config"]["model"]["bn"], copy["config"]["train"]["lr"] = bn, lr
        (tmp_path / f"copy-{bn}-{lr:g}").mkdir()
        (tmp_path / f"copy-{bn}-{lr:g}" / RESULTS).write_text(json.dumps(copy))
    widen = subprocess.run([*base, "model.bn=none,post", "protocol.stage=widen", "seed=1"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert widen.returncode == 0, widen.stderr[-3000:]
    assert "gru-none (L2), seed 1: nothing to widen" in widen.stdout + widen.stderr
    results, _ = read_study(tmp_path)
    (new,) = [r for r in results if r["config"]["train"]["lr"] == 8e-3]
    assert (new["bn"], new["seed"], new["status"]) == ("post", 1, "finished") and len(results) == 7
    # The widened rate does better than post's 4e-3 (0.1): stage final takes it
    (Path(new["path"]) / RESULTS).write_text(json.dumps(json.loads((Path(new["path"]) / RESULTS).read_text())
                                                        | {"best_val_wer": 0.05}))
    final = subprocess.run([*base, "model.bn=post", "protocol.stage=final", "seed=2"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert final.returncode == 0, final.stderr[-3000:]
    (seed2,) = [r for r in read_study(tmp_path)[0] if r["seed"] == 2]
    assert seed2["config"]["train"]["lr"] == 8e-3 and seed2["status"] == "finished"


def test_stage_augment_comes_after_the_rate_and_before_the_seeds(make_config):
    names = lambda *o: [name for name, _ in stages(["experiment=smoke", "protocol.lrs=[1e-3,2e-3]", *o])]  # noqa: E731
    assert names() == ["tune", "final"]
    on = ("train.spec_augment.time_masks=1", "protocol.tune_spec_augment=true")
    assert names(*on) == ["tune", "augment", "final"]
    assert names(*on, "protocol.lrs=[1e-3,2e-3,4e-3]", "protocol.widen=1") == ["tune", "widen", "augment", "final"]
    (_, augment), _ = stages(["experiment=smoke", "protocol.lrs=[1e-3,2e-3]", *on])[1:]
    assert "protocol.stage=augment" in augment and "seed=1" in augment
    with pytest.raises(ConfigError, match="protocol.tune_spec_augment=true: SpecAugment has no masks"):
        validate(make_config("experiment=smoke", "protocol.lrs=[1e-3]", "protocol.tune_spec_augment=true"))
    with pytest.raises(ConfigError, match="protocol.stage=augment: protocol.tune_spec_augment is false"):
        validate(make_config("experiment=smoke", "protocol.lrs=[1e-3]", "protocol.stage=augment"))


def test_stage_augment_trains_off_at_the_chosen_rate_and_final_takes_the_better(tmp_path, smoke_root):
    """Tuning results as copies of one real run: none's best rate is 2e-3. Stage augment trains seed 1 at 2e-3
    with SpecAugment off; where off scores better, stage final trains seed 2 off, at 2e-3, and otherwise on."""
    base = [sys.executable, "src/run.py", "-m", "experiment=smoke", f"data.root={smoke_root}",
            f"hydra.sweep.dir={tmp_path}", "protocol.lrs=[1e-3,2e-3]", "train.spec_augment.time_masks=1",
            "protocol.tune_spec_augment=true"]
    early = subprocess.run([*base, "protocol.stage=augment", "seed=1"], capture_output=True, text=True, timeout=600,
                           cwd=ROOT)
    assert early.returncode == 2 and "the tuning stage of gru-none (L2) is not complete" in early.stdout + early.stderr
    tune = subprocess.run([*base, "protocol.stage=tune", "train.lr=1e-3", "seed=1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert tune.returncode == 0, tune.stderr[-3000:]
    (path,) = tmp_path.rglob(RESULTS)
    real = json.loads(path.read_text())
    path.write_text(json.dumps(real | {"best_val_wer": 0.3}))
    copy = json.loads(json.dumps(real)) | {"best_val_wer": 0.2}
    copy["config"]["train"]["lr"] = 2e-3
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / RESULTS).write_text(json.dumps(copy))
    seed2 = subprocess.run([*base, "protocol.stage=final", "seed=2"], capture_output=True, text=True, timeout=600,
                           cwd=ROOT)
    assert seed2.returncode == 2 and "stage augment of gru-none (L2) is not complete" in seed2.stdout + seed2.stderr
    augment = subprocess.run([*base, "protocol.stage=augment", "seed=1"], capture_output=True, text=True,
                             timeout=600, cwd=ROOT)
    assert augment.returncode == 0, augment.stderr[-3000:]
    (off,) = [r for r in read_study(tmp_path)[0] if not r["config"]["train"]["spec_augment"]["enabled"]]
    assert (off["config"]["train"]["lr"], off["seed"], off["status"]) == (2e-3, 1, "finished")
    for off_wer, kept in ((0.1, False), (0.25, True)):
        (Path(off["path"]) / RESULTS).write_text(json.dumps(off | {"best_val_wer": off_wer}))
        final = subprocess.run([*base, "protocol.stage=final", "seed=2", "train.rerun=true"], capture_output=True,
                               text=True, timeout=600, cwd=ROOT)
        assert final.returncode == 0, final.stderr[-3000:]
        (run,) = [r for r in read_study(tmp_path)[0] if r["seed"] == 2 and r["config"]["train"]["spec_augment"][
            "enabled"] is kept]
        assert run["config"]["train"]["lr"] == 2e-3 and run["status"] == "finished"


def test_final_stage_without_its_tuning_runs_says_what_is_missing(config, make_config, tmp_path):
    with pytest.raises(ProtocolError, match=r"tuning stage of gru-none \(L2\) is not complete: .*\(0\.001, 1\)"):
        tuned_lr(tmp_path, config("protocol.lrs=[1e-3,2e-3]", "protocol.stage=final"))
    with pytest.raises(ConfigError, match="protocol.stage=final: protocol.lrs is empty"):
        validate(make_config("experiment=smoke", "protocol.stage=final"))


def test_study_tunes_each_variant_then_runs_its_seeds_at_the_chosen_rate(tmp_path, smoke_root):
    cmd = [sys.executable, "-m", "batchrnn.study", "experiment=smoke", f"data.root={smoke_root}",
           f"hydra.sweep.dir={tmp_path}", "model.bn=none,seqwise", "protocol.lrs=[1e-3,3e-3]", "protocol.seeds=[1,2]"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    results, _ = read_study(tmp_path)
    chosen = {c["lr"] for c in choose_lrs(results, [1e-3, 3e-3], [1]).values()}
    # 2 variants x 2 rates at seed 1, then seed 2 at each chosen rate; seed 1's tuning run is reused
    assert len(results) == 6 and all(r["status"] == "finished" for r in results)
    finals = [r for r in results if r["seed"] == 2]
    assert sorted(r["bn"] for r in finals) == ["none", "seqwise"]
    assert {r["config"]["train"]["lr"] for r in finals} <= chosen
    for r in finals:
        tuning = [t for t in results if t["bn"] == r["bn"] and t["seed"] == 1]
        assert r["config"]["train"]["lr"] == min(tuning, key=lambda t: (t["best_val_wer"], t["config"]["train"]["lr"]))[
            "config"]["train"]["lr"]
    assert (tmp_path / "report.md").exists() and len(list(tmp_path.rglob(RESULTS))) == 6
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)  # resumes: nothing to do
    assert again.returncode == 0 and again.stdout.count("is finished") == 8  # 4 tuning jobs, 4 final jobs
    assert "train loss" not in again.stdout


def test_final_stage_goes_on_past_a_variant_without_a_tuned_rate(tmp_path, smoke_root):
    """One variant with no rate to take (tuning missing, or every rate diverged) fails alone: the sweep's
    other variants still run their seeds, and the exit status (2) says that one did not."""
    base = [sys.executable, "src/run.py", "-m", "experiment=smoke", f"data.root={smoke_root}",
            f"hydra.sweep.dir={tmp_path}", "protocol.lrs=[1e-3]"]
    tune = subprocess.run([*base, "model.bn=seqwise", "protocol.stage=tune", "train.lr=1e-3", "seed=1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert tune.returncode == 0, tune.stderr[-3000:]
    final = subprocess.run([*base, "model.bn=none,seqwise", "protocol.stage=final", "seed=2"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert final.returncode == 2
    assert "the tuning stage of gru-none (L2) is not complete" in final.stdout + final.stderr
    results, _ = read_study(tmp_path)
    assert sorted((r["bn"], r["seed"], r["status"]) for r in results) == [("seqwise", 1, "finished"),
                                                                          ("seqwise", 2, "finished")]


@pytest.mark.parametrize("typed,message", [("model.bnn=x", "model.bnn"), ("+model.bnn=x", "model.bnn: no such setting"),
                                           ("train.lr=-1", "train.lr=-1.0: must be positive")])
def test_study_refuses_a_bad_override_in_one_line_before_any_run(tmp_path, typed, message):
    run = subprocess.run([sys.executable, "-m", "batchrnn.study", "experiment=smoke", f"hydra.sweep.dir={tmp_path}", typed],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "Traceback" not in run.stderr and run.stderr.startswith("error: ")
    assert message in run.stderr and not list(tmp_path.rglob(RESULTS))


def bn(job):
    return job.cfg.model.bn.value


class ScriptedPool(Pool):
    """The study's scheduler with each job's run replaced by a script that appends to a log when it starts
    and ends: which jobs run at once, and in which order, without training anything. The job `holds` names
    waits (at most 60 s) until the log has `until` lines with the given text, so a test does not hang on
    timing: a scheduler that never lets those jobs run beside it fails the test's order checks."""

    def __init__(self, plan, slots, log, holds=lambda job: False, until=("", 0), exits=lambda job: 0, stops=None,
                 settles=lambda job: None):
        super().__init__(plan, slots, 0)
        self.log, self.holds, self.until, self.exits, self.stops, self.settles = log, holds, until, exits, stops, settles

    def settle(self, job):
        return self.settles(job)

    def command(self, job):
        name = f"{job.study_dir.name}/{bn(job)}:{job.stage}:" + ",".join(o for o in job.overrides
                                                                          if o.startswith(("train.lr=", "seed=")))
        text, count = self.until if self.holds(job) else ("", 0)
        script = (f"import sys, time\nlog = {str(self.log)!r}\nopen(log, 'a').write('start {name}\\n')\n"
                  f"end = time.monotonic() + 60\n"
                  f"while open(log).read().count({text!r}) < {count} and time.monotonic() < end: time.sleep(0.05)\n"
                  f"open(log, 'a').write('end {name}\\n')\n"
                  + ("import os\nopen(os.environ['BATCHRNN_STOP_FILE'], 'w').write('no corpus')\n" * (job is self.stops))
                  + f"sys.exit({self.exits(job)})")
        return [sys.executable, "-c", script]


def test_the_study_starts_a_job_when_its_own_variant_is_ready_not_when_a_stage_ends(tmp_path):
    """Two variants, two slots: slow's long tuning run does not hold back fast's widening and seeds, and no
    job starts before its variant's earlier stages have ended."""
    plan = jobs(["experiment=smoke", "model.bn=none,post", "protocol.lrs=[1e-3,2e-3,4e-3]", "protocol.widen=1",
                 "protocol.seeds=[1,2]"])
    assert [(j.stage, bn(j)) for j in plan][:3] == [("tune", "none")] * 3
    assert len(plan) == 2 * (3 + 1 + 2) and len({j.variant for j in plan}) == 2
    log = tmp_path / "log"
    slow = lambda job: bn(job) == "none" and "train.lr=0.004" in job.overrides  # noqa: E731
    assert ScriptedPool(plan, 2, log, slow, until=("end smoke/post", 6)).run() == 0  # post's 6 jobs
    events = log.read_text().splitlines()
    assert len(events) == 2 * len(plan)
    slow_end = events.index("end smoke/none:tune:train.lr=0.004,seed=1")
    # every job of post ended while none's last tuning run was still going
    assert all(events.index(f"end smoke/post:{name}") < slow_end
               for name in ("tune:train.lr=0.004,seed=1", "widen:seed=1", "final:seed=2"))
    for variant in ("none", "post"):
        mine = [e.split(":", 1)[1] for e in events if e.split()[1].startswith(f"smoke/{variant}:")]
        at = lambda stage, pick: pick(i for i, e in enumerate(mine) if e.startswith(stage))  # noqa: E731
        assert at("tune", max) < at("widen", min) and at("widen", max) < at("final", min)  # its own stages in order
    running, most = 0, 0
    for e in events:
        running += 1 if e.startswith("start") else -1
        most = max(most, running)
    assert most == 2  # never more than the slots


def test_a_failed_run_leaves_the_others_going_and_the_status_says_so(tmp_path):
    plan = jobs(["experiment=smoke", "model.bn=none,post", "protocol.lrs=[1e-3,2e-3]", "protocol.seeds=[1,2]"])
    log = tmp_path / "log"
    assert ScriptedPool(plan, 1, log, exits=lambda job: 2 if job is plan[0] else 0).run() == 2
    assert log.read_text().count("end") == len(plan)  # every job ran, the failed one's variant's too


@pytest.mark.parametrize("overrides", [
    ["model.num_layers=1,3", "model.bn=none,seqwise", "experiment=smoke", "train.lr=1e-3,2e-3", "seed=1",
     "model.bn=none,post,input"],  # a key given twice: its last values, in its first place
    ["seed=1", "+model.extra=[1,2]", "hydra/launcher=parallel", "seed=2,3"],
])
def test_a_study_expands_its_sweeps_into_the_jobs_hydra_would_run(overrides):
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # the reference only: a private API
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert expand(overrides) == BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)[0]


def test_a_study_refuses_a_bad_value_anywhere_in_its_sweep_before_any_run(tmp_path):
    run = subprocess.run([sys.executable, "-m", "batchrnn.study", "experiment=smoke", f"hydra.sweep.dir={tmp_path}",
                          "model.bn=none,postt", "protocol.lrs=[1e-3]"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert run.returncode == 2 and run.stderr.startswith("error: ") and "postt" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not list(tmp_path.rglob(RESULTS))


def test_studies_joined_by_then_share_one_schedule_and_each_gets_its_report_when_its_runs_end(tmp_path):
    first = jobs(["experiment=smoke", f"hydra.sweep.dir={tmp_path / 'a'}", "protocol.lrs=[1e-3,2e-3]"])
    # other variants: a variant of two studies (the depth study's 3 layers, the grid's) keeps its stage order
    second = jobs(["experiment=smoke", f"hydra.sweep.dir={tmp_path / 'b'}", "model.bn=post,input", "protocol.lrs=[1e-3,2e-3]"])
    log, reports = tmp_path / "log", []
    slow = lambda job: job.study_dir.name == "a" and "train.lr=0.002" in job.overrides  # noqa: E731
    pool = ScriptedPool(first + second, 2, log, slow, until=("end b/", len(second)))
    pool.report = lambda study_dir: reports.append(study_dir.name) or 0
    assert pool.run() == 0
    events = log.read_text().splitlines()
    starts = [e for e in events if e.startswith("start")]  # a short run may end before the other one starts
    assert sorted(starts[:2]) == ["start a/none:tune:train.lr=0.001,seed=1", "start a/none:tune:train.lr=0.002,seed=1"]
    # the second study ran in the slot the first's long tuning run left free, and was reported first
    assert events.index("end a/none:tune:train.lr=0.002,seed=1") > max(i for i, e in enumerate(events) if "b/" in e)
    assert events[-1].startswith("end a/none:final:") and reports == ["b", "a"]
    assert sum(e.startswith("start") for e in events) == len(first) + len(second)


@pytest.mark.parametrize("argv", [["then", "experiment=smoke"], ["experiment=smoke", "then"],
                                  ["experiment=smoke", "then", "then", "experiment=smoke"]])
def test_then_needs_a_study_on_each_side(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        split_studies(argv)
    assert stop.value.code == 2 and "`then` joins two studies" in capsys.readouterr().err


@pytest.mark.parametrize("why", ["crash", "stop"])
def test_a_crash_or_an_error_every_run_would_meet_starts_no_more_runs(tmp_path, why):
    """A run that crashed (exit 1) or stopped on bad settings or a missing corpus (src/run.py's record_stop,
    exit 2): the runs already going finish, no other starts, and the status is that run's."""
    plan = jobs(["experiment=smoke", "model.bn=none,post", "protocol.lrs=[1e-3,2e-3]"])
    log, first = tmp_path / "log", plan[0]
    pool = ScriptedPool(plan, 1, log, exits=lambda job: (1 if why == "crash" else 2) if job is first else 0,
                        stops=first if why == "stop" else None)
    assert pool.run() == (1 if why == "crash" else 2)
    assert log.read_text().count("start") == 1 and not pool.stop_file.parent.exists()


def test_a_studys_jobs_put_its_presets_sweep_first_as_hydra_does():
    plan = jobs(["experiment=an4_depth", "model.bn=seqwise"])  # the command line's bn replaces the preset's
    assert plan[0].overrides[:3] == ["model.num_layers=1", "model.bn=seqwise", "experiment=an4_depth"]
    assert len({j.variant for j in plan}) == 4 and len(plan) == 4 * (3 + 2 + 3)


def test_a_variant_in_two_studies_is_trained_once(tmp_path):
    """The depth study takes the grid's 3-layer runs (protocol.reuse_from): each of its jobs waits for the grid's
    jobs of that variant up to its own stage, never the other way round. Two studies in one folder (the grid
    and the norms) likewise: the later one's run of a variant they share waits for the earlier one's."""
    grid = jobs(["experiment=smoke", f"hydra.sweep.dir={tmp_path / 'grid'}", "protocol.lrs=[1e-3,2e-3]"])
    depth = jobs(["experiment=smoke", f"hydra.sweep.dir={tmp_path / 'depth'}", "protocol.lrs=[1e-3,2e-3]",
                  f"protocol.reuse_from={tmp_path / 'grid'}", "model.num_layers=2,3"], 1)
    other = jobs(["experiment=smoke", f"hydra.sweep.dir={tmp_path / 'other'}", "protocol.lrs=[1e-3,2e-3]"], 2)
    pool = Pool(grid + depth + other, 2, 0)
    taken = [j for j in depth if j.cfg.model.num_layers == 2]  # smoke's own depth: the grid's variant
    assert all(not pool.earlier[id(j)] for j in grid if j.stage == "tune")  # the grid waits for nobody else
    assert all(set(pool.earlier[id(j)]) <= {id(o) for o in grid} for j in grid)
    for j in taken:
        assert {id(o) for o in grid if o.rank <= j.rank} <= set(pool.earlier[id(j)])
    assert not any(set(pool.earlier[id(j)]) & {id(o) for o in grid} for j in depth if j not in taken)
    assert not any(set(pool.earlier[id(j)]) & {id(o) for o in grid + depth} for j in other)  # no reuse, own folder
    again = jobs(["experiment=smoke", f"hydra.sweep.dir={tmp_path / 'grid'}", "protocol.lrs=[1e-3,2e-3]"], 1)
    pool = Pool(grid + again, 2, 0)
    first_tune = next(j for j in again if j.stage == "tune")
    assert {id(o) for o in grid if o.stage == "tune"} <= set(pool.earlier[id(first_tune)])


def test_a_later_studys_runs_wait_while_an_earlier_study_has_a_run_to_start(tmp_path):
    """The first study's tuning is all finished (settled without a process), which makes its widening and
    seeds ready only then: with one slot they still go before the second study's tuning."""
    first = jobs(["experiment=smoke", f"hydra.sweep.dir={tmp_path / 'a'}", "protocol.lrs=[1e-3,2e-3]"])
    second = jobs(["experiment=smoke", f"hydra.sweep.dir={tmp_path / 'b'}", "model.bn=post", "protocol.lrs=[1e-3,2e-3]"])
    log = tmp_path / "log"
    settled = lambda job: 0 if job.study_dir.name == "a" and job.stage == "tune" else None  # noqa: E731
    assert ScriptedPool(first + second, 1, log, settles=settled).run() == 0
    started = [e.split()[1].split(":")[0] for e in log.read_text().splitlines() if e.startswith("start")]
    assert started == ["a/none"] * sum(j.stage != "tune" for j in first) + ["b/post"] * len(second)


def test_studies_with_different_launchers_are_refused_before_any_run(tmp_path):
    run = subprocess.run([sys.executable, "-m", "batchrnn.study", "experiment=smoke", f"hydra.sweep.dir={tmp_path}",
                          "then", "experiment=smoke", "hydra/launcher=slurm_local"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "need one launcher" in run.stderr and not list(tmp_path.rglob(RESULTS))


def simulate(plan, curve) -> list[tuple]:
    """A study's plan run without training: each job takes its stage's settings as src/run.py does (stage_settings)
    and, where they name a run not made yet, writes its results.json with the scripted validation curve that
    curve(bn, lr, SpecAugment on, patience, seed) returns. Returns (stage, bn, lr, on, patience, seed) of each run."""
    made = []
    for job in plan:
        chosen = stage_settings(job.study_dir, to_container(job.cfg))
        if chosen is None:
            continue
        cfg = job.cfg.copy()
        for key, value in chosen.items():
            OmegaConf.update(cfg, key, value)
        config, path = to_container(cfg), job.study_dir / run_name(to_container(cfg))
        if (path / RESULTS).exists():
            continue
        t, bn, seed = config["train"], config["model"]["bn"], config["seed"]
        vals = curve(bn, t["lr"], t["spec_augment"]["enabled"], t["patience"], seed)
        path.mkdir(parents=True)
        (path / RESULTS).write_text(json.dumps({"status": "finished", "config": config, "seed": seed,
                                                "epochs": [{"epoch": e, "val_wer": v} for e, v in enumerate(vals, 1)],
                                                "best_val_wer": min(vals)}))
        made.append((job.stage, bn, t["lr"], t["spec_augment"]["enabled"], t["patience"], seed))
    return made


PATIENT = ["experiment=smoke", "model.bn=none,seqwise", "protocol.lrs=[1e-3,2e-3,4e-3]", "protocol.widen=0",
           "protocol.tune_seeds=[1,2]", "protocol.seeds=[1,2,3]", "train.spec_augment.time_masks=1",
           "protocol.tune_spec_augment=true", "protocol.tune_patience=2", "train.schedule=plateau",
           "train.plateau_wait=3", "train.patience=6", "train.epochs=150"]


def scripted(bn, lr, on, patience, seed):
    """Validation curves whose best values make the choices: none's rates tie-free at 2e-3 on the mean of both
    seeds though seed 1 alone is best at 4e-3; seqwise at 1e-3. SpecAugment on wins for both. none gains from every
    doubling of the patience (so the stage widens to 12/24 and takes it); seqwise loses at 6/12 (the stage stops)."""
    rate = {("none", 1e-3): (0.40, 0.40), ("none", 2e-3): (0.30, 0.20), ("none", 4e-3): (0.25, 0.60),
            ("seqwise", 1e-3): (0.20, 0.20), ("seqwise", 2e-3): (0.30, 0.30), ("seqwise", 4e-3): (0.35, 0.35)}
    best = rate[bn, lr][seed - 1] if seed <= 2 else 0.3
    best += 0.05 * (not on)
    best -= {"none": {6: 0, 12: 0.02, 24: 0.03}, "seqwise": {6: 0, 12: -0.01, 24: 0}}[bn][patience]
    return [0.9 + 0.01 * i for i in range(patience // 3)] + [best + 0.1, best, best + 0.05]


def test_choices_are_made_on_the_mean_of_two_tuning_seeds_and_the_patience_stage_widens_while_it_wins(tmp_path):
    """A whole study simulated: the two-seed choice of the rate, SpecAugment at the chosen rate, the patience stage
    (6/12 against 3/6, then 12/24 only where 6/12 won) and the final seeds at the chosen settings, each tuning run
    at those settings also its seed's final run."""
    plan = jobs([*PATIENT, f"hydra.sweep.dir={tmp_path}"])
    assert [name for name, _ in stages(PATIENT)] == ["tune", "augment", "patience 1", "patience 2", "final"]
    made = simulate(plan, scripted)
    by_stage = lambda stage: sorted(m[1:] for m in made if m[0] == stage)  # noqa: E731
    assert len(by_stage("tune")) == 2 * 3 * 2  # both variants, three rates, two seeds
    assert by_stage("augment") == [("none", 2e-3, False, 6, 1), ("none", 2e-3, False, 6, 2),
                                   ("seqwise", 1e-3, False, 6, 1), ("seqwise", 1e-3, False, 6, 2)]
    assert by_stage("patience 1") == [("none", 2e-3, True, 12, 1), ("none", 2e-3, True, 12, 2),
                                      ("seqwise", 1e-3, True, 12, 1), ("seqwise", 1e-3, True, 12, 2)]
    assert by_stage("patience 2") == [("none", 2e-3, True, 24, 1), ("none", 2e-3, True, 24, 2)]  # seqwise lost
    # final: seeds 1 and 2 are the tuning runs at the chosen settings, so only seed 3 trains
    assert by_stage("final") == [("none", 2e-3, True, 24, 3), ("seqwise", 1e-3, True, 6, 3)]
    choice = protocol_choice(read_study(tmp_path)[0], to_container(plan[0].cfg)["protocol"], (3, 6, 150))
    (none,) = [c for key, c in choice.items() if '"model.bn":"none"' in key]
    assert (none["lr"], none["augment"], none["patience"], none["patience_grid"]) == (2e-3, True, 2, [0, 1, 2])
    assert none["by_lr"][4e-3] == pytest.approx(0.425) and none["by_patience"][2] == pytest.approx(0.22)
    final = [r for r in read_study(tmp_path)[0] if r["seed"] == 3 and r["config"]["model"]["bn"] == "none"][0]
    assert [final["config"]["train"][k] for k in ("plateau_wait", "patience", "epochs")] == [12, 24, 600]  # cap too
    assert len(made) == len({m[1:] for m in made})  # no run trained twice


def test_the_patience_stage_keeps_the_shorter_schedule_on_a_tie_and_waits_for_the_rate():
    base, on = (3, 6, 150), {"spec_augment": {"enabled": True}}

    def run(lr, seed, val, patience=6):
        r = result(lr, seed, val)
        r["config"]["train"] |= on | {"plateau_wait": patience // 2, "patience": patience, "epochs": 25 * patience}
        r["config"]["protocol"] = {"tune_patience": 2}
        return r

    def only(runs):
        (c,) = choose_lrs(runs, [1e-3, 2e-3], [1, 2], tune_patience=2, base=base).values()
        return c

    tuned = [run(1e-3, s, 0.3) for s in (1, 2)] + [run(2e-3, s, 0.2) for s in (1, 2)]
    assert only(tuned[:3])["patience_grid"] == [] and only(tuned[:3])["patience"] is None  # the rate not chosen yet
    c = only(tuned)
    assert (c["patience"], c["patience_grid"], c["patience_missing"]) == (None, [0, 1], [(1, 1), (1, 2)])
    assert only(tuned + [run(2e-3, s, 0.2, 12) for s in (1, 2)])["patience"] == 0  # a tie: the shorter schedule
    assert only(tuned + [run(2e-3, 1, 0.1, 12), run(2e-3, 2, 0.31, 12)])["patience"] == 0  # the mean decides
    c = only(tuned + [run(2e-3, s, 0.1, 12) for s in (1, 2)])
    assert (c["patience"], c["patience_missing"]) == (None, [(2, 1), (2, 2)])  # won: one doubling more
    assert only(tuned + [run(2e-3, s, 0.1, 12) for s in (1, 2)] + [run(2e-3, s, 0.15, 24) for s in (1, 2)])[
        "patience"] == 1
    assert only(tuned + [run(1e-3, s, 0.01, 12) for s in (1, 2)])["patience_missing"] == [(1, 1), (1, 2)]  # other rate
    odd = run(2e-3, 1, 0.01, 12)
    odd["config"]["train"]["epochs"] = 150  # the waits doubled, the cap not: no doubling of the schedule, in no choice
    assert only(tuned + [odd])["patience_missing"] == [(1, 1), (1, 2)]


def test_the_patience_stage_needs_the_plateau_schedule(make_config):
    with pytest.raises(ConfigError, match="protocol.tune_patience: the patience stage doubles"):
        validate(make_config("experiment=smoke", "protocol.lrs=[1e-3]", "protocol.tune_patience=1"))
    with pytest.raises(ConfigError, match="protocol.stage=patience: protocol.tune_patience is 0"):
        validate(make_config("experiment=smoke", "protocol.lrs=[1e-3]", "protocol.stage=patience"))
    with pytest.raises(ConfigError, match="protocol.reuse_needs_model: seqwize is no model.bn"):
        validate(make_config("experiment=smoke", "protocol.reuse_needs_model=[none,seqwize]"))
    validate(make_config("experiment=an4_cpu_patience"))


def test_the_patience_preset_fixes_six_seeds_and_reuses_the_plateau_study(make_config):
    """Its settings are an4_cpu_plateau's but for the protocol's bookkeeping, so a run chosen again has the same
    folder name there (what protocol.reuse_from matches) and is taken, not trained again."""
    p = make_config("experiment=an4_cpu_patience").protocol
    assert (list(p.tune_seeds), list(p.seeds), p.tune_patience, p.reuse_from, list(p.reuse_needs_model)) == (
        [1, 2], [1, 2, 3, 4, 5, 6], 2, "runs/an4_cpu_plateau", ["none", "seqwise", "ln"])
    same = ("model.rnn=lstm", "model.bn=seqwise", "train.lr=4e-3", "seed=5", "train.spec_augment.enabled=false")
    assert (run_name(to_container(make_config("experiment=an4_cpu_patience", *same)))
            == run_name(to_container(make_config("experiment=an4_cpu_plateau", *same))))
