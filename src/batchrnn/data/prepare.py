"""`python -m batchrnn.data`: prepare the corpus and, with --features, the feature cache that
`python src/run.py experiment=PRESET` will read, composed from the same conf/ tree; with --export-manifests,
write its splits as JSON-lines manifests that data=manifest reads.

It lives apart from data.py because it builds features, and features.py imports data.py.
"""
import argparse
import json
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from batchrnn.config import ConfigError, CorpusName, DataConfig, register_configs, with_device_preset
from batchrnn.validation import validate
from batchrnn.data.corpus import DataError, prepare_corpus, unwritable
from batchrnn.data.features import Featurizer, cache_path, load_features
from batchrnn.data.manifest import export_manifests

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
# What a second run after a stop does: the download resumes, an extraction without its marker is done again, and
# each feature cache is written whole or not at all
AGAIN = "go on: what is prepared is kept"
PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def compose_run_config(preset: str | None) -> DictConfig:
    """The configuration `python src/run.py [experiment=PRESET]` composes ($AN4_ARCHIVE included); without
    a preset, the one src/run.py picks for this machine."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=with_device_preset([f"experiment={preset}"] if preset else []))


def feature_settings(cfg: DataConfig) -> str:
    """What a feature cache holds, in words: '64 mel bands, 20 ms window, 10 ms hop'."""
    n = Featurizer(cfg).num_features
    bins = f"{n} mel bands" if cfg.n_mels else f"{n} linear bins"
    return f"{bins}, {cfg.window_ms:g} ms window, {cfg.hop_ms:g} ms hop"


def main(argv: list[str] | None = None) -> None:
    try:
        prepare(argv)
    except KeyboardInterrupt:
        print(f"interrupted; run the same command again to {AGAIN}", file=sys.stderr)
        sys.exit(130)


def prepare(argv: list[str] | None) -> None:
    by_preset = "\n".join(f"  {preset or '(none)':10} {feature_settings(compose_run_config(preset).data)}"
                          for preset in [None, *PRESETS])
    p = argparse.ArgumentParser(prog="python -m batchrnn.data", description=__doc__.split("\n\n")[0],
                                epilog=f"feature settings by preset:\n{by_preset}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESETS,
                   help="take the data settings (corpus, mel bands, window) from conf/experiment/PRESET.yaml, "
                        "as `src/run.py experiment=PRESET` does (default: the one `src/run.py` picks for this machine, "
                        "an4_gpu_plateau with CUDA, else an4_cpu_plateau)")
    p.add_argument("--features", action="store_true",
                   help="also build the feature cache of those settings (below); the output names them")
    p.add_argument("--archive", help="local path, file:// or http(s) URL (default: $AN4_ARCHIVE, else CMU's URL)")
    p.add_argument("--mirror", action="append", dest="mirrors", metavar="URL", help="fallback URL, may repeat")
    p.add_argument("--root", help="folder for the corpus, splits and features (default: data)")
    p.add_argument("--corpus", choices=[c.value for c in CorpusName], help="default: the preset's")
    p.add_argument("--val-fraction", type=float)
    p.add_argument("--split-seed", type=int)
    for split in ("train", "val", "test"):
        p.add_argument(f"--{split}", metavar="MANIFEST.jsonl", help=f"data.{split} of --corpus manifest")
    p.add_argument("--export-manifests", metavar="DIR", type=Path,
                   help="write the corpus's splits as DIR/train.jsonl, val.jsonl, test.jsonl (NeMo's JSON lines), "
                        "to train from with data=manifest data.train=DIR/train.jsonl data.val=... data.test=...")
    args = p.parse_args(argv)
    run_cfg = compose_run_config(args.preset)
    for key in ("archive", "mirrors", "root", "corpus", "val_fraction", "split_seed", "train", "val", "test"):
        if getattr(args, key) is not None:  # a flag given beats the preset
            run_cfg.data[key] = getattr(args, key)
    try:
        validate(run_cfg)
        cfg: DataConfig = OmegaConf.to_object(run_cfg.data)
        t0 = time.perf_counter()
        corpus = prepare_corpus(cfg)
        summary = {**corpus.summary, "seconds": {"prepare": round(time.perf_counter() - t0, 1)}}
        if args.export_manifests:
            summary["exported"] = {s: str(path) for s, path in export_manifests(corpus, args.export_manifests).items()}
        if args.features:
            t0 = time.perf_counter()
            source = f"the {args.preset or run_cfg.study} preset"
            summary["features"] = {"settings": f"{feature_settings(cfg)} ({source})",
                                   "files": {split: str(cache_path(corpus, split, cfg)) for split in corpus.splits}}
            summary["frames"] = {}
            for split in corpus.splits:
                lengths = sorted(load_features(corpus, split, cfg).lengths)
                summary["frames"][split] = {"min": lengths[0], "median": lengths[len(lengths) // 2],
                                            "max": lengths[-1]}
            summary["seconds"]["features"] = round(time.perf_counter() - t0, 1)
    except (ConfigError, DataError, OSError) as e:
        problem = unwritable(e) if isinstance(e, OSError) else e
        if problem is None:  # an OSError other than a full disk or a read-only folder
            raise
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)  # as src/run.py: a problem the user can fix
    for key in ("skipped_ids", "normalized_ids"):  # the counts say enough on the terminal
        summary.pop(key)
    print(json.dumps(summary, indent=2))
