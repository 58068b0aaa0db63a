"""Typed configuration: the schema lives here, values live in conf/*.yaml.

Each dataclass is registered in Hydra's ConfigStore so YAML files extend it and a misspelt key or a
wrongly typed value fails at composition. `validate` adds the checks a type cannot express.
"""
import typing
from dataclasses import dataclass, field
from enum import Enum

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


class RNNType(str, Enum):
    gru = "gru"
    lstm = "lstm"
    rnn = "rnn"  # DS2's simple RNN with clipped ReLU, min(max(x, 0), 20)


class BNMode(str, Enum):
    none = "none"  # no normalisation in the recurrent stack
    post = "post"  # sequence-wise BN on each layer's output
    input = "input"  # sequence-wise BN on the layer's input, then a fused RNN (deepspeech.pytorch)
    skip = "skip"  # cuDNN skip-input: one BN(W x) of size H added to every gate
    seqwise = "seqwise"  # exact DS2: BN(W x) of size gates x H inside the recurrence


class Impl(str, Enum):
    fused = "fused"  # the library's fused RNN kernel (cuDNN on CUDA)
    cells = "cells"  # a Python loop over time with autograd cells: the slow reference


class Device(str, Enum):
    auto = "auto"  # CUDA when available, else CPU
    cpu = "cpu"
    cuda = "cuda"


class LoggerMode(str, Enum):
    auto = "auto"  # online when a W&B API key is configured, offline otherwise
    online = "online"
    offline = "offline"
    disabled = "disabled"


AN4_URL = "http://www.speech.cs.cmu.edu/databases/an4/an4_sphere.tar.gz"


@dataclass
class DataConfig:
    # Where the corpus comes from: a URL (http, https, file://) or a local path to an4_sphere.tar.gz.
    archive: str = AN4_URL
    # Tried in order when `archive` is a URL that fails.
    mirrors: list[str] = field(default_factory=list)
    # Folder for the extracted corpus, the split lists and the feature cache; shared by all runs.
    root: str = "data"
    # "an4" is the real corpus; "synthetic" generates a tiny AN4-shaped corpus on the fly (smoke tests).
    corpus: str = "an4"
    # Share of training speakers held out for validation (model selection never sees test).
    val_fraction: float = 0.1
    # Seeds the speaker split; the split is written to disk so every variant of a study shares it.
    split_seed: int = 0
    # Spectrogram as deepspeech.pytorch: 20 ms Hamming window, 10 ms hop, log1p, per-utterance norm.
    window_ms: float = 20.0
    hop_ms: float = 10.0
    # 0 keeps the linear spectrogram (n_fft // 2 + 1 = 161 bins); > 0 projects onto this many mel bands,
    # which shrinks the front end's work on the CPU.
    n_mels: int = 0


@dataclass
class ConvLayer:
    # One Conv2d of the DS2 front end over (freq, time), followed by BN and Hardtanh(0, 20).
    channels: int = 32
    kernel_freq: int = 41
    kernel_time: int = 11
    stride_freq: int = 2
    stride_time: int = 2


@dataclass
class ModelConfig:
    rnn: RNNType = RNNType.gru
    bn: BNMode = BNMode.none
    # Implementation where a variant has several (seqwise: fused or cells); ignored otherwise.
    impl: Impl = Impl.fused
    hidden_size: int = 256
    num_layers: int = 3
    # DS2 sums the two directions, so the next layer's input stays hidden_size wide.
    bidirectional: bool = True
    # DS2 shares the input weights W between the two directions (seqwise and skip only).
    share_input_weights: bool = False
    # deepspeech.pytorch's front end: time stride 2 in all.
    conv: list[ConvLayer] = field(
        default_factory=lambda: [ConvLayer(32, 41, 11, 2, 2), ConvLayer(32, 21, 11, 2, 1)]
    )


@dataclass
class TrainConfig:
    epochs: int = 30
    batch_size: int = 16
    # AdamW with deepspeech.pytorch's AN4 settings by default.
    lr: float = 1.5e-4
    weight_decay: float = 1e-5
    # Learning rate multiplied by this after every epoch.
    lr_gamma: float = 0.99
    # Linear warm-up over this many optimizer steps (0: none).
    warmup_steps: int = 0
    max_grad_norm: float = 400.0
    # Epoch 1 in order of increasing length (DS2's SortaGrad), later epochs shuffled length buckets.
    sortagrad: bool = True
    device: Device = Device.auto
    # Mixed precision (bf16 autocast) on CUDA; ignored on the CPU.
    amp: bool = True
    # torch intra-op threads. 0: torch's default, or under a parallel launcher (conf/hydra/launcher/) the
    # job's share of the cores, cores // n_jobs or cpus_per_task (src/run.py).
    threads: int = 0
    # A finished run (results.json with status finished) is skipped unless this is true.
    rerun: bool = False
    # Stop early after this many epochs without a better validation WER (0: never).
    patience: int = 0
    # A step with a non-finite loss or gradient is skipped; this many in a row means the run has
    # diverged (lr too high, broken features), and going on would only burn hours of compute.
    max_skipped_steps: int = 20


@dataclass
class LoggerConfig:
    mode: LoggerMode = LoggerMode.auto
    project: str = "batchrnn"
    entity: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # Names the study: the W&B group and the folder under runs/.
    study: str = "default"
    seed: int = 0


def allowed_values(key: str) -> str:
    """'model.rnn' -> 'gru|lstm|rnn': the values of an enum setting, read off the schema."""
    node = Config
    for name in key.split("."):
        node = typing.get_type_hints(node)[name]
    return "|".join(member.value for member in node)


def register_configs() -> None:
    # conf/config.yaml lists this first, so every group's YAML is checked against the dataclasses.
    ConfigStore.instance().store(name="config_schema", node=Config)
    # `src/run.py --help` (conf/hydra/help/batchrnn.yaml) lists each enum's values from the schema.
    OmegaConf.register_new_resolver("batchrnn.allowed", allowed_values, replace=True)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the allowed values."""


def validate(cfg: Config | DictConfig) -> None:
    """Checks the schema's types cannot express; raises ConfigError before any work starts."""
    m, t, d = cfg.model, cfg.train, cfg.data
    positive = {
        "model.hidden_size": m.hidden_size,
        "model.num_layers": m.num_layers,
        "train.epochs": t.epochs,
        "train.batch_size": t.batch_size,
        "train.lr": t.lr,
        "train.max_grad_norm": t.max_grad_norm,
        "train.max_skipped_steps": t.max_skipped_steps,
        "data.window_ms": d.window_ms,
        "data.hop_ms": d.hop_ms,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}={value}: must be positive")
    for key, value in {"train.weight_decay": t.weight_decay, "train.warmup_steps": t.warmup_steps,
                       "train.patience": t.patience, "train.threads": t.threads}.items():
        if value < 0:
            raise ConfigError(f"{key}={value}: must be 0 or more")
    if not 0 < t.lr_gamma <= 1:
        raise ConfigError(f"train.lr_gamma={t.lr_gamma}: must be in (0, 1]")
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction}: must be between 0 and 1")
    if d.corpus not in ("an4", "synthetic"):
        raise ConfigError(f"data.corpus={d.corpus}: allowed values are an4, synthetic")
    if d.n_mels < 0:
        raise ConfigError(f"data.n_mels={d.n_mels}: must be 0 (linear spectrogram) or positive")
    if not m.conv:
        raise ConfigError("model.conv: needs at least one conv layer")
    for i, layer in enumerate(m.conv):
        for name in ("channels", "kernel_freq", "kernel_time", "stride_freq", "stride_time"):
            if getattr(layer, name) <= 0:
                raise ConfigError(f"model.conv[{i}].{name}={getattr(layer, name)}: must be positive")
    if m.share_input_weights and BNMode(m.bn) not in (BNMode.seqwise, BNMode.skip):
        raise ConfigError(
            f"model.share_input_weights=true with model.bn={BNMode(m.bn).value}: sharing W between "
            "directions needs a separate input projection, allowed with model.bn=seqwise or skip"
        )
    if m.share_input_weights and not m.bidirectional:
        raise ConfigError("model.share_input_weights=true needs model.bidirectional=true")
    if Impl(m.impl) is Impl.cells and BNMode(m.bn) is not BNMode.seqwise:
        raise ConfigError(
            f"model.impl=cells with model.bn={BNMode(m.bn).value}: the cell reference exists for "
            "model.bn=seqwise only; use model.impl=fused"
        )


def to_container(cfg: DictConfig) -> dict:
    """Plain, JSON-ready dict with enums as their names."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
