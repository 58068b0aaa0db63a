"""The conv front end's BatchNorm + Hardtanh as one autograd function (MaskedBNHardtanh) against the same operations
one by one, in the whole training step, interleaved step by step in one process (issue 50).

Sequential runs on this VM cannot resolve a few percent: its speed drifts by more within minutes (step_cost.md).
So each real AN4 batch of the training order (epoch 2's, an4_cpu_plateau) is taken twice, once each way, in
alternating order, from the same weights (restored after each), and the step is what train_epoch times: collate,
SpecAugment, forward, CTC, backward, clipping and AdamW. Prints each way's median step and their ratio.

    python experiments/front_end_ab.py --root /work/main/data          # gru-none and lstm-seqwise, 24 batches
"""
import argparse
import copy
import statistics
import time

import torch
from torch import nn

from batchrnn.data.features import collate
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
    p.add_argument("--steps", type=int, default=24, help="training batches, each taken both ways")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for variant in args.variants.split(","):
        rnn, bn = variant.split(":")
        run = compose_run(args.root, rnn, bn)
        run.model.train()
        times = {"separate": [], "fused": []}
        ways = {"separate": separate, "fused": FUSED}
        for k, batch in enumerate(epoch_batches(run, EPOCH)[: args.steps]):
            indices = [run.train_indices[i] for i in batch]
            for name in (("fused", "separate") if k % 2 == 0 else ("separate", "fused")):
                MaskedBatchNorm.hardtanh = ways[name]
                model, opt = copy.deepcopy(run.model.state_dict()), copy.deepcopy(run.opt.state_dict())
                times[name].append(step(run, indices))
                run.model.load_state_dict(model)  # both ways take the same step from the same weights
                run.opt.load_state_dict(opt)
        MaskedBatchNorm.hardtanh = FUSED
        s, f = (statistics.median(times[w][1:]) for w in ("separate", "fused"))  # the first: warm-up
        print(f"{rnn}-{bn}: {args.steps} steps each way, median step: separate {1000 * s:.1f} ms, fused "
              f"{1000 * f:.1f} ms, separate/fused {s / f:.3f}x", flush=True)


if __name__ == "__main__":
    main()
