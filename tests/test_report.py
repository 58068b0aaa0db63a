"""The study report on a fake sweep: 2 rnn x 3 bn x 2 seeds with known WERs, times and memory."""
import json

import matplotlib.image
import pytest

from batchrnn import report

UTTERANCES = 100  # five words each, so one wrong word is 0.2% of the test set's words
# (rnn, bn) -> word errors per seed; seqwise is clearly better than none, post is as good as none.
ERRORS = {"none": (30, 20), "post": (30, 20), "seqwise": (5, 5)}
EPOCH_TIME = {"none": (9.5, 10.5), "post": (11.0, 11.0), "seqwise": (11.5, 12.5)}  # means 10, 11, 12
PEAK_MEM = {"none": (800.0, 800.0), "post": (900.0, 900.0), "seqwise": (1000.0, 1000.0)}


def fake_result(rnn: str, bn: str, seed: int) -> dict:
    errors, time_s, mem = ERRORS[bn][seed], EPOCH_TIME[bn][seed], PEAK_MEM[bn][seed]
    # post errs on other utterances than none: the same WER, but not paired utterance by utterance.
    wrong = set(range(UTTERANCES - errors, UTTERANCES)) if bn == "post" else set(range(errors))
    utts = [{"id": f"u{i}", "ref": "YES NO GO STOP ONE", "hyp": ("X" if i in wrong else "YES") + " NO GO STOP ONE"}
            for i in range(UTTERANCES)]
    wer = errors / (5 * UTTERANCES)
    epochs = [{"epoch": e, "train_loss": 3 / e, "val_loss": 3 / e, "val_wer": wer + 0.1 / e, "val_cer": wer / 2,
               "epoch_time_s": time_s, "peak_mem_mb": mem, "utt_per_s": 20.0, "lr": 1e-3} for e in (1, 2, 3)]
    return {"status": "finished", "config": {"model": {"rnn": rnn, "bn": bn, "impl": "fused"}, "seed": seed},
            "rnn": rnn, "bn": bn, "impl": "fused", "seed": seed, "study": "fake", "preset": "an4_cpu",
            "epochs": epochs, "best_epoch": 3, "best_val_wer": wer + 0.1 / 3, "test_wer": wer, "test_cer": wer / 2,
            "epoch_time_s": time_s, "peak_mem_mb": mem, "params": 1_234_567, "device": "cpu",
            "torch_version": "2.11.0", "test_utterances": utts}


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    for rnn in ("gru", "lstm"):
        for bn in ERRORS:
            for seed in (0, 1):
                run = root / f"{rnn}-{bn}" / f"seed{seed}"  # nested: the report searches recursively
                run.mkdir(parents=True)
                (run / "results.json").write_text(json.dumps(fake_result(rnn, bn, seed)))
    running = {k: v for k, v in fake_result("gru", "none", 0).items() if not k.startswith("test_")}
    running.update(status="running", seed=2, epochs=running["epochs"][:2])
    (root / "gru-none" / "seed2").mkdir()
    (root / "gru-none" / "seed2" / "results.json").write_text(json.dumps(running))
    (root / "lstm-none" / "seed3").mkdir()  # stopped by TrainingDiverged
    diverged = running | {"status": "diverged", "seed": 3, "rnn": "lstm", "error": "the run has diverged"}
    (root / "lstm-none" / "seed3" / "results.json").write_text(json.dumps(diverged))
    (root / "broken").mkdir()
    (root / "broken" / "results.json").write_text('{"status": "finis')
    return root


def table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")][1:]  # drop the header
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_report(sweep, tmp_path):
    with pytest.warns(UserWarning, match=r"skipping .*broken.*results\.json"):
        path = report.write_report(sweep, tmp_path / "out")
    text = path.read_text()
    assert path == tmp_path / "out" / "report.md"

    assert "Study report: fake" in text and "an4_cpu" in text and "torch 2.11.0" in text
    assert "CPU-sized preset" in text
    assert "12 finished, 1 still running, 1 diverged" in text and "1 unreadable" in text

    rows = table_rows(text)
    assert [r[:4] for r in rows] == [[rnn, bn, "fused", "2"] for rnn in ("gru", "lstm") for bn in ERRORS]
    gru_none, gru_post, gru_seqwise = rows[:3]
    assert gru_none[4] == "5.0 ± 1.4"  # (6% + 4%) / 2, sample std 1.41
    assert gru_seqwise[4] == "**1.0 ± 0.0**"  # the best test WER of gru is bold
    assert gru_none[7] == "10.0 ± 0.7" and gru_post[7] == "11.0 ± 0.0"
    assert (gru_none[9], gru_post[9], gru_seqwise[9]) == ("1.00", "1.10", "1.20")  # time × none
    assert (gru_none[10], gru_seqwise[10]) == ("1.00", "1.25")  # memory × none
    assert gru_none[11] == "1,234,567"
    assert gru_none[12] == "(baseline)"
    assert gru_seqwise[12].startswith("-4.0 [") and gru_seqwise[12].endswith("*")
    assert not gru_post[12].endswith("*")
    assert "Significant at 95%" in text and "gru-seqwise (-4.0 points, better)" in text

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["finished"] == 12 and data["running"] == 1 and data["diverged"] == 1 and len(data["skipped"]) == 1
    by_label = {r["label"]: r for r in data["rows"]}
    seqwise = by_label["lstm-seqwise"]
    assert seqwise["significant"] and seqwise["dwer_hi"] < 0 < -seqwise["dwer_lo"]
    assert not by_label["lstm-post"]["significant"]
    assert by_label["lstm-post"]["dwer_lo"] < 0 < by_label["lstm-post"]["dwer_hi"]
    assert by_label["gru-none"]["time_ratio"] == pytest.approx(1.0)
    assert by_label["gru-seqwise"]["time_ratio"] == pytest.approx(1.2)

    for name in report.PLOTS:
        png = tmp_path / "out" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(png).shape[0] > 100  # decodes as an image
        assert f"]({name})" in text  # embedded with a relative link


def run_with_errors(bn: str, seed: int, wrong: int) -> dict:
    """A fake run whose first `wrong` utterances have one word wrong."""
    result = fake_result("gru", "none", 0) | {"bn": bn, "seed": seed}
    result["test_utterances"] = [dict(u, hyp=("X" if i < wrong else "YES") + " NO GO STOP ONE")
                                 for i, u in enumerate(result["test_utterances"])]
    return result


def test_one_failed_seed_is_not_a_significant_difference():
    """Three seeds of none and of post, all alike but post's third, which failed to train: pooling the seeds
    per utterance makes post 20 points worse on nearly every utterance, but two seeds in three say the
    placements are the same, so the seed level of the bootstrap must keep 0 in the interval."""
    none = [run_with_errors("none", seed, 10) for seed in (1, 2, 3)]
    post = [run_with_errors("post", seed, 10) for seed in (1, 2)] + [run_with_errors("post", 3, 100)]
    dwer, lo, hi = report.paired_bootstrap(post, none)
    assert dwer == pytest.approx(30 / 500)  # (10 + 10 + 100) / 3 - 10 word errors, of 500 words
    assert lo <= 0 < hi
    # The same difference made by every seed is significant.
    consistent = [run_with_errors("post", seed, 40) for seed in (1, 2, 3)]
    dwer, lo, hi = report.paired_bootstrap(consistent, none)
    assert dwer == pytest.approx(30 / 500) and 0 < lo < dwer < hi


def test_single_seed_has_no_std_and_cli_defaults_out_to_sweep(tmp_path, capsys):
    run = tmp_path / "sweep" / "one"
    run.mkdir(parents=True)
    result = fake_result("gru", "none", 0)
    del result["test_utterances"]
    (run / "results.json").write_text(json.dumps(result))
    report.main([str(tmp_path / "sweep")])
    assert "wrote" in capsys.readouterr().out
    rows = table_rows((tmp_path / "sweep" / "report.md").read_text())
    assert rows[0][3:5] == ["1", "**6.0**"]
    assert "No paired comparison" in (tmp_path / "sweep" / "report.md").read_text()


def test_missing_sweep_is_one_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no such folder"):
        report.main([str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no readable results.json"):
        report.main([str(tmp_path / "empty")])


@pytest.fixture
def depth_sweep(tmp_path):
    """gru at depths 1 and 3, none and seqwise, 2 seeds: seqwise is as good as none at depth 1 (on other
    utterances) and clearly better at depth 3."""
    root = tmp_path / "depth"
    for layers in (1, 3):
        for bn in ("none", "seqwise"):
            for seed in (0, 1):
                result = fake_result("gru", "post" if (layers, bn) == (1, "seqwise") else bn, seed)
                result["bn"] = result["config"]["model"]["bn"] = bn
                result["config"]["model"]["num_layers"] = layers  # results files keep the depth in config only
                run = root / f"model.bn={bn},model.num_layers={layers},seed={seed}"
                run.mkdir(parents=True)
                (run / "results.json").write_text(json.dumps(result))
    return root


def test_depth_sweep_compares_within_each_depth(depth_sweep, tmp_path):
    text = report.write_report(depth_sweep, tmp_path / "out").read_text()
    rows = table_rows(text.split("## BN's effect by depth")[0])
    assert [r[:5] for r in rows] == [["gru", str(layers), bn, "fused", "2"] for layers in (1, 3)
                                     for bn in ("none", "seqwise")]
    assert rows[0][-1] == rows[2][-1] == "(baseline)"  # each depth has its own none
    assert not rows[1][-1].endswith("*") and rows[3][-1].startswith("-4.0 [") and rows[3][-1].endswith("*")
    assert rows[0][5] == rows[1][5] == "**5.0 ± 1.4**"  # bold per depth: a tie at depth 1
    assert "gru-seqwise-L3 (-4.0 points, better)" in text and "not significant: 1 of 2" in text

    effect = table_rows(text.split("## BN's effect by depth")[1].split("## Plots")[0])
    assert "| rnn | bn | impl | depth 1 | depth 3 |" in text
    assert effect[0][:3] == ["gru", "seqwise", "fused"] and effect[0][4].endswith("*")
    assert not effect[0][3].endswith("*")

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(r["label"], r["num_layers"]) for r in data["rows"]] == [
        ("gru-none-L1", 1), ("gru-seqwise-L1", 1), ("gru-none-L3", 3), ("gru-seqwise-L3", 3)]
    for name in report.PLOTS + (report.DEPTH_PLOT,):
        assert matplotlib.image.imread(tmp_path / "out" / name).shape[0] > 100
        assert f"]({name})" in text


@pytest.mark.usefixtures("wandb_env")  # no key: auto goes offline
def test_report_is_logged_to_wandb_as_a_report_run(sweep, tmp_path, capsys):
    from wandb_offline import read_offline_run

    with pytest.warns(UserWarning, match="broken"):
        report.main([str(sweep), "--out", str(tmp_path / "out"), "--wandb"])
    assert "W&B: report logged offline, upload with `wandb sync" in capsys.readouterr().out

    run = read_offline_run(tmp_path / "out" / "wandb-report")
    assert run["run"]["job_type"] == "report" and run["run"]["group"] == "fake" and run["run"]["name"] == "report"
    assert run["config"]["study"] == "fake"
    logged = {k: v for step in run["history"] for k, v in step.items() if k.startswith("report/")}
    assert logged["report/table"]["_type"] == "table-file" and logged["report/table"]["nrows"] == 6
    assert {k for k, v in logged.items() if v.get("_type") == "image-file"} == {
        f"report/{name.removesuffix('.png')}" for name in report.PLOTS}
    assert run["summary"]["finished"] == 12 and run["summary"]["significance"].startswith("Significant at 95%")
