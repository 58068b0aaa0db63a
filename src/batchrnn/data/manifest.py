"""A corpus of your own: JSON-lines manifests in NeMo's convention, one utterance a line.

    {"audio_filepath": "wav/1089-134686-0000.flac", "duration": 10.43, "text": "he hoped there would be stew"}

with an optional "offset" (seconds) and "speaker". `prepare_manifest_corpus` turns data.train, data.val (or a
seeded split of train) and data.test into the Corpus the trainer reads, with AN4's checks and counts;
`pin_content` puts the manifests' hash into the run's settings; `export_manifests` writes a corpus as manifests.
"""
import hashlib
import json
import logging
import math
import os
import warnings
from pathlib import Path

import soundfile as sf
import torch
import torchaudio

from batchrnn.config import BadText, CorpusName, DataConfig
from batchrnn.data.base import SAMPLE_RATE, Corpus, DataError, Utterance, describe, split_corpus
from batchrnn.data.text import TranscriptError, normalize
from batchrnn.storage import atomic_write

log = logging.getLogger(__name__)
SPLITS = ("train", "val", "test")
NUMBER = (int, float)
# key -> (types, required); any other key (NeMo's "lang", "pred_text", ...) is left alone
FIELDS = {"audio_filepath": (str, True), "duration": (NUMBER, True), "text": (str, True), "offset": (NUMBER, False),
          "speaker": ((str, int), False)}
EXAMPLE = '{"audio_filepath": "a.wav", "duration": 1.5, "text": "yes"}'
# How much less audio than its "duration" a line may hold: durations rounded to 10 ms, and MP3's decoder delay and
# padding (tens of ms). A file shorter by more is cut off, or its line wrong: training on it would pair a part of
# the audio with the whole transcript.
SHORT_BY_S = 0.1


def manifests(cfg: DataConfig) -> dict[str, Path]:
    """The manifests given, by split (val may be absent)."""
    return {split: Path(getattr(cfg, split)).expanduser() for split in SPLITS if getattr(cfg, split)}


def content_sha256(cfg: DataConfig) -> str:
    """sha256 over the given manifests' bytes, each under its split's name: what the corpus holds, not where."""
    digest = hashlib.sha256()
    for split, path in manifests(cfg).items():
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read the {split} manifest ({e.strerror}); check data.{split}") from e
        digest.update(f"{split}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def pin_content(data: DataConfig) -> None:
    """data.manifest_sha256 from data=manifest's manifests ("" for any other corpus), before the run is named."""
    data.manifest_sha256 = content_sha256(data) if CorpusName(data.corpus) is CorpusName.manifest else ""


# -----------------------------------------------------------------------------
# reading a manifest

def utterance_id(audio: Path, offset: float, base: Path) -> str:
    """The audio path (relative to the manifests' common folder, so a moved corpus keeps its ids), and the
    offset in milliseconds' precision when the utterance starts inside the file: 'wav/a.flac@12.5'."""
    path = os.path.relpath(audio, base) if audio.is_relative_to(base) else str(audio)
    return path + (f"@{offset:.3f}".rstrip("0").rstrip(".") if offset else "")


def parse_line(line: str, where: str) -> dict:
    """One manifest line as a checked dict, or an error naming manifest:line and what is wrong."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e.msg}, column {e.colno}); each line is one utterance, {EXAMPLE}") from e
    if not isinstance(entry, dict):
        raise DataError(f"{where}: a JSON {type(entry).__name__}, not an object; each line is one utterance, {EXAMPLE}")
    for key, (types, required) in FIELDS.items():
        if key not in entry:
            if required:
                raise DataError(f"{where}: no {key!r}; each line is one utterance, {EXAMPLE}")
            continue
        value = entry[key]
        if not isinstance(value, types) or isinstance(value, bool):
            raise DataError(f"{where}: {key!r} is {value!r}; it must be a {'number' if types is NUMBER else 'string'}")
    if not (math.isfinite(entry["duration"]) and entry["duration"] > 0):
        raise DataError(f"{where}: 'duration' is {entry['duration']!r}; it must be the utterance's length in seconds, "
                        "more than 0")
    if not (math.isfinite(entry.get("offset", 0)) and entry.get("offset", 0) >= 0):
        raise DataError(f"{where}: 'offset' is {entry['offset']!r}; it must be seconds into the file, 0 or more")
    if not entry["audio_filepath"].strip():
        raise DataError(f"{where}: 'audio_filepath' is empty; give the audio file's path")
    return entry


def read_manifest(path: Path, split: str, bad_text: BadText, base: Path):
    """Utterances of one manifest in its own order; the ids left out (no_audio, bad_text) and those whose text
    was normalised, to be counted and logged, never dropped or changed in silence."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the {split} manifest ({e}); check data.{split}") from e
    utts, lines_of, normalized = [], {}, []
    skipped = {"no_audio": [], "bad_text": []}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        entry = parse_line(line, where)
        audio = Path(os.path.normpath(path.parent.absolute() / Path(entry["audio_filepath"]).expanduser()))
        offset = float(entry.get("offset", 0))
        uid = utterance_id(audio, offset, base)
        if uid in lines_of:
            raise DataError(f"{where}: utterance {uid} is also on line {lines_of[uid]}; remove one of the two lines")
        lines_of[uid] = lineno
        try:
            text = normalize(entry["text"])
        except TranscriptError as e:
            if BadText(bad_text) is BadText.skip:
                skipped["bad_text"].append(uid)
                continue
            raise DataError(f"{where}: utterance {uid}: {e}; correct that line, delete it, or set data.bad_text=skip "
                            "to leave such lines out") from e
        if not audio.is_file():
            skipped["no_audio"].append(uid)
            continue
        if text != " ".join(entry["text"].split()):
            normalized.append(uid)
        utts.append(Utterance(uid, str(entry.get("speaker", "")), str(audio), text, offset, float(entry["duration"])))
    if not utts:
        raise DataError(f"{path}: no utterance with audio and a transcript in the {split} manifest; check data.{split}")
    return utts, skipped, normalized


# -----------------------------------------------------------------------------
# audio

class ManifestAudio:
    """An utterance's samples, float32 mono at 16 kHz: the segment [offset, offset + duration) of anything
    soundfile reads (WAV, FLAC, SPHERE, MP3 with libsndfile 1.1+), another rate resampled with torchaudio."""

    def __init__(self):
        self.rates_logged = set()  # the log says once per rate that it is resampled

    def __call__(self, u: Utterance) -> torch.Tensor:
        fix = "convert it to WAV or FLAC, or delete it to leave that utterance out"
        try:
            with sf.SoundFile(u.path) as f:
                rate, total = f.samplerate, f.frames
                start = round(u.offset * rate)
                if start < total:
                    f.seek(start)
                    audio = f.read(round(u.duration * rate) if u.duration else -1, dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError, ValueError) as e:
            raise DataError(f"{u.path}: not audio that soundfile reads ({e}); {fix}") from e
        if start >= total or not len(audio):
            raise DataError(f"{u.path}: no samples at offset {u.offset:g} s (the file holds {total / rate:.2f} s); "
                            "correct its manifest line")
        if u.duration and len(audio) < (u.duration - SHORT_BY_S) * rate:
            raise DataError(f"{u.path}: {len(audio) / rate:.2f} s of audio from offset {u.offset:g} s, where its "
                            f"manifest line says a duration of {u.duration:g} s; replace a cut-off file with a whole "
                            "copy, or correct that line's duration")
        samples = torch.from_numpy(audio.mean(axis=1))  # (samples,), channels averaged as AN4's reader does
        if rate != SAMPLE_RATE:
            if rate not in self.rates_logged:
                self.rates_logged.add(rate)
                log.warning("resampling %d Hz audio to %d Hz with torchaudio (first: %s)", rate, SAMPLE_RATE, u.path)
            samples = torchaudio.functional.resample(samples, rate, SAMPLE_RATE)
        return samples


# -----------------------------------------------------------------------------
# the corpus

def prepare_manifest_corpus(cfg: DataConfig) -> Corpus:
    """data.train, data.val and data.test as a Corpus; without data.val, a seeded split of train (by speaker where
    every training line names one), written to data.root/manifest/ and reused as AN4's is."""
    given = manifests(cfg)
    root = Path(cfg.root) / CorpusName.manifest.value
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{root}: cannot create the data folder ({e.strerror}); set data.root to a writable "
                        "folder") from e
    base = Path(os.path.commonpath([str(p.parent.absolute()) for p in given.values()]))
    splits, skipped, normalized, owner = {}, {}, {}, {}
    for split, path in given.items():
        splits[split], skipped[split], normalized[split] = read_manifest(path, split, cfg.bad_text, base)
        for u in splits[split]:
            if u.id in owner:
                raise DataError(f"{path}: utterance {u.id} is also in the {owner[u.id]} manifest; an utterance in two "
                                "splits would be selected or tested on what was trained on: remove one line")
            owner[u.id] = split
    sources = {split: str(path) for split, path in given.items()}
    if "val" in given:
        how = "manifest"
    else:
        by_speaker = all(u.speaker for u in splits["train"])
        digest = hashlib.sha256(given["train"].read_bytes()).hexdigest()[:12]
        split_file = root / f"splits-{digest}-seed{cfg.split_seed}-val{cfg.val_fraction}.json"
        splits |= split_corpus(split_file, splits["train"], splits["test"], cfg.val_fraction, cfg.split_seed,
                               by_speaker)
        skipped["val"], normalized["val"], sources["val"] = {k: [] for k in skipped["train"]}, [], sources["train"]
        how = f"{split_file} (seed {cfg.split_seed}, {'whole speakers' if by_speaker else 'single utterances'})"
    for split in SPLITS:
        for line in describe(sources[split], split, skipped[split], normalized[split]):
            warnings.warn(line)
    splits = {s: splits[s] for s in SPLITS}
    summary = {
        "corpus": CorpusName.manifest.value,
        "root": str(root),
        "manifests": sources,
        "manifest_sha256": content_sha256(cfg),
        "val": how,
        "utterances": {s: len(u) for s, u in splits.items()},
        "speakers": {s: len({x.speaker for x in u if x.speaker}) for s, u in splits.items()},
        "minutes": {s: round(sum(x.duration for x in u) / 60, 2) for s, u in splits.items()},
        "skipped": {s: {k: len(v) for k, v in skipped[s].items()} for s in SPLITS},
        "skipped_ids": {s: skipped[s] for s in SPLITS},
        "normalized": {s: len(normalized[s]) for s in SPLITS},
        "normalized_ids": {s: normalized[s] for s in SPLITS},
    }
    return Corpus(name=CorpusName.manifest.value, root=root, splits=splits, summary=summary, read=ManifestAudio())


def whole_file(path: str) -> float:
    """An audio file's length in seconds, exact to the sample (frames / rate reads back as the same frames)."""
    info = sf.info(path)
    return info.frames / info.samplerate


def export_manifests(corpus: Corpus, out: Path) -> dict[str, Path]:
    """Each split of a prepared corpus as out/<split>.jsonl in its own order, with absolute audio paths and AN4's
    whole files' durations, so that data=manifest reads the same utterances and features (python -m batchrnn.data
    --export-manifests)."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{out}: cannot create the manifests' folder ({e.strerror}); give a writable folder") from e
    written = {}
    for split, utts in corpus.splits.items():
        lines = []
        for u in utts:
            entry = {"audio_filepath": str(Path(u.path).absolute()), "duration": u.duration or whole_file(u.path),
                     "text": u.text}
            entry |= ({"offset": u.offset} if u.offset else {}) | ({"speaker": u.speaker} if u.speaker else {})
            lines.append(json.dumps(entry))
        written[split] = out / f"{split}.jsonl"
        atomic_write(written[split], lambda tmp: tmp.write_text("".join(line + "\n" for line in lines)))
    return written
