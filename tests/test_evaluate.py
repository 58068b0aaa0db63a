"""A trained model outside its run: best.pt rebuilds the model, and `python -m batchrnn.evaluate` re-scores
a run and transcribes audio files with it, on the generated smoke corpus."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import soundfile as sf
import torch
from hydra import compose, initialize_config_dir

from batchrnn.training.checkpoint import load_model
from batchrnn.data.corpus import prepare_corpus
from batchrnn.model import DeepSpeech2
from batchrnn.training.rundir import BEST, RESULTS
from batchrnn.training.loop import train
from conftest import ROOT


def evaluate(*args: str) -> subprocess.CompletedProcess:
    # This checkout's package, whichever one the environment has installed.
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "batchrnn.evaluate", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture(scope="module")
def run(tmp_path_factory, smoke_root):
    """One finished smoke run: its folder, its config and its results."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=smoke", f"data.root={smoke_root}"])
    out = tmp_path_factory.mktemp("run")
    return out, cfg, train(cfg, out)


def test_checkpoint_rebuilds_the_same_model(run):
    out, cfg, results = run
    blob = torch.load(out / BEST, weights_only=True)
    assert blob["config"]["model"] == results["config"]["model"] and blob["epoch"] == results["best_epoch"]
    model, info = load_model(out / BEST)
    assert "state_dict" not in info and info["val_wer"] == results["best_val_wer"]
    assert not model.training
    reference = DeepSpeech2(cfg.model, blob["num_features"], len(blob["labels"]))  # built from the run's config
    reference.load_state_dict(blob["state_dict"])
    reference.eval()
    x, lengths = torch.randn(3, blob["num_features"], 120), torch.tensor([120, 90, 41])
    with torch.no_grad():
        (a, a_lens), (b, b_lens) = model(x, lengths), reference(x, lengths)
    assert torch.equal(a, b) and torch.equal(a_lens, b_lens)


def test_score_reprints_the_runs_test_wer(run, tmp_path, smoke_root):
    out, _, results = run
    done = evaluate("score", str(out), "--split", "test", "--data-root", str(smoke_root),
                    "--out", str(tmp_path / "scores.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"test WER {100 * results['test_wer']:.2f}%" in done.stdout and "12 utterances" in done.stdout
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert scores["wer"] == results["test_wer"] and scores["utterances"] == results["test_utterances"]


def test_transcribe_sphere_and_wav_as_the_run_decoded_them(run, tmp_path):
    out, cfg, results = run
    # The utterance with the longest hypothesis, so that a wrong decode shows.
    utt = max(results["test_utterances"], key=lambda u: len(u["hyp"]))
    sphere = next(u.path for u in prepare_corpus(cfg.data).splits["test"] if u.id == utt["id"])
    samples, rate = sf.read(sphere, dtype="int16")
    wav = tmp_path / f"{utt['id']}.wav"
    sf.write(wav, samples, rate, subtype="PCM_16")
    done = evaluate("transcribe", str(out / BEST), sphere, str(wav))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [f"{sphere}\t{utt['hyp']}", f"{wav}\t{utt['hyp']}"]


def test_bare_state_dict_is_refused_clearly(run, tmp_path):
    old = tmp_path / BEST  # best.pt as runs wrote it before checkpoints held their config
    torch.save(torch.load(run[0] / BEST, weights_only=True)["state_dict"], old)
    done = evaluate("score", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {old}: a bare state dict without the config that rebuilds the model (best.pt of a run trained "
        "before checkpoints held their config); only runs trained by this version can be used: train it again "
        "(train.rerun=true)"]


def test_other_sample_rate_is_refused_clearly(run, tmp_path):
    wav = tmp_path / "8k.wav"
    sf.write(wav, torch.zeros(8000).numpy(), 8000)
    done = evaluate("transcribe", str(run[0]), str(wav))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: {wav}: sample rate 8000 Hz, the model reads 16000 Hz audio; resample it "
        f"(e.g. sox {wav} -r 16000 out.wav)"]


def test_non_finite_audio_is_refused_clearly(run, tmp_path):
    """Its features would be NaN, and its transcript empty."""
    wav = tmp_path / "nan.wav"
    sf.write(wav, torch.full((8000,), float("nan")).numpy(), 16000, subtype="FLOAT")
    done = evaluate("transcribe", str(run[0]), str(wav))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: {wav}: non-finite samples (NaN or infinity); replace it with a good copy, or leave it out"]


def test_missing_run_and_results_file_instead_of_checkpoint(run, tmp_path):
    done = evaluate("score", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "nowhere: no such file" in done.stderr
    done = evaluate("transcribe", str(run[0] / RESULTS), "a.wav")
    assert done.returncode == 2 and "not a readable model file" in done.stderr and "Traceback" not in done.stderr


def test_step_cost_times_a_trained_model_and_its_fresh_twin_on_the_same_batches(run, tmp_path, capsys):
    """experiments/step_cost.py: one row per model (trained, and at its seed's initialisation), and a clear
    error for runs whose data settings differ, since no batches would fit them all."""
    spec = importlib.util.spec_from_file_location("step_cost", ROOT / "experiments" / "step_cost.py")
    step_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_cost)
    out = run[0]
    step_cost.main([str(out), "--fresh", "--batches", "1", "--rounds", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:-4] for r in rows] == [[out.name], [out.name, "(fresh)"]]
    assert all(float(r[-4]) > 0 and float(r[-3]) > 0 for r in rows)

    other = tmp_path / "other-s1"
    other.mkdir()
    blob = torch.load(out / BEST, weights_only=True)
    blob["config"]["data"]["hop_ms"] = 2 * blob["config"]["data"]["hop_ms"]
    torch.save(blob, other / BEST)
    with pytest.raises(SystemExit) as stop:
        step_cost.main([str(out), str(other)])
    assert stop.value.code == 2
    assert f"other and {out.name} differ in data.hop_ms: give runs of one preset" in capsys.readouterr().err
    step_cost.main([str(out), "--phases", "--batches", "1", "--rounds", "1"])
    head, row = capsys.readouterr().out.splitlines()[1:]
    assert head.split() == ["model", *step_cost.PHASES, "total"] and row.split()[0] == out.name
    ms = dict(zip(head.split()[1:], map(float, row.split()[1:])))
    assert ms["forward"] > 0 and ms["backward"] > 0 and ms["optimizer"] > 0
    assert sum(ms[p] for p in step_cost.PHASES) == pytest.approx(ms["total"], abs=0.1 * len(step_cost.PHASES))
