"""Which parts of one training step repeat bit for bit on this device (issue 9: CTC's backward on CUDA).

    python experiments/cuda_determinism.py [--device cuda] [--experiment an4_gpu]

From one seed and one state, each part runs twice and prints one JSON line: the largest absolute
difference between the two gradients (0.0: bitwise repeatable). The parts: CTC's loss and backward
alone, one recurrent layer of the experiment's size (fused kernel), and a whole DeepSpeech2 step (loss
and every parameter's gradient) in float32 and under bf16 autocast. Last, whether CTC's backward runs
under torch.use_deterministic_algorithms(True). Random inputs: no corpus needed. Seconds on a GPU.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from batchrnn.data.features import Featurizer  # noqa: E402
from batchrnn.model import DeepSpeech2, build_recurrent_layer  # noqa: E402
from batchrnn.data.text import LABELS  # noqa: E402


def twice(step) -> float:
    """Largest absolute difference between two runs of step() (a list of tensors) from the same seed."""
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        outs.append([t.detach().float() for t in step()])
    return max((a - b).abs().max().item() for a, b in zip(*outs))


def ctc_inputs(device, frames=150, batch=16, classes=len(LABELS), label=40):
    g = torch.Generator().manual_seed(1)
    log_probs = torch.randn(frames, batch, classes, generator=g).log_softmax(-1).to(device).requires_grad_()
    targets = torch.randint(1, classes, (batch, label), generator=g).to(device)
    return log_probs, targets, torch.full((batch,), frames, device=device), torch.full((batch,), label, device=device)


def ctc_step(device):
    log_probs, targets, in_lens, tgt_lens = ctc_inputs(device)
    loss = torch.nn.CTCLoss(zero_infinity=True)(log_probs, targets, in_lens, tgt_lens)
    return torch.autograd.grad(loss, log_probs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experiment", default="an4_gpu", help="the model size (default an4_gpu)")
    p.add_argument("--frames", type=int, default=300, help="input frames of the whole-model step")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    device = torch.device(args.device)
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_check import compose

    cfg = compose(args.experiment, str(ROOT / "data"))
    m = cfg.model
    lines = [{"part": "ctc loss + backward", "max_abs_diff": twice(lambda: ctc_step(device))}]

    layer = build_recurrent_layer(m.rnn, "none", m.hidden_size, m.hidden_size).to(device)
    x = torch.randn(args.frames // 2, args.batch, m.hidden_size, device=device, requires_grad=True)
    lengths = torch.full((args.batch,), args.frames // 2, device=device)
    lines.append({"part": f"{getattr(m.rnn, 'value', m.rnn)} layer {m.hidden_size} (fused) backward",
                  "max_abs_diff": twice(lambda: torch.autograd.grad(layer(x, lengths).square().sum(),
                                                                    [x, *layer.parameters()]))})

    torch.manual_seed(0)
    width = Featurizer(cfg.data).num_features
    model = DeepSpeech2(m, width, len(LABELS)).to(device)
    feats = torch.randn(args.batch, width, args.frames, device=device)
    x_lens = torch.full((args.batch,), args.frames, device=device)
    _, targets, _, tgt_lens = ctc_inputs(device, batch=args.batch, label=20)
    ctc = torch.nn.CTCLoss(zero_infinity=True)
    for amp in (False, True):
        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits, out_lens = model(feats, x_lens)
            loss = ctc(logits.float().log_softmax(-1), targets, out_lens, tgt_lens)
            return [loss, *torch.autograd.grad(loss, list(model.parameters()))]
        lines.append({"part": f"DeepSpeech2 {args.experiment} step, {'bf16 autocast' if amp else 'float32'}",
                      "max_abs_diff": twice(step)})

    torch.use_deterministic_algorithms(True)
    try:
        ctc_step(device)
        verdict = "runs"
    except RuntimeError as e:
        verdict = f"raises: {str(e).splitlines()[0][:160]}"
    lines.append({"part": "ctc backward under use_deterministic_algorithms(True)", "result": verdict})
    for line in lines:
        print(json.dumps({"device": str(device), **line}), flush=True)


if __name__ == "__main__":
    main()
