"""The corpus pipeline and features on small generated fixtures: no real archive, no network."""
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from omegaconf import OmegaConf

from batchrnn.data import base
from batchrnn.data import corpus as data
from batchrnn.data import features
from batchrnn.data import prepare
from batchrnn.config import DataConfig
from batchrnn.data.corpus import DataError, Utterance, extract_archive, parse_transcripts, prepare_corpus, read_audio
from batchrnn.data.features import FeatureSet, Featurizer, collate, load_features, make_batches
from batchrnn.data.text import encode
from conftest import ROOT


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """The synthetic corpus prepared once: (cfg, corpus)."""
    cfg = DataConfig(corpus="synthetic", root=str(tmp_path_factory.mktemp("root")))
    return cfg, prepare_corpus(cfg)


@pytest.fixture(scope="session")
def synthetic_archive(tmp_path_factory):
    return data.make_synthetic_archive(tmp_path_factory.mktemp("archive") / "an4.tar.gz", 4, 3, 2)


def tar_dir(src: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "an4", arcname="an4")
    return archive


def write_sph(path: Path, seconds=0.5, rate=16000, endian="LITTLE") -> np.ndarray:
    samples = (np.random.default_rng(0).standard_normal(int(seconds * rate)) * 3000).astype(np.int16)
    sf.write(path, samples, rate, format="NIST", subtype="PCM_16", endian=endian)
    return samples


# -- audio ----------------------------------------------------------------------

def test_sphere_both_byte_orders_read_the_same(tmp_path):
    samples = write_sph(tmp_path / "le.sph", endian="LITTLE")
    write_sph(tmp_path / "be.sph", endian="BIG")
    assert b"sample_byte_format -s2 01" in (tmp_path / "le.sph").read_bytes()[:1024]
    assert b"sample_byte_format -s2 10" in (tmp_path / "be.sph").read_bytes()[:1024]
    le, be = read_audio(tmp_path / "le.sph"), read_audio(tmp_path / "be.sph")
    assert le.dtype == torch.float32 and le.shape == (8000,)
    assert torch.equal(le, be)
    assert torch.allclose(le, torch.from_numpy(samples / 32768.0).float())


def test_read_audio_errors_name_the_file(tmp_path):
    (tmp_path / "empty.sph").write_bytes(b"")
    (tmp_path / "text.sph").write_text("not audio at all\n" * 100)
    write_sph(tmp_path / "8k.sph", rate=8000)
    for name, words in [("missing.sph", "not found"), ("empty.sph", "empty"), ("text.sph", "not a readable"),
                        ("8k.sph", "8000 Hz")]:
        with pytest.raises(DataError, match=words) as e:
            read_audio(tmp_path / name)
        assert name in str(e.value)


# -- transcripts ----------------------------------------------------------------

def test_parse_both_transcript_formats(tmp_path):
    (tmp_path / "train.transcription").write_text("<s> YES </s> (an251-fash-b)\n<s> go  stop </s> (cen1-fa-b)")
    (tmp_path / "test.transcription").write_text("RUBOUT G M E F THREE NINE (an406-fcaw-b)\n\n")
    train, normalized = parse_transcripts(tmp_path / "train.transcription")
    assert train == {"an251-fash-b": "YES", "cen1-fa-b": "GO STOP"} and normalized == ["cen1-fa-b"]  # lower case
    test = {"an406-fcaw-b": "RUBOUT G M E F THREE NINE"}
    assert parse_transcripts(tmp_path / "test.transcription") == (test, [])  # spacing is no change


def test_bad_transcript_names_utterance_and_file(tmp_path):
    path = tmp_path / "an4_train.transcription"
    path.write_text("<s> YES </s> (an251-fash-b)\n<s> NO 42 </s> (an252-fash-b)\n")
    with pytest.raises(DataError, match="an252-fash-b") as e:
        parse_transcripts(path)
    assert "an4_train.transcription:2" in str(e.value)


@pytest.mark.filterwarnings("ignore:AN4 archive of unknown checksum")
def test_unmatched_audio_and_transcripts_are_skipped_and_counted(tmp_path, synthetic_archive):
    extract_archive(synthetic_archive, tmp_path / "src")
    an4 = tmp_path / "src" / "an4"
    lines = (an4 / "etc" / "an4_train.transcription").read_text().splitlines()
    orphan_audio = lines[0].split("(")[1].rstrip(")")  # its transcript goes, its audio stays
    (an4 / "etc" / "an4_train.transcription").write_text("\n".join(lines[1:]) + "\n")
    orphan_text = lines[1].split("(")[1].rstrip(")")  # its audio goes, its transcript stays
    next((an4 / "wav").rglob(f"{orphan_text}.sph")).unlink()
    archive = tar_dir(tmp_path / "src", tmp_path / "edited.tar.gz")
    with pytest.warns(UserWarning, match="skipping 1 train"):
        corpus = prepare_corpus(DataConfig(archive=str(archive), root=str(tmp_path / "root")))
    assert corpus.summary["skipped"]["train"] == {"no_audio": 1, "no_transcript": 1}
    skipped = corpus.summary["skipped_ids"]["train"]
    assert skipped == {"no_audio": [orphan_text], "no_transcript": [orphan_audio]}
    assert corpus.summary["utterances"]["train"] + corpus.summary["utterances"]["val"] == 4 * 3 - 2
    assert "content verified" in corpus.summary["checksum"]


# -- archives -------------------------------------------------------------------

def test_extraction_refuses_members_outside_the_target(tmp_path):
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ["an4/README", "../evil"]:
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"boom"))
    with pytest.raises(DataError, match=r"\.\./evil"):
        extract_archive(archive, tmp_path / "out")
    assert not (tmp_path / "evil").exists()


def test_truncated_archive_is_a_clear_error(tmp_path, synthetic_archive):
    archive = tmp_path / "an4_sphere.tar.gz"
    archive.write_bytes(synthetic_archive.read_bytes()[: synthetic_archive.stat().st_size // 2])
    with pytest.raises(DataError, match="truncated or corrupt") as e:
        prepare_corpus(DataConfig(archive=f"file://{archive}", root=str(tmp_path / "root")))
    assert str(archive) in str(e.value)
    assert not (tmp_path / "root" / "an4" / data.MARKER).exists()  # the next run extracts again


def test_missing_archive_names_the_path(tmp_path):
    with pytest.raises(DataError, match="nowhere.tar.gz: archive not found"):
        data.fetch_archive(str(tmp_path / "nowhere.tar.gz"), [], tmp_path)


# -- splits ---------------------------------------------------------------------

def test_split_is_deterministic_whole_speakers_and_reused(tmp_path, synthetic, monkeypatch):
    cfg, corpus = synthetic
    speakers = {s: {u.speaker for u in utts} for s, utts in corpus.splits.items()}
    assert not speakers["train"] & speakers["val"]
    assert not speakers["test"] & (speakers["train"] | speakers["val"])
    assert len(speakers["val"]) == 1 and len(speakers["train"]) == 5  # round(6 * 0.1) with at least one
    assert base.choose_val_speakers([f"s{i}" for i in range(74)], 0.1, 0) == base.choose_val_speakers(
        [f"s{i}" for i in reversed(range(74))], 0.1, 0
    )
    assert len(base.choose_val_speakers([f"s{i}" for i in range(74)], 0.1, 0)) == 7
    split_file = corpus.root / "an4" / f"splits-seed{cfg.split_seed}-val{cfg.val_fraction}.json"
    assert json.loads(split_file.read_text())["val_speakers"] == sorted(speakers["val"])
    mtime = split_file.stat().st_mtime_ns
    monkeypatch.setattr(base, "choose_val_speakers", lambda *a: pytest.fail("the saved split was not reused"))
    again = prepare_corpus(cfg)
    assert again.splits == corpus.splits and split_file.stat().st_mtime_ns == mtime


def test_synthetic_corpus_end_to_end(synthetic):
    cfg, corpus = synthetic
    assert corpus.root == Path(cfg.root) / "synthetic"
    assert corpus.summary["utterances"] == {"train": 30, "val": 6, "test": 12}
    assert corpus.summary["speakers"] == {"train": 5, "val": 1, "test": 2}
    assert corpus.summary["skipped"]["test"] == {"no_audio": 0, "no_transcript": 0}
    u = corpus.splits["test"][0]
    assert isinstance(u, Utterance) and u.id.split("-")[1] == u.speaker and Path(u.path).is_file()
    assert 0.5 <= len(read_audio(u.path)) / 16000 <= 2.0
    marker = corpus.root / "an4" / data.MARKER
    mtime = marker.stat().st_mtime_ns
    assert prepare_corpus(cfg).summary["utterances"] == corpus.summary["utterances"]
    assert marker.stat().st_mtime_ns == mtime  # no second extraction


# -- features -------------------------------------------------------------------

def test_feature_shapes_and_normalisation():
    audio = torch.randn(16000) * 0.1
    linear = Featurizer(DataConfig())
    spec = linear(audio)
    assert linear.num_features == 161 and spec.shape == (101, 161) and spec.dtype == torch.float32
    assert abs(spec.mean().item()) < 1e-4 and abs(spec.std().item() - 1) < 1e-4
    mel = Featurizer(DataConfig(n_mels=40))
    assert mel.num_features == 40 and mel(audio).shape == (101, 40)


def test_feature_cache_written_once_then_loaded(tmp_path, synthetic, monkeypatch):
    cfg, corpus = synthetic
    corpus = replace(corpus, root=tmp_path)  # a fresh cache folder
    fs = load_features(corpus, "val", cfg)
    assert len(fs) == 6 and fs.num_features == 161 and fs.texts == [u.text for u in corpus.splits["val"]]
    path = features.cache_path(corpus, "val", cfg)
    mtime = path.stat().st_mtime_ns
    monkeypatch.setattr(Featurizer, "__call__", lambda *a: pytest.fail("features computed twice"))
    again = load_features(corpus, "val", cfg)
    assert path.stat().st_mtime_ns == mtime and all(torch.equal(a, b) for a, b in zip(fs.feats, again.feats))
    assert features.cache_path(corpus, "val", DataConfig(n_mels=40)) != path
    assert features.cache_path(corpus, "test", cfg).parent != path.parent  # other ids, other key
    monkeypatch.undo()
    path.write_bytes(path.read_bytes()[:100])
    with pytest.warns(UserWarning, match="unreadable feature cache"):
        rebuilt = load_features(corpus, "val", cfg)
    assert rebuilt.lengths == fs.lengths


def test_memory_mapped_cache_holds_the_features_bit_for_bit(tmp_path, synthetic):
    cfg, corpus = synthetic
    corpus = replace(corpus, root=tmp_path)
    featurizer = Featurizer(cfg)
    before = [featurizer(read_audio(u.path)) for u in corpus.splits["train"]]  # what the in-memory cache held
    fs = load_features(corpus, "train", cfg)
    assert len(fs) == len(before) and all(torch.equal(a, b) for a, b in zip(before, fs.feats))
    assert isinstance(fs.feats, features.MappedFeatures) and fs.lengths == [len(f) for f in before]
    index = features.cache_path(corpus, "train", cfg)
    assert features.frames_path(index).stat().st_size == 4 * sum(fs.lengths) * fs.num_features
    meta = json.loads(index.read_text())
    assert meta["version"] == features.CACHE_VERSION and meta["ids"] == fs.ids and meta["lengths"] == fs.lengths
    assert sorted(p.name for p in index.parent.iterdir()) == ["train.f32", "train.json"]  # no temporary left


def test_cache_is_written_utterance_by_utterance(tmp_path, synthetic, monkeypatch):
    cfg, corpus = synthetic
    folder = features.cache_path(replace(corpus, root=tmp_path), "val", cfg).parent
    written = []

    def read(u):  # before each utterance, what the temporary frames file already holds
        written.append(sum(p.stat().st_size for p in folder.glob(".val.f32.*.tmp")))
        return read_audio(u.path)

    monkeypatch.setattr(torch, "cat", lambda *a, **k: pytest.fail("a whole split concatenated in memory"))
    fs = load_features(replace(corpus, root=tmp_path, read=read), "val", cfg)
    assert written == [4 * fs.num_features * sum(fs.lengths[:i]) for i in range(len(fs))]


def test_a_cache_of_another_version_or_size_is_computed_again(tmp_path, synthetic):
    cfg, corpus = synthetic
    corpus = replace(corpus, root=tmp_path)
    fs = load_features(corpus, "val", cfg)
    index = features.cache_path(corpus, "val", cfg)
    meta = json.loads(index.read_text())
    index.write_text(json.dumps(meta | {"version": 1}))
    with pytest.warns(UserWarning, match="cache version 1, expected"):
        load_features(corpus, "val", cfg)
    frames = features.frames_path(index)
    frames.write_bytes(frames.read_bytes()[:-4])
    with pytest.warns(UserWarning, match="val.f32 holds .* bytes, the index says"):
        again = load_features(corpus, "val", cfg)
    assert all(torch.equal(a, b) for a, b in zip(fs.feats, again.feats))


def rss_anon() -> int:
    """Resident anonymous memory in bytes: the heap, not the pages of mapped files."""
    return int(re.search(r"RssAnon:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="RssAnon is Linux's")
def test_an_epoch_over_a_mapped_cache_keeps_resident_memory_flat(tmp_path):
    """256 MB of features written straight into the cache format (no audio), then an epoch of batches."""
    rng, width, n = np.random.default_rng(0), 64, 2000
    lengths = rng.integers(300, 700, n).tolist()
    utts = [Utterance(f"u{i}", "", "", "YES") for i in range(n)]
    corpus = base.Corpus("manifest", tmp_path, {"train": utts}, {}, read=lambda u: pytest.fail("no audio to read"))
    cfg = DataConfig(n_mels=width)
    index = features.cache_path(corpus, "train", cfg)
    index.parent.mkdir(parents=True)
    with open(features.frames_path(index), "wb") as f:
        for length in lengths:
            f.write(rng.standard_normal((length, width), dtype=np.float32).tobytes())
    index.write_text(json.dumps({"version": features.CACHE_VERSION, "num_features": width,
                                 "ids": [u.id for u in utts], "lengths": lengths,
                                 "audio": [features.stamp(u.path) for u in utts]}))
    size = features.frames_path(index).stat().st_size
    assert size > 200e6
    before = rss_anon()
    fs = load_features(corpus, "train", cfg)
    total, peak = 0.0, 0
    for batch in make_batches(fs.lengths, 32, shuffle=True, seed=0):
        x, x_lens, _, _ = collate(fs, batch)
        total += float(x.sum())
        peak = max(peak, rss_anon() - before)
    assert total != 0.0 and sum(fs.lengths) * width * 4 == size  # every frame was read
    assert peak < 0.25 * size, f"RssAnon grew by {peak / 1e6:.0f} MB over an epoch of a {size / 1e6:.0f} MB cache"


def test_make_batches():
    lengths = [5, 3, 9, 1, 7, 3, 8, 2, 6, 4, 10]
    ordered = make_batches(lengths, 4, shuffle=False, seed=0)
    flat = [i for b in ordered for i in b]
    assert sorted(flat) == list(range(len(lengths))) and [len(b) for b in ordered] == [4, 4, 3]
    assert [lengths[i] for i in flat] == sorted(lengths)  # SortaGrad: increasing length
    shuffled = make_batches(lengths, 4, shuffle=True, seed=1)
    assert sorted(map(sorted, shuffled)) == sorted(map(sorted, ordered))  # same buckets, other order
    assert shuffled == make_batches(lengths, 4, shuffle=True, seed=1)
    assert len({str(make_batches(lengths, 2, True, s)) for s in range(5)}) > 1


def test_collate_shapes_and_padding():
    fs = FeatureSet(["a", "b"], [torch.ones(3, 5), torch.ones(7, 5)], ["YES", "GO A"], 5)
    x, x_lens, y, y_lens = collate(fs, [0, 1])
    assert x.shape == (2, 5, 7) and x.dtype == torch.float32
    assert x_lens.tolist() == [3, 7] and y_lens.tolist() == [3, 4] and y.dtype == torch.int64
    assert y.tolist() == encode("YES") + encode("GO A")
    assert x[0, :, 3:].abs().sum() == 0 and x[0, :, :3].eq(1).all() and x[1].eq(1).all()


# -- the command line (python -m batchrnn.data) ----------------------------------

def test_cli_builds_the_features_a_run_of_the_preset_reads(tmp_path, capsys, make_config):
    prepare.main(["--preset", "smoke", "--root", str(tmp_path), "--features"])
    built = json.loads(capsys.readouterr().out)["features"]
    cfg = OmegaConf.to_object(make_config("experiment=smoke", f"data.root={tmp_path}").data)  # as run.py has it
    corpus = prepare_corpus(cfg)
    assert built["files"] == {split: str(features.cache_path(corpus, split, cfg)) for split in corpus.splits}
    assert all(Path(f).is_file() for f in built["files"].values())
    assert built["settings"] == f"{cfg.n_mels} mel bands, 20 ms window, 10 ms hop (the smoke preset)"


def test_cli_help_names_each_preset_features_and_errors_end_in_one_line(tmp_path, make_config):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "batchrnn.data", *args], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})

    n_mels = make_config("experiment=an4_cpu").data.n_mels
    assert re.search(rf"\n  an4_cpu +{n_mels} mel bands, ", cli("--help").stdout)
    run = cli("--archive", str(tmp_path / "nowhere.tar.gz"), "--root", str(tmp_path / "root"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr == f"error: {tmp_path / 'nowhere.tar.gz'}: archive not found; check data.archive\n"
