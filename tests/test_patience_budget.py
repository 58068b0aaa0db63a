"""experiments/patience_budget.py --left: what the patience study has left to train, counted by the protocol's rule
from committed runs of two variants (a fixed list, so that the study's later runs do not move the figures)."""
import shutil
import subprocess
import sys

from conftest import ROOT

RESULTS = ROOT / "experiments" / "results"
PATIENCE = ["gru-none-L3-lr0.001-s1-3f718286", "gru-none-L3-lr0.001-s2-6c8ef8ea", "gru-none-L3-lr0.002-s1-cae123d6",
            "gru-none-L3-lr0.002-s2-9f5b6b43", "gru-none-L3-lr0.004-s1-f863d3ec", "gru-none-L3-lr0.004-s2-283a4b13",
            "lstm-post-L3-lr0.001-s1-367e8561", "lstm-post-L3-lr0.001-s2-0d1f7ce9", "lstm-post-L3-lr0.002-s1-90e583d0",
            "lstm-post-L3-lr0.002-s2-6ac7b22a", "lstm-post-L3-lr0.004-s1-1050a6be", "lstm-post-L3-lr0.004-s2-cd14b442"]
CONVERGED = ["gru-none-L3-lr0.001-s1-3f718286", "gru-none-L3-lr0.002-s1-cae123d6", "gru-none-L3-lr0.002-s1-f703c35a",
             "gru-none-L3-lr0.002-s2-9f5b6b43", "gru-none-L3-lr0.002-s3-1f96750c", "gru-none-L3-lr0.004-s1-f863d3ec",
             "lstm-post-L3-lr0.0005-s1-3b5b59e8", "lstm-post-L3-lr0.001-s1-367e8561", "lstm-post-L3-lr0.001-s1-c21f60e3",
             "lstm-post-L3-lr0.001-s2-0d1f7ce9", "lstm-post-L3-lr0.001-s3-da5ff1f0", "lstm-post-L3-lr0.001-s4-9d96054e",
             "lstm-post-L3-lr0.001-s5-7387029a", "lstm-post-L3-lr0.001-s6-e2478e74", "lstm-post-L3-lr0.002-s1-90e583d0",
             "lstm-post-L3-lr0.004-s1-1050a6be"]


def copy_runs(study: str, names: list[str], to):
    for name in names:
        shutil.copytree(RESULTS / study / name, to / name)


def test_runs_left_follow_the_protocol(tmp_path):
    # gru-none and lstm-post: their rate grid is done, both tuning seeds' mean best at its lowest rate, 1e-3
    copy_runs("an4_cpu_patience", PATIENCE, tmp_path / "patience")
    copy_runs("an4_cpu_plateau", CONVERGED, tmp_path / "plateau")
    (tmp_path / "runs").mkdir()  # no best.pt left of any run
    out = subprocess.run([sys.executable, ROOT / "experiments" / "patience_budget.py", tmp_path / "plateau",
                          "--left", tmp_path / "patience", "--checkpoints", tmp_path / "runs"],
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split(" | ")[0].strip("| "): line.strip("| \n").split(" | ") for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| variant")}
    # gru-none (none needs its best.pt, so nothing is taken from the converged study). Fewest: 5e-4 past the edge
    # (2), SpecAugment off (2), 6/12 (2), seeds 3-6 (4); most: 5e-4 and 2.5e-4 (4), 2, 6/12 and 12/24 (4), 4. Its two
    # tuning runs at 1e-3, their best.pt gone, train again for the LM (make patience-finish).
    assert rows["gru-none"][1].startswith("0.001 (") and rows["gru-none"][2] == "0"
    assert rows["gru-none"][3].startswith("10 (") and rows["gru-none"][4].startswith("14 (")
    assert rows["gru-none"][5] == "2"
    # lstm-post takes seed 1's runs at 5e-4 and with SpecAugment off at 1e-3, and seeds 3-6 at 1e-3, from the
    # converged study. Fewest: 1 + 1 + 2 + 0; most: 1 + 2 widening, 2 off at 2.5e-4, 4, 4
    assert rows["lstm-post"][3].startswith("4 (") and rows["lstm-post"][4].startswith("13 (")
    assert rows["lstm-post"][5] == "0"
    assert "fewest: 14 runs left to train" in out and "most: 27 runs left to train" in out
    assert "and 2 runs to train again for the LM decoding" in out
