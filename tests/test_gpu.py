"""CUDA lane (pytest -m gpu on a GPU machine): cuDNN paths agree with the reference; a run trains."""
import pytest
import torch

from batchrnn.config import BNMode
from batchrnn.model import build_recurrent_layer
from batchrnn.training.loop import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
@pytest.mark.parametrize("bn", ["seqwise", "ln", "wn"])
def test_fused_matches_cells_on_cuda(rnn, bn):
    """cuDNN through nn.GRU/nn.LSTM (which flattens the weights it is handed in place), both directions."""
    torch.manual_seed(0)
    cells = build_recurrent_layer(rnn, bn, 16, 8, impl="cells").double().cuda()
    fused = build_recurrent_layer(rnn, bn, 16, 8, impl="fused").double().cuda()
    fused.load_state_dict(cells.state_dict())
    x = torch.randn(12, 4, 16, dtype=torch.float64, device="cuda", requires_grad=True)
    lengths = torch.tensor([12, 9, 5, 1], device="cuda")
    ys = [m(x, lengths) for m in (cells, fused)]
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-9, atol=1e-10)
    gs = [torch.autograd.grad(y.sum(), [x, *m.parameters()]) for y, m in zip(ys, (cells, fused))]
    for a, b in zip(*gs):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("bn", [b.value for b in BNMode])
def test_every_variant_runs_under_bf16_autocast_on_cuda(bn):
    torch.manual_seed(0)
    m = build_recurrent_layer("lstm", bn, 16, 8).cuda()
    x = torch.randn(12, 4, 16, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(x, torch.tensor([12, 9, 5, 1], device="cuda"))
    y.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("bn", ["none", "seqwise"])
def test_smoke_run_on_cuda_with_autocast(make_config, smoke_root, tmp_path, bn):
    cfg = make_config("experiment=smoke", f"data.root={smoke_root}", "train.device=cuda", f"model.bn={bn}")
    results = train(cfg, tmp_path)
    assert results["device"] == "cuda" and results["peak_mem_mb"] > 0
    assert all(torch.isfinite(torch.tensor(e["train_loss"])) for e in results["epochs"])
