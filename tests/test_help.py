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


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for .venv/bin/python: the preset for -c, nothing to prepare, and each study's exit status from $EXIT
case "$*" in
  -c*) echo experiment=an4_cpu ;;
  *batchrnn.study*)
    study=grid; [[ "$*" == *an4_depth* ]] && study=depth; [[ "$*" == *ln,wn* ]] && study=norms
    echo "$study" >> "$RAN"; code="${EXIT#*$study=}"; exit "${code%%,*}" ;;
esac
"""


@pytest.mark.parametrize("exits,ran,status", [
    ("grid=0,depth=0,norms=0,", ["grid", "depth", "norms"], 0),
    ("grid=3,depth=0,norms=0,", ["grid", "depth", "norms"], 3),  # some runs diverged: counted, not a stop
    ("grid=0,depth=2,norms=3,", ["grid", "depth", "norms"], 2),  # a variant with no rate: its report says so
    ("grid=0,depth=143,norms=0,", ["grid", "depth"], 143)])  # a signal or a crash stops them all
def test_make_studies_goes_on_after_a_study_that_ended_with_2_or_3(tmp_path, exits, ran, status):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "reproduce_an4.sh").write_text((ROOT / "experiments" / "reproduce_an4.sh").read_text())
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text(FAKE_PYTHON)
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "experiments" / "reproduce_an4.sh"), "all"], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "EXIT": exits, "RAN": str(tmp_path / "ran")})
    assert done.returncode == status, done.stderr
    assert (tmp_path / "ran").read_text().split() == ran
