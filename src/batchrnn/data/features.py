"""Spectrograms as deepspeech.pytorch computes them, cached once per split, and length-bucketed batches.

Each (corpus, split, feature settings) is computed once and saved as one file, so epochs and later runs
only torch.load it and do no signal processing.
"""
import hashlib
import json
import random
import warnings
from dataclasses import dataclass

import torch
import torchaudio

from batchrnn.config import DataConfig
from batchrnn.data.corpus import SAMPLE_RATE, Corpus, read_audio
from batchrnn.errors import one_line
from batchrnn.storage import atomic_write
from batchrnn.data.text import encode
from batchrnn.progress import progress_bar

CACHE_VERSION = 1  # bump when the featurizer changes, so old caches are not reused


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

    @property
    def num_features(self) -> int:
        return self.mel.n_mels if self.mel is not None else self.n_fft // 2 + 1

    @torch.no_grad()
    def __call__(self, audio: torch.Tensor) -> torch.Tensor:
        spec = self.spectrogram(audio)  # (F, T) magnitude
        if self.mel is not None:
            spec = self.mel(spec)
        spec = torch.log1p(spec)
        # One mean and std per utterance (deepspeech.pytorch): evens out the recording level.
        spec = (spec - spec.mean()) / spec.std().clamp_min(1e-5)
        return spec.T.contiguous()  # (T, F)


@dataclass
class FeatureSet:
    ids: list[str]
    feats: list[torch.Tensor]  # each (T, F)
    texts: list[str]
    num_features: int

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> list[int]:
        return [f.shape[0] for f in self.feats]


def cache_path(corpus: Corpus, split: str, cfg: DataConfig):
    """<root>/features/<key>/<split>.pt; the key hashes the settings and the split's utterance ids."""
    ids = [u.id for u in corpus.splits[split]]
    settings = {"version": CACHE_VERSION, "sample_rate": SAMPLE_RATE, "window_ms": cfg.window_ms,
                "hop_ms": cfg.hop_ms, "n_mels": cfg.n_mels, "ids": ids}
    key = hashlib.sha1(json.dumps(settings).encode()).hexdigest()[:12]
    return corpus.root / "features" / key / f"{split}.pt"


def load_features(corpus: Corpus, split: str, cfg: DataConfig) -> FeatureSet:
    utts = corpus.splits[split]
    path = cache_path(corpus, split, cfg)
    if path.is_file():
        try:
            blob = torch.load(path, weights_only=True)
            if blob["ids"] != [u.id for u in utts]:
                raise ValueError("utterance ids differ from the split")
            feats = list(torch.split(blob["feats"], blob["lengths"]))
            return FeatureSet(blob["ids"], feats, blob["texts"], blob["num_features"])
        except Exception as e:  # a torn or foreign file costs a recompute, never the run
            warnings.warn(f"{path}: unreadable feature cache ({one_line(e)}); computing it again")
    featurizer = Featurizer(cfg)
    feats = [featurizer(read_audio(u.path)) for u in progress_bar(utts, desc=f"features {corpus.name}/{split}")]
    fs = FeatureSet([u.id for u in utts], feats, [u.text for u in utts], featurizer.num_features)
    # One concatenated tensor loads much faster than a thousand small ones.
    blob = {"ids": fs.ids, "texts": fs.texts, "num_features": fs.num_features, "lengths": fs.lengths,
            "feats": torch.cat(feats) if feats else torch.zeros(0, fs.num_features)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: torch.save(blob, tmp))
    return fs


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
