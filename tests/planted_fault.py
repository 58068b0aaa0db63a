"""src/run.py with a fault planted in every rank, for tests/test_distributed.py: the data-parallel comparison must
catch each. `python tests/planted_fault.py FAULT OVERRIDES...` under torchrun, FAULT one of FAULTS."""
import itertools
import runpy
import sys
from pathlib import Path

from batchrnn.layers import folds
from batchrnn.training import distributed

ROOT = Path(__file__).resolve().parents[1]
STEP = 5  # the training step (from 0) whose share rank 1 drops or counts twice: in epoch 2 of the smoke corpus


def weighted(times: float):
    """share_loss with rank 1's share of one step weighted by times: 0 drops it, 2 counts it twice."""
    share_loss, steps = distributed.share_loss, itertools.count()

    def planted(loss, mine, total):
        weighted_loss = share_loss(loss, mine, total)
        return weighted_loss * times if next(steps) == STEP and distributed.rank() == 1 else weighted_loss

    return planted


def unsynced_variance(*tensors):
    """all_sum, but a lone tensor (BatchNorm's variance, folds.masked_moments and the fold's) stays this rank's."""
    return list(tensors) if len(tensors) == 1 else all_sum(*tensors)


all_sum = folds.all_sum
FAULTS = {"drop": ("share_loss", weighted(0.0)), "double": ("share_loss", weighted(2.0)),
          "unsynced_variance": ("all_sum", unsynced_variance)}

if __name__ == "__main__":
    name, patch = FAULTS[sys.argv.pop(1)]
    setattr(distributed if name == "share_loss" else folds, name, patch)
    sys.argv[0] = str(ROOT / "src" / "run.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
