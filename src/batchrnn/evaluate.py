"""Use a trained model: re-score a run's best checkpoint on a split, or transcribe audio files with it.

    python -m batchrnn.evaluate score runs/smoke/gru-seqwise-L2-lr0.003-s0-<hash> --split test --out hyps.json
    python -m batchrnn.evaluate score runs/smoke/gru-seqwise-L2-lr0.003-s0-<hash> --split test --decoder beam
    python -m batchrnn.evaluate transcribe runs/smoke/gru-seqwise-L2-lr0.003-s0-<hash>/best.pt a.sph b.wav
    python -m batchrnn.evaluate transcribe runs/smoke/gru-seqwise-L2-lr0.003-s0-<hash> --decoder beam a.sph
    python -m batchrnn.evaluate export runs/smoke/gru-seqwise-L2-lr0.003-s0-<hash> --format onnx
    python -m batchrnn.evaluate decode runs/an4_cpu_patience   # every finished run, with the LM, into results.json
"""
import argparse
import json
import os
import sys
from pathlib import Path

import soundfile as sf
import torch

from batchrnn import export
from batchrnn.training.checkpoint import CheckpointError, load_model, typed
from batchrnn.config import AN4_ARCHIVE_ENV, ConfigError, DataConfig, DecodeConfig, Decoder, TrainConfig
from batchrnn.data.corpus import SAMPLE_RATE, DataError, prepare_corpus, read_audio
from batchrnn.data.features import Featurizer, finite, load_features
from batchrnn.data.manifest import content_sha256, manifests
from batchrnn.decoding.beam import check
from batchrnn.progress import progress_bar
from batchrnn.storage import write_json
from batchrnn.data.text import greedy_decode
from batchrnn.training.device import pick_device, uses_bf16
from batchrnn.training.rundir import BEST, RESULTS, RunFolder
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


def decode_config(args) -> DecodeConfig:
    """--decoder and its settings; the grid is the schema's (decode.lm_weights, decode.word_scores)."""
    for flag, value in (("--lm", args.lm), ("--lexicon", args.lexicon)):
        if value and args.decoder == Decoder.greedy.value:
            raise UsageError(f"{flag} {value}: greedy decoding uses no language model; add --decoder beam, or drop "
                             f"{flag}")
    cfg = DecodeConfig(decoder=Decoder(args.decoder), lm=args.lm or "", lexicon=args.lexicon or "",
                       beam_size=args.beam_size)
    check(cfg)
    return cfg


def score_split(args) -> None:
    decoding = decode_config(args)  # before the model loads: a wrong setting fails at once
    path, device = checkpoint_path(args.checkpoint), pick_device(args.device)
    model, info = load_model(path, device)
    cfg = data_config(info, args.data_root)
    if cfg.manifest_sha256 and content_sha256(cfg) != cfg.manifest_sha256:  # its test set would not be the run's
        given = ", ".join(str(m) for m in manifests(cfg).values())
        raise UsageError(f"{path}: its manifests ({given}) have changed since the run trained; score it on the "
                         "manifests it was trained with")
    if (unfinished := unfinished_run(path)) is not None:
        print(f"warning: {path.parent}: {unfinished}; these are the scores of its best epoch so far "
              f"({info.get('epoch')})", file=sys.stderr)
    fs = load_features(prepare_corpus(cfg), args.split, cfg)
    result = score(model, fs, info["config"]["train"]["batch_size"], device, uses_amp(info, device), progress=True)
    print(f"{path}: {args.split} WER {100 * result['wer']:.2f}%, CER {100 * result['cer']:.2f}%, "
          f"{len(fs)} utterances (best epoch {info.get('epoch')})")
    lm = None
    if Decoder(decoding.decoder) is Decoder.beam:
        from batchrnn.decoding.tuning import decode_run  # loads torchaudio's decoder: only where a beam is asked for

        lm = decode_run(path, decoding, cfg, device, progress=True)
        wer, cer = (lm["test_wer"], lm["test_cer"]) if args.split == "test" else (lm["val_wer"], lm["val_cer"])
        print(f"{path}: {args.split} WER {100 * wer:.2f}%, CER {100 * cer:.2f}% with the LM {lm['lm']} (sha256 "
              f"{lm['lm_sha256'][:16]}, beam {lm['beam_size']}; LM weight {lm['lm_weight']:g}, word score "
              f"{lm['word_score']:g}, chosen on validation over {len(lm['grid'])} points)")
    if args.out:
        write_json(args.out, {"checkpoint": str(path), "split": args.split, **result} | ({"lm": lm} if lm else {}))


def decode_runs(args) -> None:
    """Every finished run under the folders given, decoded with the word LM at these settings (the grid as this
    code widens it), into its results.json's `lm`: a study decoded again after its decoder's rule changed. Greedy
    figures stay as they are. A finished run without its best.pt keeps the `lm` it has, and is named."""
    decoding = decode_config(args)
    device = pick_device(args.device)
    folders = sorted({r.parent for f in args.folders for r in Path(f).rglob(RESULTS)})
    if not folders:
        raise UsageError(f"{', '.join(args.folders)}: no {RESULTS} under it; give a run folder or a study's folder "
                         "of runs")
    from batchrnn.decoding.tuning import decode_run  # loads torchaudio's decoder

    decoded, not_finished, no_model = 0, 0, []
    for folder in progress_bar(folders, desc="LM decoding", unit="run"):
        try:
            results = json.loads((folder / RESULTS).read_text())
        except ValueError as e:
            raise UsageError(f"{folder / RESULTS}: not JSON ({e}); nothing was decoded from it on, and the runs "
                             "before it are written: restore it (keep_results.sh keeps a copy) and run decode "
                             "again") from e
        if results.get("status") != "finished":
            not_finished += 1
            continue
        if fault := RunFolder(folder).best_fault(results["config"]):  # missing, damaged, or another model's
            no_model.append(f"{folder.name} ({fault})")
            continue
        lm = decode_run(folder / BEST, decoding, data_config(results, args.data_root), device)
        write_json(folder / RESULTS, results | {"lm": lm})
        decoded += 1
        edge = f"; on the grid's edge ({', '.join(lm['at_edge'])})" if lm["at_edge"] else ""
        print(f"{folder}: test WER {100 * results['test_wer']:.2f}% greedy, {100 * lm['test_wer']:.2f}% with the "
              f"LM (weight {lm['lm_weight']:g}, word score {lm['word_score']:g}, {len(lm['grid'])} points{edge})")
    print(f"decoded {decoded} finished runs with the LM {decoding.lm or '(the built 3-gram)'}; {not_finished} not "
          f"finished (running or diverged), left alone" + (
              f"; {len(no_model)} finished without a usable {BEST}, keeping the lm they had: " + ", ".join(no_model)
              if no_model else ""))


def unfinished_run(path: Path) -> str | None:
    """'unfinished (status running, 3 epochs)' when the best.pt at path lies in a run folder whose results.json
    says the run has not finished; None for a finished run, or a best.pt kept elsewhere."""
    try:
        results = json.loads((path.parent / RESULTS).read_text())
    except (OSError, ValueError):
        return None
    status = results.get("status") if isinstance(results, dict) else None
    if status in (None, "finished"):
        return None
    epochs = len(results.get("epochs") or [])
    return f"unfinished (status {status}, {epochs} epoch{'s' * (epochs != 1)} in {RESULTS})"


def read_any_audio(path: str) -> torch.Tensor:
    """float32 mono samples of a SPHERE file (the corpus's own checks) or anything else soundfile reads."""
    if Path(path).is_dir():
        raise UsageError(f"{path}: a folder, not an audio file; give the files in it (e.g. {path}/*.wav)")
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
    decoding = decode_config(args)
    path, device = checkpoint_path(args.checkpoint), pick_device(args.device)
    model, info = export.load_any(path, device)  # a best.pt, or an export of one
    featurizer = Featurizer(data_config(info))
    words = None
    if Decoder(decoding.decoder) is Decoder.beam:  # at the LM weight and word score tuned on the run's validation
        from batchrnn.decoding.beam import BeamSearch, language_model
        from batchrnn.decoding.tuning import decode_run

        cfg = data_config(info, args.data_root)
        tuned = decode_run(path, decoding, cfg, device)
        search = BeamSearch(language_model(decoding, cfg, prepare_corpus(cfg)), decoding.beam_size)
        words = lambda e: search([e], tuned["lm_weight"], tuned["word_score"])[0]  # noqa: E731
    for audio_path in args.audio:
        audio = finite(read_any_audio(audio_path), audio_path, "or leave it out")
        if len(audio) < featurizer.n_fft:  # the spectrogram's first window, centred on sample 0
            raise UsageError(f"{audio_path}: {len(audio)} samples, too short to transcribe; give at least "
                             f"{featurizer.n_fft} ({1000 * featurizer.n_fft // SAMPLE_RATE} ms)")
        feats = featurizer(audio)  # (T, F)
        lengths = torch.tensor([feats.shape[0]], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_amp(info, device) and
                            "exported" not in info):  # an export is float32, as its check was
            logits, out_lens = model(feats.T[None].to(device), lengths)  # (T', 1, classes)
        text = (greedy_decode(logits.float(), out_lens)[0] if words is None
                else words(logits[:out_lens[0], 0].float().log_softmax(-1).cpu()))
        print(f"{audio_path}\t{text}", flush=True)


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
    s.add_argument("--out", type=Path, help="also write the scores and every utterance's hypothesis here (JSON)")
    s.set_defaults(run=score_split)
    t = commands.add_parser("transcribe", help="print path<TAB>transcript for each audio file (SPHERE, WAV)")
    t.set_defaults(run=transcribe)
    d = commands.add_parser("decode", help="decode every finished run under the folders given with the word LM, "
                            "into each results.json's lm (after the study that trained them has ended: a running "
                            "study decodes the runs it meets again at its own settings)")
    d.add_argument("folders", nargs="+", metavar="RUN_OR_STUDY_DIR")
    d.set_defaults(run=decode_runs, decoder=Decoder.beam.value)
    for command in (s, t, d):
        command.add_argument("--data-root", help="folder of the prepared corpus (default: the run's data.root)")
        if command is not d:
            command.add_argument("--decoder", choices=[x.value for x in Decoder], default=Decoder.greedy.value,
                                 help="beam: with a word LM, its LM weight and word score tuned on the run's "
                                      "validation split (docs/decoding.md); score prints greedy's figures too")
        command.add_argument("--lm", help="with the beam (--decoder beam; decode always): a KenLM ARPA or binary "
                                          "file (default: a 3-gram of the training transcripts, built and cached "
                                          "under the data root)")
        command.add_argument("--lexicon", help="with the beam: the words it may emit, one a line (default: the "
                                               "training words)")
        command.add_argument("--beam-size", type=int, default=DecodeConfig.beam_size)
        if command is not d:
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
