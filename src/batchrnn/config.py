"""Typed configuration: the schema and every default live here; conf/*.yaml says only what differs.

Each dataclass is registered in Hydra's ConfigStore so YAML files extend it and a misspelt key or a
wrongly typed value fails at composition. `validate` adds the checks a type cannot express, each in one place.
"""
import typing
from dataclasses import dataclass, field
from enum import Enum

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf


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
    ln = "ln"  # LayerNorm of W x over one frame's gates x H inside the recurrence, folded into the fused kernel
    ln_full = "ln_full"  # Ba et al.'s LayerNorm LSTM/GRU: LN of W x, of U h and (LSTM) of the cell; a step loop
    wn = "wn"  # weight normalisation of W's rows (and U's, model.weight_norm_recurrent), folded into the kernel
    rbn = "rbn"  # Cooijmans et al.'s recurrent BN: BN per time step of W x, of U h and (LSTM) of the cell; a step loop


class CorpusName(str, Enum):
    an4 = "an4"  # CMU AN4, fetched (or taken from data.archive) and prepared once
    synthetic = "synthetic"  # a tiny AN4-shaped corpus generated on the fly (smoke tests)
    manifest = "manifest"  # a corpus of your own: JSON-lines manifests in NeMo's convention (data.train, val, test)


class BadText(str, Enum):
    refuse = "refuse"  # a transcript with a character outside the alphabet stops the run, naming manifest:line
    skip = "skip"  # such utterances are left out, counted and logged (Common Voice's digits and hyphens)


class Stage(str, Enum):
    single = "single"  # one run at train.lr as given
    tune = "tune"  # the learning-rate search: train.lr as given, swept over protocol.lrs by the study driver
    widen = "widen"  # train.lr: the rate past the grid's edge where this variant's best lies (protocol.widen)
    # protocol.tune_spec_augment: the tuning seeds again at the rate the tuning chose, with SpecAugment off
    augment = "augment"
    # protocol.tune_patience: the tuning seeds again at the chosen rate and SpecAugment, the plateau schedule's
    # plateau_wait, patience and epoch cap doubled (and doubled again while the more patient wins)
    patience = "patience"
    final = "final"  # train.lr (SpecAugment, patience, where tuned) as the tuning stages chose for this variant


class Schedule(str, Enum):
    exponential = "exponential"  # x train.lr_gamma every epoch, whatever validation does (the earlier studies)
    plateau = "plateau"  # held while validation improves; x train.plateau_factor when it stops (train.plateau_*)


class Impl(str, Enum):
    fused = "fused"  # the library's fused RNN kernel (cuDNN on CUDA); ln_full and rbn, with no other: their step loops
    cells = "cells"  # a Python loop over time with autograd cells: the slow reference (seqwise, ln, wn)


class Device(str, Enum):
    auto = "auto"  # CUDA when available, else CPU
    cpu = "cpu"
    cuda = "cuda"


class Decoder(str, Enum):
    greedy = "greedy"  # best path: argmax per frame, repeats merged, blanks dropped
    beam = "beam"  # torchaudio's CTC beam search (flashlight-text) with a word LM, tuned on validation (decode.*)


class LoggerMode(str, Enum):
    auto = "auto"  # online when a W&B API key is configured, offline otherwise
    online = "online"
    offline = "offline"
    disabled = "disabled"


AN4_URL = "http://www.speech.cs.cmu.edu/databases/an4/an4_sphere.tar.gz"
AN4_ARCHIVE_ENV = "AN4_ARCHIVE"  # a local path or file:// URL that replaces the download (CI, benchmarks)


@dataclass
class DataConfig:
    # Where the corpus comes from: a URL (http, https, file://) or a local path to an4_sphere.tar.gz.
    # $AN4_ARCHIVE when set, so CI and machines without internet use their local copy.
    archive: str = "${oc.env:" + AN4_ARCHIVE_ENV + "," + AN4_URL + "}"
    # Tried in order when `archive` is a URL that fails.
    mirrors: list[str] = field(default_factory=list)
    # Folder for the extracted corpus, the split lists and the feature cache; shared by all runs.
    root: str = "data"
    corpus: CorpusName = CorpusName.an4
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
    # data.corpus=manifest: JSON-lines manifests, one utterance a line: {"audio_filepath", "duration", "text"},
    # optionally "offset" (seconds) and "speaker"; relative audio paths resolve against the manifest's folder.
    # Where they lie is no part of a run's identity (a moved corpus is the same run); what they hold is, through
    # manifest_sha256. test is required; without val, a seeded split of train (by speaker when given).
    train: str = ""
    val: str = ""
    test: str = ""
    # What a manifest line whose text has a character outside the alphabet does (after AN4's normalisation).
    bad_text: BadText = BadText.refuse
    # A text file, one sentence a line, that the decoder's word LM is estimated from (decode.decoder=beam, no
    # decode.lm); "": the training split's transcripts. Never validation's or test's.
    lm_text: str = ""
    # The manifests' content, sha256 over train, val and test: filled in before the run is named
    # (batchrnn.data.manifest.pin_content), so two corpora never share a run folder. "" for AN4; never set it.
    manifest_sha256: str = ""


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
    # Implementation where a variant has several (seqwise, ln, wn: fused or cells); ignored otherwise.
    impl: Impl = Impl.fused
    hidden_size: int = 256
    num_layers: int = 3
    # DS2 sums the two directions, so the next layer's input stays hidden_size wide.
    bidirectional: bool = True
    # DS2 shares the input weights W between the two directions (variants with an input projection of
    # their own: skip, seqwise, ln, ln_full, wn, rbn).
    share_input_weights: bool = False
    # model.bn=wn only: weight-normalise the recurrent weights U too (Salimans & Kingma normalise every
    # weight). Off by default, so that wn, like the other variants, changes only how x enters the gates.
    weight_norm_recurrent: bool = False
    # deepspeech.pytorch's front end: time stride 2 in all.
    conv: list[ConvLayer] = field(
        default_factory=lambda: [ConvLayer(32, 41, 11, 2, 2), ConvLayer(32, 21, 11, 2, 1)]
    )


@dataclass
class SpecAugmentConfig:
    # SpecAugment (Park et al. 2019) on training batches only, with torchaudio's masking transforms;
    # the same for every variant, so it regularises without favouring one. 0 masks: off.
    freq_masks: int = 0
    freq_width: int = 8  # each frequency mask covers up to this many feature bins
    time_masks: int = 0
    time_width: int = 20  # each time mask covers up to this many 10 ms frames
    # Masks drawn per utterance, from the seed, the epoch and the utterance's id, within its own length: the
    # same whatever batch it lands in and however many processes train (data-parallel). false: torchaudio's
    # masks from the process's random stream over the padded batch, as the earlier studies drew them.
    per_utterance: bool = False
    # false: no masks, whatever the counts above. The study's stage augment (protocol.tune_spec_augment) tunes it.
    enabled: bool = True


@dataclass
class TrainConfig:
    # The cap: with train.patience > 0 a run normally stops earlier, when validation stops improving.
    epochs: int = 30
    batch_size: int = 16
    # AdamW with deepspeech.pytorch's AN4 settings by default.
    lr: float = 1.5e-4
    weight_decay: float = 1e-5
    # How the rate falls: exponential (x lr_gamma after every epoch) or plateau (driven by validation).
    schedule: Schedule = Schedule.exponential
    # schedule=exponential: the rate multiplied by this after every epoch.
    lr_gamma: float = 0.99
    # schedule=plateau: after warm-up the rate is held while validation improves (what patience counts: a
    # better WER, or a loss fall of patience_loss_drop), and multiplied by plateau_factor once it has not
    # improved for plateau_wait epochs since its last improvement or cut. The plateau_* values here were chosen
    # once for every variant in pilots on validation with the plain LSTM and the LSTM's seqwise BN
    # (experiments/converged.md): 3 epochs reached a lower validation WER on both than ESPnet2's AN4 recipe's 2
    # (torch's ReduceLROnPlateau at patience 1, which cuts when bad epochs > patience).
    plateau_wait: int = 3
    plateau_factor: float = 0.5
    # Patience may stop a plateau run only after this many cuts (every run gets at least one, as in Melis et
    # al.'s lamb, so that no run stops at its first rate), and the run stops once the rate has fallen below
    # plateau_floor x lr.
    plateau_min_cuts: int = 1
    plateau_floor: float = 1e-3
    # No cut while the network has not yet got a word right (best validation WER 100%): under CTC its blank phase
    # is where it has not started, not a plateau of what it can learn, and its loss falls slowly there (the plain
    # LSTM was cut twice before it emitted a word: experiments/converged.md). Patience still stops a run that
    # stays blank without its loss falling. false: cuts from the end of warm-up, as torch's ReduceLROnPlateau.
    plateau_hold_blank: bool = True
    # Linear warm-up over this many optimizer steps (0: none).
    warmup_steps: int = 0
    max_grad_norm: float = 400.0
    # Epoch 1 in order of increasing length (DS2's SortaGrad), later epochs shuffled length buckets.
    sortagrad: bool = True
    device: Device = Device.auto
    # Mixed precision (bf16 autocast) on CUDA; on the CPU see cpu_bf16.
    amp: bool = True
    # bf16 autocast on the CPU too, only where the CPU computes bf16 natively (AVX512-BF16 or AMX);
    # refused elsewhere, where emulated bf16 would be slower and change the numbers for nothing.
    cpu_bf16: bool = False
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)
    # torch intra-op threads. 0: torch's default, or under a parallel launcher (conf/hydra/launcher/) the
    # job's share of the cores, cores // n_jobs or cpus_per_task (src/run.py).
    threads: int = 0
    # A finished run (results.json with status finished) is skipped unless this is true.
    rerun: bool = False
    # Stop after this many epochs in which neither validation WER nor validation loss improved (0: never):
    # trained until validation stops improving. The loss counts because a network at blank output
    # (100% WER) for its first epochs is still learning.
    patience: int = 0
    # The fall of validation loss (relative, since its last counted fall) that counts as an improvement.
    patience_loss_drop: float = 0.02
    # A step with a non-finite loss or gradient is skipped; this many in a row means the run has
    # diverged (lr too high, broken features), and going on would only burn hours of compute.
    max_skipped_steps: int = 20
    # Data-parallel runs (torchrun, or SLURM tasks): how long a rank waits in a collective for the others before
    # every rank stops with an error, rather than hanging when one has stopped answering. Long enough for what rank
    # 0 does alone between two collectives (checkpoints, W&B's start, up to 30 s).
    dist_timeout_s: float = 600.0


@dataclass
class LoggerConfig:
    mode: LoggerMode = LoggerMode.auto
    project: str = "batchrnn"
    entity: str | None = None
    tags: list[str] = field(default_factory=lambda: ["an4", "ds2"])


@dataclass
class DecodeConfig:
    """How a trained model's output becomes words (batchrnn.decoding). No part of a run's identity: one trained run
    is decoded in many ways without training it again. docs/decoding.md."""
    decoder: Decoder = Decoder.greedy
    # decoder=beam: a KenLM word LM, ARPA or binary. "": a 3-gram with modified Kneser-Ney estimated from the
    # training transcripts (or data.lm_text), cached under data.root/lm/ and named by its content's sha256.
    lm: str = ""
    # decoder=beam: the words the search may emit, one a line (its first field). "": the LM's training words.
    lexicon: str = ""
    beam_size: int = 50
    # decoder=beam: the grid every trained model is tuned on, on its own validation split (the lowest WER; ties:
    # the earlier point, in this order); test is decoded once, at the chosen point. deepspeech.pytorch's alpha
    # (LM weight) and beta (word insertion score).
    lm_weights: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0])
    word_scores: list[float] = field(default_factory=lambda: [-1.0, 0.0, 1.0, 2.0])
    # Where the chosen point lies on an edge of the grid (the highest LM weight, the lowest above 0, or either edge
    # of the word scores), that axis gains one value past the edge, a step as wide as the edge's own, and the new
    # points decode validation too; at most this many times an edge, as protocol.widen widens the rates. Ties
    # still go to the earlier point: the grid's, then the widenings' in turn. 0: the grid as given. In the AN4
    # patience study's first 21 decoded runs, 13 chose the highest word score of the grid as given.
    widen: int = 4


@dataclass
class ProtocolConfig:
    """The fair-comparison protocol of a study (batchrnn.study runs it, batchrnn.study.protocol applies it).

    Stage tune trains every variant at each rate of `lrs` with the `tune_seeds`; each variant keeps the
    rate with the lowest mean best validation WER (never test). Where that rate is the grid's lowest or
    highest, stage widen tunes the variant at one more rate past that edge (up to `widen` times), so that no
    variant is judged at a rate its own optimum lies beyond. Stage final trains `seeds` at the chosen rate.
    None of these settings changes what one run computes, so they stay out of a run's identity.
    """
    lrs: list[float] = field(default_factory=list)  # empty: no tuning, every run at train.lr
    tune_seeds: list[int] = field(default_factory=lambda: [1])
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    stage: Stage = Stage.single
    # How many rates a variant's grid may grow past the edge where its best rate lies, one at a time, in the
    # grid's own ratio (1e-3, 2e-3, 4e-3 best at 4e-3: 8e-3, then 1.6e-2 if 8e-3 is best). 0: never. Only grids
    # of three rates or more. Twice: the AN4 grid's gru-skip was best at 8e-3 after widening once.
    widen: int = 2
    # A study folder whose finished runs this study takes instead of training them again, where a run's
    # settings are the same (its folder name is): the depth study's 3-layer runs are the grid's. "": none.
    reuse_from: str = ""
    # model.bn placements whose runs are taken from reuse_from only with their best.pt, so that they can be decoded
    # (with the word LM, decode.decoder=beam); without it they train here. The patience study's LM family holds
    # its headline comparisons (none, seqwise, ln) though the converged runs' models are gone. []: any run.
    reuse_needs_model: list[str] = field(default_factory=list)
    # SpecAugment as a tuning dimension beside the rate, by coordinate search: stage augment trains each
    # variant's tune_seeds once more at its chosen rate with SpecAugment off (train.spec_augment.enabled=false),
    # and the variant keeps whichever of on and off has the lower mean best validation WER (ties: on).
    tune_spec_augment: bool = False
    # The plateau schedule's patience as a tuning dimension, by coordinate search after the rate and SpecAugment:
    # stage patience trains each variant's tune_seeds once more at its chosen settings with train.plateau_wait,
    # train.patience and the cap train.epochs doubled (the cap with them, so that it stays as far out of reach),
    # and the variant keeps the more patient schedule only where its mean best validation WER is lower; where it
    # does, the stage doubles again, up to this many times in all (a grid widened past its edge). 0: never.
    tune_patience: int = 0


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
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


def check_known_keys(node: DictConfig, schema: DictConfig, path: str = "") -> None:
    """Every key is one the schema knows. Hydra's `+key=value` adds keys past the schema's struct flag,
    so `+model.bnn=seqwise` would otherwise train bn=none with a stray setting beside it."""
    for key in node:
        where = f"{path}{key}"
        if key not in schema:
            known = ", ".join(str(k) for k in schema)
            raise ConfigError(f"{where}: no such setting; the settings {'of ' + path[:-1] if path else 'at the top'}"
                              f" are: {known}")
        child, ref = node._get_node(key), schema._get_node(key)
        if isinstance(child, DictConfig) and isinstance(ref, DictConfig) and not ref._is_missing():
            check_known_keys(child, ref, f"{where}.")
        elif isinstance(child, ListConfig) and isinstance(ref, ListConfig) and len(ref):
            for i, item in enumerate(child):
                if isinstance(item, DictConfig) and isinstance(ref[0], DictConfig):
                    check_known_keys(item, ref[0], f"{where}[{i}].")


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in /proc/cpuinfo (Linux x86); False wherever that cannot be read."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def to_container(cfg: DictConfig) -> dict:
    """Plain, JSON-ready dict with enums as their names."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


# The preset a run without experiment= takes, by the machine at hand: the converged protocol's (issue 28). The
# exponential-schedule presets of the earlier studies (an4_gpu, an4_cpu) stay, named on the command line.
DEVICE_PRESETS = {"cuda": "an4_gpu_plateau", "cpu": "an4_cpu_plateau"}


def with_device_preset(argv: list[str]) -> list[str]:
    """No experiment= on the command line: the preset that learns AN4 on the machine at hand."""
    if any(a.split("=")[0].lstrip("+~") == "experiment" for a in argv) or {"-h", "--help", "--hydra-help"} & set(argv):
        return argv
    import torch

    return argv + [f"experiment={DEVICE_PRESETS['cuda' if torch.cuda.is_available() else 'cpu']}"]
