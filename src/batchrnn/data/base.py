"""What every corpus is made of: its utterances, the Corpus the trainer reads, the validation split, the log lines
of what was left out or changed, and the error a user can fix. AN4 (corpus.py) and manifests (manifest.py) build on it.
"""
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from batchrnn.storage import write_json

SAMPLE_RATE = 16000  # the features' rate: AN4 is 16 kHz, 16-bit, mono; a manifest's other rates are resampled


def feature_bins(cfg) -> int:
    """The features' width F for DataConfig cfg: its mel bands, or the linear spectrogram's n_fft // 2 + 1 bins."""
    return cfg.n_mels if cfg.n_mels > 0 else int(SAMPLE_RATE * cfg.window_ms / 1000) // 2 + 1


class DataError(RuntimeError):
    """A corpus problem the user can fix; the message names the file and the fix."""


@dataclass(frozen=True)
class Utterance:
    id: str  # AN4: <prompt>-<speaker>-b; a manifest's: its audio path and offset
    speaker: str  # "" where a manifest gives none
    path: str  # the audio file
    text: str  # normalised, in text.LABELS
    offset: float = 0.0  # seconds into the file where the utterance starts (a manifest's "offset")
    duration: float = 0.0  # seconds read from offset on (a manifest's "duration"); 0: the whole file (AN4)


@dataclass
class Corpus:
    name: str  # "an4", "synthetic" or "manifest"
    root: Path  # holds features/ (and AN4's an4/)
    splits: dict[str, list[Utterance]]  # train, val, test
    summary: dict  # counts per split, skipped items, checksum status
    read: Callable[[Utterance], torch.Tensor]  # an utterance's samples: float32, mono, 16 kHz, (samples,)


def describe(corpus_dir, split: str, skipped: dict[str, list[str]], normalized: list[str]) -> list[str]:
    """One line per kind of utterance left out or changed, naming the first few."""
    what = {"no_audio": "skipping {n} {split} utterances without audio",
            "no_transcript": "skipping {n} {split} utterances without a transcript",
            "bad_text": "skipping {n} {split} utterances whose text has characters outside the alphabet "
                        "(data.bad_text=skip)",
            "normalized": "{n} {split} transcripts normalised (case or punctuation)"}
    return [f"{corpus_dir}: {what[kind].format(n=len(ids), split=split)}: "
            + ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
            for kind, ids in (skipped | {"normalized": normalized}).items() if ids]


def corpus_changes(summary: dict) -> list[str]:
    """describe()'s lines from a corpus summary, for the run's log, each naming its manifest or AN4's folder."""
    sources = summary.get("manifests", {})
    return [line for split in summary["skipped_ids"] for line in
            describe(sources.get(split) or Path(summary["root"]) / "an4", split, summary["skipped_ids"][split],
                     summary["normalized_ids"][split])]


def choose_val_speakers(speakers: list[str], val_fraction: float, seed: int, what: str = "speakers") -> list[str]:
    speakers = sorted(speakers)
    if len(speakers) < 2:
        raise DataError(f"{len(speakers)} training {what}: a validation split needs at least 2")
    n_val = min(max(1, round(len(speakers) * val_fraction)), len(speakers) - 1)
    return sorted(random.Random(seed).sample(speakers, n_val))


def split_corpus(
    path: Path, train: list[Utterance], test: list[Utterance], val_fraction: float, seed: int,
    by_speaker: bool = True,
) -> dict[str, list[Utterance]]:
    """train/val/test with whole speakers in val (by_speaker=False: single utterances, for a corpus that names
    no speakers); the split is kept on disk at path so every run shares it."""
    by_id = {u.id: u for u in train}
    if path.is_file():
        saved = json.loads(path.read_text())
        if set(saved["train"]) | set(saved["val"]) != by_id.keys():
            raise DataError(f"{path}: lists other utterances than the corpus holds; delete it to re-split")
    else:
        group = (lambda u: u.speaker) if by_speaker else (lambda u: u.id)
        held = set(choose_val_speakers(list({group(u) for u in train}), val_fraction, seed,
                                       "speakers" if by_speaker else "utterances"))
        saved = {"split_seed": seed, "val_fraction": val_fraction}
        if by_speaker:
            saved |= {"train_speakers": sorted({u.speaker for u in train} - held), "val_speakers": sorted(held),
                      "test_speakers": sorted({u.speaker for u in test})}
        else:
            saved["by"] = "utterance"
        saved |= {"train": [u.id for u in train if group(u) not in held],
                  "val": [u.id for u in train if group(u) in held], "test": [u.id for u in test]}
        write_json(path, saved)
    return {"train": [by_id[i] for i in saved["train"]], "val": [by_id[i] for i in saved["val"]],
            "test": test}
