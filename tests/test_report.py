"""The study report on generated results: known WERs, times, memory and validation curves, so every number
the report prints can be checked by hand."""
import copy
import importlib.util
import json
import logging
import os
import re
import time

import matplotlib.image
import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import ROOT

from batchrnn.config import Config
from batchrnn.study.report import write_report
from batchrnn.study.report.__main__ import main
from batchrnn.study.report.against import chosen, reading
from batchrnn.study.report import plots
from batchrnn.study.report.plots import DEPTH_PLOT, series
from batchrnn.study.report.stats import detectable, first_reach, holm, paired_bootstrap, utterance_errors
from batchrnn.study.report.summary import DRIFT

PLOTS = ("val_wer.png", "wer_vs_time.png", "peak_mem.png", "grad_norm.png")  # every report draws these
UTTERANCES = 100  # five words each, so one wrong word is 0.2% of the test set's words
# (rnn, bn) -> word errors per seed; seqwise is clearly better than none, post is as good as none.
ERRORS = {"none": (30, 20), "post": (30, 20), "seqwise": (5, 5)}
EPOCH_TIME = {"none": (9.5, 10.5), "post": (11.0, 11.0), "seqwise": (11.5, 12.5)}  # means 10, 11, 12
PEAK_MEM = {"none": (800.0, 800.0), "post": (900.0, 900.0), "seqwise": (1000.0, 1000.0)}
SCHEMA = OmegaConf.to_container(OmegaConf.structured(Config), resolve=True, enum_to_str=True)


def result(config: dict, wrong: set, val_wers: list[float], time_s: float = 10.0, mem: float = 800.0,
           status: str = "finished", improving_at_cap: bool = False) -> dict:
    """A results.json as the trainer writes it: the utterances in `wrong` have one word wrong."""
    m = config["model"]
    utts = [{"id": f"u{i}", "ref": "YES NO GO STOP ONE", "hyp": ("X" if i in wrong else "YES") + " NO GO STOP ONE"}
            for i in range(UTTERANCES)]
    wer = len(wrong) / (5 * UTTERANCES)
    epochs = [{"epoch": e, "train_loss": 3 / e, "val_loss": 3 / e, "val_wer": v, "val_cer": v / 2,
               "epoch_time_s": time_s,
               "peak_mem_mb": mem, "utt_per_s": 20.0, "lr": 1e-3, "grad_norm_mean": 5.0 / e, "grad_norm_max": 20.0 / e}
              for e, v in enumerate(val_wers, 1)]
    out = {"status": status, "config": config, "rnn": m["rnn"], "bn": m["bn"], "impl": m.get("impl", "fused"),
           "seed": config["seed"], "study": "fake", "preset": "an4_cpu", "epochs": epochs,
           "best_epoch": 1 + val_wers.index(min(val_wers)), "best_val_wer": min(val_wers),
           "stop": "cap" if status == "finished" else None, "improving_at_cap": improving_at_cap,
           "epoch_time_s": time_s, "peak_mem_mb": mem, "params": 1_234_567, "device": "cpu", "torch_version": "2.11.0"}
    if status == "finished":
        out |= {"test_wer": wer, "test_cer": wer / 2, "test_utterances": utts}
    return out


def fake_result(rnn: str, bn: str, seed: int) -> dict:
    """The 2 rnn x 3 bn x 2 seeds sweep's run: post errs on other utterances than none (the same WER,
    not paired utterance by utterance)."""
    errors = ERRORS[bn][seed]
    wrong = set(range(UTTERANCES - errors, UTTERANCES)) if bn == "post" else set(range(errors))
    wer = errors / (5 * UTTERANCES)
    config = {"model": {"rnn": rnn, "bn": bn, "impl": "fused"}, "seed": seed}
    return result(config, wrong, [wer + 0.1 / e for e in (1, 2, 3)], EPOCH_TIME[bn][seed], PEAK_MEM[bn][seed])


def write(root, name: str, results: dict) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "results.json").write_text(json.dumps(results))


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    for rnn in ("gru", "lstm"):
        for bn in ERRORS:
            for seed in (0, 1):
                write(root, f"{rnn}-{bn}/seed{seed}", fake_result(rnn, bn, seed))  # nested: the search is recursive
    running = fake_result("gru", "none", 0) | {"status": "running"}
    running["config"] = running["config"] | {"seed": 2}
    running["epochs"] = running["epochs"][:2]
    write(root, "gru-none/seed2", running)
    diverged = fake_result("lstm", "none", 0) | {"status": "diverged", "error": "the run has diverged"}
    diverged["config"] = diverged["config"] | {"seed": 3}
    write(root, "lstm-none/seed3", diverged)
    (root / "broken").mkdir()
    (root / "broken" / "results.json").write_text('{"status": "finis')
    return root


def table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")][1:]  # drop the header
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def section(text: str, title: str) -> str:
    return text.split(f"## {title}\n")[1].split("\n## ")[0]


def test_report(sweep, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        path = write_report(sweep, tmp_path / "out")
    assert any("broken" in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)
    text = path.read_text()
    assert path == tmp_path / "out" / "report.md"

    assert "Study report: fake" in text and "an4_cpu" in text and "torch 2.11.0" in text
    assert "CPU-sized preset" in text
    assert "12 finished, 1 still running, 1 diverged" in text and "1 unreadable" in text
    assert "Protocol" not in text  # a plain sweep: every row is in the results table
    assert "Epoch times drifted" not in text  # seeds' epoch times at most 1.11x apart
    # "How to read" is a legend of three lines and a link to docs/report.md, which holds every rule
    legend = section(text, "How to read").strip().splitlines()
    guide = re.search(r"\]\(([^)#]+)#how-to-read\)", legend[-1]).group(1)
    assert len(legend) == 4 and (path.parent / guide).resolve() == (ROOT / "docs" / "report.md").resolve()
    assert "## How to read" in (ROOT / "docs" / "report.md").read_text()

    rows = table_rows(section(text, "Quality at convergence"))
    # lstm-none's seed 3 diverged: in no mean, but said beside n
    assert [r[:4] for r in rows] == [[rnn, bn, "fused", "2 (+1 diverged)" if (rnn, bn) == ("lstm", "none") else "2"]
                                     for rnn in ("gru", "lstm") for bn in ERRORS]
    gru_none, gru_post, gru_seqwise = rows[:3]
    assert gru_none[4] == "5.0 ± 1.4"  # (6% + 4%) / 2, sample std 1.41
    assert gru_seqwise[4] == "**1.0 ± 0.0**"  # the best test WER of gru is bold
    assert gru_none[7] == "1.00 ± 0.00"  # train loss at the tested epoch 3 (3 / 3): from the epochs, no key yet
    assert gru_none[8] == "10.0 ± 0.7" and gru_post[8] == "11.0 ± 0.0"
    assert (gru_none[10], gru_post[10], gru_seqwise[10]) == ("1.00", "1.10", "1.20")  # time × none
    assert (gru_none[11], gru_seqwise[11]) == ("1.00", "1.25")  # memory × none
    assert gru_none[12] == "1,234,567"
    assert gru_none[13] == "(baseline)"
    assert gru_seqwise[13].startswith("-4.0 [") and gru_seqwise[13].endswith("*")
    assert not gru_post[13].endswith("*")

    # Head to head: each placement vs none, and seqwise vs post, per rnn: 3 x 2 comparisons, one family.
    pairs = [(r[0], r[1]) for r in table_rows(section(text, "Head to head"))]
    assert pairs == [(rnn, p) for rnn in ("gru", "lstm")
                     for p in ("post vs none", "seqwise vs none", "post vs seqwise")]
    assert "Holm–Bonferroni over the 6 comparisons" in text
    assert "gru: seqwise vs none (-4.0 points, seqwise better)" in text

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["finished"] == 12 and data["running"] == 1 and data["diverged"] == 1 and len(data["skipped"]) == 1
    by_label = {r["label"]: r for r in data["rows"]}
    seqwise = by_label["lstm-seqwise"]
    assert seqwise["significant"] and seqwise["dwer_hi"] < 0 < -seqwise["dwer_lo"] and seqwise["p_holm"] < 0.05
    assert not by_label["lstm-post"]["significant"]
    assert by_label["lstm-post"]["dwer_lo"] < 0 < by_label["lstm-post"]["dwer_hi"]
    assert by_label["gru-none"]["time_ratio"] == pytest.approx(1.0)
    assert by_label["gru-seqwise"]["time_ratio"] == pytest.approx(1.2)
    assert by_label["gru-none"]["seeds"] == [0, 1]  # the running seed 2 is not in the verdict

    for name in PLOTS:
        png = tmp_path / "out" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(png).shape[0] > 100  # decodes as an image
        assert f"]({name})" in text  # embedded with a relative link


def errors_with(wrong: int) -> dict:
    """A seed's per-utterance errors: the first `wrong` utterances have one word wrong."""
    return utterance_errors(result({"model": {"rnn": "gru", "bn": "none"}, "seed": 0}, set(range(wrong)), [0.5]))


def test_one_failed_seed_is_not_a_significant_difference():
    """Three seeds of none and of post, all alike but post's third, which failed to train: pooling the seeds
    per utterance makes post 20 points worse on nearly every utterance, but two seeds in three say the
    placements are the same, so the seed level of the bootstrap must keep 0 in the interval."""
    none = [errors_with(10)] * 3
    post = [errors_with(10), errors_with(10), errors_with(100)]
    d = paired_bootstrap(post, none)
    assert d.dwer == pytest.approx(30 / 500)  # (10 + 10 + 100) / 3 - 10 word errors, of 500 words
    assert d.lo <= 0 < d.hi and d.p > 0.05
    # The same difference made by every seed is significant, and its p-value is as small as the resamples allow.
    d = paired_bootstrap([errors_with(40)] * 3, none)
    assert d.dwer == pytest.approx(30 / 500) and 0 < d.lo < d.dwer < d.hi and d.p < 0.001


def test_the_detectable_difference_is_the_bootstraps_standard_error_times_the_two_quantiles():
    """One seed a side, 400 one-word utterances, each wrong with probability 0.2 independently on each side:
    the paired difference's standard error is sqrt(2 x 0.2 x 0.8 / 400) = 0.0283, so at 80% power with Holm
    over 4 the detectable difference is (2.498 + 0.842) x 0.0283 = 0.0945; over 1, (1.960 + 0.842) x 0.0283."""
    rng = np.random.default_rng(1)
    a, b = ({str(u): (int(w), 1) for u, w in enumerate(rng.random(400) < 0.2)} for _ in range(2))
    se = float(np.sqrt(2 * 0.2 * 0.8 / 400))
    assert detectable([a], [b], tests=4) == pytest.approx(3.340 * se, rel=0.12)
    assert detectable([a], [b], tests=1) / detectable([a], [b], tests=4) == pytest.approx(2.802 / 3.340, rel=1e-3)
    # Seeds that disagree widen it: the seed level of the bootstrap counts their spread.
    worse = {u: (1, 1) for u in a}
    assert detectable([a, worse], [b, b], tests=4) > 2 * detectable([a, a], [b, b], tests=4)
    assert detectable([{}], [b], tests=4) is None


def test_holm_on_a_hand_worked_example():
    # sorted 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> kept monotone: 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([]) == []


def test_a_figure_that_is_not_a_number_skips_its_run_with_a_warning(sweep, tmp_path, caplog):
    """A hand-edited or hostile results.json: the report died in numpy's float conversion."""
    path = sweep / "gru-post" / "seed1" / "results.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"test_wer": "abc"}))
    with caplog.at_level(logging.WARNING):
        report = write_report(sweep, tmp_path / "out")
    assert f"skipping {path}: test_wer is 'abc', not a number; rerun that run or delete the file" in caplog.text
    assert "Quality at convergence" in report.read_text()


def test_single_seed_has_no_std_and_cli_defaults_out_to_sweep(tmp_path, capsys):
    one = fake_result("gru", "none", 0)
    del one["test_utterances"]
    write(tmp_path / "sweep", "one", one)
    main([str(tmp_path / "sweep")])
    assert "wrote" in capsys.readouterr().out
    text = (tmp_path / "sweep" / "report.md").read_text()
    assert table_rows(section(text, "Quality at convergence"))[0][3:5] == ["1", "**6.0**"]
    assert "No paired comparison" in text


def test_missing_sweep_is_one_clear_error(tmp_path, capsys):
    for folder, message in (("nope", "no such folder"), ("empty", "no readable results.json")):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(SystemExit) as exit:
            main([str(tmp_path / folder)])
        assert exit.value.code == 2  # as every entry point exits on a problem the user can fix
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / folder}: {message}") and err.count("\n") == 1


def test_the_power_script_prints_each_comparison_of_the_report(depth_sweep, capsys):
    """experiments/detectable.py reads a study as the report does: one line per comparison (here `seqwise` against
    `none` at each of 2 depths, a family of 2), with its n and the detectable difference at 80% power."""
    spec = importlib.util.spec_from_file_location("detectable", ROOT / "experiments" / "detectable.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([str(depth_sweep)])
    out = capsys.readouterr().out
    assert "2 comparisons (Holm's family), 80% power" in out
    lines = [line for line in out.splitlines() if line.startswith("| gru")]
    assert [line.split(" | ")[0] for line in lines] == ["| gru-L1: seqwise vs none", "| gru-L3: seqwise vs none"]
    assert all(float(line.strip(" |").split(" | ")[-1]) > 0 for line in lines)


@pytest.fixture
def depth_sweep(tmp_path):
    """gru at depths 1 and 3, none and seqwise, 2 seeds: seqwise is as good as none at depth 1 (on other
    utterances) and clearly better at depth 3."""
    root = tmp_path / "depth"
    for layers in (1, 3):
        for bn in ("none", "seqwise"):
            for seed in (0, 1):
                r = fake_result("gru", "post" if (layers, bn) == (1, "seqwise") else bn, seed)
                r["config"]["model"] |= {"bn": bn, "num_layers": layers}  # results keep the depth in config only
                write(root, f"model.bn={bn},model.num_layers={layers},seed={seed}", r)
    return root


def test_depth_sweep_compares_within_each_depth(depth_sweep, tmp_path):
    text = write_report(depth_sweep, tmp_path / "out").read_text()
    rows = table_rows(section(text, "Quality at convergence"))
    assert [r[:5] for r in rows] == [["gru", str(layers), bn, "fused", "2"] for layers in (1, 3)
                                     for bn in ("none", "seqwise")]
    assert rows[0][-1] == rows[2][-1] == "(baseline)"  # each depth has its own none
    assert not rows[1][-1].endswith("*") and rows[3][-1].startswith("-4.0 [") and rows[3][-1].endswith("*")
    assert rows[0][5] == rows[1][5] == "**5.0 ± 1.4**"  # bold per depth: a tie at depth 1
    assert "gru-L3: seqwise vs none (-4.0 points, seqwise better)" in text and "not significant: 1 of 2" in text

    effect = table_rows(section(text, "BN's effect by depth"))
    assert "| variant | depth 1 | depth 3 |" in text
    assert effect[0][0] == "gru-seqwise" and effect[0][2].endswith("*") and not effect[0][1].endswith("*")

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(r["label"], r["num_layers"]) for r in data["rows"]] == [
        ("gru-none-L1", 1), ("gru-seqwise-L1", 1), ("gru-none-L3", 3), ("gru-seqwise-L3", 3)]
    for name in PLOTS + (DEPTH_PLOT,):
        assert matplotlib.image.imread(tmp_path / "out" / name).shape[0] > 100
        assert f"]({name})" in text


def config(bn: str, seed: int, lr: float, protocol: dict | None = None, **model) -> dict:
    """A resolved config as results.json holds it: the schema's defaults with these settings."""
    c = copy.deepcopy(SCHEMA)
    c["model"] |= {"bn": bn, **model}
    c["train"]["lr"], c["seed"], c["study"] = lr, seed, "fake"
    c["protocol"] |= protocol or {}
    return c


def test_rows_at_other_settings_are_never_pooled(tmp_path, caplog):
    """What a runs/smoke folder holds after a few ad-hoc commands: gru-none at two rates, two seeds each,
    one of them trained twice (two folders), and a wider model: each setting its own, labelled, row."""
    root = tmp_path / "smoke"
    for lr in (1e-3, 3e-3):
        for seed in (1, 2):
            write(root, f"lr{lr}-s{seed}", result(config("none", seed, lr), set(range(10 * seed)), [0.9, 0.5]))
    write(root, "again", result(config("none", 1, 1e-3), set(range(10)), [0.9, 0.5]))  # the same run, typed otherwise
    write(root, "wide", result(config("none", 1, 1e-3, hidden_size=64), set(), [0.9, 0.4]))
    # the same settings on a GPU (train.device=auto): bf16 autocast there, float32 here; not a third seed
    write(root, "gpu", result(config("none", 3, 3e-3), set(), [0.9, 0.3]) | {"device": "cuda", "bf16": True})
    with caplog.at_level(logging.WARNING):
        text = write_report(root).read_text()
    assert any("the same settings and seed" in r.getMessage() for r in caplog.records)
    assert "Left out, the same settings and seed as another folder" in text

    data = json.loads((root / "report.json").read_text())
    assert [(r["label"], r["n"], r["seeds"]) for r in data["rows"]] == [
        ("gru-none lr=0.001 device=cpu hidden_size=64", 1, [1]),
        ("gru-none lr=0.001 device=cpu hidden_size=256", 2, [1, 2]),
        ("gru-none lr=0.003 device=cpu hidden_size=256", 2, [1, 2]),
        ("gru-none lr=0.003 device=cuda bf16 hidden_size=256", 1, [3])]
    assert all(len(set(r["seeds"])) == len(r["seeds"]) for r in data["rows"])
    assert data["comparisons"] == []  # no two placements share all their other settings
    assert "| rnn | bn | impl | lr | device | hidden_size | n |" in section(text, "Quality at convergence")


def protocol_study(root, capped: str | None = None) -> None:
    """gru x none, input, seqwise tuned over lr 1e-3 and 3e-3 with seed 1, then seeds 1 and 2 at the chosen
    rate: none chooses 1e-3, input and seqwise 3e-3. At 3e-3 seqwise errs on 5 utterances a seed, input
    on 15; none on 25 at 1e-3. `capped`: that placement's seed-2 run reached the cap still improving."""
    p = {"lrs": [1e-3, 3e-3], "tune_seeds": [1], "seeds": [1, 2]}
    best = {("none", 1e-3): 0.30, ("none", 3e-3): 0.40, ("input", 1e-3): 0.35, ("input", 3e-3): 0.25,
            ("seqwise", 1e-3): 0.30, ("seqwise", 3e-3): 0.20}
    chosen = {"none": 1e-3, "input": 3e-3, "seqwise": 3e-3}
    errors = {"none": 25, "input": 15, "seqwise": 5}
    for (bn, lr), val in best.items():
        for seed in [1] + [2] * (lr == chosen[bn]):
            wrong = set(range(errors[bn])) if lr == chosen[bn] else set(range(UTTERANCES))  # the other rate: awful
            stage = "tune" if seed == 1 else "final"
            write(root, f"{bn}-{lr}-{seed}", result(config(bn, seed, lr, p | {"stage": stage}), wrong,
                                                    [0.9, val + 0.1, val], improving_at_cap=(bn, seed) == (capped, 2)))


def test_protocol_tuning_table_and_verdict_at_the_chosen_rate(tmp_path):
    protocol_study(tmp_path)
    text = write_report(tmp_path).read_text()
    assert "Grid (`protocol.lrs`): 0.001, 0.003; tuning seeds (`protocol.tune_seeds`): 1" in text
    tuning = table_rows(section(text, "Protocol: each variant's learning rate, chosen on validation"))
    assert tuning == [["gru-none", "**30.0 ✓**", "40.0"], ["gru-input", "35.0", "**25.0 ✓**"],
                      ["gru-seqwise", "30.0", "**20.0 ✓**"]]

    data = json.loads((tmp_path / "report.json").read_text())
    # Only the chosen rate's runs: the tuning run at the other rate (every utterance wrong) is in no row.
    assert [(r["bn"], r["lr"], r["seeds"], r["test_wer"]) for r in data["rows"]] == [
        ("none", 1e-3, [1, 2], 0.05), ("input", 3e-3, [1, 2], 0.03), ("seqwise", 3e-3, [1, 2], 0.01)]
    assert [t["lr"] for t in data["tuning"]] == [1e-3, 3e-3, 3e-3]

    # Head to head: input and seqwise vs none, and exact DS2 against deepspeech.pytorch's input directly.
    pairs = {(c["a_name"], c["b_name"]): c for c in data["comparisons"]}
    assert list(pairs) == [("input", "none"), ("seqwise", "none"),
                           ("input", "seqwise")]
    head = pairs["input", "seqwise"]
    assert head["dwer"] == pytest.approx(0.02) and head["significant"]
    assert all(c["p"] <= c["p_holm"] <= min(1.0, 3 * c["p"]) for c in data["comparisons"])
    assert "gru: input vs seqwise (+2.0 points, seqwise better)" in text
    assert "Holm–Bonferroni over the 3 comparisons" in data["significance"]


def test_a_variant_still_tuning_is_in_no_verdict(tmp_path):
    protocol_study(tmp_path)
    p = {"lrs": [1e-3, 3e-3], "tune_seeds": [1], "seeds": [1, 2], "stage": "tune"}
    write(tmp_path, "post-done", result(config("post", 1, 1e-3, p), set(), [0.9, 0.1]))
    write(tmp_path, "post-running", result(config("post", 1, 3e-3, p), set(), [0.9], status="running"))
    write(tmp_path, "off-grid", result(config("none", 1, 1e-2, p), set(), [0.9, 0.1]))  # a run typed by hand
    text = write_report(tmp_path).read_text()
    tuning = table_rows(section(text, "Protocol: each variant's learning rate, chosen on validation"))
    assert ["gru-post", "10.0", "…"] in tuning
    assert "Still tuning, so in no verdict yet" in text
    assert "gru-post (missing or unfinished lr, seed: 0.003, 1)" in text
    assert "At a rate outside the grid, in no table: gru-none lr=0.01." in text
    data = json.loads((tmp_path / "report.json").read_text())
    assert [(r["bn"], r["lr"]) for r in data["rows"]] == [("none", 1e-3), ("input", 3e-3), ("seqwise", 3e-3)]


def widened_study(root, widen: int | None) -> None:
    """Tuned over 1e-3, 2e-3, 4e-3: none's best inside (2e-3), seqwise's at the top, so its grid widened to 8e-3,
    which did better still; and a run of none at 8e-3, outside its grid. widen None: runs made before the
    setting existed (no key)."""
    p = {"lrs": [1e-3, 2e-3, 4e-3], "tune_seeds": [1], "seeds": [1], "stage": "tune"}
    best = {("none", 1e-3): 0.3, ("none", 2e-3): 0.2, ("none", 4e-3): 0.3, ("none", 8e-3): 0.1,
            ("seqwise", 1e-3): 0.3, ("seqwise", 2e-3): 0.2, ("seqwise", 4e-3): 0.1, ("seqwise", 8e-3): 0.05}
    for (bn, lr), val in best.items():
        c = config(bn, 1, lr, p)
        if widen is None:
            del c["protocol"]["widen"]
        else:
            c["protocol"]["widen"] = widen
        write(root, f"{bn}-{lr}", result(c, set(), [0.9, val]))


def test_a_widened_grid_in_the_tuning_table(tmp_path):
    widened_study(tmp_path, 1)
    text = write_report(tmp_path).read_text()
    tuning = section(text, "Protocol: each variant's learning rate, chosen on validation")
    assert "| variant | lr 0.001 | lr 0.002 | lr 0.004 | lr 0.008 |" in tuning
    assert "the variant's grid widens by one rate past that edge, in the grid's own ratio, up to 1 time" in tuning
    assert table_rows(tuning) == [["gru-none", "30.0", "**20.0 ✓**", "30.0", ""],  # blank: not in none's grid
                                  ["gru-seqwise", "30.0", "20.0", "10.0", "**5.0 ✓**"]]
    assert "a rate beyond it might do better still: gru-seqwise. Raise `protocol.widen`" in tuning
    assert "At a rate outside the grid, in no table: gru-none lr=0.008." in tuning
    data = json.loads((tmp_path / "report.json").read_text())
    assert [(r["bn"], r["lr"]) for r in data["rows"]] == [("none", 2e-3), ("seqwise", 8e-3)]


def test_runs_from_before_widening_existed_are_read_unwidened(tmp_path):
    widened_study(tmp_path, None)
    data = json.loads((write_report(tmp_path).parent / "report.json").read_text())
    assert data["protocol"]["widen"] == 0
    assert [(r["bn"], r["lr"]) for r in data["rows"]] == [("none", 2e-3), ("seqwise", 4e-3)]
    assert data["off_grid"] == ["gru-none lr=0.008", "gru-seqwise lr=0.008"]


def test_spec_augment_tuned_beside_the_rate_shows_both_choices(tmp_path):
    """protocol.tune_spec_augment: none and input tuned over two rates with SpecAugment on, then off at the chosen
    rate (stage augment). none keeps off (25% against 30%), input keeps on (30% against 25%); seqwise's off run is
    still going. The verdict holds each variant's runs at both of its choices."""
    p = {"lrs": [1e-3, 3e-3], "tune_seeds": [1], "seeds": [1, 2], "tune_spec_augment": True}

    def run(bn, seed, lr, on, val, stage, status="finished"):
        c = config(bn, seed, lr, p | {"stage": stage})
        c["train"]["spec_augment"] |= {"enabled": on, "time_masks": 2}
        write(tmp_path, f"{bn}-{lr}-{seed}-{on}", result(c, set(range(5 if on else 2)), [0.9, val], status=status))

    for bn, chosen in (("none", 1e-3), ("input", 3e-3), ("seqwise", 3e-3)):
        run(bn, 1, 1e-3, True, 0.30 if chosen == 1e-3 else 0.35, "tune")
        run(bn, 1, 3e-3, True, 0.40 if chosen == 1e-3 else 0.25, "tune")
    run("none", 1, 1e-3, False, 0.25, "augment")
    run("none", 2, 1e-3, False, 0.26, "final")
    run("input", 1, 3e-3, False, 0.30, "augment")
    run("input", 2, 3e-3, True, 0.26, "final")
    run("seqwise", 1, 3e-3, False, 0.9, "augment", status="running")
    text = write_report(tmp_path).read_text()
    tuning = section(text, "Protocol: each variant's learning rate and SpecAugment, chosen on validation")
    assert "| variant | lr 0.001 | lr 0.003 | SpecAugment off | SpecAugment |" in tuning
    assert table_rows(tuning) == [["gru-none", "**30.0 ✓**", "40.0", "**25.0 ✓**", "off"],
                                  ["gru-input", "35.0", "**25.0 ✓**", "30.0", "on"],
                                  ["gru-seqwise", "35.0", "**25.0 ✓**", "…", "…"]]
    assert "SpecAugment still tuning, so in no verdict yet: gru-seqwise (seeds 1 with it off at lr 0.003)" in tuning
    data = json.loads((tmp_path / "report.json").read_text())
    assert [(r["bn"], r["lr"], r["seeds"], r["label"]) for r in data["rows"]] == [
        ("none", 1e-3, [1, 2], "gru-none lr=0.001 spec_augment=off"),
        ("input", 3e-3, [1, 2], "gru-input lr=0.003 spec_augment=on")]
    assert [(t["augment"], t["by_augment"]) for t in data["tuning"]][:2] == [
        (False, {"on": 0.30, "off": 0.25}), (True, {"on": 0.25, "off": 0.30})]
    assert [c["a_name"] + " vs " + c["b_name"] for c in data["comparisons"]] == ["input vs none"]


def test_a_run_still_improving_at_the_cap_is_marked(tmp_path):
    protocol_study(tmp_path, capped="input")
    text = write_report(tmp_path).read_text()
    rows = {r[1]: r for r in table_rows(section(text, "Quality at convergence"))}
    assert rows["input"][4] == "2 †1" and rows["seqwise"][4] == "2"
    notes = {r[1]: r[-1] for r in table_rows(section(text, "Head to head"))}
    assert notes["input vs none"] == "† still improving at the cap or floor (input: 1 of 2)"
    assert notes["input vs seqwise"].startswith("†")
    assert notes["seqwise vs none"] == ""
    assert "seqwise better) †" in text  # beside the significant comparison too
    assert rows["input"][-1].endswith(" †") and not rows["seqwise"][-1].endswith("†")  # ΔWER vs none


def test_speed_of_convergence_on_hand_made_curves(tmp_path):
    assert first_reach([{"epoch": 1, "val_wer": 0.9, "epoch_time_s": 10.0}, {"epoch": 2, "val_wer": 0.4,
                        "epoch_time_s": 12.0}, {"epoch": 3, "val_wer": 0.3, "epoch_time_s": 11.0}], 0.4) == (2, 22.0)
    assert first_reach([{"epoch": 1, "val_wer": 0.9, "epoch_time_s": 10.0}], 0.4) is None
    # none: best 0.5 and 0.3 (median 0.4), seqwise: best 0.2 and 0.2. Threshold: 0.4, the higher median.
    curves = {("none", 1): [1.0, 0.8, 0.6, 0.5], ("none", 2): [1.0, 0.6, 0.3],
              ("seqwise", 1): [0.6, 0.4, 0.2], ("seqwise", 2): [0.7, 0.3, 0.2]}
    for (bn, seed), val in curves.items():
        time_s = 2.0 if bn == "none" else 3.0
        write(tmp_path, f"{bn}{seed}", result(config(bn, seed, 1e-3), set(range(5)), val, time_s=time_s))
    text = write_report(tmp_path).read_text()
    rows = {r[1]: r for r in table_rows(section(text, "Speed of convergence"))}
    # none: seed 1 never reaches 0.4 (counted with its 4 epochs, 8 s: a lower bound), seed 2 at epoch 3 (6 s);
    # seqwise at epochs 2 and 2 (6 s each)
    assert rows["none"][3:8] == ["40.0", "1 of 2", "≥ 3.5 ± 0.7", "≥ 7.0 ± 1.4", "3.5 ± 0.7"]
    assert rows["seqwise"][3:8] == ["40.0", "2 of 2", "2.0 ± 0.0", "6.0 ± 0.0", "3.0 ± 0.0"]
    assert rows["none"][8] == "2.0 ± 0.0" and rows["seqwise"][8] == "1.0 ± 0.0"  # first at or below 90%
    data = json.loads((tmp_path / "report.json").read_text())
    (c,) = data["comparisons"]
    assert c["speed_winner"] == "gru-seqwise" and not c["significant"]  # the same test errors: a tie in quality


def test_the_early_speed_column_counts_a_seed_still_blank_as_a_lower_bound(tmp_path):
    """Epochs to 90% validation WER (out of CTC's blank phase): none's seed 2 never got there in its 4 epochs, so
    none's mean, (3 + 4) / 2, is a lower bound; seqwise's seeds got there at epochs 1 and 2. It decides nothing:
    the speed verdict stays the threshold's."""
    curves = {("none", 1): [1.0, 0.95, 0.5, 0.3], ("none", 2): [1.0, 1.0, 1.0, 0.95],
              ("seqwise", 1): [0.8, 0.4, 0.3], ("seqwise", 2): [0.95, 0.6, 0.3]}
    for (bn, seed), val in curves.items():
        write(tmp_path, f"{bn}{seed}", result(config(bn, seed, 1e-3), set(range(5)), val))
    text = write_report(tmp_path).read_text()
    assert "| epochs trained | epochs to 90% val WER |" in section(text, "Speed of convergence")
    rows = {r[1]: r for r in table_rows(section(text, "Speed of convergence"))}
    assert rows["none"][8] == "≥ 3.5 ± 0.7" and rows["seqwise"][8] == "1.5 ± 0.7"
    row = next(r for r in json.loads((tmp_path / "report.json").read_text())["rows"] if r["bn"] == "none")
    assert (row["epochs_to_words"], row["words_censored"]) == (3.5, 1)


def test_a_stopped_seed_holds_its_last_value_in_the_validation_curve():
    """Seeds stop at different epochs: a finished one keeps its last validation WER for the later epochs of
    the others, so the plotted mean does not jump when a seed stops; a running one is not held."""
    def run(status: str, wers: list[float]) -> dict:
        return {"status": status, "epochs": [{"epoch": e, "val_wer": w} for e, w in enumerate(wers, 1)]}

    row = {"_runs": [run("finished", [0.9, 0.8]), run("finished", [0.9, 0.3, 0.2, 0.1]), run("running", [1.0, 0.5, 0.4])]}
    assert series(row, "val_wer", 100, hold=True) == (
        [1, 2, 3, 4], [[90.0, 90.0, 100.0], [80.0, 30.0, 50.0], [20.0, 40.0, 80.0], [10.0, 80.0]])
    assert series(row, "val_wer", 100)[1][3] == [10.0]  # without hold: the seeds that reached the epoch


def test_one_failed_seed_does_not_loosen_the_speed_threshold(tmp_path):
    """Three seeds of none, one of which failed to train (best validation WER 0.9): the threshold is the
    highest median of best validation WER (none's 0.3), not the mean (0.5) that the failed seed drags up."""
    curves = {("none", 1): [1.0, 0.6, 0.3], ("none", 2): [1.0, 0.5, 0.3], ("none", 3): [1.0, 0.95, 0.9],
              ("seqwise", 1): [0.6, 0.2], ("seqwise", 2): [0.6, 0.2], ("seqwise", 3): [0.6, 0.25]}
    for (bn, seed), val in curves.items():
        write(tmp_path, f"{bn}{seed}", result(config(bn, seed, 1e-3), set(range(5)), val))
    rows = {r[1]: r for r in table_rows(section(write_report(tmp_path).read_text(), "Speed of convergence"))}
    assert rows["none"][3:6] == ["30.0", "2 of 3", "≥ 3.0 ± 0.0"]  # the failed seed counts with its 3 epochs
    assert rows["seqwise"][3:6] == ["30.0", "3 of 3", "2.0 ± 0.0"]


def test_a_sooner_mean_that_is_a_lower_bound_wins_no_speed_comparison(tmp_path):
    """none's seeds reach the threshold at epoch 2, or never in 2 epochs (a lower bound of 2): mean >= 2.0
    against seqwise's exact 3.0. Sooner only on the bound, so the speed comparison is unclear, not none's."""
    curves = {("none", 1): [0.9, 0.3], ("none", 2): [0.9, 0.5], ("seqwise", 1): [0.9, 0.8, 0.3],
              ("seqwise", 2): [0.9, 0.8, 0.4]}  # medians of best val WER: 0.4 and 0.35, so the threshold is 0.4
    for (bn, seed), val in curves.items():
        write(tmp_path, f"{bn}{seed}", result(config(bn, seed, 1e-3), set(range(5)), val))
    text = write_report(tmp_path).read_text()
    rows = {r[1]: r for r in table_rows(section(text, "Speed of convergence"))}
    assert rows["none"][4:6] == ["1 of 2", "≥ 2.0 ± 0.0"] and rows["seqwise"][4:6] == ["2 of 2", "3.0 ± 0.0"]
    (c,) = json.loads((tmp_path / "report.json").read_text())["comparisons"]
    assert c["speed_winner"] is None and c["speed_censored"]
    assert table_rows(section(text, "Head to head"))[0][6] == "unclear"


def test_diverged_seeds_are_counted_not_dropped(tmp_path):
    """A seed that diverged has no test WER: the row says so beside n, and in the speed verdict it counts as
    never reaching the threshold. A setting whose every seed diverged is named, in no table."""
    write(tmp_path, "none1", result(config("none", 1, 1e-3), set(range(20)), [0.9, 0.4]))
    write(tmp_path, "none2", result(config("none", 2, 1e-3), set(range(20)), [0.9, 0.4]))
    write(tmp_path, "seq1", result(config("seqwise", 1, 1e-3), set(range(5)), [0.9, 0.3]))
    write(tmp_path, "seq2", result(config("seqwise", 2, 1e-3), set(), [0.9, 0.8, 0.7], status="diverged"))
    write(tmp_path, "post1", result(config("post", 1, 1e-3), set(), [0.9], status="diverged"))
    text = write_report(tmp_path).read_text()
    quality = {r[1]: r for r in table_rows(section(text, "Quality at convergence"))}
    assert quality["seqwise"][3] == "1 (+1 diverged)" and quality["none"][3] == "2" and "post" not in quality
    assert "Every seed diverged, so in no table: gru-post." in text
    speed = {r[1]: r for r in table_rows(section(text, "Speed of convergence"))}
    # threshold 0.4 (none's mean); seqwise: seed 1 at epoch 2, seed 2 never in its 3 epochs
    assert speed["seqwise"][4:6] == ["1 of 2", "≥ 2.5 ± 0.7"] and speed["none"][4:6] == ["2 of 2", "2.0 ± 0.0"]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["failed"] == ["gru-post"]
    assert [(r["bn"], r["n"], r["diverged"]) for r in data["rows"]] == [("none", 2, 0), ("seqwise", 1, 1)]


def test_a_variant_whose_every_rate_diverged_is_named_with_the_fix(tmp_path):
    protocol_study(tmp_path)
    p = {"lrs": [1e-3, 3e-3], "tune_seeds": [1], "seeds": [1, 2], "stage": "tune"}
    for lr in (1e-3, 3e-3):
        write(tmp_path, f"post-{lr}", result(config("post", 1, lr, p), set(), [0.9], status="diverged"))
    text = write_report(tmp_path).read_text()
    assert ("Every rate of the grid diverged, so no seeds were trained: gru-post. Add lower rates to "
            "`protocol.lrs`") in text
    assert "Still tuning" not in text
    assert ["gru-post", "diverged", "diverged"] in table_rows(section(text, "Protocol: each variant's learning rate, "
                                                                             "chosen on validation"))


def test_one_seed_comparisons_and_missing_references_are_said(tmp_path):
    """A study partway through: input and none with one seed, no finished seqwise yet."""
    write(tmp_path, "none1", result(config("none", 1, 1e-3), set(range(40)), [0.9, 0.4]))
    write(tmp_path, "input1", result(config("input", 1, 1e-3), set(), [0.9, 0.3]))
    text = write_report(tmp_path).read_text()
    (row,) = table_rows(section(text, "Head to head"))
    assert row[1] == "input vs none" and row[5] == "yes"
    assert row[-1] == "one seed on a side: its interval holds the test set's variation only"
    assert "1 of the significant rest on one seed on a side" in text
    assert "Not compared: gru: no finished `seqwise` row, so no comparison with it." in text
    assert json.loads((tmp_path / "report.json").read_text())["unpaired"] == [
        "gru: no finished `seqwise` row, so no comparison with it"]


def test_a_stale_running_run_is_reported_as_stopped(tmp_path):
    base = fake_result("gru", "none", 0)
    write(tmp_path, "live", base | {"status": "running"})
    write(tmp_path, "stopped", base | {"status": "running", "config": base["config"] | {"seed": 1}})
    hour_ago = time.time() - 3600
    for path in (tmp_path / "stopped").iterdir():
        os.utime(path, (hour_ago, hour_ago))
    text = write_report(tmp_path).read_text()
    assert "0 finished, 1 still running, 1 stopped (resume with the same command)" in text
    assert f"Stopped (nothing written for a while, so no process owns them): {tmp_path / 'stopped'}" in text
    data = json.loads((tmp_path / "report.json").read_text())
    assert (data["running"], data["stopped"], data["stopped_runs"]) == (1, 1, [str(tmp_path / "stopped")])


@pytest.mark.usefixtures("wandb_env")  # no key: auto goes offline
def test_report_is_logged_to_wandb_as_a_report_run(sweep, tmp_path, capsys):
    from wandb_offline import read_offline_run

    main([str(sweep), "--out", str(tmp_path / "out"), "--wandb"])
    assert "W&B: report logged offline, upload with `wandb sync" in capsys.readouterr().out

    run = read_offline_run(tmp_path / "out" / "wandb-report")
    assert run["run"]["job_type"] == "report" and run["run"]["group"] == "fake" and run["run"]["name"] == "report"
    assert run["config"]["study"] == "fake"
    logged = {k: v for step in run["history"] for k, v in step.items() if k.startswith("report/")}
    assert logged["report/table"]["_type"] == "table-file" and logged["report/table"]["nrows"] == 6
    files = tmp_path / "out" / "wandb-report" / "wandb"
    (table,) = files.glob(f"offline-run-*/files/{logged['report/table']['path']}")
    columns = set(json.loads(table.read_text())["columns"])
    assert {"label", "n", "dwer", "dwer_lo", "dwer_hi", "p_holm", "significant"} <= columns  # every row's keys
    assert logged["report/head_to_head"]["nrows"] == 6 and "report/tuning" not in logged  # no protocol
    assert {k for k, v in logged.items() if v.get("_type") == "image-file"} == {
        f"report/{name.removesuffix('.png')}" for name in PLOTS}
    assert run["summary"]["finished"] == 12 and run["summary"]["significance"].startswith("Significant at")


def test_runs_from_several_machines_are_named_and_their_time_ratios_qualified(tmp_path):
    for seed, host in ((1, "a: Xeon"), (2, "b: EPYC")):
        for bn in ("none", "seqwise"):
            write(tmp_path, f"{bn}-{seed}", result(config(bn, seed, 1e-3), set(), [0.9, 0.5]) | {"machine": host})
    text = write_report(tmp_path).read_text()
    assert "- Machines: 2 (a: Xeon; b: EPYC)" in text and "time ratios mix machine and variant" in text
    assert json.loads((tmp_path / "report.json").read_text())["machines"] == ["a: Xeon", "b: EPYC"]
    for path in tmp_path.rglob("results.json"):  # one machine: no such line
        path.write_text(json.dumps(json.loads(path.read_text()) | {"machine": "a: Xeon"}))
    assert "Machines:" not in write_report(tmp_path).read_text()


def test_runs_with_other_thread_counts_are_counted_and_their_time_ratios_qualified(tmp_path):
    """The grid's runs, one 2-thread job at a time (train.threads 0, from before results.json recorded threads),
    beside the normalisations' two 1-thread jobs at once."""
    for bn, threads in (("none", None), ("seqwise", 1)):
        for seed in (1, 2):
            run = result(config(bn, seed, 1e-3), set(), [0.9, 0.5])
            write(tmp_path, f"{bn}-{seed}", run | ({"threads": threads} if threads else {}))
    text = write_report(tmp_path).read_text()
    assert "- Torch threads: 2 runs with 1; 2 runs with torch's default (not recorded)." in text
    assert json.loads((tmp_path / "report.json").read_text())["threads"] == {"1": 2, "torch's default (not recorded)": 2}
    for path in tmp_path.rglob("results.json"):  # one thread count: no such line
        path.write_text(json.dumps(json.loads(path.read_text()) | {"threads": 2}))
    assert "Torch threads:" not in write_report(tmp_path).read_text()


def test_seeds_whose_epoch_times_drifted_apart_are_named_below_the_table(tmp_path):
    """The same work at speeds more than DRIFT apart on one machine: its speed changed while the study ran (seen
    on the shared VM of the AN4 study), so the time ratios are not costs, and the report says so under the table."""
    times = {("none", 1): 10.0, ("none", 2): 13.0, ("seqwise", 1): 11.5, ("seqwise", 2): 11.5 * DRIFT}
    for (bn, seed), t in times.items():
        write(tmp_path, f"{bn}-{seed}", result(config(bn, seed, 1e-3), set(), [0.9, 0.5], time_s=t))
    text = write_report(tmp_path).read_text()
    assert ("Epoch times drifted: the seeds of 1 setting did the same work on one machine at speeds up to 1.30x "
            "apart (gru-none: 10.0 to 13.0 s), so its speed changed while the study ran") in text
    assert json.loads((tmp_path / "report.json").read_text())["drift"] == [
        {"label": "gru-none", "min_s": 10.0, "max_s": 13.0, "ratio": pytest.approx(1.3)}]  # DRIFT exactly: steady
    def rewrite(name: str, **changes) -> None:
        path = tmp_path / name / "results.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))

    rewrite("none-1", epoch_time_s=10.0 / 20)
    rewrite("none-2", epoch_time_s=13.0 / 20)  # epochs under a second (smoke runs): timer noise, no warning
    assert "Epoch times drifted" not in write_report(tmp_path).read_text()
    rewrite("none-1", epoch_time_s=10.0, machine="a: Xeon")
    rewrite("none-2", epoch_time_s=13.0, machine="b: EPYC")  # two machines differ for another reason
    assert "Epoch times drifted" not in write_report(tmp_path).read_text()
    rewrite("none-2", machine="a: Xeon")
    assert "gru-none: 10.0 to 13.0 s" in write_report(tmp_path).read_text()


def test_a_stray_run_at_the_chosen_rate_stays_out_of_the_verdict(tmp_path):
    protocol_study(tmp_path)
    write(tmp_path, "stray", result(config("none", 0, 1e-3), set(range(60)), [0.9, 0.3]))  # seed 0, a plain run
    data = json.loads(write_report(tmp_path).with_name("report.json").read_text())
    assert [(r["bn"], r["seeds"]) for r in data["rows"]] == [("none", [1, 2]), ("input", [1, 2]), ("seqwise", [1, 2])]


def test_seeds_added_to_a_finished_study_join_its_verdict(tmp_path, caplog):
    """A finished study run again with more seeds for one variant (protocol.seeds=[1,2,3] after [1,2]: its tuning
    settled, it trains seqwise's seed 3 alone): one protocol, whose verdict holds the union of the seeds; the other
    variants keep theirs, and --only seed=1,2 gives the report from before."""
    protocol_study(tmp_path)
    p = {"lrs": [1e-3, 3e-3], "tune_seeds": [1], "seeds": [1, 2, 3], "stage": "final"}
    write(tmp_path, "seqwise-3", result(config("seqwise", 3, 3e-3, p), set(range(35)), [0.9, 0.3, 0.25]))
    with caplog.at_level(logging.WARNING):
        text = write_report(tmp_path).read_text()
    assert not any("different protocols" in r.getMessage() for r in caplog.records)
    data = json.loads((tmp_path / "report.json").read_text())
    assert [(r["bn"], r["seeds"]) for r in data["rows"]] == [("none", [1, 2]), ("input", [1, 2]),
                                                             ("seqwise", [1, 2, 3])]
    assert data["protocol"]["seeds"] == [1, 2, 3] and data["protocol"]["seed_lists"] == [[1, 2], [1, 2, 3]]
    assert next(r for r in data["rows"] if r["bn"] == "seqwise")["test_wer"] == pytest.approx((1 + 1 + 7) / 300)
    assert ("seeds of the verdict (`protocol.seeds`): 1, 2, 3 (the runs were made with [1, 2] and with [1, 2, 3], "
            "so a row holds whichever of these seeds its variant has: its n).") in text

    main([str(tmp_path), "--out", str(tmp_path / "before"), "--only", "seed=1,2"])
    before = json.loads((tmp_path / "before" / "report.json").read_text())
    assert [r["seeds"] for r in before["rows"]] == [[1, 2]] * 3 and before["protocol"]["seed_lists"] == [[1, 2]]


def test_a_variant_run_on_two_kinds_of_device_is_flagged(tmp_path, caplog):
    """A study resumed on a GPU machine: seed 2 of gru-none ran again, under bf16 on CUDA. Its rate was chosen
    over the CPU's tuning runs, so the report warns, and the CUDA run is a row of its own, not a third seed."""
    protocol_study(tmp_path)
    p = {"lrs": [1e-3, 3e-3], "tune_seeds": [1], "seeds": [1, 2], "stage": "final"}
    write(tmp_path, "none-gpu", result(config("none", 2, 1e-3, p), set(range(25)), [0.9, 0.4, 0.3])
          | {"device": "cuda", "bf16": True})
    with caplog.at_level(logging.WARNING):
        write_report(tmp_path)
    assert any("one variant's runs ran on cpu and cuda bf16" in r.getMessage() for r in caplog.records)
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert [(r["bn"], r["settings"].get("device"), r["seeds"]) for r in rows if r["bn"] == "none"] == [
        ("none", "cpu", [1, 2]), ("none", "cuda bf16", [2])]


def test_training_time_counts_every_run_and_sets_reused_ones_apart(tmp_path):
    """protocol_study's 9 runs of 3 epochs at 10 s: 270 s, of which the verdict's 6 runs hold 180 s; a run taken
    from another study is not counted as trained here, and a running one is."""
    protocol_study(tmp_path)
    reused = result(config("none", 3, 1e-3), set(), [0.9, 0.5], time_s=3600.0) | {"reused_from": "/elsewhere/run"}
    write(tmp_path, "reused", reused)
    running = result(config("seqwise", 3, 3e-3), set(), [0.9], time_s=90.0, status="running")
    write(tmp_path, "running", running)
    text = write_report(tmp_path).read_text()
    compute = json.loads((tmp_path / "report.json").read_text())["compute"]
    assert compute == pytest.approx({"hours": 0.1, "runs": 10, "verdict_hours": 0.075, "reused_hours": 2.0,
                                     "reused_runs": 1})
    assert "- Training time: 0.10 h over 10 runs on cpu" in text
    assert ", 0.07 h of it in the runs of the verdict; besides, 1 finished runs (2.00 h) were taken" in text


def test_only_reports_the_runs_with_those_settings_and_compares_only_them(tmp_path, capsys):
    """A folder with the grid's placements and another normalisation beside them (as the grid's folder holds
    ln, wn, ln_full after the norms study): --only model.bn=... reports the grid alone, its comparisons the
    only family Holm corrects over; rates match by value."""
    protocol_study(tmp_path)
    p = {"lrs": [1e-3, 3e-3], "tune_seeds": [1], "seeds": [1, 2], "stage": "tune"}
    for lr, val in ((1e-3, 0.5), (3e-3, 0.4)):
        write(tmp_path, f"ln-{lr}-1", result(config("ln", 1, lr, p), set(range(40)), [0.9, val]))
    everything = json.loads((write_report(tmp_path, tmp_path / "all").parent / "report.json").read_text())
    assert {r["bn"] for r in everything["rows"]} == {"none", "input", "seqwise", "ln"}
    assert len(everything["comparisons"]) == 5  # input, seqwise, ln vs none; input, ln vs seqwise

    main([str(tmp_path), "--out", str(tmp_path / "grid"), "--only", "model.bn=none,input", "--only", "model.bn=seqwise"])
    grid = json.loads((tmp_path / "grid" / "report.json").read_text())
    assert [r["bn"] for r in grid["rows"]] == ["none", "input", "seqwise"] and len(grid["comparisons"]) == 3
    assert grid["only"] == {"settings": {"model.bn": ["none", "input", "seqwise"]}, "left_out": 2}
    assert "Holm–Bonferroni over the 3 comparisons" in grid["significance"]
    assert ("- Only the runs with model.bn in none, input, seqwise (`--only`): 2 other runs in the folder are in no "
            "table, plot or comparison.") in (tmp_path / "grid" / "report.md").read_text()

    main([str(tmp_path), "--out", str(tmp_path / "rate"), "--only", "train.lr=3e-3", "--only", "model.bn=ln"])
    rate = json.loads((tmp_path / "rate" / "report.json").read_text())  # 3e-3 is the runs' 0.003
    assert rate["only"]["left_out"] == 10 and [t["by_lr"] for t in rate["tuning"]] == [{"0.001": None, "0.003": 0.4}]

    for bad, message in ((["--only", "model.norm=ln"], "--only model.norm: not a setting of these runs"),
                         (["--only", "model.bn"], "write SETTING=V1,V2"),
                         (["--only", "model.bn=wn"], "no run has model.bn in wn"),
                         (["--only", "device=cpu"], "--only device: not a setting of these runs")):  # computed, no setting
        with pytest.raises(SystemExit) as stop:
            main([str(tmp_path), "--out", str(tmp_path / "bad"), *bad])
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_the_full_layernorm_rnn_is_compared_with_the_fused_ln_it_adds_to(tmp_path):
    """ln_full (a step loop, several times ln's cost) must earn its price against ln, the fused LayerNorm of
    W x: that pair is compared head to head too, in the same Holm family; without ln, there is nothing to pair."""
    protocol_study(tmp_path)
    p = {"lrs": [1e-3, 3e-3], "tune_seeds": [1], "seeds": [1, 2], "stage": "tune"}
    for bn, errors in (("ln", 10), ("ln_full", 8)):
        for lr, val in ((1e-3, 0.5), (3e-3, 0.3)):
            for seed in (1, 2) if lr == 3e-3 else (1,):
                write(tmp_path, f"{bn}-{lr}-{seed}", result(config(bn, seed, lr, p | {"stage": "tune" if seed == 1 else "final"}),
                                                         set(range(errors + seed)), [0.9, val]))
    report = write_report(tmp_path, tmp_path / "all")
    pairs = [(c["a"].split()[0], c["b"].split()[0]) for c in json.loads((report.parent / "report.json").read_text())[
        "comparisons"]]  # labels: "gru-ln lr=0.003"
    assert ("gru-ln_full", "gru-ln") in pairs and len(pairs) == 4 + 3 + 1  # 4 vs none, 3 vs seqwise, ln_full vs ln
    assert "and `ln_full` against `ln` (a step loop against the fused variant it adds to)" in report.read_text()
    assert "Holm–Bonferroni over the 8 comparisons" in report.read_text()
    assert "| gru | ln_full | loop |" in report.read_text(), "ln_full is a step loop: its impl column says so"

    main([str(tmp_path), "--out", str(tmp_path / "no-ln"), "--only", "model.bn=none,input,seqwise,ln_full"])
    alone = json.loads((tmp_path / "no-ln" / "report.json").read_text())
    assert not any(c["b"].startswith("gru-ln ") for c in alone["comparisons"]) and len(alone["comparisons"]) == 5
    assert "against `ln`" not in (tmp_path / "no-ln" / "report.md").read_text()


def test_a_study_against_an_earlier_one_says_which_verdicts_held(sweep, tmp_path, capsys, monkeypatch):
    """The converged study beside the exponential one (the `sweep` fixture): the plain LSTM caught up with
    seqwise (that verdict no longer significant) and so left post behind (newly significant); the GRU's
    verdicts held; a variant only the new study has is a row with nothing on the earlier side."""
    new = tmp_path / "new"
    for rnn in ("gru", "lstm"):
        for bn in ERRORS:
            for seed in (0, 1):
                r = fake_result(rnn, bn, seed)
                if (rnn, bn) == ("lstm", "none"):  # as good as seqwise now, on the same utterances
                    r = result(r["config"], set(range(5)), [0.2, 0.1, 0.01]) | {"train_loss_at_best": 0.05}
                write(new, f"{rnn}-{bn}-{seed}", r)
    for seed in (0, 1):
        write(new, f"gru-ln-{seed}", result({"model": {"rnn": "gru", "bn": "ln"}, "seed": seed}, set(range(6)),
                                            [0.3, 0.2, 0.02]))
    plotted, real = [], plots.earlier_vs_new
    monkeypatch.setattr(plots, "earlier_vs_new", lambda pairs, *args: plotted.append(pairs) or real(pairs, *args))
    main([str(new), "--out", str(tmp_path / "out"), "--against", str(sweep)])
    text = (tmp_path / "out" / "against.md").read_text()
    assert text.startswith("# fake against fake")
    # the plot: each variant's earlier and new test WER, in the table's order; gru-ln only on the new side
    assert "![against](against.png)" in text and (tmp_path / "out" / "against.png").stat().st_size > 0
    (pairs,) = plotted
    drawn = {(b or a)["variant"]: (a and round(100 * a["test_wer"], 1), b and round(100 * b["test_wer"], 1))
             for a, b in pairs}
    assert drawn["lstm-none"] == (5.0, 1.0) and drawn["gru-ln"] == (None, 1.2)
    assert list(drawn) == [r[0] for r in table_rows(section(text, "Each variant"))]
    variants = {r[0]: r for r in table_rows(section(text, "Each variant"))}
    # earlier: 6% and 4% (the diverged seed in no mean), train loss 3 / 3 from the epochs; new: 1%, its recorded 0.05
    assert variants["lstm-none"][1:5] == [f"lr {SCHEMA['train']['lr']:g}", "5.0 (2)", "1.00", "3"] and variants["lstm-none"][6:] == [
        "1.0 (2)", "0.05", "3", "-4.0"]
    assert variants["gru-ln"][1:3] == ["–", "–"] and variants["gru-ln"][6] == "1.2 (2)" and variants["gru-ln"][9] == "–"
    verdicts = {(r[0], r[1]): r[6] for r in table_rows(section(text, "Each head-to-head comparison"))}
    assert verdicts[("gru", "seqwise vs none")] == "held"
    assert verdicts[("lstm", "seqwise vs none")] == "no longer significant"
    assert verdicts[("lstm", "post vs none")] == "newly significant"
    assert verdicts[("gru", "post vs none")] == "neither"
    assert verdicts[("gru", "ln vs none")] == "not in both"
    # held: also post vs seqwise, in both rnns; neither: gru post vs none; ln's two are in the new study only
    assert "3 held, 0 reversed, 1 no longer significant, 1 newly significant, 1 neither." in text
    assert (reading({"p": 0.01, "significant": True, "dwer": -0.05}, {"p": 0.01, "significant": True, "dwer": 0.03})
            == "reversed")

    with pytest.raises(SystemExit) as stop:  # a wrong earlier folder fails before anything is written
        main([str(new), "--out", str(tmp_path / "bad"), "--against", str(tmp_path / "nope")])
    assert stop.value.code == 2 and f"{tmp_path / 'nope'}: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def patience_study(root, seeds: dict | None = None, capped: tuple | None = None, preset: str = "an4_cpu_patience"):
    """none and seqwise at one rate, tuned on seeds 1 and 2 (stage tune at 3/6, cap 150), then stage patience at
    6/12, cap 300: none's mean improves (20% against 30%), so it keeps 6/12; seqwise's worsens (35%), so it keeps
    3/6. Then the final seeds at those (`seeds`: each placement's, by default the preset's 1-6). `capped`: (bn,
    seed) of a run that reached the cap."""
    p = {"lrs": [1e-3], "tune_seeds": [1, 2], "seeds": [1, 2, 3, 4, 5, 6], "tune_patience": 1}
    seeds = seeds or {}
    for bn, patient in (("none", 0.20), ("seqwise", 0.35)):
        chosen = 12 if bn == "none" else 6
        for patience, seed in [(6, 1), (6, 2), (12, 1), (12, 2)] + [(chosen, s) for s in seeds.get(bn, range(3, 7))
                                                                   if s > 2]:
            c = config(bn, seed, 1e-3, p | {"stage": "tune" if patience == 6 and seed <= 2 else "patience"})
            c["train"] |= {"schedule": "plateau", "plateau_wait": patience // 2, "patience": patience,
                           "epochs": 25 * patience}
            val = patient if patience == 12 and seed <= 2 else 0.30
            r = result(c, set(range(10 if bn == "seqwise" else 20)), [0.9, val + 0.1, val])
            write(root, f"{bn}-{patience}-{seed}", r | {"preset": preset, "commit": "c0ffee",
                                                        "stop": "cap" if (bn, seed) == capped else "patience"})


def test_the_patience_stage_in_the_tuning_table_and_the_verdict_at_the_chosen_schedule(tmp_path):
    patience_study(tmp_path)
    text = write_report(tmp_path).read_text()
    tuning = section(text, "Protocol: each variant's learning rate and the schedule's patience, chosen on validation")
    assert "| variant | lr 0.001 | 3/6, cap 150 | 6/12, cap 300 |" in tuning
    assert table_rows(tuning) == [["gru-none", "**30.0 ✓**", "30.0", "**20.0 ✓**"],
                                  ["gru-seqwise", "**30.0 ✓**", "**30.0 ✓**", "35.0"]]
    assert "The search is by coordinates: the rate was chosen at the shorter patience (3/6, cap 150)" in tuning
    assert "The most patient schedule tried (6/12, cap 300) won, so a more patient one might do better still: " \
           "gru-none." in tuning
    data = json.loads((tmp_path / "report.json").read_text())
    assert [(r["bn"], r["settings"]["train.patience"], r["seeds"]) for r in data["rows"]] == [
        ("none", 12, [1, 2, 3, 4, 5, 6]), ("seqwise", 6, [1, 2, 3, 4, 5, 6])]
    assert "- Trained at commit c0ffee (16 runs)" in text and data["commits"] == {"c0ffee": 16}


def test_a_verdict_is_called_pre_registered_only_over_the_presets_seeds(tmp_path):
    patience_study(tmp_path / "held")
    text = write_report(tmp_path / "held").read_text()
    assert "- Seeds fixed in advance: every row of the verdict holds exactly the seeds 1, 2, 3, 4, 5, 6 that the " \
           "preset `an4_cpu_patience` gives" in text and "Not pre-registered" not in text
    patience_study(tmp_path / "short", seeds={"seqwise": [1, 2, 3]})  # seqwise's seeds 4-6 never ran
    text = write_report(tmp_path / "short").read_text()
    assert "Seeds fixed in advance" not in text
    assert "- Not pre-registered: the preset `an4_cpu_patience` writes seeds 1, 2, 3, 4, 5, 6, and these rows hold " \
           "others: gru-seqwise" in text
    data = json.loads((tmp_path / "short" / "report.json").read_text())
    assert data["preregistered"]["held"] is False and data["preregistered"]["differ"] == [data["rows"][1]["label"]]
    patience_study(tmp_path / "other", preset="an4_cpu_plateau")  # a preset that fixes seeds 1-3 only
    assert "- Not pre-registered: the preset `an4_cpu_plateau` writes seeds 1, 2, 3," in write_report(
        tmp_path / "other").read_text()


def test_a_run_that_reaches_the_cap_of_the_plateau_schedule_is_marked(tmp_path):
    patience_study(tmp_path, capped=("seqwise", 4))  # stopped by the cap, whether or not still improving
    text = section(write_report(tmp_path).read_text(), "Quality at convergence")
    head = next(line for line in text.splitlines() if line.startswith("| rnn"))
    n = [c.strip() for c in head.strip("|").split("|")].index("n")  # after the columns of the varying settings
    rows = {r[1]: r for r in table_rows(text)}
    assert rows["seqwise"][n] == "6 †1" and rows["none"][n] == "6"


def test_against_names_the_patience_each_study_chose():
    row = {"lr": 2e-3, "settings": {"train.spec_augment.enabled": True, "train.plateau_wait": 6, "train.patience": 12}}
    assert chosen(row) == "lr 0.002, SpecAugment on, patience 6/12"
    assert chosen({"lr": 2e-3, "settings": {}}) == "lr 0.002"  # neither tuned


MACHINE = "host: AMD EPYC 9B14 (boot 1234abcd)"


def bench_file(path, rows: list[tuple]) -> str:
    """experiments/bench_inference.py --json's file: a line per (rnn, bn, way, time_ratio[, batch, threads, layers,
    hidden]), batch 1, 1 thread, 3 x 256 (the schema's size, the fake runs') unless given."""
    lines = []
    for rnn, bn, way, ratio, *rest in rows:
        batch, threads, layers, hidden = rest + [1, 1, 3, 256][len(rest):]
        lines.append(json.dumps({"size": "an4_cpu_plateau", "layers": layers, "hidden": hidden, "rnn": rnn, "bn": bn,
                                 "backend": "fused", "way": way, "batch": batch, "threads": threads, "seconds": 1.0,
                                 "rtf": 0.003, "time_ratio": ratio, "peak_mb": 65.0, "mem_ratio": 1.0, "audio_s": 357.0,
                                 "utterances": 130, "rounds": 10, "machine": MACHINE, "cpus": 2, "torch": "2.11.0",
                                 "onnxruntime": "1.32.0", "date": "2026-12-07 02:38 UTC"}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_results_table_gains_each_variants_cost_to_serve_from_the_inference_bench(sweep, tmp_path):
    """--inference: each row's time over none's from the bench rows of its rnn and size, at batch 1 on 1 thread
    where the file has them (its first configuration is another); the folded model where the variant folds (what
    one ships), else the eval-mode one, marked; – where the file has no row of that variant, size or configuration."""
    bench = bench_file(tmp_path / "inference.jsonl", [
        ("gru", "post", "folded", 1.5, 16, 2),  # the file's first configuration, not the server's
        ("gru", "none", "eval", 1.0), ("gru", "none", "folded", 1.0),
        ("gru", "post", "eval", 1.3), ("gru", "post", "folded", 1.02),  # folds: the folded ratio
        ("gru", "seqwise", "eval", 1.4),  # no folded row: eval's, marked
        ("gru", "seqwise", "folded", 9.0, 1, 1, 5, 1024),  # another size
        ("lstm", "none", "folded", 1.0), ("lstm", "seqwise", "folded", 0.98, 16, 2)])  # lstm-post: none at all
    main([str(sweep), "--out", str(tmp_path / "out"), "--inference", bench])
    text = (tmp_path / "out" / "report.md").read_text()
    table = section(text, "Quality at convergence")
    assert table.split("\n| ")[1].split(" | ")[11:14] == ["mem × none", "serve × none", "params"]
    assert [(r[0], r[1], r[12]) for r in table_rows(table)] == [
        ("gru", "none", "1.00"), ("gru", "post", "1.02"), ("gru", "seqwise", "1.40 (eval)"),
        ("lstm", "none", "1.00"), ("lstm", "post", "–"), ("lstm", "seqwise", "–")]
    assert f"from experiments/bench_inference.py's `{bench}`" in table
    assert f"Measured at batch 1 on 1 thread, on {MACHINE}, 2 CPUs, torch 2.11.0, onnxruntime 1.32.0, 2026-12" in table
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(r["label"], r["serve_ratio"], r["serve_way"]) for r in data["rows"]] == [
        ("gru-none", 1.0, "folded"), ("gru-post", 1.02, "folded"), ("gru-seqwise", 1.4, "eval"),
        ("lstm-none", 1.0, "folded"), ("lstm-post", None, None), ("lstm-seqwise", None, None)]
    assert data["inference"]["file"] == bench and (data["inference"]["batch"], data["inference"]["threads"]) == (1, 1)


def test_an_inference_file_that_does_not_fit_the_runs_is_one_clear_error(tmp_path, capsys):
    """Without batch 1 on 1 thread the file's first configuration; a file of another model size, unparsable or
    missing: an `error:` line that names the fix, exit 2, and nothing written."""
    write(tmp_path / "sweep", "one", fake_result("gru", "none", 0))
    main([str(tmp_path / "sweep"), "--out", str(tmp_path / "ok"), "--inference",
          bench_file(tmp_path / "batched.jsonl", [("gru", "none", "folded", 1.0, 16, 2)])])
    ok = (tmp_path / "ok" / "report.md").read_text()
    assert table_rows(section(ok, "Quality at convergence"))[0][12] == "1.00"
    assert "Measured at batch 16 on 2 threads, on" in ok
    (tmp_path / "broken.jsonl").write_text('{"layers": 3, "hidden"\n')
    for name, rows, message in (
            ("gpu.jsonl", [("gru", "none", "folded", 1.0, 1, 1, 5, 1024)],
             "no row of the runs' model size (3 x 256); the file has 5 x 1024; run python "
             "experiments/bench_inference.py --json"),
            ("broken.jsonl", None, "line 1 is no bench row"),
            ("missing.jsonl", None, "no such file; write it with python experiments/bench_inference.py --json")):
        path = bench_file(tmp_path / name, rows) if rows else str(tmp_path / name)
        with pytest.raises(SystemExit) as stop:
            main([str(tmp_path / "sweep"), "--out", str(tmp_path / "bad"), "--inference", path])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith(f"error: --inference {path}: ") and message in err, err
        assert err.count("\n") == 1 and not (tmp_path / "bad").exists()
