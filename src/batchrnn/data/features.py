"""Spectrograms as deepspeech.pytorch computes them, cached once per split, and length-bucketed batches.

Each (corpus, split, feature settings) is computed once into one float32 file of (frames, F), written utterance by
utterance, beside a JSON index of its utterances and their audio files' sizes and modification times; runs
memory-map it, so a corpus need not fit in memory, and compute it again where an audio file has changed since.
"""
import hashlib
import json
import os
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torchaudio

from batchrnn.config import DataConfig
from batchrnn.data.base import SAMPLE_RATE, Corpus, DataError, Utterance, feature_bins
from batchrnn.errors import one_line
from batchrnn.storage import atomic_write
from batchrnn.data.text import encode
from batchrnn.progress import progress_bar

CACHE_VERSION = 3  # bump when the featurizer or the cache's format changes, so old caches are not reused


class Featurizer:
    """audio (samples,) -> normalised log1p magnitude spectrogram (T, F), optionally on mel bands."""

    def __init__(self, cfg: DataConfig):
        self.n_fft = int(SAMPLE_RATE * cfg.window_ms / 1000)  # 320 for 20 ms
        hop = int(SAMPLE_RATE * cfg.hop_ms / 1000)  # 160 for 10 ms
        self.spectrogram = torchaudio.transforms.Spectrogram(
            n_fft=self.n_fft, win_length=self.n_fft, hop_length=hop, window_fn=torch.hamming_window, power=1
        )
        self.mel = None  # mel bands shrink the conv front end's work; 0 keeps all 161 linear bins
        if cfg.n_mels > 0:
            self.mel = torchaudio.transforms.MelScale(cfg.n_mels, SAMPLE_RATE, n_stft=self.n_fft // 2 + 1)
        self.num_features = feature_bins(cfg)

    @torch.no_grad()
    def __call__(self, audio: torch.Tensor) -> torch.Tensor:
        spec = self.spectrogram(audio)  # (F, T) magnitude
        if self.mel is not None:
            spec = self.mel(spec)
        spec = torch.log1p(spec)
        # One mean and std per utterance (deepspeech.pytorch): evens out the recording level.
        spec = (spec - spec.mean()) / spec.std().clamp_min(1e-5)
        return spec.T.contiguous()  # (T, F)


class MappedFeatures(Sequence):
    """Utterance i's (T, F) features as a view into one memory-mapped (frames, F) array: pages are read when a
    batch touches them and the kernel may drop them again, so memory stays flat however large the corpus."""

    def __init__(self, frames: torch.Tensor, lengths: list[int]):
        self.frames = frames  # (sum of lengths, F)
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.frames[int(self.offsets[i]) : int(self.offsets[i + 1])]  # (T, F), no copy


@dataclass
class FeatureSet:
    ids: list[str]
    feats: Sequence[torch.Tensor]  # each (T, F): a list, or MappedFeatures from the cache
    texts: list[str]
    num_features: int

    def __len__(self) -> int:
        return len(self.ids)

    @cached_property
    def lengths(self) -> list[int]:
        return list(self.feats.lengths) if isinstance(self.feats, MappedFeatures) else [f.shape[0] for f in self.feats]


def cache_path(corpus: Corpus, split: str, cfg: DataConfig) -> Path:
    """<root>/features/<key>/<split>.json, the index of <split>.f32 beside it; the key hashes the settings and the
    split's utterance ids (and where a manifest gives them, each utterance's segment of its file)."""
    utts = corpus.splits[split]
    settings = {"version": CACHE_VERSION, "sample_rate": SAMPLE_RATE, "window_ms": cfg.window_ms,
                "hop_ms": cfg.hop_ms, "n_mels": cfg.n_mels, "ids": [u.id for u in utts]}
    if any(u.offset or u.duration for u in utts):
        settings["segments"] = [(u.offset, u.duration) for u in utts]
    key = hashlib.sha1(json.dumps(settings).encode()).hexdigest()[:12]
    return corpus.root / "features" / key / f"{split}.json"


def frames_path(index: Path) -> Path:
    """The raw float32 (frames, F) array that a cache index describes."""
    return index.with_suffix(".f32")


class StaleFeatures(ValueError):
    """An audio file changed after its features were cached."""


def stamp(path: str) -> list[int] | None:
    """What says cheaply that an audio file changed: its size and modification time (None: it cannot be looked up)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def finite(samples: torch.Tensor, path, fix: str = "or delete it to leave that utterance out") -> torch.Tensor:
    """samples, or DataError where one is NaN or infinite: its features would be NaN, its batch skipped every epoch
    (all of them: a run of no steps), its hypothesis empty."""
    if not torch.isfinite(samples).all():
        raise DataError(f"{path}: non-finite samples (NaN or infinity); replace it with a good copy, {fix}")
    return samples


def map_features(index: Path, utts: list[Utterance]) -> tuple[MappedFeatures, int]:
    """The cached features of these utterances, memory-mapped, and their width; ValueError where the cache is not
    theirs or not whole, StaleFeatures where an audio file's size or modification time changed since."""
    meta = json.loads(index.read_text())
    if meta["version"] != CACHE_VERSION:
        raise ValueError(f"cache version {meta['version']}, expected {CACHE_VERSION}")
    if meta["ids"] != [u.id for u in utts]:
        raise ValueError("utterance ids differ from the split")
    changed = list(dict.fromkeys(u.path for u, then in zip(utts, meta["audio"], strict=True) if stamp(u.path) != then))
    if changed:
        raise StaleFeatures(f"{len(changed)} audio files changed since their features were computed, "
                            f"{changed[0]} first")
    lengths, width = meta["lengths"], meta["num_features"]
    if len(lengths) != len(utts) or min(lengths, default=1) < 1:
        raise ValueError("lengths do not match the utterances")
    numel, data = sum(lengths) * width, frames_path(index)
    if os.path.getsize(data) != 4 * numel:
        raise ValueError(f"{data.name} holds {os.path.getsize(data)} bytes, the index says {4 * numel}")
    # shared=False maps the file privately: read-only use never copies a page, nor writes one back
    flat = torch.from_file(str(data), shared=False, size=numel, dtype=torch.float32) if numel else torch.zeros(0)
    return MappedFeatures(flat.view(-1, width), lengths), width


def write_features(index: Path, corpus: Corpus, split: str, featurizer: Featurizer) -> None:
    """Features of every utterance of the split appended one by one to <split>.f32 (never a whole split in
    memory), then the index; each file is replaced whole (storage.atomic_write), the index last."""
    utts, lengths, audio = corpus.splits[split], [], []

    def append(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            for u in progress_bar(utts, desc=f"features {corpus.name}/{split}"):
                audio.append(stamp(u.path))  # before the read: a change during it shows at the next start
                spec = featurizer(finite(corpus.read(u), u.path))  # (T, F) float32, C-contiguous
                f.write(spec.numpy().tobytes())
                lengths.append(spec.shape[0])

    index.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(frames_path(index), append)
    meta = {"version": CACHE_VERSION, "num_features": featurizer.num_features, "ids": [u.id for u in utts],
            "lengths": lengths, "audio": audio}
    atomic_write(index, lambda tmp: tmp.write_text(json.dumps(meta)))


def load_features(corpus: Corpus, split: str, cfg: DataConfig) -> FeatureSet:
    """The split's features, memory-mapped from its cache; computed into the cache first where there is none."""
    utts = corpus.splits[split]
    ids, texts = [u.id for u in utts], [u.text for u in utts]
    index, feats = cache_path(corpus, split, cfg), None
    if index.is_file():
        try:
            feats, width = map_features(index, utts)
        except StaleFeatures as e:  # the audio decides, not the features once computed from it
            warnings.warn(f"{index}: {e}; computing the {split} features again")
        except Exception as e:  # a torn or foreign file costs a recompute, never the run
            warnings.warn(f"{index}: unreadable feature cache ({one_line(e)}); computing it again")
    if feats is None:
        write_features(index, corpus, split, Featurizer(cfg))
        feats, width = map_features(index, utts)
    return FeatureSet(ids, feats, texts, width)


def make_batches(lengths: list[int], batch_size: int, shuffle: bool, seed: int) -> list[list[int]]:
    """Consecutive runs of length-sorted indices; shuffle reorders whole batches, so padding stays small.

    shuffle=False gives increasing length: DS2's SortaGrad first epoch.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        random.Random(seed).shuffle(batches)
    return batches


def collate(fs: FeatureSet, indices: list[int]):
    """x (N, F, T_max) zero-padded, x_lens (N,), y concatenated targets, y_lens (N,)."""
    feats = [fs.feats[i] for i in indices]
    x_lens = torch.tensor([f.shape[0] for f in feats], dtype=torch.int64)
    x = torch.zeros(len(feats), fs.num_features, int(x_lens.max()))
    for k, f in enumerate(feats):
        x[k, :, : f.shape[0]] = f.T
    targets = [encode(fs.texts[i]) for i in indices]
    y = torch.tensor([c for t in targets for c in t], dtype=torch.int64)
    y_lens = torch.tensor([len(t) for t in targets], dtype=torch.int64)
    return x, x_lens, y, y_lens
