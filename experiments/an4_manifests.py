"""AN4 exported as manifests trains as the built-in path (issue 29), on the real archive: the features of the three
splits bit for bit, then one an4_cpu epoch from each (seed 1, one thread) with the same losses to the last digit.

    AN4_ARCHIVE=../shared/data/an4_sphere.tar.gz .venv/bin/python experiments/an4_manifests.py [WORK_DIR]

WORK_DIR (default: a temporary folder) holds the corpus, the manifests and the two runs. About 2 minutes on 2 cores.
tests/test_manifest.py checks the same on the generated corpus.
"""
import os
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from batchrnn.config import register_configs
from batchrnn.data import prepare
from batchrnn.data.corpus import prepare_corpus
from batchrnn.data.features import load_features
from batchrnn.data.manifest import pin_content
from batchrnn.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("train", "val", "test")


def main(work: Path, archive: str) -> bool:
    root, exported = work / "data", work / "manifests"
    prepare.main(["--preset", "an4_cpu", "--root", str(root), "--archive", archive,
                  "--export-manifests", str(exported)])
    common = ["experiment=an4_cpu", f"data.root={root}", f"data.archive={archive}", "train.epochs=1",
              "train.threads=1", "logger.mode=disabled", "seed=1"]
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        built_in = compose(config_name="config", overrides=common)
        manifest = compose(config_name="config", overrides=[
            *common, "data=manifest", *(f"data.{s}={exported / (s + '.jsonl')}" for s in SPLITS)])
    a, b = prepare_corpus(OmegaConf.to_object(built_in.data)), prepare_corpus(OmegaConf.to_object(manifest.data))
    same = True
    for split in SPLITS:
        fa, fb = load_features(a, split, built_in.data), load_features(b, split, manifest.data)
        equal = (fa.texts == fb.texts and fa.lengths == fb.lengths
                 and all(torch.equal(x, y) for x, y in zip(fa.feats, fb.feats)))
        print(f"{split}: {len(fa)} and {len(fb)} utterances, {sum(fa.lengths)} frames, bit-identical: {equal}")
        same &= equal
    pin_content(manifest.data)  # as src/run.py does: the run is known by what its manifests hold
    first = train(built_in, work / "runs" / "an4")["epochs"][0]
    again = train(manifest, work / "runs" / "manifests")["epochs"][0]
    for key in ("train_loss", "val_loss", "val_wer", "grad_norm_max"):
        print(f"epoch 1 {key}: built-in {first[key]!r}, manifests {again[key]!r}, equal: {first[key] == again[key]}")
        same &= first[key] == again[key]
    return same


if __name__ == "__main__":
    archive = os.environ.get("AN4_ARCHIVE")
    if not archive or not Path(archive).is_file():
        sys.exit("error: set AN4_ARCHIVE to a local an4_sphere.tar.gz (here: ../shared/data/an4_sphere.tar.gz)")
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(0 if main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp), archive) else 1)
