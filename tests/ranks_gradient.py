"""The gradient of fixed training batches of the smoke preset, for tests/test_distributed.py: run by torchrun with
several ranks (`python tests/ranks_gradient.py OUT VARIANTS_JSON`, rank 0 saves OUT; every rank then leaves the
process group and writes OUT.rankN.json, its gloo worker threads before and after) or called in one process."""
import json
import os
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from batchrnn.config import register_configs
from batchrnn.training import distributed
from batchrnn.training.loop import Run, gradient

ROOT = Path(__file__).resolve().parents[1]


def batches(run: Run) -> dict[str, list[int]]:
    """Ragged lengths, shares of 4 and 3 utterances; and a batch of one, where the second rank has no share."""
    return {"seven": run.train_indices[3:10], "one": run.train_indices[12:13]}


def gradients(variants: list[list[str]]) -> list[dict]:
    """Per variant (a list of overrides of the smoke preset): per batch its summed loss, every parameter's
    gradient and every buffer (BatchNorm's running moments) after the batch."""
    register_configs()
    out = []
    for overrides in variants:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["experiment=smoke", *overrides])
        run = Run(cfg)
        run.model.train()
        found = {}
        for name, indices in batches(run).items():
            summed, norm = gradient(run, indices, epoch=2)
            found[name] = {"loss": summed, "norm": float(norm),
                           "grads": {k: p.grad.clone() for k, p in run.model.named_parameters()},
                           "buffers": {k: b.clone() for k, b in run.model.named_buffers()}}
        out.append(found)
    return out


def gloo_threads() -> int:
    """This process's gloo worker threads (torch names them pt_gloo_runloop)."""
    return sum(Path(f"/proc/self/task/{task}/comm").read_text().strip() == "pt_gloo_runloop"
               for task in os.listdir("/proc/self/task"))


if __name__ == "__main__":
    found = gradients(json.loads(sys.argv[2]))
    rank = torch.distributed.get_rank()
    if rank == 0:
        torch.save(found, sys.argv[1])
    during = gloo_threads()
    freed = distributed.leave()  # what start()'s exit handler does: checked here, while it can still be seen
    Path(f"{sys.argv[1]}.rank{rank}.json").write_text(json.dumps(
        {"freed": freed, "threads_during": during, "threads_after": gloo_threads()}))
