"""`python src/run.py --help`: the project's own page lists every allowed value, preset and launcher."""
import re
import subprocess
import sys

import pytest

from batchrnn.config import BadText, BNMode, CorpusName, Device, Impl, LoggerMode, RNNType
from conftest import ROOT


@pytest.fixture(scope="module")
def help_page() -> str:
    run = subprocess.run([sys.executable, str(ROOT / "src" / "run.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("key,enum", [("model.rnn", RNNType), ("model.bn", BNMode), ("model.impl", Impl),
                                      ("train.device", Device), ("logger.mode", LoggerMode), ("data", CorpusName),
                                      ("data.bad_text", BadText)])
def test_help_lists_every_allowed_value(help_page, key, enum):
    assert f"{key}={'|'.join(member.value for member in enum)}" in help_page


@pytest.mark.parametrize("folder", ["experiment", "hydra/launcher"])
def test_help_has_a_line_for_every_preset_and_launcher(help_page, folder):
    names = sorted(p.stem for p in (ROOT / "conf" / folder).glob("*.yaml"))
    assert names and all(re.search(rf"^  {name} +\w", help_page, re.MULTILINE) for name in names), names


def test_study_script_refuses_an_unknown_study_in_one_line():
    done = subprocess.run(["bash", str(ROOT / "experiments" / "reproduce_an4.sh"), "grids"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: unknown study 'grids'; use grid, depth, norms or all"


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for .venv/bin/python: the preset for -c, each data preparation and the study call written to $RAN
case "$*" in
  -c*) echo an4_cpu_plateau ;;
  *batchrnn.data*) echo "data $*" >> "$RAN" ;;
  *batchrnn.study*) echo "study $*" >> "$RAN"; exit "$EXIT" ;;
esac
"""


@pytest.fixture
def fake_venv(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "reproduce_an4.sh").write_text((ROOT / "experiments" / "reproduce_an4.sh").read_text())
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text(FAKE_PYTHON)
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)

    def run(*args, exit_status=0, **env):
        done = subprocess.run(["bash", str(tmp_path / "experiments" / "reproduce_an4.sh"), *args], capture_output=True,
                              text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "EXIT": str(exit_status), "RAN": str(tmp_path / "ran")} | env)
        return done.returncode, (tmp_path / "ran").read_text().splitlines()

    return run


def test_make_studies_is_one_schedule_of_the_studies_in_order(fake_venv):
    """The converged protocol: grid, then norms (in the grid's folder), then LSTM seeds 4-6, then depth, joined by `then` in one study
    call (so the later studies fill the slots the earlier leave free, and a study that ends with 2 or 3 does not
    stop the next), each with the extra overrides; each preset's data prepared once before; the study's exit status
    is the script's."""
    code, ran = fake_venv("all", "hydra/launcher=parallel", exit_status=3)
    assert code == 3
    *data, study = ran
    assert data == ["data -m batchrnn.data --preset an4_cpu_plateau --root data --features",
                    "data -m batchrnn.data --preset an4_depth_plateau --root data --features"]
    groups = study.removeprefix("study -m batchrnn.study ").removesuffix(" --wandb").split(" then ")
    grid = "experiment=an4_cpu_plateau model.rnn=gru,lstm model.bn="
    assert groups == [grid + "none,post,input,skip,seqwise hydra/launcher=parallel",
                      grid + "ln,wn,ln_full hydra/launcher=parallel",
                      LSTM6 + " hydra/launcher=parallel",
                      "experiment=an4_depth_plateau hydra/launcher=parallel"]


LSTM6 = ("experiment=an4_cpu_plateau model.rnn=lstm model.bn=none,post,input,skip,seqwise,ln,wn,ln_full "
         "protocol.seeds=[1,2,3,4,5,6]")


def test_make_reproduce_an4_runs_every_study_of_the_readmes_table(fake_venv):
    """The README's headline table: the grid and the norms with seeds 1-3, and every LSTM variant with seeds 1-6.
    SEEDS changes the first two only; LSTM_SEEDS the third."""
    code, ran = fake_venv("grid")
    groups = ran[-1].removeprefix("study -m batchrnn.study ").removesuffix(" --wandb").split(" then ")
    grid = "experiment=an4_cpu_plateau model.rnn=gru,lstm model.bn="
    assert code == 0 and groups == [grid + "none,post,input,skip,seqwise", grid + "ln,wn,ln_full", LSTM6]
    _, ran = fake_venv("grid", SEEDS="1", LSTM_SEEDS="1,4")
    groups = ran[-1].removeprefix("study -m batchrnn.study ").removesuffix(" --wandb").split(" then ")
    assert groups[0].endswith("protocol.seeds=[1]") and groups[2].endswith("protocol.seeds=[1,4]")


def test_the_earlier_exponential_studies_still_run(fake_venv):
    """SCHEDULE=exponential: the earlier presets, in their earlier order (grid, depth, norms)."""
    code, ran = fake_venv("all", SCHEDULE="exponential")
    groups = ran[-1].removeprefix("study -m batchrnn.study ").removesuffix(" --wandb").split(" then ")
    assert code == 0 and groups == ["experiment=an4_cpu model.rnn=gru,lstm model.bn=none,post,input,skip,seqwise",
                                    "experiment=an4_depth",
                                    "experiment=an4_cpu model.rnn=gru,lstm model.bn=ln,wn,ln_full"]
    code, _ = fake_venv("grid", SCHEDULE="cosine")
    assert code == 2


def test_one_study_is_one_group(fake_venv):
    code, ran = fake_venv("depth")
    assert code == 0 and ran == ["data -m batchrnn.data --preset an4_depth_plateau --root data --features",
                                 "study -m batchrnn.study experiment=an4_depth_plateau --wandb"]
