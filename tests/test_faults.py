"""Bad input, faults and interruptions, each with the real thing: corrupted files, real signals, a real
HTTP server that drops connections, an unreachable W&B server and one that goes away mid-run. Every
refusal names the file and the fix; every handled case is counted in results.json and the log; nothing
finished is lost.
"""
import errno
import http.server
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from hydra import compose, initialize_config_dir

from batchrnn.data import base
from batchrnn.data import corpus as data
from batchrnn.data import features
from batchrnn.tracking import tracker as tracking
from batchrnn.config import DataConfig, to_container
from batchrnn.data.corpus import DataError, extract_archive, prepare_corpus
from batchrnn import storage
from batchrnn.data import prepare as preparation
from batchrnn.training import rundir
from batchrnn.training.rundir import BEST, CHECKPOINT, LOCK, RESULTS, RunError, RunFolder
from batchrnn.study.sweep import FAILED_DIR, STOP_FILE
from batchrnn.training.identity import run_name
from batchrnn.training import distributed, loop, stopping
from batchrnn.training.loop import TrainingDiverged, train
from batchrnn.training.checkpoint import load_model
from batchrnn import evaluate
from conftest import BN_MODES, ROOT
from wandb_offline import read_offline_run

pytestmark = pytest.mark.filterwarnings("ignore:AN4 archive of unknown checksum", "ignore:.*skipping",
                                        "ignore:.*normalised")
RUN = [sys.executable, str(ROOT / "src" / "run.py")]


def config(*overrides: str):
    """The smoke preset composed, as conftest's make_config does, but usable in module-scoped fixtures."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=smoke", *overrides])


@pytest.fixture
def smoke(smoke_root):
    return lambda *overrides: config(f"data.root={smoke_root}", *overrides)


def cli(*args: str, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=timeout)


# -- a copy of the corpus to break ----------------------------------------------------------------

@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    """The smoke corpus as an archive (6 train speakers x 6, 2 test speakers x 6)."""
    return data.make_synthetic_archive(tmp_path_factory.mktemp("pristine") / "an4.tar.gz")


def edited(archive: Path, folder: Path, edit) -> Path:
    """archive extracted into folder, changed by edit(an4_dir), packed again as folder/edited.tar.gz."""
    extract_archive(archive, folder / "src")
    edit(folder / "src" / "an4")
    with tarfile.open(folder / "edited.tar.gz", "w:gz") as tar:
        tar.add(folder / "src" / "an4", arcname="an4")
    return folder / "edited.tar.gz"


def train_lines(an4: Path) -> list[str]:
    return (an4 / "etc" / "an4_train.transcription").read_text().splitlines()


def set_train_lines(an4: Path, lines: list[str]) -> None:
    (an4 / "etc" / "an4_train.transcription").write_text("\n".join(lines) + "\n")


def uid(line: str) -> str:
    return line.rsplit("(", 1)[1].rstrip(")")


def training_speaker_lines(an4: Path) -> list[int]:
    """Indices of train transcript lines whose speaker lands in the training split, not validation."""
    lines = train_lines(an4)
    speakers = sorted({uid(l).split("-")[1] for l in lines})
    val = set(base.choose_val_speakers(speakers, DataConfig.val_fraction, DataConfig.split_seed))
    return [i for i, l in enumerate(lines) if uid(l).split("-")[1] not in val]


def prepare(archive: Path, root: Path):
    return prepare_corpus(DataConfig(archive=str(archive), root=str(root)))


# -- data: archives and folders -------------------------------------------------------------------

def test_missing_archive_folder_or_root_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"nowhere\.tar\.gz: archive not found; check data\.archive"):
        prepare(tmp_path / "nowhere.tar.gz", tmp_path / "root")
    with pytest.raises(DataError, match="a folder, not an archive; set data.archive"):
        prepare(tmp_path, tmp_path / "root")
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match="cannot create the data folder .*; set data.root to a writable folder"):
        prepare(tmp_path / "nowhere.tar.gz", tmp_path / "file" / "root")


def test_unreadable_archive_names_the_path(tmp_path, archive, monkeypatch):
    copy = tmp_path / "an4.tar.gz"
    copy.write_bytes(archive.read_bytes())
    copy.chmod(0)  # enough for a user; root reads any file, so opening it is refused here as well
    real_open = open

    def refusing_open(file, *args, **kwargs):
        if Path(file) == copy:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refusing_open)
    with pytest.raises(DataError, match=f"{re.escape(str(copy))}: archive not readable; fix its permissions"):
        prepare(copy, tmp_path / "root")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_archive_is_refused_and_not_half_used(tmp_path, archive, damage):
    blob = archive.read_bytes()
    bad = tmp_path / "an4.tar.gz"
    bad.write_bytes(blob[: len(blob) // 2] if damage == "truncated" else os.urandom(len(blob)))
    with pytest.raises(DataError, match="truncated or corrupt archive .*delete it and fetch it again") as e:
        prepare(bad, tmp_path / "root")
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "root" / "an4" / data.MARKER).exists()  # the next run extracts afresh


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink"])
def test_member_outside_the_target_is_refused(tmp_path, kind):
    evil = tmp_path / "evil.tar"
    outside = tmp_path / "outside"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo({"dotdot": "an4/../../outside", "absolute": str(outside)}.get(kind, "an4/link"))
        if kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, str(outside)
        elif kind == "hardlink":
            info.type, info.linkname = tarfile.LNKTYPE, "../outside"
        else:
            info.size = 4
        tar.addfile(info, io.BytesIO(b"boom") if info.size else None)
    with pytest.raises(DataError, match=rf"{re.escape(str(evil))}: refusing member"):
        extract_archive(evil, tmp_path / "root")
    assert not outside.exists()


# -- data: audio ---------------------------------------------------------------------------------

def _break(how: str):
    def edit(an4: Path):
        path = sorted((an4 / "wav").rglob("*.sph"))[0]
        blob = path.read_bytes()
        if how == "truncated":
            path.write_bytes(blob[: 1024 + (len(blob) - 1024) // 2])
        elif how == "garbage":
            path.write_bytes(os.urandom(len(blob)))
        elif how == "header only":
            path.write_bytes(blob[:1024])
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "wav":
            sf.write(path, np.zeros(8000), 16000, format="WAV")
    return edit


@pytest.mark.parametrize("how,words", [
    ("truncated", "truncated SPHERE file"), ("garbage", "not a readable SPHERE file"),
    ("header only", "a SPHERE header without samples"), ("empty", "empty audio file"),
    ("wav", "WAV audio where AN4 has NIST SPHERE"),
])
def test_broken_audio_is_refused_naming_the_file_and_the_fix(tmp_path, archive, how, words):
    bad = edited(archive, tmp_path, _break(how))
    with pytest.raises(DataError, match=words) as e:
        prepare(bad, tmp_path / "root")
    assert re.search(r"syn\d-\w+-b\.sph: ", str(e.value))
    assert "delete it to leave that utterance out" in str(e.value)
    assert "\n" not in str(e.value)


def test_audio_broken_after_preparation_is_caught_too(tmp_path, archive):
    corpus = prepare(archive, tmp_path / "root")
    path = Path(corpus.splits["test"][0].path)
    path.write_bytes(path.read_bytes()[:2048])  # cut after preparation: the next run still notices
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}: truncated SPHERE file"):
        prepare(archive, tmp_path / "root")


# -- data: transcripts ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,words", [("YES 42", r"outside the alphabet: '24'"),
                                        ("TWENTY-ONE", "outside the alphabet: '-'"), ("", "empty transcript")])
def test_bad_transcript_is_refused_with_utterance_and_line(tmp_path, archive, text, words):
    def edit(an4):
        lines = train_lines(an4)
        lines[3] = f"<s> {text} </s> ({uid(lines[3])})"
        set_train_lines(an4, lines)
    bad = edited(archive, tmp_path, edit)
    with pytest.raises(DataError, match=words) as e:
        prepare(bad, tmp_path / "root")
    lines = (tmp_path / "src" / "an4" / "etc" / "an4_train.transcription").read_text().splitlines()
    assert f"an4_train.transcription:4: utterance {uid(lines[3])}: " in str(e.value)
    assert "correct that line, or delete it" in str(e.value)


# -- data: what is handled, end to end: counted in results.json and in the log ---------------------

@pytest.fixture(scope="module")
def handled(archive, tmp_path_factory):
    """One smoke run on a corpus with a lower-case, punctuated transcript, a transcript without audio,
    audio without a transcript and a label too long for CTC: (results.json, log text, the ids)."""
    folder = tmp_path_factory.mktemp("handled")
    ids = {}

    def edit(an4):
        lines, rows = train_lines(an4), training_speaker_lines(an4)
        ids["normalized"], ids["no_audio"], ids["no_transcript"], ids["ctc"] = (uid(lines[i]) for i in rows[:4])
        words = lines[rows[0]].split("<s> ")[1].split(" </s>")[0].split()
        lines[rows[0]] = f"<s> {', '.join(words).lower()}! </s> ({ids['normalized']})"
        next((an4 / "wav").rglob(f"{ids['no_audio']}.sph")).unlink()
        lines[rows[3]] = f"<s> {' '.join(['YES STOP'] * 30)} </s> ({ids['ctc']})"
        set_train_lines(an4, [l for i, l in enumerate(lines) if i != rows[2]])

    bad = edited(archive, folder, edit)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("batchrnn").addHandler(handler)
    try:
        train(config("data.corpus=an4", f"data.archive={bad}", f"data.root={folder / 'root'}"), folder / "run")
    finally:
        logging.getLogger("batchrnn").removeHandler(handler)
    return json.loads((folder / "run" / RESULTS).read_text()), "\n".join(records), ids


def test_normalised_transcript_is_counted_and_logged(handled):
    results, log, ids = handled
    assert results["corpus"]["normalized"] == {"train": 1, "test": 0}
    assert results["corpus"]["normalized_ids"]["train"] == [ids["normalized"]]
    assert re.search(rf"1 train transcripts normalised \(case or punctuation\): {ids['normalized']}", log)


def test_transcript_without_audio_and_audio_without_transcript_are_counted_and_logged(handled):
    results, log, ids = handled
    assert results["corpus"]["skipped"]["train"] == {"no_audio": 1, "no_transcript": 1}
    assert results["corpus"]["skipped_ids"]["train"] == {"no_audio": [ids["no_audio"]],
                                                         "no_transcript": [ids["no_transcript"]]}
    assert f"skipping 1 train utterances without audio: {ids['no_audio']}" in log
    assert f"skipping 1 train utterances without a transcript: {ids['no_transcript']}" in log


def test_label_too_long_for_ctc_is_left_out_counted_and_logged(handled):
    results, log, ids = handled
    assert results["status"] == "finished" and results["ctc_skipped_utterances"] == [ids["ctc"]]
    assert "1 training utterances have more labels than the model's output frames allow" in log
    assert ids["ctc"] in log


# -- config ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,allowed", [("model.rnn", "transformer", "[gru, lstm, rnn]"),
                                               ("model.bn", "layer", f"[{', '.join(BN_MODES)}]")])
def test_unknown_variant_on_the_command_line(tmp_path, key, value, allowed):
    run = cli(f"{key}={value}", f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert f"{key}={value}" in run.stderr and f"Invalid value '{value}', expected one of {allowed}" in run.stderr
    assert not (tmp_path / "run").exists()  # refused before any work


@pytest.mark.parametrize("overrides,message", [
    (["model.impl=cells", "model.bn=post"], "model.impl=cells with model.bn=post: the cell reference exists for "
                                            "model.bn=seqwise|ln|wn only; use model.impl=fused"),
    (["train.max_skipped_steps=0"], "train.max_skipped_steps=0: must be positive"),
    # the preset's 64 mel bands; torchaudio's masks wider than the input zero it all, silently
    (["train.spec_augment.freq_masks=3", "train.spec_augment.freq_width=500"],
     "train.spec_augment.freq_width=500: 3 masks of up to 500 bins could cover all 64 feature bins, and train on "
     "zeros; give freq_masks x freq_width at most 64 (Park et al.'s LD policy: 2 masks of up to 27 of 80 bins)"),
])
def test_impossible_value_on_the_command_line(tmp_path, overrides, message):
    run = cli(*overrides, f"hydra.run.dir={tmp_path}", timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stdout + run.stderr
    assert f"error: {message}\n" in run.stdout + run.stderr
    assert not (tmp_path / RESULTS).exists()


def test_time_masks_that_could_cover_a_typical_utterance_are_refused_before_training(tmp_path, smoke_root):
    """The utterances' lengths are known once the features are: refused then, before the first step."""
    run = cli("experiment=smoke", f"data.root={smoke_root}", "train.spec_augment.time_masks=5",
              "train.spec_augment.time_width=100000", f"hydra.run.dir={tmp_path}")
    assert run.returncode == 2 and "Traceback" not in run.stdout + run.stderr
    (line,) = [l for l in (run.stdout + run.stderr).splitlines() if "error:" in l]
    assert re.search(r"error: train.spec_augment.time_width=100000: 5 masks of up to 100000 frames could cover the "
                     r"median training utterance \(\d+ frames\) whole, and train on zeros; give time_masks x "
                     r"time_width less than \d+$", line), line
    assert not list(tmp_path.glob(f"*/{CHECKPOINT}"))


# -- training: non-finite steps --------------------------------------------------------------------

def test_non_finite_step_is_skipped_and_counted(tmp_path, caplog):
    cfg = config(f"data.root={tmp_path / 'data'}")
    corpus = prepare_corpus(cfg.data)
    bad = corpus.splits["train"][5].id
    fs = features.load_features(corpus, "train", cfg.data)
    frames = np.memmap(features.frames_path(features.cache_path(corpus, "train", cfg.data)), np.float32, "r+",
                       shape=(sum(fs.lengths), fs.num_features))
    start = sum(fs.lengths[:5])
    frames[start:start + 3] = float("nan")  # three frames of one utterance, in the real cache file
    frames.flush()
    del frames, fs
    results = train(cfg, tmp_path / "run")
    assert results["status"] == "finished"
    assert results["skipped_steps"] == 2 and [e["skipped_steps"] for e in results["epochs"]] == [1, 2]
    # the skipped step's BatchNorm statistics were taken back: evaluation stays finite
    assert all(np.isfinite([e["val_loss"], e["train_loss"]]).all() for e in results["epochs"])
    assert np.isfinite(results["test_loss"])
    assert re.search(rf"epoch 1 step \d+: non-finite loss or gradient, step skipped .*{bad}", caplog.text)


def test_persistent_non_finite_steps_stop_the_run_and_keep_what_was_done(smoke, tmp_path):
    cfg = smoke("train.lr=1e30", "train.max_skipped_steps=3")  # the first step sends every weight to 1e30
    with pytest.raises(TrainingDiverged, match=r"4 steps in a row .* epoch 2; the run has diverged\. Lower "
                                               r"train\.lr \(now 1e\+30\) or check the data"):
        train(cfg, tmp_path)
    results = json.loads((tmp_path / RESULTS).read_text())
    assert results["status"] == "diverged" and [e["epoch"] for e in results["epochs"]] == [1]
    assert "the run has diverged" in results["error"] and (tmp_path / CHECKPOINT).exists()
    assert results["skipped_steps"] == 4  # 3 in epoch 1, the 4th in epoch 2 stopped it


@pytest.mark.parametrize("launcher", ["basic", "parallel"])  # parallel: the jobs run in other processes
def test_sweep_goes_on_past_a_diverged_run_and_a_restart_skips_the_finished_one(tmp_path, smoke_root, launcher):
    args = ["-m", f"data.root={smoke_root}", f"hydra.sweep.dir={tmp_path}", "experiment=smoke",
            "train.lr=3e-3,1e30", "train.max_skipped_steps=3", f"hydra/launcher={launcher}"]
    first = cli(*args)
    good, bad = sorted((p.parent for p in tmp_path.rglob(RESULTS)),
                       key=lambda run: json.loads((run / RESULTS).read_text())["config"]["train"]["lr"])
    assert first.returncode == 3, first.stderr[-2000:]
    assert "Traceback" not in first.stderr and "error: 1 runs of this sweep stopped early" in first.stderr
    assert len(re.findall(r"error: .*the run has diverged", (bad / "run.log").read_text())) == 1  # Hydra's job log
    assert json.loads((good / RESULTS).read_text())["status"] == "finished"
    assert json.loads((bad / RESULTS).read_text())["status"] == "diverged"
    mtime = (good / CHECKPOINT).stat().st_mtime_ns
    again = cli(*args)
    assert again.returncode == 3 and "is finished; train.rerun=true runs it again" in (good / "run.log").read_text()
    assert (good / CHECKPOINT).stat().st_mtime_ns == mtime  # not trained again
    assert len(json.loads((bad / RESULTS).read_text())["epochs"]) == 1  # resumed, diverged again, kept epoch 1


def test_two_sweeps_in_one_folder_each_exit_by_their_own_jobs(tmp_path, smoke_root):
    """The record of a sweep's failed jobs was the folder's: a second sweep there deleted the first's (which then
    exited 0), or read it (and exited 2 though its own jobs had finished). One sweep is held (SIGSTOP) while the
    other runs from start to end, as two sweeps started together interleave."""
    common = ["-m", "experiment=smoke", f"data.root={smoke_root}", f"hydra.sweep.dir={tmp_path}"]
    damaged = tmp_path / run_name(to_container(config(f"data.root={smoke_root}", "model.rnn=lstm")))
    damaged.mkdir(parents=True)
    (damaged / CHECKPOINT).write_bytes(b"not a checkpoint")  # its job stops at once: exit 2

    def held(until, *overrides) -> subprocess.Popen:
        """A sweep, stopped once until() holds."""
        proc = subprocess.Popen([*RUN, *common, *overrides], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 120
        while not until():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)
        return proc

    def resumed(proc: subprocess.Popen) -> int:
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err[-2000:]

    # the first sweep's failed job is on record when the second starts and ends
    first = held(lambda: [p for p in (tmp_path / FAILED_DIR).rglob("*") if p.is_file()], "model.rnn=lstm,gru")
    try:
        second = cli(*common, "model.rnn=rnn")
    finally:
        code, err = resumed(first)
    assert second.returncode == 0, second.stderr[-2000:]
    assert code == 2 and "error: 1 runs of this sweep stopped early" in err, err
    # a sweep whose jobs all finish, while another fails a job and ends
    clean = tmp_path / run_name(to_container(config(f"data.root={smoke_root}", "model.rnn=rnn", "seed=1")))
    # held once its run has built its model, so past the data folder's lock (distributed.one_at_a_time): held
    # inside it, the fourth sweep's job would wait on that lock for good (seen once in a full suite at 5bd05e5)
    log = clean / "run.log"
    third = held(lambda: log.exists() and "parameters on" in log.read_text(), "model.rnn=rnn", "seed=1")
    try:
        fourth = cli(*common, "model.rnn=lstm")
    finally:
        code, err = resumed(third)
    assert fourth.returncode == 2, fourth.stderr[-2000:]
    assert code == 0, err
    assert not (tmp_path / FAILED_DIR).exists()  # each sweep took its records away


def test_data_error_stops_a_sweep_with_one_line(tmp_path):
    bad = tmp_path / "an4_sphere.tar.gz"
    bad.write_bytes(b"not an archive" * 100)
    run = cli("-m", "experiment=smoke", "data.corpus=an4", f"data.archive={bad}", f"data.root={tmp_path / 'root'}",
              f"hydra.sweep.dir={tmp_path / 'sweep'}", "model.rnn=gru,lstm")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    errors = re.findall(r"error: .*", run.stdout)
    assert len(errors) == 1 and f"{bad}: truncated or corrupt archive" in errors[0]  # the second job never ran
    assert "delete it and fetch it again" in errors[0]
    assert not list((tmp_path / "sweep").rglob(RESULTS))


def test_a_run_the_study_started_tells_it_of_an_error_every_run_would_meet(tmp_path, monkeypatch):
    """src/run.py's side of the study's stop (batchrnn.study.sweep.record_stop): a corrupt archive is written to the
    file the study named, so the study starts no more runs (tests/test_protocol.py has the study's side)."""
    bad = tmp_path / "an4_sphere.tar.gz"
    bad.write_bytes(b"not an archive" * 100)
    monkeypatch.setenv(STOP_FILE, str(tmp_path / "stop"))
    run = cli("experiment=smoke", "data.corpus=an4", f"data.archive={bad}", f"data.root={tmp_path / 'root'}",
              f"hydra.run.dir={tmp_path / 'study'}")
    assert run.returncode == 2 and f"{bad}: truncated or corrupt archive" in (tmp_path / "stop").read_text()


# -- training: interruptions and damaged run folders -----------------------------------------------

def test_sigterm_ends_a_parallel_sweeps_worker_processes_too(tmp_path, smoke_root):
    """joblib's workers (hydra/launcher=parallel) take a job's SystemExit for its result and wait for more: a
    SIGTERM to the sweep's process group must end them too, not leave them busy once the sweep is gone."""
    study = tmp_path / "study"
    args = ["-m", "experiment=smoke", f"data.root={smoke_root}", f"hydra.sweep.dir={study}", "train.epochs=30",
            "seed=1,2", "hydra/launcher=parallel"]
    with open(tmp_path / "out.log", "w+") as out:
        proc = subprocess.Popen([*RUN, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while len(list(study.glob(f"*/{CHECKPOINT}"))) < 2:  # both jobs past their first epoch, in workers
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before it was killed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)  # anything left of the sweep's process group?
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("a worker of the sweep was still running 30 s after SIGTERM")
        out.seek(0)
        assert out.read().count("stopped by SIGTERM") == 2

def test_processes_that_share_a_fresh_data_folder_prepare_it_one_at_a_time(tmp_path):
    """A parallel sweep's jobs (or ranks) on a fresh data.root: one prepares the corpus and its features while the
    others wait on the folder's lock (training.distributed.one_at_a_time), instead of writing the same files at
    once (two jobs once raced on the synthetic archive's .part file)."""
    root = tmp_path / "data"
    with distributed.one_at_a_time(root):  # held here, as by the first job
        proc = subprocess.Popen([*RUN, "experiment=smoke", f"data.root={root}", f"hydra.run.dir={tmp_path / 'run'}",
                                 "train.epochs=1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(8)  # time enough to start and, were it not waiting, to make the corpus
        waited = proc.poll() is None and not (root / "synthetic" / "an4" / data.MARKER).exists()
    out, _ = proc.communicate(timeout=300)
    assert waited, out[-2000:]
    assert proc.returncode == 0, out[-2000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, smoke_root):
    return train(config(f"data.root={smoke_root}", "train.epochs=6"), tmp_path_factory.mktemp("whole"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_run_resumes_and_ends_as_if_never_killed(tmp_path, smoke_root, uninterrupted, sig):
    study = tmp_path / "study"
    args = ["experiment=smoke", f"data.root={smoke_root}", f"hydra.run.dir={study}", "train.epochs=6"]
    with open(tmp_path / "out.log", "w+") as out:
        proc = subprocess.Popen([*RUN, *args], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not list(study.glob(f"*/{CHECKPOINT}")):  # epoch 1 is complete: kill it in epoch 2 or later
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it was killed"
            time.sleep(0.01)
        (run,) = (p.parent for p in study.glob(f"*/{CHECKPOINT}"))
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        out.seek(0)
        log = out.read()
    assert code == (128 + sig if sig == signal.SIGTERM else -sig), log[-2000:]
    if sig == signal.SIGTERM:
        assert "stopped by SIGTERM; run the same command again to resume" in log and "Traceback" not in log
    if (run / RESULTS).exists():
        assert json.loads((run / RESULTS).read_text())["status"] == "running"
    # a process killed while writing leaves its temporary file: it must not matter
    (run / f".{CHECKPOINT}.999999.tmp").write_bytes(b"half a checkpoint")
    (run / f".{RESULTS}.999999.tmp").write_text('{"status": "fini')
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed" in resumed.stdout
    results = json.loads((run / RESULTS).read_text())
    assert results["status"] == "finished" and results.keys() == uninterrupted.keys()
    assert [e["epoch"] for e in results["epochs"]] == [1, 2, 3, 4, 5, 6]
    assert [e["train_loss"] for e in results["epochs"]] == pytest.approx(
        [e["train_loss"] for e in uninterrupted["epochs"]], rel=1e-5)
    assert not list(run.glob(".*.tmp"))


def test_sigterm_in_a_step_ends_the_run_when_that_step_is_done(smoke, tmp_path, monkeypatch):
    """The handler src/run.py installs acts between two steps (batchrnn.training.stopping): a SIGTERM that comes in
    the middle of a step (here before its forward and backward) lets the step finish, AdamW's update included,
    and the run leaves before the next one, with exit status 143 and epoch 1's checkpoint as the last."""
    whole, started, finished, updates = loop.gradient, [], [], []

    def gradient(run, indices, epoch):
        if epoch == 2:
            started.append(epoch)
            if len(started) == 2:  # the second step of epoch 2
                os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler at its next bytecode: in this step
        out = whole(run, indices, epoch)
        if epoch == 2:
            finished.append(epoch)
        return out

    def step(self, *args, real=torch.optim.AdamW.step, **kwargs):
        updates.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(loop, "gradient", gradient)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    previous = signal.signal(signal.SIGTERM, stopping.on_signal)
    try:
        with pytest.raises(SystemExit) as stop:
            train(smoke("train.epochs=4"), tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stop.value.code == 128 + signal.SIGTERM
    assert started == finished == [2, 2]  # the step the signal came in finished; no third step began
    progress = torch.load(tmp_path / CHECKPOINT, weights_only=False)["progress"]
    assert progress["epoch"] == 1 and len(updates) == progress["step"] + 2  # epoch 2's two updates were made
    assert progress["step"] > 2  # epoch 2 had more steps to take: the signal stopped it


def test_a_sigterm_is_acted_on_at_once_outside_training_and_at_the_next_check_inside():
    with pytest.raises(SystemExit) as stop:
        stopping.on_signal(signal.SIGTERM, None)
    assert stop.value.code == 128 + signal.SIGTERM
    reached = []
    with pytest.raises(SystemExit) as stop:
        with stopping.deferred():
            stopping.on_signal(signal.SIGTERM, None)  # recorded only
            stopping.on_signal(signal.SIGINT, None)  # the first one is the one acted on
            reached.append("after the signals")
            stopping.check()
            reached.append("after the check")
    assert stop.value.code == 128 + signal.SIGTERM and reached == ["after the signals"]
    stopping.check()  # nothing stays pending once the run has left: a later score() in this process goes on
    with pytest.raises(SystemExit):  # one after the last check: acted on when the training ends
        with stopping.deferred():
            stopping.on_signal(signal.SIGTERM, None)
    with stopping.deferred():  # a new run starts with none pending
        stopping.check()


@pytest.mark.skipif(not (sys.platform == "linux" and os.uname().machine == "x86_64"),
                    reason="oneDNN's generated x64 GEMM kernels; the check reads glibc's structures")
def test_a_storm_of_sigterms_in_onednns_kernels_leaves_a_run_process_intact():
    """oneDNN's GEMM kernels point the stack register at a heap buffer, and a signal's frame lands below it: SIGTERM
    every 0.5 ms crashed the GRU and the LSTM step loops within about a second with the handler alone
    (`experiments/signal_frames.py --stack off`). With src/run.py's set-up (stopping.install: an alternate signal
    stack for the main thread, large enough for this CPU's frame, and the handler on it) both train through the
    storm, every step's gradients the same bits, and leave with 143 on the SIGTERMs they recorded."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}  # it would give the stack itself
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "signal_frames.py"), "--seconds", "3",
                          "--stack", "run"], capture_output=True, text=True, timeout=300, env=env)
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["rnn"], r["exit"], r.get("gradients changed")) for r in results] == [("gru", 143, 0),
                                                                                      ("lstm", 143, 0)], out
    for r in results:
        assert r["alternate stack"] >= r["frame needs"] > 0 and r["SA_ONSTACK"], r  # whatever GEMM this CPU runs
        assert r["steps"] >= 3 and r["SIGTERMs sent"] >= 300, r  # signals came in the middle of steps
    assert out.returncode == 0


def test_damaged_checkpoint_names_the_file_and_the_fix(smoke, tmp_path):
    train(smoke("train.epochs=1"), tmp_path)
    (tmp_path / RESULTS).unlink()  # as if stopped before finishing
    checkpoint = tmp_path / CHECKPOINT
    whole = checkpoint.read_bytes()
    checkpoint.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(RunError, match=rf"{re.escape(str(checkpoint))}: unreadable .*; train.rerun=true to train "
                                       "this run afresh"):
        train(smoke("train.epochs=1"), tmp_path)
    checkpoint.write_bytes(whole)  # whole again, but of another model
    with pytest.raises(RunError, match=r"the checkpoint of another run \(other model.hidden_size\).*train.rerun=true"):
        train(smoke("train.epochs=1", "model.hidden_size=16"), tmp_path)


def test_a_run_folder_that_cannot_be_written_names_it_and_the_fix(smoke, tmp_path, monkeypatch):
    """A read-only run folder (as a user who is not root meets it): the lock's file cannot be opened."""
    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(rundir, "open", refuse, raising=False)  # the lock's open, rundir's only one
    with pytest.raises(RunError, match=rf"{re.escape(str(tmp_path / LOCK))}: Permission denied; make the folder "
                                       "writable, or choose another"):
        train(smoke(), tmp_path)


def full_disk(path: Path) -> None:
    """The next atomic write of path, by this process, fails as on a full disk: its temporary file is /dev/full."""
    (path.parent / f".{path.name}.{os.getpid()}.tmp").symlink_to("/dev/full")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, whose writes fail with ENOSPC")
def test_a_full_disk_at_a_checkpoint_names_the_file_and_the_run_resumes(smoke, tmp_path, monkeypatch, uninterrupted):
    """torch.save's own file writer said only "unexpected pos 704 vs 598", in a traceback."""
    whole = RunFolder.save_checkpoint

    def save_checkpoint(self, model, opt, progress, *args):
        if progress["epoch"] == 2:
            full_disk(self.file(CHECKPOINT))
        return whole(self, model, opt, progress, *args)

    with monkeypatch.context() as patch:
        patch.setattr(RunFolder, "save_checkpoint", save_checkpoint)
        with pytest.raises(RunError, match=rf"{re.escape(str(tmp_path / CHECKPOINT))}: No space left on device; free "
                                           "space on that disk; then run the same command again"):
            train(smoke("train.epochs=6"), tmp_path)
    assert torch.load(tmp_path / CHECKPOINT, weights_only=False)["progress"]["epoch"] == 1  # whole, as it was
    assert not list(tmp_path.glob(".*.tmp"))
    results = train(smoke("train.epochs=6"), tmp_path)
    assert [e["epoch"] for e in results["epochs"]] == [1, 2, 3, 4, 5, 6]
    assert results["test_wer"] == uninterrupted["test_wer"]


def test_a_full_disk_while_preparing_the_corpus_is_one_error_line(tmp_path, monkeypatch, capsys, archive):
    """As `python -m batchrnn.data` and as a run prepare it: writing the corpus's marker (its fsync, where a full
    disk shows on many filesystems), then extracting the archive (which was called corrupt)."""
    def fsync(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as os.fsync raises it: no file named

    with monkeypatch.context() as patch:
        patch.setattr(storage, "fsync", fsync)
        with pytest.raises(SystemExit) as stop:
            preparation.main(["--preset", "smoke", "--root", str(tmp_path / "cli")])
        (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
        assert stop.value.code == 2
        assert error == f"error: {tmp_path / 'cli'}/synthetic/an4/{data.MARKER}: No space left on device; free " \
                        "space on that disk, or set data.root to another folder; then run the same command again"
        with pytest.raises(DataError, match="No space left on device; free space on that disk, or set data.root"):
            train(config(f"data.root={tmp_path / 'run'}"), tmp_path / "run")

    def makefile(self, tarinfo, targetpath):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tarfile.TarFile, "makefile", makefile)
    with pytest.raises(DataError, match=r"No space left on device; free space on that disk, or set data.root") as e:
        prepare(archive, tmp_path / "extract")
    assert "corrupt" not in str(e.value)


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_a_study_folder_that_names_a_file_is_one_error_line(tmp_path, key):
    (tmp_path / "file").write_text("")
    run = cli(*["-m"] * (key == "hydra.sweep.dir"), "experiment=smoke", f"{key}={tmp_path / 'file'}", timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr == f"error: {key}={tmp_path / 'file'}: names a file, not a folder; give a folder that can be " \
                         "written\n"


def test_evaluate_says_a_run_is_unfinished_and_that_a_folder_is_not_audio(smoke, tmp_path, monkeypatch, capsys):
    with monkeypatch.context() as patch:
        stopped_after(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            train(smoke("train.epochs=3"), tmp_path)
    capsys.readouterr()
    evaluate.main(["score", str(tmp_path), "--device", "cpu"])
    assert f"warning: {tmp_path}: unfinished (status running, 1 epoch in {RESULTS}); these are the scores of its " \
           "best epoch so far (1)\n" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        evaluate.main(["transcribe", str(tmp_path), str(tmp_path), "--device", "cpu"])
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert stop.value.code == 2
    assert error == f"error: {tmp_path}: a folder, not an audio file; give the files in it (e.g. {tmp_path}/*.wav)"


def test_sigterm_ends_python_m_batchrnn_data_with_one_line(tmp_path):
    """It ended with 143 and said nothing. A download that never answers holds it inside its preparation."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "all_proxy")}
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(120)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/an4_sphere.tar.gz"
        proc = subprocess.Popen([sys.executable, "-m", "batchrnn.data", "--preset", "smoke", "--corpus", "an4",
                                 "--archive", url, "--root", str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env | {"PYTHONPATH": str(ROOT / "src")})
        connection, _ = server.accept()  # it is downloading
        with connection:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert err == f"stopped by SIGTERM; run the same command again to {preparation.AGAIN}\n"


def stopped_after(monkeypatch, epochs: int) -> None:
    """The next train() stops (KeyboardInterrupt) as epoch `epochs` + 1 begins, its files as after `epochs`."""
    whole = loop.train_epoch

    def train_epoch(run, progress, tracker):
        if progress.epoch == epochs + 1:
            raise KeyboardInterrupt
        return whole(run, progress, tracker)

    monkeypatch.setattr(loop, "train_epoch", train_epoch)


def test_damaged_best_of_a_stopped_run_is_written_again_before_any_epoch_trains(smoke, tmp_path, monkeypatch,
                                                                                caplog, uninterrupted):
    """best.pt was read only once training ended: a garbled one cost the epochs after the stop, then every later
    run failed at once. checkpoint.pt holds the best epoch's weights, so best.pt is written again at resume."""
    assert uninterrupted["best_epoch"] < 3  # so the checkpoint at 3 holds other weights than the best
    with monkeypatch.context() as patch:
        stopped_after(patch, 3)
        with pytest.raises(KeyboardInterrupt):
            train(smoke("train.epochs=6"), tmp_path)
    (tmp_path / BEST).write_bytes(b"garbled")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        results = train(smoke("train.epochs=6"), tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    (warned,) = [i for i, line in enumerate(lines) if line.startswith(f"{tmp_path / BEST}: ")]
    assert re.match(rf"{re.escape(str(tmp_path / BEST))}: not a readable model file .*; written again from "
                    rf"{CHECKPOINT} \(epoch {uninterrupted['best_epoch']}, the best\)", lines[warned])
    assert warned < min(i for i, line in enumerate(lines) if line.startswith("epoch 4:"))  # before any epoch
    assert [e["epoch"] for e in results["epochs"]] == [1, 2, 3, 4, 5, 6]
    assert results["test_wer"] == uninterrupted["test_wer"] and results["best_epoch"] == uninterrupted["best_epoch"]
    assert load_model(tmp_path / BEST)[1]["epoch"] == uninterrupted["best_epoch"]


@pytest.mark.parametrize("damage", ["missing", "garbled"])
def test_finished_run_without_a_usable_best_stays_finished_and_evaluate_refuses_it(smoke, tmp_path, caplog, capsys,
                                                                                   damage):
    first = train(smoke(), tmp_path)
    mtime = (tmp_path / CHECKPOINT).stat().st_mtime_ns
    (tmp_path / BEST).unlink() if damage == "missing" else (tmp_path / BEST).write_bytes(b"garbled")
    caplog.clear()
    again = train(smoke(), tmp_path)
    assert again["status"] == "finished" and again["epochs"] == first["epochs"]
    assert (tmp_path / CHECKPOINT).stat().st_mtime_ns == mtime  # not trained again
    assert re.search(rf"{re.escape(str(tmp_path / BEST))}: .*; the run stays finished, but evaluate cannot use it: "
                     r"train.rerun=true trains it again", caplog.text)
    with pytest.raises(SystemExit) as stop:
        evaluate.main(["score", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("error:") == 1 and f"error: {tmp_path / BEST}: " in err


def test_a_checkpoint_copied_from_another_run_is_refused(smoke, tmp_path):
    """docs/runs.md: a checkpoint of other settings is refused; one of the same model's shape (another rate and
    seed) was resumed, its epochs then filed under this run's settings."""
    train(smoke("train.epochs=1", "train.lr=1e-2", "seed=7"), tmp_path / "other")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / CHECKPOINT).write_bytes((tmp_path / "other" / CHECKPOINT).read_bytes())
    with pytest.raises(RunError, match=r"checkpoint.pt: the checkpoint of another run \(other seed, train.lr\); put "
                                       r"it back in its own run's folder, or train.rerun=true"):
        train(smoke("train.epochs=1"), tmp_path / "run")
    assert not (tmp_path / "run" / RESULTS).exists()


def test_a_deleted_checkpoint_of_a_run_with_epochs_on_record_is_refused(smoke, tmp_path, monkeypatch):
    """It restarted the run from scratch without a word, and results.json's epochs were replaced."""
    with monkeypatch.context() as patch:
        stopped_after(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            train(smoke("train.epochs=3"), tmp_path)
    (tmp_path / CHECKPOINT).unlink()
    with pytest.raises(RunError, match=rf"{CHECKPOINT}: missing, though {RESULTS} records 1 complete epoch; put it "
                                       "back to resume, or train.rerun=true"):
        train(smoke("train.epochs=3"), tmp_path)
    assert len(json.loads((tmp_path / RESULTS).read_text())["epochs"]) == 1  # kept
    assert train(smoke("train.epochs=3", "train.rerun=true"), tmp_path)["status"] == "finished"


def test_damaged_results_of_a_finished_run_are_rebuilt_without_training(smoke, tmp_path, caplog):
    first = train(smoke(), tmp_path)
    mtimes = {name: (tmp_path / name).stat().st_mtime_ns for name in (CHECKPOINT, BEST)}
    (tmp_path / RESULTS).write_text('{"status": "fini')
    again = train(smoke(), tmp_path)
    assert "unreadable" in caplog.text and (tmp_path / f"{RESULTS}.unreadable").exists()
    assert {name: (tmp_path / name).stat().st_mtime_ns for name in (CHECKPOINT, BEST)} == mtimes
    assert again["status"] == "finished" and again["epochs"] == first["epochs"]
    assert again["test_wer"] == first["test_wer"]


def test_corrupt_feature_cache_is_computed_again(tmp_path, smoke):
    cfg = smoke()
    corpus = prepare_corpus(cfg.data)
    corpus = replace(corpus, root=tmp_path)  # its own cache folder
    fs = features.load_features(corpus, "val", cfg.data)
    features.cache_path(corpus, "val", cfg.data).write_bytes(os.urandom(5000))
    with pytest.warns(UserWarning, match="unreadable feature cache .*computing it again"):
        assert features.load_features(corpus, "val", cfg.data).lengths == fs.lengths


# -- logging ---------------------------------------------------------------------------------------

def test_unreachable_wandb_server_falls_back_to_offline_and_training_completes(smoke, tmp_path, monkeypatch,
                                                                                caplog, wandb_env):
    wandb_env("http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr(tracking, "INIT_TIMEOUT_S", 2)
    results = train(smoke("logger.mode=online"), tmp_path / "run")
    assert results["status"] == "finished"
    assert "W&B online init failed" in caplog.text and "logging offline" in caplog.text
    history = [h for h in read_offline_run(tmp_path / "run")["history"] if "val_wer" in h]
    assert [h["val_wer"] for h in history] == pytest.approx([e["val_wer"] for e in results["epochs"]])


class FakeWandbServer(http.server.ThreadingHTTPServer):
    """Just enough of a W&B server for an online run to start and stream: one GraphQL answer that holds
    every field wandb's init reads, upload URLs for the run's files, and 200 for everything else."""

    ANSWER = {"data": {
        "viewer": {"id": "u1", "entity": "tester", "username": "tester", "flags": "{}", "teams": {"edges": []}},
        "serverInfo": {"features": [], "cliVersionInfo": {}, "latestLocalVersionInfo": None},
        "upsertBucket": {"inserted": True, "bucket": {
            "id": "b1", "name": "run1", "displayName": "run1", "description": "", "config": "{}",
            "sweepName": None, "historyLineCount": 0, "eventsLineCount": 0, "logLineCount": 0,
            "summaryMetrics": "{}", "historyTail": "[]",
            "project": {"id": "p1", "name": "batchrnn", "entity": {"id": "e1", "name": "tester"}}}},
    }}

    def __init__(self):
        super().__init__(("127.0.0.1", 0), FakeWandbHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class FakeWandbHandler(http.server.BaseHTTPRequestHandler):
    timeout = 10

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        answer = {}
        if self.path.startswith("/graphql"):
            request = json.loads(body)
            answer = self.server.ANSWER
            if "CreateRunFiles" in request["query"]:
                answer = {"data": {"createRunFiles": {"runID": "run1", "uploadHeaders": [], "files": [
                    {"name": f, "uploadUrl": f"{self.server.url}/upload/{f}"} for f in request["variables"]["files"]]}}}
        out = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_PUT = do_GET = do_POST

    def log_message(self, *args):
        pass


def test_wandb_server_lost_mid_run_costs_only_the_upload(smoke, tmp_path, monkeypatch, caplog, wandb_env):
    """Online start, then the server goes away after epoch 1: training finishes, finish gives up after
    FINISH_TIMEOUT_S instead of waiting forever (wandb's default), and every epoch is on disk to sync."""
    server = FakeWandbServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    wandb_env(server.url)
    monkeypatch.setattr(tracking, "FINISH_TIMEOUT_S", 3)
    log_epoch = tracking.WandbTracker.log_epoch

    def log_then_lose_the_server(self, row):
        log_epoch(self, row)
        if row["epoch"] == 1:
            server.shutdown()
            server.server_close()  # connections are refused from here on

    monkeypatch.setattr(tracking.WandbTracker, "log_epoch", log_then_lose_the_server)
    finish, took = tracking.WandbTracker.finish, []

    def timed_finish(self):  # only the finish is bounded: training's own time depends on the machine
        start = time.monotonic()
        finish(self)
        took.append(time.monotonic() - start)

    monkeypatch.setattr(tracking.WandbTracker, "finish", timed_finish)
    results = train(smoke("logger.mode=online"), tmp_path / "run")
    assert results["status"] == "finished" and len(results["epochs"]) > 1
    # without finish_timeout, wandb's finish blocks for good; with it, FINISH_TIMEOUT_S and the service's teardown
    assert len(took) == 1 and took[0] < tracking.FINISH_TIMEOUT_S + 30, took
    assert "W&B online init failed" not in caplog.text  # it did start online
    assert "W&B could not finish the run" in caplog.text and "wandb sync" in caplog.text
    history = [h for h in read_offline_run(tmp_path / "run", prefix="run")["history"] if "val_wer" in h]
    assert [h["val_wer"] for h in history] == pytest.approx([e["val_wer"] for e in results["epochs"]])


# -- downloads -------------------------------------------------------------------------------------

class FlakyServer(http.server.ThreadingHTTPServer):
    """Serves one payload with Range support; the first `drops` responses stop halfway and hang up."""

    def __init__(self, payload: bytes, drops: int):
        self.payload, self.drops, self.requests = payload, drops, []
        super().__init__(("127.0.0.1", 0), FlakyHandler)


class FlakyHandler(http.server.BaseHTTPRequestHandler):
    timeout = 10  # a stuck client cannot hold the server past the test

    def do_GET(self):
        server, payload = self.server, self.server.payload
        server.requests.append(self.headers.get("Range"))
        start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-"))[1])
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(payload) - 1}/{len(payload)}")
        self.send_header("Content-Length", str(len(payload) - start))
        self.end_headers()
        body = payload[start:]
        if server.drops:
            server.drops -= 1
            body = body[: len(body) // 2]  # then the connection closes: a short read
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(data, "RETRY_WAIT_S", 0.01)
    servers = []

    def start(payload: bytes, drops: int) -> FlakyServer:
        server = FlakyServer(payload, drops)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_broken_download_is_resumed_and_complete(tmp_path, serve, archive):
    payload = archive.read_bytes()
    server = serve(payload, drops=1)
    url = f"http://127.0.0.1:{server.server_port}/an4_sphere.tar.gz"
    path = data.fetch_archive(url, [], tmp_path)
    assert path.read_bytes() == payload and not list(tmp_path.glob("*.part"))
    assert server.requests == [None, f"bytes={len(payload) // 2}-"]  # the second asked for the rest only


def test_failing_download_names_the_url_and_leaves_nothing_behind(tmp_path, serve, archive):
    server = serve(archive.read_bytes(), drops=100)
    url = f"http://127.0.0.1:{server.server_port}/an4_sphere.tar.gz"
    with pytest.raises(DataError, match=f"{re.escape(url)}: download failed after 4 tries .*set data.archive "
                                        "to a local copy"):
        prepare_corpus(DataConfig(archive=url, root=str(tmp_path)))
    assert len(server.requests) == 4 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("typed", ["+model.bnn=seqwise", "++train.lrr=1e-3", "+extra=1"])
def test_unknown_key_fails_whatever_its_prefix(tmp_path, typed):
    """Hydra's own hint for a misspelt key is `+key=value`, which adds it past the schema."""
    run = cli("experiment=smoke", typed, f"hydra.run.dir={tmp_path}", timeout=60)
    key = typed.lstrip("+").split("=")[0]
    assert run.returncode == 2 and "Traceback" not in run.stdout + run.stderr
    assert f"error: {key}: no such setting" in run.stdout + run.stderr
    assert not list(tmp_path.rglob(RESULTS))


# -- two processes on one run -----------------------------------------------------------------------

HOLD = """
import sys, time
from batchrnn.training.rundir import RunFolder
with RunFolder(sys.argv[1]).lock():
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_second_process_on_a_run_is_refused_and_a_killed_one_blocks_nothing(smoke, tmp_path):
    """Another process holds the run folder: train() refuses at once, naming it; once that process is killed
    with -9, the same run trains (the OS released its lock)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        started = time.monotonic()
        with pytest.raises(RunError, match=rf"is being trained by process {holder.pid} on .* since .*; wait for it"):
            train(smoke(), tmp_path)
        assert time.monotonic() - started < 60, "refused at once, not after waiting"
        assert not (tmp_path / RESULTS).exists() and not (tmp_path / CHECKPOINT).exists()
    finally:
        holder.kill()
        holder.wait()
    assert train(smoke(), tmp_path)["status"] == "finished"


def test_the_command_line_refuses_a_held_run_with_exit_2_and_one_error_line(tmp_path, smoke_root):
    cfg = config(f"data.root={smoke_root}")
    folder = tmp_path / "smoke" / run_name(to_container(cfg))
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        run = cli("experiment=smoke", f"data.root={smoke_root}", f"hydra.run.dir={tmp_path / 'smoke'}")
    finally:
        holder.kill()
        holder.wait()
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in (run.stdout + run.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and str(folder) in errors[0] and f"process {holder.pid}" in errors[0], errors
