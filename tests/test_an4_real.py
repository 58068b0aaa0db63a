"""The real AN4 archive end to end (slow lane): AN4_ARCHIVE=path/to/an4_sphere.tar.gz pytest -m slow."""
import os
from pathlib import Path

import pytest

from batchrnn.config import DataConfig
from batchrnn.data import prepare_corpus


@pytest.mark.slow
def test_real_an4_counts_and_split(tmp_path):
    archive = os.environ.get("AN4_ARCHIVE")
    if not archive or not Path(archive).is_file():
        pytest.skip("set AN4_ARCHIVE to a local an4_sphere.tar.gz")
    corpus = prepare_corpus(DataConfig(archive=archive, root=str(tmp_path)))
    speakers = {s: {u.speaker for u in utts} for s, utts in corpus.splits.items()}
    assert len(corpus.splits["train"]) + len(corpus.splits["val"]) == 948
    assert len(speakers["train"] | speakers["val"]) == 74
    assert len(corpus.splits["test"]) == 130 and len(speakers["test"]) == 10
    assert speakers["val"] and not speakers["val"] & speakers["train"]
    assert corpus.summary["skipped"] == {s: {"no_audio": 0, "no_transcript": 0} for s in ("train", "test")}
