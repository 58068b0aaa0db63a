"""Stops one smoke run many times at random moments of its training, in one process, and resumes it each time:
the hunt for the rare crash at a SIGTERM (experiments/converged.md, the Study log). Each stop sends SIGTERM to the
main thread after a random delay, with src/run.py's handler (batchrnn.training.stopping), so the run leaves at its
next step with SystemExit(143); train() then resumes it from its last epoch. A crash ends the process (faulthandler
prints every thread's Python stack first); otherwise it prints how many stops ended cleanly.

    python experiments/sigterm_stress.py [--seconds 180] [--folder DIR]
"""
import argparse
import faulthandler
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from batchrnn.config import register_configs
from batchrnn.training import stopping
from batchrnn.training.loop import train

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180, help="how long to go on stopping and resuming")
    parser.add_argument("--folder", type=Path, help="the run's and the corpus's folder (default: a new temporary one)")
    args = parser.parse_args()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="sigterm_stress_"))
    faulthandler.enable()
    register_configs()
    signal.signal(signal.SIGTERM, stopping.on_signal)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=smoke", f"data.root={folder / 'data'}",
                                                       "train.epochs=100000", "train.patience=100000"])
    main_thread, draw = threading.main_thread().ident, random.Random(0)
    end, stops = time.monotonic() + args.seconds, 0
    while time.monotonic() < end:
        # the first start imports torch's optimiser stack and makes the corpus: let it reach training first
        timer = threading.Timer(draw.uniform(0.3, 1.5) + (15 if not stops else 0), signal.pthread_kill,
                                (main_thread, signal.SIGTERM))
        timer.start()
        try:
            train(cfg, folder / "run")
        except SystemExit as e:
            if e.code != 128 + signal.SIGTERM:
                raise
            stops += 1
        timer.join()
    print(f"{stops} stops ended cleanly in {args.seconds:.0f} s (folder {folder})")


if __name__ == "__main__":
    main()
