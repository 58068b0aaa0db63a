"""Shared fixtures: Hydra composition of the real conf/ tree, and one tiny corpus per session."""
import contextlib
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from batchrnn.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
# Every normalisation, written out once, in BNMode's order: tests/test_rnn.py holds it to BNMode, so a variant added
# to the code fails there until it is named here, and a variant dropped from the code fails there too. The tests
# that spell the variants out (the bench's rows, the allowed values, the CPU GRU's fused variants) read them from
# here, so they cannot shrink with the code they test. STEP_LOOPS: the variants without a fused route.
BN_MODES = ["none", "post", "input", "skip", "seqwise", "ln", "ln_full", "wn", "rbn"]
STEP_LOOPS = ["ln_full", "rbn"]
FUSED_MODES = [bn for bn in BN_MODES if bn not in STEP_LOOPS]
# make bench's rows, in its order: every fused variant, exact DS2's step-by-step reference, the step loops
BENCH_ROWS = [(bn, "fused") for bn in FUSED_MODES] + [("seqwise", "cells")] + [(bn, "fused") for bn in STEP_LOOPS]
register_configs()


@pytest.fixture
def make_config():
    def make(*overrides: str):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    return make


@pytest.fixture(scope="session")
def smoke_root(tmp_path_factory) -> Path:
    """data.root for the smoke corpus, shared so the corpus is generated once per test session."""
    return tmp_path_factory.mktemp("smoke-data")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """No W&B credentials or server anywhere wandb looks (env, ~/.netrc, ~/.config/wandb), so auto goes
    offline; returns online(base_url), which sets a fake key and that server."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb"))

    def online(base_url: str) -> None:
        monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
        monkeypatch.setenv("WANDB_BASE_URL", base_url)

    return online


@contextlib.contextmanager
def killed_after(epochs: int):
    """The run trained inside is stopped (KeyboardInterrupt) once its epoch `epochs`' checkpoint is written, as if
    killed there: its own settings throughout, since a checkpoint of other settings is refused at resume."""
    from batchrnn.training import loop

    one_epoch = loop.train_epoch

    def train_epoch(run, progress, tracker):
        if progress.epoch == epochs + 1:
            raise KeyboardInterrupt
        return one_epoch(run, progress, tracker)

    loop.train_epoch = train_epoch
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        loop.train_epoch = one_epoch
