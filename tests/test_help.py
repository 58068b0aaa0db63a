"""`python src/run.py --help`: the project's own page lists every allowed value, preset and launcher."""
import re
import subprocess
import sys

import pytest

from batchrnn.config import BNMode, Device, Impl, LoggerMode, RNNType
from conftest import ROOT


@pytest.fixture(scope="module")
def help_page() -> str:
    run = subprocess.run([sys.executable, str(ROOT / "src" / "run.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("key,enum", [("model.rnn", RNNType), ("model.bn", BNMode), ("model.impl", Impl),
                                      ("train.device", Device), ("logger.mode", LoggerMode)])
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
