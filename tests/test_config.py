"""Config composition: every variant and experiment composes; bad values fail with one clear line."""
import re
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException

from batchrnn.config import BNMode, ConfigError, RNNType
from batchrnn.validation import validate
from batchrnn.model import DeepSpeech2
from conftest import ROOT


@pytest.mark.parametrize("rnn", [r.value for r in RNNType])
@pytest.mark.parametrize("bn", [b.value for b in BNMode])
def test_every_variant_composes_and_builds(make_config, rnn, bn):
    cfg = make_config("experiment=smoke", f"model.rnn={rnn}", f"model.bn={bn}")
    validate(cfg)
    assert (cfg.model.rnn, cfg.model.bn) == (RNNType(rnn), BNMode(bn))
    assert len(DeepSpeech2(cfg.model, num_features=32, num_classes=29).rnns) == cfg.model.num_layers


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_composes(make_config, experiment):
    validate(make_config(f"experiment={experiment}"))


@pytest.mark.parametrize("key,value", [("model.rnn", "transformer"), ("model.bn", "layer")])
def test_unknown_variant_names_key_value_and_choices(make_config, key, value):
    with pytest.raises(ConfigCompositionException) as e:
        make_config(f"{key}={value}")
    message = str(e.value.__cause__ or e.value)
    assert value in message and key in message
    choices = RNNType if key == "model.rnn" else BNMode
    assert all(c.value in message for c in choices)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.hidden_size=0"], "model.hidden_size=0: must be positive"),
        (["model.num_layers=-1"], "model.num_layers=-1"),
        (["data.val_fraction=1.5"], "data.val_fraction"),
        (["model.impl=cells", "model.bn=post"], "model.impl=cells with model.bn=post"),
        (["model.share_input_weights=true", "model.bn=none"], "model.share_input_weights"),
        (["model.impl=cells", "model.bn=ln_full"], "model.impl=cells with model.bn=ln_full"),
        (["model.weight_norm_recurrent=true", "model.bn=seqwise"],
         "model.weight_norm_recurrent=true with model.bn=seqwise"),
    ],
)
def test_impossible_values_are_refused(make_config, overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(make_config(*overrides))


def test_cli_refuses_bad_value_before_any_work(tmp_path):
    """Before any work, torch's import (seconds) included, once a preset is named (without one, torch picks it by
    the device): -X importtime lists every module the process loaded."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "src" / "run.py"), "experiment=smoke", "model.hidden_size=-3",
         f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2
    assert "model.hidden_size=-3: must be positive" in run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "results.json").exists()
    assert "| hydra" in run.stderr and not re.search(r"\|\s*torch$", run.stderr, re.M)


def test_without_a_preset_the_machine_picks_one():
    import torch

    from batchrnn.config import with_device_preset

    expected = "experiment=an4_gpu_plateau" if torch.cuda.is_available() else "experiment=an4_cpu_plateau"
    assert with_device_preset(["model.bn=seqwise"]) == ["model.bn=seqwise", expected]
    for given in (["experiment=smoke"], ["+experiment=an4_depth"], ["experiment=null"], ["--help"]):
        assert with_device_preset(given) == given


def test_every_schema_default_is_defined_once():
    """conf/ holds no value equal to the schema's default for the same key: a second copy of a default is
    the one that gets edited while the other silently wins."""
    import yaml
    from omegaconf import OmegaConf

    from batchrnn.config import Config
    from batchrnn.training.identity import flatten

    defaults = flatten(OmegaConf.to_container(OmegaConf.structured(Config)))
    for path in (ROOT / "conf").rglob("*.yaml"):
        if "hydra" in path.parts:
            continue
        tree = yaml.safe_load(path.read_text()) or {}
        prefix = "" if path.name == "config.yaml" or "experiment" in path.parts else f"{path.parent.name}."
        for key, value in flatten({k: v for k, v in tree.items() if k not in ("defaults", "hydra")}, prefix).items():
            assert key not in defaults or defaults[key] != value, f"{path}: {key}: {value} repeats the schema's default"
