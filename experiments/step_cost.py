"""The cost of one training step of trained models, on the same AN4 batches, with subnormal floats kept and
flushed to zero.

Why it exists: in the AN4 grid on the CPU, GRU `none` epochs took about 26 s and GRU `seqwise` epochs about
18 s, while `bench_rnn.py` (random weights and inputs) puts seqwise at 1.12x none. One hypothesis is
subnormal arithmetic, which x86 CPUs run many times slower and which trained weights and small gradients
can produce: if so, flushing subnormals to zero (torch.set_flush_denormal) closes the gap. The models are
each run's best.pt; --fresh adds each at a fresh initialisation (the run's seed), as bench_rnn.py sees it.

    python experiments/step_cost.py runs/an4_cpu/gru-none-L3-lr0.002-s1-* runs/an4_cpu/gru-seqwise-L3-lr0.004-s1-* --fresh

--phases times instead the training loop's step as train_epoch runs it, phase by phase: SpecAugment, the
BN buffers' copy, forward + CTC, backward, gradient clipping and the AdamW step (each model with its own
optimizer, at a rate of 0 so that the weights stay as trained), to find which part of an epoch depends on
the variant. Left untimed, as the same for every variant: collating a batch, the rate's update, the
finiteness checks and logging.

Rounds interleave the models and both modes, so drift of the machine hits them alike; the figure is the
median over rounds of the mean step time over the batches. Run it with nothing else on the machine.
"""
import argparse
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from batchrnn.training.checkpoint import load_model, model_of
from batchrnn.config import Config
from batchrnn.data.features import collate, make_batches
from batchrnn.training.identity import LR, settings
from batchrnn.training.loop import Run, ctc_loss

PHASES = ("augment", "buffers", "forward", "backward", "clip", "optimizer")


def subnormal_share(model: torch.nn.Module) -> float:
    """The share of the gradients' nonzero elements that are subnormal."""
    tiny, subnormal, nonzero = torch.finfo(torch.float32).tiny, 0, 0
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.detach()
            subnormal += int(((g != 0) & (g.abs() < tiny)).sum())
            nonzero += int((g != 0).sum())
    return subnormal / max(nonzero, 1)


def step(model, ctc, batch, bf16: bool) -> None:
    model.zero_grad(set_to_none=True)
    loss, _, _ = ctc_loss(model, ctc, *batch, bf16=bf16)
    loss.backward()


def phased_step(model, opt, run: Run, batch, clock: dict) -> None:
    """train_epoch's step, each phase's seconds added to clock[phase]."""
    t = time.perf_counter
    start = t()
    x, x_lens, y, y_lens = batch
    if run.augment is not None:
        x = run.augment(x, x_lens, [f"utterance{k}" for k in range(len(x_lens))], 1)
    marks = [t()]
    [b.clone() for b in model.buffers()]
    marks.append(t())
    loss, _, _ = ctc_loss(model, run.ctc, x, x_lens, y, y_lens, run.bf16)
    opt.zero_grad(set_to_none=True)
    marks.append(t())
    loss.backward()
    marks.append(t())
    torch.nn.utils.clip_grad_norm_(model.parameters(), run.cfg.train.max_grad_norm).item()
    marks.append(t())
    opt.step()
    marks.append(t())
    for phase, (a, b) in zip(PHASES, zip([start] + marks, marks)):
        clock[phase] += b - a


def phases(models: dict, run: Run, batches: list, rounds: int) -> None:
    opts = {name: torch.optim.AdamW(m.parameters(), lr=0.0, weight_decay=run.cfg.train.weight_decay)
            for name, m in models.items()}
    clocks = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            phased_step(model, opts[name], run, batches[0], dict.fromkeys(PHASES, 0.0))  # warm-up
            clock = dict.fromkeys(PHASES, 0.0)
            for batch in batches:
                phased_step(model, opts[name], run, batch, clock)
            clocks[name].append(clock)
    print(f"cpu ({torch.get_num_threads()} threads), torch {torch.__version__}, {len(batches)} AN4 training "
          f"batches, the training step by phase (ms per step), median of {rounds} interleaved rounds")
    print(f"{'model':<40}" + "".join(f"{p:>10}" for p in PHASES) + f"{'total':>10}")
    for name, rounds_of in clocks.items():
        ms = {p: statistics.median(c[p] for c in rounds_of) * 1e3 / len(batches) for p in PHASES}
        total = statistics.median(sum(c.values()) for c in rounds_of) * 1e3 / len(batches)
        print(f"{name:<40}" + "".join(f"{ms[p]:10.1f}" for p in PHASES) + f"{total:10.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, each holding a best.pt")
    parser.add_argument("--batches", type=int, default=6, help="training batches per measurement (default 6)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--fresh", action="store_true", help="also each run's model at a fresh initialisation")
    parser.add_argument("--phases", action="store_true", help="time the training loop's step phase by phase "
                        "(subnormals kept) instead of forward + backward with and without flushing")
    args = parser.parse_args(argv)
    if not args.phases and not torch.set_flush_denormal(True):
        parser.error("this CPU cannot flush subnormals to zero (torch.set_flush_denormal), so there is nothing to compare")
    torch.set_flush_denormal(False)

    models, blobs = {}, {}
    for folder in args.runs:
        trained, blob = load_model(folder / "best.pt")
        name = folder.name.rsplit("-", 1)[0]
        models[name], blobs[name] = trained.train(), blob
        if args.fresh:  # the same model at its seed's initialisation, as bench_rnn.py sees it
            torch.manual_seed(blob["config"]["seed"])
            models[name + " (fresh)"] = model_of(blob).train()
    # One preset's data and training settings (the rate aside): the same batches fit every model, and the
    # step is each model's train_epoch step.
    same = {name: {k: v for k, v in settings(blob["config"]).items() if k.split(".")[0] in ("data", "train") and k != LR}
            for name, blob in blobs.items()}
    first = next(iter(same))
    for name, s in same.items():
        if differ := sorted(k for k in s.keys() | same[first].keys() if s.get(k) != same[first].get(k)):
            parser.error(f"{name} and {first} differ in {', '.join(differ)}: give runs of one preset, whose "
                         "batches and training step are the same (train.lr aside)")
    # the data and loss once, from the first run's config: every model steps on the same batches
    run = Run(OmegaConf.merge(OmegaConf.structured(Config), blobs[first]["config"]))
    fs, ctc = run.sets["train"], run.ctc
    order = make_batches([fs.lengths[i] for i in run.train_indices], run.cfg.train.batch_size, True, seed=1)
    batches = [collate(fs, [run.train_indices[i] for i in b]) for b in order[:args.batches]]
    if args.phases:
        phases(models, run, batches, args.rounds)
        return

    times = {(name, flush): [] for name in models for flush in (False, True)}
    share = {}
    for _ in range(args.rounds):
        for name, model in models.items():
            for flush in (False, True):
                torch.set_flush_denormal(flush)
                step(model, ctc, batches[0], run.bf16)  # warm-up
                start = time.perf_counter()
                for batch in batches:
                    step(model, ctc, batch, run.bf16)
                times[name, flush].append((time.perf_counter() - start) / len(batches))
                if not flush:
                    share[name] = subnormal_share(model)
    torch.set_flush_denormal(False)

    print(f"cpu ({torch.get_num_threads()} threads), torch {torch.__version__}, {len(batches)} AN4 training "
          f"batches, forward + CTC + backward, median of {args.rounds} interleaved rounds")
    print(f"{'model':<40} {'kept ms':>9} {'flushed ms':>11} {'kept/flushed':>13} {'subnormal grads':>16}")
    for name in models:
        kept, flushed = (statistics.median(times[name, f]) * 1e3 for f in (False, True))
        print(f"{name:<40} {kept:9.1f} {flushed:11.1f} {kept / flushed:13.2f} {share[name]:16.2%}")


if __name__ == "__main__":
    main()
