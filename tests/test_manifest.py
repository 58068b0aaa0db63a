"""data=manifest: NeMo-style JSON-lines manifests on tiny generated corpora (WAV, FLAC, MP3, other rates), every
kind of bad line, the run's identity, and AN4 exported as manifests training as the built-in path does."""
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from omegaconf import OmegaConf

from batchrnn.config import ConfigError, DataConfig, to_container
from batchrnn import evaluate
from batchrnn.data import features, manifest, prepare
from batchrnn.data.base import DataError, corpus_changes
from batchrnn.data.corpus import prepare_corpus
from batchrnn.data.features import Featurizer, load_features
from batchrnn.training.rundir import RESULTS
from batchrnn.data.manifest import pin_content
from batchrnn.study.scheduler import jobs
from batchrnn.training.identity import mismatch, run_name
from batchrnn.training.loop import train
from batchrnn.validation import validate
from conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore:.*skipping", "ignore:.*normalised",
                                        "ignore:AN4 archive of unknown checksum")
RATE = 16000


def write_audio(path: Path, seconds: float, rate: int = RATE, seed: int = 0, **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(seconds * rate)) / rate
    audio = 0.3 * np.sin(2 * np.pi * (300 + 50 * seed) * t) + 0.01 * np.random.default_rng(seed).standard_normal(len(t))
    sf.write(path, (audio * 32767).astype(np.int16), rate, **kwargs)  # integers every format stores alike
    return path


def write_manifest(path: Path, entries: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    return path


def entry(audio: str, text: str = "YES", duration: float = 0.5, **extra) -> dict:
    return {"audio_filepath": audio, "duration": duration, "text": text, **extra}


@pytest.fixture
def corpus_dir(tmp_path):
    """Six speakers of two 0.5 s WAVs each under corpus/wav/, and a 2 s file to take segments of."""
    root = tmp_path / "corpus"
    for s in range(6):
        for u in range(2):
            write_audio(root / "wav" / f"s{s}" / f"{u}.wav", 0.5, seed=s)
    write_audio(root / "wav" / "long.wav", 2.0, seed=9)
    return root


def lines(speakers=range(6)) -> list[dict]:
    return [entry(f"wav/s{s}/{u}.wav", "GO A", speaker=f"s{s}") for s in speakers for u in range(2)]


def data_cfg(tmp_path, **manifests) -> DataConfig:
    return DataConfig(corpus="manifest", root=str(tmp_path / "data"), **{k: str(v) for k, v in manifests.items()})


# -- good corpora -----------------------------------------------------------------------------------

def test_a_manifest_corpus_in_its_own_order_paths_relative_to_the_manifest(tmp_path, corpus_dir):
    train = write_manifest(corpus_dir / "train.jsonl", lines(range(4)) + [
        entry("wav/long.wav", "yes, no.", duration=1.0), entry("wav/long.wav", "stop", duration=0.5, offset=1.25,
                                                               lang="en")])
    val = write_manifest(corpus_dir / "val.jsonl", lines([4]))
    test = write_manifest(corpus_dir / "lists" / "test.jsonl",
                          [entry(str(corpus_dir / "wav/s5/0.wav")), entry("../wav/s5/1.wav", "NO")])
    with pytest.warns(UserWarning, match="2 train transcripts normalised"):
        corpus = prepare_corpus(data_cfg(tmp_path, train=train, val=val, test=test))
    ids = [u.id for u in corpus.splits["train"]]
    # ids: the path under the manifests' common folder, and the offset where the utterance starts inside its file
    assert ids == [f"wav/s{s}/{u}.wav" for s in range(4) for u in range(2)] + ["wav/long.wav", "wav/long.wav@1.25"]
    assert [u.id for u in corpus.splits["test"]] == ["wav/s5/0.wav", "wav/s5/1.wav"]  # absolute and ../ alike
    assert corpus.splits["train"][8].text == "YES NO" and corpus.splits["train"][9].text == "STOP"
    assert corpus.summary["normalized_ids"]["train"] == ["wav/long.wav", "wav/long.wav@1.25"]
    assert corpus.summary["utterances"] == {"train": 10, "val": 2, "test": 2}
    assert corpus.summary["speakers"] == {"train": 4, "val": 1, "test": 0}
    assert corpus.summary["minutes"]["train"] == round((8 * 0.5 + 1.0 + 0.5) / 60, 2)
    assert corpus.summary["val"] == "manifest" and corpus.summary["manifests"]["test"] == str(test)
    fs = load_features(corpus, "train", data_cfg(tmp_path))
    # a 0.5 s file, its first second (of 2 s) and 0.5 s from 1.25 s: 10 ms frames, centred windows
    assert fs.lengths[0] == 51 and fs.lengths[8] == 101 and fs.lengths[9] == 51
    whole = sf.read(corpus_dir / "wav/s0/0.wav", dtype="float32")[0]
    assert torch.equal(fs.feats[0], Featurizer(data_cfg(tmp_path))(torch.from_numpy(whole)))
    segment = sf.read(corpus_dir / "wav/long.wav", dtype="float32")[0][20000:28000]
    assert torch.equal(fs.feats[9], Featurizer(data_cfg(tmp_path))(torch.from_numpy(segment)))


def test_without_val_a_seeded_split_by_speaker_is_written_and_reused(tmp_path, corpus_dir):
    train = write_manifest(corpus_dir / "train.jsonl", lines(range(5)))
    test = write_manifest(corpus_dir / "test.jsonl", lines([5]))
    cfg = data_cfg(tmp_path, train=train, test=test)
    cfg.val_fraction = 0.4
    corpus = prepare_corpus(cfg)
    val_speakers = {u.speaker for u in corpus.splits["val"]}
    assert len(val_speakers) == 2 and not val_speakers & {u.speaker for u in corpus.splits["train"]}
    assert len(corpus.splits["val"]) == 4 and len(corpus.splits["train"]) == 6
    split_file = Path(corpus.summary["val"].split(" (")[0])
    saved = json.loads(split_file.read_text())
    assert split_file.parent == tmp_path / "data" / "manifest" and saved["val_speakers"] == sorted(val_speakers)
    mtime = split_file.stat().st_mtime_ns
    assert prepare_corpus(cfg).splits == corpus.splits and split_file.stat().st_mtime_ns == mtime  # read back
    cfg.split_seed = 1
    prepare_corpus(cfg)
    assert len(list(split_file.parent.glob("splits-*.json"))) == 2  # another seed, another split of its own
    # without speakers: single utterances, seeded
    write_manifest(train, [{k: v for k, v in e.items() if k != "speaker"} for e in lines(range(5))])
    cfg.split_seed = 0
    by_utterance = prepare_corpus(cfg)
    assert len(by_utterance.splits["val"]) == 4 and "single utterances" in by_utterance.summary["val"]


# -- audio ----------------------------------------------------------------------------------------------

def test_another_rate_is_resampled_and_logged_once(tmp_path, caplog):
    for u in range(4):
        write_audio(tmp_path / f"{u}.wav", 1.0, rate=8000, seed=u)
    cfg = data_cfg(tmp_path, train=write_manifest(tmp_path / "train.jsonl", [entry(f"{u}.wav", duration=1.0)
                                                                             for u in range(3)]),
                   test=write_manifest(tmp_path / "test.jsonl", [entry("3.wav", duration=1.0)]))
    cfg.val = cfg.train.replace("train", "val")
    write_manifest(Path(cfg.val), [entry("0.wav", duration=0.5, offset=0.5)])
    corpus = prepare_corpus(cfg)
    with caplog.at_level(logging.WARNING):
        fs = {split: load_features(corpus, split, cfg) for split in corpus.splits}
    assert caplog.text.count("resampling 8000 Hz audio to 16000 Hz with torchaudio") == 1
    assert fs["train"].lengths == [101, 101, 101] and fs["val"].lengths == [51]  # 10 ms frames at 16 kHz


def test_flac_sphere_and_mp3_read_as_wav(tmp_path):
    formats = {"wav": {}, "flac": {}, "sph": {"format": "NIST", "subtype": "PCM_16"}}
    if "MP3" in sf.available_formats():  # libsndfile 1.1 and later
        formats["mp3"] = {"format": "MP3"}
    for ext, kwargs in formats.items():
        write_audio(tmp_path / f"a.{ext}", 1.0, **kwargs)
    for name in ("b", "c"):
        write_audio(tmp_path / f"{name}.wav", 0.5)
    manifest = write_manifest(tmp_path / "m.jsonl", [entry(f"a.{ext}", duration=1.0) for ext in formats])
    val, test = (write_manifest(tmp_path / f"{name}.jsonl", [entry(f"{name}.wav")]) for name in ("b", "c"))
    corpus = prepare_corpus(data_cfg(tmp_path, train=manifest, val=val, test=test))
    fs = load_features(corpus, "train", DataConfig(n_mels=32))
    assert fs.lengths[:3] == [101, 101, 101]
    assert torch.equal(fs.feats[0], fs.feats[1]) and torch.equal(fs.feats[0], fs.feats[2])  # the same samples
    if "mp3" in formats:
        assert abs(fs.lengths[3] - 101) <= 5  # the decoder's padding


def test_features_follow_what_the_audio_files_hold(tmp_path, corpus_dir, recwarn):
    """A file overwritten at the same path (here of the same size) is featurised again at the next start, and only
    its split; the cache key, like the run's identity, stays what the manifests hold."""
    cfg = data_cfg(tmp_path, train=write_manifest(corpus_dir / "train.jsonl", lines(range(4))),
                   val=write_manifest(corpus_dir / "val.jsonl", lines([4])),
                   test=write_manifest(corpus_dir / "test.jsonl", lines([5])))
    corpus = prepare_corpus(cfg)
    before = {split: load_features(corpus, split, cfg) for split in corpus.splits}
    cache = features.frames_path(features.cache_path(corpus, "test", cfg))
    written = cache.stat().st_mtime_ns
    assert load_features(corpus, "train", cfg).feats[1].equal(before["train"].feats[1])
    assert not recwarn.list  # unchanged audio: the cache as it was
    path = corpus_dir / "wav" / "s0" / "1.wav"
    size = path.stat().st_size
    write_audio(path, 0.5, seed=7)  # other audio, the same length
    assert path.stat().st_size == size
    with pytest.warns(UserWarning, match=rf"1 audio files changed since their features were computed, {path} first; "
                                         "computing the train features again"):
        again = load_features(prepare_corpus(cfg), "train", cfg)
    assert again.feats[1].equal(Featurizer(cfg)(torch.from_numpy(sf.read(path, dtype="float32")[0])))
    assert not again.feats[1].equal(before["train"].feats[1]) and again.feats[0].equal(before["train"].feats[0])
    assert load_features(corpus, "test", cfg).feats[0].equal(before["test"].feats[0])
    assert cache.stat().st_mtime_ns == written  # another split's cache is left alone


def test_non_finite_audio_is_refused_naming_the_file(tmp_path, corpus_dir):
    """NaN features would skip its batch every epoch (every batch, where all files are NaN: a run of no steps)."""
    bad = corpus_dir / "wav" / "s1" / "0.wav"
    audio = sf.read(bad, dtype="float32")[0]
    audio[100] = np.nan
    sf.write(bad, audio, RATE, subtype="FLOAT")
    cfg = data_cfg(tmp_path, train=write_manifest(corpus_dir / "train.jsonl", lines(range(4))),
                   test=write_manifest(corpus_dir / "test.jsonl", lines([5])))
    corpus = prepare_corpus(cfg)
    split = next(s for s, utts in corpus.splits.items() if str(bad) in [u.path for u in utts])
    with pytest.raises(DataError, match=rf"^{bad}: non-finite samples \(NaN or infinity\); replace it with a good "
                                        r"copy, or delete it to leave that utterance out$"):
        load_features(corpus, split, cfg)
    assert not features.cache_path(corpus, split, cfg).exists()


@pytest.mark.parametrize("cut", ["duration", "truncated"])
def test_audio_shorter_than_its_duration_is_refused(tmp_path, corpus_dir, cut):
    """A header-truncated file, or a line whose duration overstates its file: a part of the audio would train with
    the whole transcript. Within manifest.SHORT_BY_S a duration passes (rounding, MP3's padding)."""
    train = lines(range(4))
    path = corpus_dir / "wav" / "s0" / "1.wav"
    if cut == "duration":
        train[1]["duration"] = 500
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    train[0]["duration"] = 0.5 + 0.9 * manifest.SHORT_BY_S  # wav/s0/0.wav, 0.5 s, read first
    cfg = data_cfg(tmp_path, train=write_manifest(corpus_dir / "train.jsonl", train),
                   val=write_manifest(corpus_dir / "val.jsonl", lines([4])),
                   test=write_manifest(corpus_dir / "test.jsonl", lines([5])))
    with pytest.raises(DataError, match=rf"^{path}: 0.\d\d s of audio from offset 0 s, where its manifest line says a "
                                        rf"duration of {500 if cut == 'duration' else 0.5:g} s; replace a cut-off file "
                                        "with a whole copy, or correct that line's duration$"):
        load_features(prepare_corpus(cfg), "train", cfg)


@pytest.mark.parametrize("bad", ["nan", "short"])
def test_bad_audio_stops_a_run_in_one_line(tmp_path, corpus_dir, bad):
    train = lines(range(4))
    if bad == "nan":
        sf.write(corpus_dir / "wav" / "s0" / "1.wav", np.full(8000, np.inf, dtype=np.float32), RATE, subtype="FLOAT")
    else:
        train[1]["duration"] = 500
    run = subprocess.run([sys.executable, str(ROOT / "src" / "run.py"), "experiment=smoke", "data=manifest",
                          f"data.train={write_manifest(corpus_dir / 'train.jsonl', train)}",
                          f"data.test={write_manifest(corpus_dir / 'test.jsonl', lines([5]))}",
                          f"data.root={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stdout + run.stderr
    (line,) = [l for l in (run.stdout + run.stderr).splitlines() if "error:" in l]
    assert f"error: {corpus_dir / 'wav' / 's0' / '1.wav'}: " in line
    assert ("non-finite samples" if bad == "nan" else "where its manifest line says a duration of 500 s") in line
    assert not list((tmp_path / "run").glob(f"*/{RESULTS}"))


# -- bad lines ---------------------------------------------------------------------------------------------

GOOD = entry("wav/s0/0.wav")


@pytest.mark.parametrize("line, words", [
    ("{not json", "not JSON"),
    ('["wav/s0/0.wav", 0.5, "YES"]', "a JSON list, not an object"),
    (json.dumps({"duration": 0.5, "text": "YES"}), "no 'audio_filepath'"),
    (json.dumps({"audio_filepath": "wav/s0/0.wav", "text": "YES"}), "no 'duration'"),
    (json.dumps({"audio_filepath": "wav/s0/0.wav", "duration": 0.5}), "no 'text'"),
    (json.dumps(entry("wav/s0/0.wav", duration="0.5")), "'duration' is '0.5'; it must be a number"),
    (json.dumps(entry("wav/s0/0.wav", duration=True)), "'duration' is True"),
    (json.dumps(entry("wav/s0/0.wav", duration=0)), "more than 0"),
    (json.dumps(entry("wav/s0/0.wav", offset=-1)), "'offset' is -1"),
    (json.dumps(entry("wav/s0/0.wav", text=7)), "'text' is 7; it must be a string"),
    (json.dumps(entry("")), "'audio_filepath' is empty"),
    (json.dumps(GOOD), "utterance wav/s0/0.wav is also on line 1"),
    (json.dumps(entry("wav/s0/1.wav", "NO 42")), "utterance wav/s0/1.wav: characters outside the alphabet: '24'"),
    (json.dumps(entry("wav/s0/1.wav", " .")), "utterance wav/s0/1.wav: empty transcript"),
])
def test_a_bad_line_is_refused_naming_manifest_and_line(tmp_path, corpus_dir, line, words):
    train = write_manifest(corpus_dir / "train.jsonl", [GOOD, "", line])
    test = write_manifest(corpus_dir / "test.jsonl", lines([5]))
    with pytest.raises(DataError, match=words) as e:
        prepare_corpus(data_cfg(tmp_path, train=train, test=test))
    assert str(e.value).startswith(f"{train}:3: ")


def test_bad_text_skip_leaves_such_lines_out_counted_and_logged(tmp_path, corpus_dir):
    train = write_manifest(corpus_dir / "train.jsonl", lines(range(4)) + [
        entry("wav/s4/0.wav", "twenty-one"), entry("wav/s4/1.wav", "route 66")])
    test = write_manifest(corpus_dir / "test.jsonl", lines([5]))
    cfg = data_cfg(tmp_path, train=train, test=test, val=write_manifest(corpus_dir / "val.jsonl", lines([4])))
    with pytest.raises(DataError, match=rf"^{train}:9: utterance wav/s4/0.wav: .*data.bad_text=skip"):
        prepare_corpus(cfg)
    cfg.bad_text = "skip"
    with pytest.warns(UserWarning, match="skipping 2 train utterances whose text has characters outside"):
        corpus = prepare_corpus(cfg)
    assert corpus.summary["skipped"]["train"] == {"no_audio": 0, "bad_text": 2}
    assert corpus.summary["skipped_ids"]["train"]["bad_text"] == ["wav/s4/0.wav", "wav/s4/1.wav"]
    assert [f"{train}: skipping 2 train utterances" in line for line in corpus_changes(corpus.summary)] == [True]


def test_missing_audio_is_counted_and_other_corpus_errors_name_the_file(tmp_path, corpus_dir):
    train = write_manifest(corpus_dir / "train.jsonl", lines(range(4)) + [entry("wav/gone.wav")])
    test = write_manifest(corpus_dir / "test.jsonl", lines([5]))
    with pytest.warns(UserWarning, match="skipping 1 train utterances without audio: wav/gone.wav"):
        corpus = prepare_corpus(data_cfg(tmp_path, train=train, test=test))
    assert corpus.summary["skipped"]["train"] == {"no_audio": 1, "bad_text": 0}
    # one utterance in two splits; an empty manifest; a manifest that is not there
    leak = write_manifest(corpus_dir / "leak.jsonl", lines([0]))
    with pytest.raises(DataError, match=rf"{leak}: utterance wav/s0/0.wav is also in the train manifest"):
        prepare_corpus(data_cfg(tmp_path, train=train, test=leak))
    with pytest.raises(DataError, match=rf"{write_manifest(corpus_dir / 'e.jsonl', [''])}: no utterance"):
        prepare_corpus(data_cfg(tmp_path, train=corpus_dir / "e.jsonl", test=test))
    with pytest.raises(DataError, match=rf"{tmp_path / 'no.jsonl'}: cannot read the test manifest"):
        pin_content(data_cfg(tmp_path, train=train, test=tmp_path / "no.jsonl"))
    (corpus_dir / "wav" / "s5" / "0.wav").write_text("not audio\n" * 50)
    corpus = prepare_corpus(data_cfg(tmp_path, train=train, test=test))
    with pytest.raises(DataError, match=r"s5/0.wav: not audio that soundfile reads"):
        load_features(corpus, "test", DataConfig())


# -- configuration and identity ---------------------------------------------------------------------------

def test_every_preset_takes_the_manifest_corpus_and_test_is_required(make_config):
    assert make_config("experiment=smoke").data.corpus.value == "synthetic"  # still the generated corpus
    given = ["data.train=a.jsonl", "data.test=b.jsonl"]
    for preset in ("smoke", "an4_cpu", "an4_gpu", "an4_depth", None):  # None: the bare schema's defaults
        cfg = make_config(*[f"experiment={preset}"] * bool(preset), "data=manifest", *given)
        assert cfg.data.corpus.value == "manifest" and cfg.data.train == "a.jsonl"
        validate(cfg)
    assert make_config("data=manifest", "experiment=smoke", *given).data.corpus.value == "manifest"
    with pytest.raises(ConfigError, match=r"^data.test: not given; data=manifest needs the test manifest"):
        validate(make_config("experiment=smoke", "data=manifest", "data.train=a.jsonl"))
    with pytest.raises(ConfigError, match=r"^data.train=a.jsonl: a manifest, read only by data=manifest"):
        validate(make_config("experiment=smoke", "data.train=a.jsonl"))
    with pytest.raises(ConfigError, match=r"^data.bad_text=skip: only data=manifest reads it"):
        validate(make_config("experiment=smoke", "data.bad_text=skip"))


def test_no_test_manifest_stops_the_run_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "src" / "run.py"), "experiment=smoke", "data=manifest",
                          f"data.train={tmp_path / 'a.jsonl'}", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stdout + run.stderr
    assert "error: data.test: not given; data=manifest needs the test manifest" in run.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_run_is_known_by_what_its_manifests_hold_not_where_they_lie(tmp_path, corpus_dir, make_config):
    write_manifest(corpus_dir / "train.jsonl", lines(range(5)))
    write_manifest(corpus_dir / "test.jsonl", lines([5]))

    def named(folder: Path) -> tuple[str, dict]:
        cfg = make_config("experiment=smoke", "data=manifest", f"data.train={folder / 'train.jsonl'}",
                          f"data.test={folder / 'test.jsonl'}")
        pin_content(cfg.data)
        return run_name(to_container(cfg)), to_container(cfg)

    name, config = named(corpus_dir)
    moved = shutil.copytree(corpus_dir, tmp_path / "moved")
    assert named(moved)[0] == name  # relative paths: the same bytes, the same run
    ids = [u.id for u in prepare_corpus(OmegaConf.to_object(make_config(
        "experiment=smoke", "data=manifest", f"data.train={moved / 'train.jsonl'}",
        f"data.test={moved / 'test.jsonl'}", f"data.root={tmp_path}").data)).splits["train"]]
    assert ids[0] == "wav/s0/0.wav"  # and the same ids, so the same feature cache key
    write_manifest(moved / "train.jsonl", lines(range(4)))
    other, other_config = named(moved)
    assert other != name and mismatch(config, other_config) == ["data.manifest_sha256"]
    # the study names each job's run as src/run.py does
    planned = jobs(["experiment=smoke", "data=manifest", f"data.train={corpus_dir / 'train.jsonl'}",
                    f"data.test={corpus_dir / 'test.jsonl'}"])
    assert len(planned) == 3 and {job.cfg.data.manifest_sha256 for job in planned} == {
        config["data"]["manifest_sha256"]}
    # AN4 keeps its folder names: the new settings at their defaults count as absent
    an4 = to_container(make_config("experiment=smoke"))
    pinned = make_config("experiment=smoke")
    pin_content(pinned.data)
    older = json.loads(json.dumps(an4))
    for key in ("train", "val", "test", "bad_text", "manifest_sha256"):
        del older["data"][key]
    assert run_name(to_container(pinned)) == run_name(an4) == run_name(older) and mismatch(older, an4) == []


# -- AN4 as manifests ------------------------------------------------------------------------------------

def test_an4_exported_as_manifests_trains_as_the_built_in_path(tmp_path, capsys, make_config):
    root = tmp_path / "data"
    prepare.main(["--preset", "smoke", "--root", str(root), "--export-manifests", str(tmp_path / "m")])
    exported = json.loads(capsys.readouterr().out)["exported"]
    assert exported == {s: str(tmp_path / "m" / f"{s}.jsonl") for s in ("train", "val", "test")}
    common = ["experiment=smoke", f"data.root={root}", "train.epochs=1"]
    built_in = make_config(*common)
    manifest = make_config(*common, "data=manifest", *(f"data.{s}={p}" for s, p in exported.items()))
    a, b = prepare_corpus(OmegaConf.to_object(built_in.data)), prepare_corpus(OmegaConf.to_object(manifest.data))
    for split in a.splits:
        fa, fb = load_features(a, split, built_in.data), load_features(b, split, manifest.data)
        assert fa.texts == fb.texts and fa.lengths == fb.lengths and len(fa) == len(a.splits[split])
        assert all(torch.equal(x, y) for x, y in zip(fa.feats, fb.feats))  # bit for bit
        assert [Path(u.path).name for u in a.splits[split]] == [Path(u.path).name for u in b.splits[split]]
    pin_content(manifest.data)  # as src/run.py does
    first, again = train(built_in, tmp_path / "an4")["epochs"][0], train(manifest, tmp_path / "manifest")["epochs"][0]
    assert first["train_loss"] == again["train_loss"] and first["val_loss"] == again["val_loss"]
    assert first["val_wer"] == again["val_wer"] and first["grad_norm_max"] == again["grad_norm_max"]
    # a manifest run is re-scored on its own manifests, and refused once they have changed
    evaluate.main(["score", str(tmp_path / "manifest"), "--device", "cpu"])
    assert "test WER" in capsys.readouterr().out
    Path(exported["test"]).write_text("".join(Path(exported["test"]).read_text().splitlines(True)[:3]))
    with pytest.raises(SystemExit) as e:
        evaluate.main(["score", str(tmp_path / "manifest"), "--device", "cpu"])
    assert e.value.code == 2 and "have changed since the run trained" in capsys.readouterr().err
