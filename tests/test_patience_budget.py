"""experiments/patience_budget.py --left: what the patience study has left to train, counted by the protocol's rule
from the committed runs of two variants."""
import shutil
import subprocess
import sys

from conftest import ROOT

RESULTS = ROOT / "experiments" / "results"


def copy_runs(study: str, variants: tuple[str, ...], to):
    to.mkdir()
    for run in (RESULTS / study).iterdir():
        if run.name.startswith(variants):
            shutil.copytree(run, to / run.name)


def test_runs_left_follow_the_protocol(tmp_path):
    # gru-none and lstm-post: their rate grid is done, both tuning seeds' mean best at its lowest rate, 1e-3
    variants = ("gru-none-", "lstm-post-")
    copy_runs("an4_cpu_patience", variants, tmp_path / "patience")
    copy_runs("an4_cpu_plateau", variants, tmp_path / "plateau")
    (tmp_path / "runs").mkdir()  # no best.pt left of any run
    out = subprocess.run([sys.executable, ROOT / "experiments" / "patience_budget.py", tmp_path / "plateau",
                          "--left", tmp_path / "patience", "--checkpoints", tmp_path / "runs"],
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    # fewest: 5e-4 past the edge (2), SpecAugment off (2), 6/12 (2), seeds 3-6 trained, as none needs its best.pt
    # (4), and the two tuning runs at 1e-3 again, their best.pt gone (2); most: 5e-4 and 2.5e-4 (4), 2, 6/12 and
    # 12/24 (4), seeds 3-6 (4)
    assert rows["gru-none"][1].startswith("0.001 (") and rows["gru-none"][2] == "0"
    assert rows["gru-none"][3].startswith("12 (") and rows["gru-none"][4].startswith("14 (")
    # lstm-post takes seed 1's runs at 5e-4 and with SpecAugment off from the converged study (its placement needs no
    # best.pt), and its seeds 3-6 at 1e-3 in the fewest case: 1 + 1 + 2 + 0; most: 1 + 2, 1, 4, 4
    assert rows["lstm-post"][2] == "0"
    assert rows["lstm-post"][3].startswith("4 (") and rows["lstm-post"][4].startswith("12 (")
    assert "fewest: 16 runs left to train" in out and "most: 26 runs left to train" in out
