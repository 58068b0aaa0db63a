"""The AN4 corpus: fetch the archive, extract it safely, verify it once, parse it, split it by speaker.

`prepare_corpus` does all of it idempotently (and hands data.corpus=manifest to batchrnn.data.manifest);
`python -m batchrnn.data` runs it from the shell. What both build on (Utterance, Corpus, the split) is in base.py.
`make_synthetic_archive` writes a tiny AN4-shaped archive that goes through the very same pipeline.
"""
import hashlib
import http.client
import json
import os
import re
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zlib
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from batchrnn.config import CorpusName, DataConfig
from batchrnn.data.base import SAMPLE_RATE, Corpus, DataError, Utterance, describe, split_corpus
from batchrnn.data.manifest import prepare_manifest_corpus
from batchrnn.errors import cannot_write, one_line
from batchrnn.storage import write_json
from batchrnn.data.text import TranscriptError, normalize
from batchrnn.progress import progress_bar

# Archives whose bytes we have seen; any other archive is checked by content instead of refused,
# because AN4 circulates in several repackagings with the same audio.
KNOWN_SHA256 = {
    "c17719cd64968548c3ff645d8a67a505fba9ee8ace04cb6c26add5541298599d": "AN4 rebuilt as SPHERE (shared/data)",
}
AN4_COUNTS = {"train": 948, "test": 130}  # utterances in the real corpus
# split name -> folder under an4/wav/ and the stem of its etc/ files
LAYOUT = {"train": ("an4_clstk", "an4_train"), "test": ("an4test_clstk", "an4_test")}
MARKER = ".prepared.json"  # written last: its presence means extraction and verification completed
RETRY_WAIT_S = 1.0  # a broken download is retried after 1, 2, 4 ... times this


# -----------------------------------------------------------------------------
# fetching

def fetch_archive(source: str, mirrors: list[str], dest_dir: Path) -> Path:
    """A local path or file:// URL is used in place; http(s) is downloaded once into dest_dir."""
    errors = []
    for url in [source, *mirrors]:
        try:
            return _fetch_one(url, Path(dest_dir))
        except DataError as e:
            errors.append(str(e))
    if len(errors) == 1:
        raise DataError(errors[0])
    raise DataError(f"could not get the AN4 archive from any of {len(errors)} sources: {'; '.join(errors)}")


def _fetch_one(source: str, dest_dir: Path) -> Path:
    url = urllib.parse.urlparse(source)
    if url.scheme in ("http", "https"):
        dest = dest_dir / (Path(url.path).name or "an4_sphere.tar.gz")
        if not dest.is_file():  # only a finished download gets the final name
            _download(source, dest)
        return dest
    path = Path(urllib.request.url2pathname(url.path)) if url.scheme == "file" else Path(source).expanduser()
    if path.is_dir():
        raise DataError(f"{path}: a folder, not an archive; set data.archive to an4_sphere.tar.gz itself")
    if not path.is_file():
        raise DataError(f"{path}: archive not found; check data.archive")
    try:  # opening tells, where os.access guesses (root, ACLs, network file systems)
        with open(path, "rb"):
            pass
    except PermissionError as e:
        raise DataError(f"{path}: archive not readable; fix its permissions") from e
    return path


def _download(url: str, dest: Path, attempts: int = 4) -> None:
    """Download to dest.part, resuming with a Range request after a broken connection, then rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    part.unlink(missing_ok=True)  # a leftover may come from another mirror: never splice two sources
    error = None
    for attempt in range(attempts):
        have = part.stat().st_size if part.exists() else 0
        request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                # Append only what the server says continues our part; anything else starts over.
                if have and not (response.status == 206 and
                                 response.headers.get("Content-Range", "").startswith(f"bytes {have}-")):
                    have = 0
                total = have + response.length if response.length is not None else None
                with open(part, "ab" if have else "wb") as f, progress_bar(
                    total=total, initial=have, unit="B", unit_scale=True, desc=dest.name
                ) as bar:
                    while chunk := response.read(1 << 20):
                        f.write(chunk)
                        bar.update(len(chunk))
            if total is not None and part.stat().st_size != total:
                raise OSError(f"connection closed at {part.stat().st_size} of {total} bytes")
            os.replace(part, dest)
            return
        except urllib.error.HTTPError as e:
            error = e
            if e.code == 416:  # our partial file is not a prefix the server recognises
                part.unlink(missing_ok=True)
            elif e.code < 500:
                break  # 403, 404: asking again will not help
        except (OSError, EOFError, http.client.HTTPException) as e:  # resets, timeouts, short reads
            error = e
        if attempt + 1 < attempts:
            time.sleep(RETRY_WAIT_S * 2**attempt)
    part.unlink(missing_ok=True)  # never leave a partial file for a later run to mistake for the archive
    raise DataError(f"{url}: download failed after {attempt + 1} tries ({error}); check the network, "
                    "or set data.archive to a local copy")


# -----------------------------------------------------------------------------
# extracting and verifying

def unwritable(e: OSError) -> DataError | None:
    """A full disk or a data.root this process may not write in, as the DataError that says so; None for any other
    OSError. Every file of a prepared corpus is written whole or marked when complete, so nothing is lost."""
    if (problem := cannot_write(e)) is None:
        return None
    return DataError(f"{problem}, or set data.root to another folder; then run the same command again")


def extract_archive(archive: Path, dest: Path) -> None:
    """Extract into dest (the archive's an4/ lands at dest/an4); members outside dest are refused."""
    dest = Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)

    def checked(tar):  # lazy, so the archive is read in one pass
        for member in tar:
            target = (dest / member.name).resolve()
            if os.path.isabs(member.name) or not target.is_relative_to(dest):
                raise DataError(f"{archive}: refusing member {member.name!r}, it points outside {dest}")
            yield member

    try:
        with tarfile.open(archive, "r:*") as tar:
            tar.extractall(dest, members=checked(tar), filter="data")
    except tarfile.FilterError as e:  # links out of dest, devices: the filter names the member
        raise DataError(f"{archive}: refusing member {e.tarinfo.name!r} ({e})") from e
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        if isinstance(e, OSError) and (full := unwritable(e)):  # a full disk: the archive is whole
            raise full from e
        raise DataError(f"{archive}: truncated or corrupt archive ({one_line(e)}); delete it and fetch it "
                        "again") from e


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_content(name: str, tables: dict[str, list[Utterance]]) -> str:
    """Checks an archive of unknown checksum by what it holds: utterances present, audio readable."""
    for split, utts in tables.items():
        if not utts:
            raise DataError(f"{name}: no {split} utterances found; is this an AN4 archive?")
        for u in progress_bar(utts, desc=f"checking {split} audio", leave=False):
            _audio_info(u.path)
    counts = {split: len(utts) for split, utts in tables.items()}
    if name == "an4" and counts != AN4_COUNTS:
        warnings.warn(f"AN4 archive of unknown checksum has {counts} utterances, expected {AN4_COUNTS}")
    return f"unknown checksum; content verified ({counts['train']} train, {counts['test']} test utterances)"


# -----------------------------------------------------------------------------
# audio

# The fix for a broken audio file: a good copy, or no file, which leaves the utterance out and counted.
_REPLACE = "replace it from a good copy of the archive, or delete it to leave that utterance out"


def _audio_info(path):
    """The header of a readable 16 kHz SPHERE file, or an error naming the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: audio file not found; re-extract the corpus (delete its an4/{MARKER})")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty audio file; {_REPLACE}")
    try:
        info = sf.info(str(path))
    except (sf.LibsndfileError, RuntimeError) as e:
        raise DataError(f"{path}: not a readable SPHERE file ({e}); {_REPLACE}") from e
    if info.format != "NIST":
        raise DataError(f"{path}: {info.format} audio where AN4 has NIST SPHERE; convert it to SPHERE, "
                        "or delete it to leave that utterance out")
    if info.frames == 0:
        raise DataError(f"{path}: a SPHERE header without samples; {_REPLACE}")
    with open(path, "rb") as f:  # libsndfile reads a cut-off file as a shorter one; the header knows better
        declared = re.search(rb"sample_count -i (\d+)", f.read(1024))
    if declared and int(declared[1]) != info.frames:
        raise DataError(f"{path}: truncated SPHERE file ({info.frames} of {int(declared[1])} samples); {_REPLACE}")
    if info.samplerate != SAMPLE_RATE:
        raise DataError(f"{path}: sample rate {info.samplerate} Hz, expected {SAMPLE_RATE} Hz; resample it")
    return info


def read_utterance(u: Utterance) -> torch.Tensor:
    """An AN4 utterance's samples: its whole SPHERE file."""
    return read_audio(u.path)


def read_audio(path) -> torch.Tensor:
    """float32 mono samples at 16 kHz; libsndfile reads each file's byte order from its header."""
    _audio_info(path)
    try:
        audio, _ = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as e:
        raise DataError(f"{path}: not a readable SPHERE file ({e}); {_REPLACE}") from e
    return torch.from_numpy(audio.mean(axis=1))  # (samples,)


# -----------------------------------------------------------------------------
# transcripts and utterances

_LINE = re.compile(r"^(?P<text>.*?)\s*\((?P<id>[^()\s]+)\)\s*$")


def parse_transcripts(path: Path) -> tuple[dict[str, str], list[str]]:
    """id -> normalised text, from lines `<s> YES </s> (an251-fash-b)` or `GO A B (an406-fcaw-b)`, and
    the ids whose text normalisation changed beyond spacing (case, punctuation), so they can be counted."""
    texts, changed = {}, []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.match(line)
        if not m:
            raise DataError(f"{path}:{lineno}: expected 'TEXT (utterance-id)', got {line!r}")
        uid, text = m["id"], m["text"].replace("<s>", " ").replace("</s>", " ")
        if len(uid.split("-")) != 3:
            raise DataError(f"{path}:{lineno}: utterance id {uid!r} is not <prompt>-<speaker>-b")
        if uid in texts:
            raise DataError(f"{path}:{lineno}: utterance {uid} appears twice; remove one line")
        try:
            texts[uid] = normalize(text)
        except TranscriptError as e:
            raise DataError(f"{path}:{lineno}: utterance {uid}: {e}; correct that line, or delete it to leave "
                            "the utterance out") from e
        if texts[uid] != " ".join(text.split()):
            changed.append(uid)
    return texts, changed


def read_split(corpus_dir: Path, split: str) -> tuple[list[Utterance], dict[str, list[str]], list[str]]:
    """Utterances with both a transcript and audio; the ids missing either, and those whose transcript
    was normalised, are returned to be counted, never dropped or changed in silence."""
    folder, stem = LAYOUT[split]
    etc, wav = corpus_dir / "etc", corpus_dir / "wav"
    for f in (etc / f"{stem}.transcription", etc / f"{stem}.fileids"):
        if not f.is_file():
            raise DataError(f"{f}: missing; the archive is not laid out as AN4 (an4/etc, an4/wav), or the "
                            f"folder changed after extraction (delete {corpus_dir / MARKER} to extract again)")
    texts, normalized = parse_transcripts(etc / f"{stem}.transcription")
    # The fileids list says where each utterance should be; what is really on disk decides.
    listed = {Path(line).name: wav / f"{line}.sph" for line in (etc / f"{stem}.fileids").read_text().split()}
    audio = {uid: p for uid, p in listed.items() if p.is_file()}
    audio |= {p.stem: p for p in (wav / folder).glob("*/*.sph")}
    if texts and not audio:
        raise DataError(f"{wav / folder}: no audio at all for the {split} split; re-extract the corpus "
                        f"(delete {corpus_dir / MARKER})")
    both = sorted(texts.keys() & audio.keys())
    utts = [Utterance(uid, uid.split("-")[1], str(audio[uid]), texts[uid]) for uid in both]
    skipped = {
        "no_audio": sorted((texts.keys() | listed.keys()) - audio.keys()),
        "no_transcript": sorted(audio.keys() - texts.keys()),
    }
    normalized = sorted(set(normalized) & set(both))
    for line in describe(corpus_dir, split, skipped, normalized):
        warnings.warn(line)
    return utts, skipped, normalized


# -----------------------------------------------------------------------------
# the pipeline

def prepare_corpus(cfg: DataConfig) -> Corpus:
    """Fetch, extract, verify (once), parse and split; later calls only parse and reuse the split."""
    name = CorpusName(cfg.corpus).value  # the schema's enum: Hydra refused any other value
    if name == CorpusName.manifest.value:
        return prepare_manifest_corpus(cfg)
    # The synthetic corpus lives in its own folder so the two never mix, features included.
    root = Path(cfg.root) / name if name == "synthetic" else Path(cfg.root)
    corpus_dir, marker = root / "an4", root / "an4" / MARKER
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{root}: cannot create the data folder ({e.strerror}); set data.root to a writable "
                        "folder") from e
    fresh = not marker.is_file()
    if fresh:
        if name == "synthetic":
            archive = make_synthetic_archive(root / "an4_synthetic.tar.gz")
        else:
            archive = fetch_archive(cfg.archive, list(cfg.mirrors), root)
        digest = sha256(archive)
        extract_archive(archive, root)
    tables, skipped, normalized = {}, {}, {}
    for split in LAYOUT:
        tables[split], skipped[split], normalized[split] = read_split(corpus_dir, split)
    if fresh:
        known = KNOWN_SHA256.get(digest)
        checksum = f"known: {known}" if known else verify_content(name, tables)
        write_json(marker, {"archive": str(archive), "sha256": digest, "checksum": checksum})
    status = json.loads(marker.read_text())
    splits = split_corpus(corpus_dir / f"splits-seed{cfg.split_seed}-val{cfg.val_fraction}.json", tables["train"],
                          tables["test"], cfg.val_fraction, cfg.split_seed)
    summary = {
        "corpus": name,
        "root": str(root),
        "archive": status["archive"],
        "sha256": status["sha256"],
        "checksum": status["checksum"],
        "utterances": {s: len(u) for s, u in splits.items()},
        "speakers": {s: len({x.speaker for x in u}) for s, u in splits.items()},
        "minutes": {s: round(sum(_audio_info(x.path).duration for x in u) / 60, 2) for s, u in splits.items()},
        "skipped": {s: {k: len(v) for k, v in d.items()} for s, d in skipped.items()},
        "skipped_ids": skipped,
        "normalized": {s: len(ids) for s, ids in normalized.items()},
        "normalized_ids": normalized,
    }
    return Corpus(name=name, root=root, splits=splits, summary=summary, read=read_utterance)


# -----------------------------------------------------------------------------
# a tiny synthetic AN4

SYNTH_WORDS = ["YES", "NO", "GO", "STOP", "A", "B", "C", "E", "ONE", "TWO"]
CHAR_S, GAP_S = 0.06, 0.08  # seconds per character, silence between words
LICENSE = "Synthetic AN4-shaped corpus generated by batchrnn.data.corpus; free for any use.\n"


def _char_tone(c: str, rng: np.random.Generator, pitch: float) -> np.ndarray:
    """60 ms of two partials fixed per character, so a model can learn to read the characters off."""
    k = ord(c) - ord("A")
    t = np.arange(int(CHAR_S * SAMPLE_RATE)) / SAMPLE_RATE
    f1, f2 = pitch * (300 + 110 * k), pitch * (3400 + 160 * (k % 9))
    tone = np.sin(2 * np.pi * f1 * t) + 0.6 * np.sin(2 * np.pi * f2 * t)
    return 0.3 * tone * np.hanning(len(t)) + 0.01 * rng.standard_normal(len(t))


def _synth_utterance(words: list[str], rng: np.random.Generator, pitch: float) -> np.ndarray:
    gap = np.zeros(int(GAP_S * SAMPLE_RATE))
    parts = [gap]
    for w in words:
        parts += [_char_tone(c, rng, pitch) for c in w] + [gap]
    audio = np.concatenate(parts)
    audio = np.pad(audio, (0, max(0, SAMPLE_RATE // 2 - len(audio))))  # at least 0.5 s
    audio += 0.005 * rng.standard_normal(len(audio))
    return np.clip(audio, -1, 1)


def make_synthetic_archive(
    path: Path, n_train_speakers: int = 6, utts_per_speaker: int = 6, n_test_speakers: int = 2, seed: int = 0
) -> Path:
    """Writes an AN4-shaped .tar.gz (same layout, transcript formats and SPHERE audio) and returns path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        an4 = Path(tmp) / "an4"
        (an4 / "etc").mkdir(parents=True)
        (an4 / "LICENSE").write_text(LICENSE)
        (an4 / "README").write_text("Synthetic AN4: each character is a fixed 60 ms tone pair.\n")
        speakers = {"train": n_train_speakers, "test": n_test_speakers}
        n_spk = 0
        for split, (folder, stem) in LAYOUT.items():
            fileids, lines = [], []
            for s in range(speakers[split]):
                speaker = f"{'fm'[n_spk % 2]}s{n_spk:02d}"  # 4 letters like AN4's fash, mcen
                endian = "LITTLE" if n_spk % 2 == 0 else "BIG"  # both byte orders, as in real SPHERE
                pitch = rng.uniform(0.9, 1.1)
                n_spk += 1
                (an4 / "wav" / folder / speaker).mkdir(parents=True)
                for u in range(utts_per_speaker):
                    uid = f"syn{u + 1}-{speaker}-b"
                    words = list(rng.choice(SYNTH_WORDS, size=rng.integers(1, 5)))
                    audio = _synth_utterance(words, rng, pitch)
                    sf.write(an4 / "wav" / folder / speaker / f"{uid}.sph", audio, SAMPLE_RATE,
                             format="NIST", subtype="PCM_16", endian=endian)
                    fileids.append(f"{folder}/{speaker}/{uid}")
                    text = " ".join(words)
                    lines.append(f"<s> {text} </s> ({uid})" if split == "train" else f"{text} ({uid})")
            (an4 / "etc" / f"{stem}.fileids").write_text("\n".join(fileids) + "\n")
            (an4 / "etc" / f"{stem}.transcription").write_text("\n".join(lines) + "\n")
        part = path.with_name(path.name + ".part")
        with tarfile.open(part, "w:gz") as tar:
            tar.add(an4, arcname="an4")
        os.replace(part, path)
    return path
