"""The conv front end's BatchNorm + Hardtanh three ways, in the whole training step, interleaved step by step in one
process (issue 50): `separate`, the operations one by one under autograd; `aten`, one autograd function
(MaskedBNHardtanh) of torch operations; `native`, that function on the CPU kernel (layers.cpu_front_end).

Sequential runs on this VM cannot resolve a few percent: its speed drifts by more within minutes (step_cost.md).
So each real AN4 batch of the training order (epoch 2's, an4_cpu_plateau) is taken twice, once each way, in
alternating order, from the same weights (restored after each), and the step is what train_epoch times: collate,
SpecAugment, forward, CTC, backward, clipping and AdamW. Prints each way's median step and each one's ratio to the
first way's.

    python experiments/front_end_ab.py --root /work/main/data                         # aten against native
    python experiments/front_end_ab.py --root /work/main/data --ways separate,aten    # the function, the operations
"""
import argparse
import copy
import statistics
import time

import torch
from torch import nn

from batchrnn.data.features import collate
from batchrnn.layers import cpu_front_end
from batchrnn.layers.folds import MaskedBatchNorm
from batchrnn.training.loop import epoch_batches
from step_profile import EPOCH, compose_run

FUSED = MaskedBatchNorm.hardtanh


def separate(self, x, mask, lo, hi, channel_dim=-1):
    """The operations MaskedBNHardtanh fuses, one by one under autograd (the front end before it)."""
    return nn.functional.hardtanh(self.normalize(x, mask, channel_dim), lo, hi) * mask


def step(run, indices: list[int]) -> float:
    fs = run.sets["train"]
    start = time.perf_counter()
    x, x_lens, y, y_lens = collate(fs, indices)
    x = run.augment(x, x_lens, [fs.ids[i] for i in indices], EPOCH)
    loss, _, _ = run.loss(x, x_lens, y, y_lens)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.train.max_grad_norm)
    run.opt.step()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data", help="the prepared corpus (data.root)")
    p.add_argument("--variants", default="gru:none,lstm:seqwise", help="rnn:bn, comma-separated")
    p.add_argument("--steps", type=int, default=24, help="training batches, each taken every way")
    p.add_argument("--ways", default="aten,native",
                   help="of separate, aten, native; comma-separated, the first the base")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    kernel = cpu_front_end.extension()
    ways = {"separate": (separate, kernel), "aten": (FUSED, None), "native": (FUSED, kernel)}
    chosen = args.ways.split(",")
    if unknown := set(chosen) - set(ways):
        p.error(f"--ways: unknown {', '.join(sorted(unknown))}; the ways are {', '.join(ways)}")
    if "native" in chosen and kernel is None:
        p.error("--ways native: the front end's CPU kernel is not built here (python -m batchrnn.layers.build -v)")
    for variant in args.variants.split(","):
        rnn, bn = variant.split(":")
        run = compose_run(args.root, rnn, bn)
        run.model.train()
        times = {name: [] for name in chosen}
        for k, batch in enumerate(epoch_batches(run, EPOCH)[: args.steps]):
            indices = [run.train_indices[i] for i in batch]
            for name in chosen[k % len(chosen):] + chosen[: k % len(chosen)]:  # each way first in turn
                MaskedBatchNorm.hardtanh, extension = ways[name]
                cpu_front_end.extension = lambda extension=extension: extension
                model, opt = copy.deepcopy(run.model.state_dict()), copy.deepcopy(run.opt.state_dict())
                times[name].append(step(run, indices))
                run.model.load_state_dict(model)  # every way takes the same step from the same weights
                run.opt.load_state_dict(opt)
        MaskedBatchNorm.hardtanh = FUSED
        medians = {name: statistics.median(times[name][1:]) for name in chosen}  # the first: warm-up
        base = chosen[0]
        print(f"{rnn}-{bn}: {args.steps} steps each way, median step: "
              + ", ".join(f"{name} {1000 * m:.1f} ms" for name, m in medians.items()) + "; "
              + ", ".join(f"{base}/{name} {medians[base] / medians[name]:.3f}x" for name in chosen[1:]), flush=True)


if __name__ == "__main__":
    main()
