"""Use a trained model: re-score a run's best checkpoint on a split, or transcribe audio files with it.

    python -m batchrnn.evaluate score runs/smoke/gru-seqwise-L2-lr0.003-s0-<hash> --split test --out hyps.json
    python -m batchrnn.evaluate transcribe runs/smoke/gru-seqwise-L2-lr0.003-s0-<hash>/best.pt a.sph b.wav
    python -m batchrnn.evaluate export runs/smoke/gru-seqwise-L2-lr0.003-s0-<hash> --format onnx
"""
import argparse
import os
import sys
from pathlib import Path

import soundfile as sf
import torch

from batchrnn import export
from batchrnn.training.checkpoint import CheckpointError, load_model, typed
from batchrnn.config import AN4_ARCHIVE_ENV, ConfigError, DataConfig, TrainConfig
from batchrnn.data.corpus import SAMPLE_RATE, DataError, prepare_corpus, read_audio
from batchrnn.data.features import Featurizer, load_features
from batchrnn.data.manifest import content_sha256, manifests
from batchrnn.storage import write_json
from batchrnn.data.text import greedy_decode
from batchrnn.training.device import pick_device, uses_bf16
from batchrnn.training.rundir import BEST
from batchrnn.training.loop import score


class UsageError(ValueError):
    """A command-line value or an input file that cannot work; the message names it and the fix."""


def checkpoint_path(path: str) -> Path:
    """A run folder stands for its best.pt: the checkpoint that the run's test scores come from."""
    path = Path(path)
    return path / BEST if path.is_dir() else path


def data_config(info: dict, root: str | None = None) -> DataConfig:
    """The run's own data settings (corpus, split, features), optionally with another data.root."""
    cfg = typed(DataConfig, info["config"]["data"])
    if root:
        cfg.root = root
    # The saved archive is resolved; DataConfig.archive lets AN4_ARCHIVE replace it, and so does this.
    if cfg.corpus == "an4" and os.environ.get(AN4_ARCHIVE_ENV):
        cfg.archive = os.environ[AN4_ARCHIVE_ENV]
    return cfg


def uses_amp(info: dict, device: torch.device) -> bool:
    """Scored as the run scored it: bf16 autocast on CUDA (train.amp) or on the CPU (train.cpu_bf16)."""
    return uses_bf16(typed(TrainConfig, info["config"]["train"]), device)


def score_split(args) -> None:
    path, device = checkpoint_path(args.checkpoint), pick_device(args.device)
    model, info = load_model(path, device)
    cfg = data_config(info, args.data_root)
    if cfg.manifest_sha256 and content_sha256(cfg) != cfg.manifest_sha256:  # its test set would not be the run's
        given = ", ".join(str(m) for m in manifests(cfg).values())
        raise UsageError(f"{path}: its manifests ({given}) have changed since the run trained; score it on the "
                         "manifests it was trained with")
    fs = load_features(prepare_corpus(cfg), args.split, cfg)
    result = score(model, fs, info["config"]["train"]["batch_size"], device, uses_amp(info, device), progress=True)
    print(f"{path}: {args.split} WER {100 * result['wer']:.2f}%, CER {100 * result['cer']:.2f}%, "
          f"{len(fs)} utterances (best epoch {info.get('epoch')})")
    if args.out:
        write_json(args.out, {"checkpoint": str(path), "split": args.split, **result})


def read_any_audio(path: str) -> torch.Tensor:
    """float32 mono samples of a SPHERE file (the corpus's own checks) or anything else soundfile reads."""
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such audio file; give SPHERE or WAV files")
    try:
        info = sf.info(path)
    except (sf.LibsndfileError, RuntimeError) as e:
        raise UsageError(f"{path}: not audio that soundfile can read ({e}); give SPHERE or WAV files") from e
    if info.samplerate != SAMPLE_RATE:
        raise UsageError(f"{path}: sample rate {info.samplerate} Hz, the model reads {SAMPLE_RATE} Hz audio; "
                         f"resample it (e.g. sox {path} -r {SAMPLE_RATE} out.wav)")
    if info.format == "NIST":
        return read_audio(path)
    audio, _ = sf.read(path, dtype="float32", always_2d=True)
    return torch.from_numpy(audio.mean(axis=1))  # (samples,), channels averaged as the corpus reader does


@torch.no_grad()
def transcribe(args) -> None:
    path, device = checkpoint_path(args.checkpoint), pick_device(args.device)
    model, info = export.load_any(path, device)  # a best.pt, or an export of one
    featurizer = Featurizer(data_config(info))
    for audio_path in args.audio:
        audio = read_any_audio(audio_path)
        if len(audio) < featurizer.n_fft:  # the spectrogram's first window, centred on sample 0
            raise UsageError(f"{audio_path}: {len(audio)} samples, too short to transcribe; give at least "
                             f"{featurizer.n_fft} ({1000 * featurizer.n_fft // SAMPLE_RATE} ms)")
        feats = featurizer(audio)  # (T, F)
        lengths = torch.tensor([feats.shape[0]], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_amp(info, device) and
                            "exported" not in info):  # an export is float32, as its check was
            logits, out_lens = model(feats.T[None].to(device), lengths)  # (T', 1, classes)
        print(f"{audio_path}\t{greedy_decode(logits.float(), out_lens)[0]}", flush=True)


def export_run(args) -> None:
    path = checkpoint_path(args.checkpoint)
    model, info = load_model(path)  # refuses a missing, damaged or foreign best.pt
    cfg, out = data_config(info, args.data_root), args.out or export.default_out(path, args.format)
    worst, padded = export.export(path, model, info, args.format, out,
                                  lambda: load_features(prepare_corpus(cfg), "val", cfg))
    print(f"{out}: {args.format} export of {path}, log-probabilities within {worst:.1g} of the trained model's "
          f"and {padded:.1g} under padding on the validation set")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m batchrnn.evaluate", description=__doc__.splitlines()[0])
    commands = p.add_subparsers(dest="command", required=True)
    s = commands.add_parser("score", help="WER and CER of a run's best checkpoint on its val or test split")
    s.add_argument("--split", choices=["val", "test"], default="test")
    s.add_argument("--data-root", help="folder of the prepared corpus (default: the run's data.root)")
    s.add_argument("--out", type=Path, help="also write the scores and every utterance's hypothesis here (JSON)")
    s.set_defaults(run=score_split)
    t = commands.add_parser("transcribe", help="print path<TAB>transcript for each audio file (SPHERE, WAV)")
    t.set_defaults(run=transcribe)
    for command in (s, t):
        command.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT", help=f"a run folder (its {BEST}) "
                             "or a checkpoint file")
        command.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    x = commands.add_parser("export", help="the model with its normalisations folded, for serving "
                            "(docs/export.md)")
    x.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT", help=f"a run folder (its {BEST}) or a checkpoint")
    x.add_argument("--format", choices=export.FORMATS, default="torch")
    x.add_argument("--out", type=Path, help="where to write it (default: beside the checkpoint, best.export.pt "
                   "or best.onnx)")
    x.add_argument("--data-root", help="folder of the prepared corpus, for the check on the validation set "
                   "(default: the run's data.root)")
    x.set_defaults(run=export_run)
    t.add_argument("audio", nargs="+", metavar="AUDIO", help="16 kHz audio files")
    args = p.parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, ConfigError, DataError, UsageError, OSError) as e:  # OSError: e.g. --out's folder
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)  # as the trainer and argparse exit on a problem the user can fix


if __name__ == "__main__":
    main()
