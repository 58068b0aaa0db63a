"""Where the real training step spends its time: the recurrent kernels, the convolutions, and everything else.

The an4_cpu_plateau model at its seed's initialisation, on real AN4 batches in the order training takes them
(epoch 2's, the first shuffled one), each step as train_epoch runs it (batchrnn.training.loop.gradient's parts,
then the AdamW step). torch's profiler splits forward + CTC + backward into:

- recurrent: the fused kernels (oneDNN's lbr_gru through batchrnn.layers.cpu_gru; torch's oneDNN LSTM), with all
  they run inside;
- convolutions: the front end's Conv2d, forward and backward;
- everything else: elementwise work, masks, copies, reversal, BN statistics (the folds' matrix products among
  them, shown apart as "matmul"), the head, CTC, and Python between the operators.

It prints those shares, the optimizer step (gradient clipping and AdamW) as a share of the whole step, and the
operators that take "everything else", with their calls per step. Shares and calls per step hold under load;
milliseconds do not.

    python experiments/step_profile.py [--root /work/main/data] [--threads 1,2] [--steps 4]
"""
import argparse
import collections
import time

import torch
from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile, record_function

from batchrnn.config import register_configs
from batchrnn.data.features import collate
from batchrnn.data.prepare import CONF_DIR
from batchrnn.training.loop import Run, epoch_batches

RECURRENT = {"LbrGRU", "LbrGRUBackward", "aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward"}
CONVOLUTION = {"aten::convolution", "aten::convolution_backward"}
MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::addmv", "aten::addmv_", "aten::mv", "aten::addbmm"}
PHASES = ("batch", "forward", "backward", "optimizer")  # forward: model and CTC; optimizer: clipping and AdamW
EPOCH = 2  # the first shuffled epoch (SortaGrad takes epoch 1 in length order)


def compose_run(root: str, rnn: str, bn: str) -> Run:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=an4_cpu_plateau", f"data.root={root}",
                                                       f"model.rnn={rnn}", f"model.bn={bn}", "train.threads=1"])
    return Run(cfg)


def training_step(run: Run, indices: list[int]) -> None:
    """loop.gradient's step on one process, then AdamW's, each phase under a profiler label."""
    fs = run.sets["train"]
    with record_function("## batch"):
        x, x_lens, y, y_lens = collate(fs, indices)
        x = run.augment(x, x_lens, [fs.ids[i] for i in indices], EPOCH)
    with record_function("## forward"):
        loss, _, _ = run.loss(x, x_lens, y, y_lens)
    run.opt.zero_grad(set_to_none=True)
    with record_function("## backward"):
        loss.backward()
    with record_function("## optimizer"):
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.train.max_grad_norm)
        run.opt.step()


def category(event) -> tuple[str, str | None]:
    """(recurrent | convolution | other, the step's phase) of a profiler event, from its enclosing events."""
    kind, phase, e = "other", None, event
    while e is not None:
        if e.name in RECURRENT:
            kind = "recurrent"
        elif e.name in CONVOLUTION and kind == "other":
            kind = "convolution"
        elif e.name.startswith("## "):
            phase = e.name[3:]
        e = e.cpu_parent
    return kind, phase


def measure(run: Run, batches: list[list[int]], steps: int) -> dict:
    """Milliseconds per step by phase and kind, and the self time and calls of every other operator."""
    indices = [[run.train_indices[i] for i in b] for b in batches[:steps + 1]]
    training_step(run, indices[0])  # warm-up: workspaces, oneDNN primitives
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in indices[1:]:
            training_step(run, b)
    events = prof.events()
    phase_ms, kind_ms = collections.Counter(), collections.Counter()
    other_ms, other_calls = collections.Counter(), collections.Counter()
    for e in events:
        kind, phase = category(e)
        if e.name.startswith("## ") and e.cpu_parent is None:
            phase_ms[e.name[3:]] += e.cpu_time_total / 1e3 / steps
        if phase not in ("forward", "backward"):
            continue
        kind_ms[kind] += e.self_cpu_time_total / 1e3 / steps
        if kind == "other":
            name = "(Python between operators)" if e.name.startswith("## ") else e.name
            other_ms[name] += e.self_cpu_time_total / 1e3 / steps
            other_calls[name] += 1 / steps
    return {"phase": phase_ms, "kind": kind_ms, "other": other_ms, "calls": other_calls}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="data", help="data.root: the prepared AN4 corpus and features (default: data)")
    p.add_argument("--variants", default="gru:none,gru:seqwise,lstm:none,lstm:seqwise", help="rnn:bn, comma-separated")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    p.add_argument("--steps", type=int, default=4, help="profiled steps per variant and thread count (default 4)")
    p.add_argument("--top", type=int, default=8, help="operators of everything else shown (default 8)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for variant in args.variants.split(","):
        rnn, bn = variant.split(":")
        run = compose_run(args.root, rnn, bn)
        batches = epoch_batches(run, EPOCH)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            rows.append((f"{rnn}-{bn}", threads, measure(run, batches, args.steps)))

    print(f"an4_cpu_plateau, torch {torch.__version__}, epoch {EPOCH}'s first {args.steps} batches after one "
          "warm-up; shares of forward + CTC + backward, optimizer of the whole step")
    print(f"{'variant':<14}{'threads':>8}{'fwd+bwd ms':>12}{'recurrent':>11}{'conv':>8}{'else':>8}"
          f"{'(matmul)':>10}{'optimizer':>11}")
    for name, threads, m in rows:
        work = m["phase"]["forward"] + m["phase"]["backward"]
        kind = m["kind"]
        total = sum(kind.values())  # the same as work but for the profiler's own time between steps
        matmul = sum(v for k, v in m["other"].items() if k in MATMUL)
        print(f"{name:<14}{threads:>8}{work:12.1f}{kind['recurrent'] / total:11.0%}{kind['convolution'] / total:8.0%}"
              f"{kind['other'] / total:8.0%}{matmul / total:10.0%}{m['phase']['optimizer'] / sum(m['phase'].values()):11.1%}")
    for name, threads, m in rows:
        total = sum(m["kind"].values())
        top = ", ".join(f"{op.removeprefix('aten::')} {ms / total:.1%} ({m['calls'][op]:.0f})"
                        for op, ms in m["other"].most_common(args.top))
        print(f"{name} {threads}t, everything else (share of fwd+bwd, calls per step): {top}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
