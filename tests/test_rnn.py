"""Every recurrent variant: shapes, gradients, padding invariance, and seqwise's exactness."""
import pytest
import torch
from torch import nn

from batchrnn.config import BNMode, Impl, RNNType
from batchrnn.model import build_recurrent_layer
from batchrnn.rnn import GATES, LAYERS, Gram, MaskedBatchNorm, cheaper_route, projected_moments

T, N, D, H = 9, 3, 5, 4
LENGTHS = torch.tensor([9, 5, 2])
VARIANTS = [(r.value, b.value) for r in RNNType for b in BNMode]


def layer(rnn, bn, seed=0, **kw):
    torch.manual_seed(seed)
    return build_recurrent_layer(rnn, bn, D, H, **kw).double()


def test_every_bn_mode_has_a_layer_class():
    assert set(LAYERS) == set(BNMode)


@pytest.mark.parametrize("rnn,bn", VARIANTS)
def test_shape_and_backward(rnn, bn):
    m = layer(rnn, bn)
    x = torch.randn(T, N, D, dtype=torch.float64, requires_grad=True)
    y = m(x, LENGTHS)
    assert y.shape == (T, N, H)
    assert torch.all(y[5:, 1] == 0) and torch.all(y[2:, 2] == 0), "padded frames must be zero"
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert x.grad[5:, 1].abs().sum() == 0, "padding must receive no gradient"


@pytest.mark.parametrize("rnn,bn", VARIANTS)
@pytest.mark.parametrize("training", [True, False])
def test_padding_never_changes_valid_frames(rnn, bn, training):
    m = layer(rnn, bn).train(training)
    x = torch.randn(T, N, D, dtype=torch.float64)
    garbage = x.clone()
    garbage[5:, 1] = 1e4
    garbage[2:, 2] = float("nan")
    y, y_garbage = m(x, LENGTHS), m(garbage, LENGTHS)
    torch.testing.assert_close(y, y_garbage, rtol=0, atol=1e-12)
    if not training:  # eval: each sequence alone, unpadded, gives the same frames
        for n, length in enumerate(LENGTHS.tolist()):
            alone = m(x[:length, n : n + 1], LENGTHS[n : n + 1])
            torch.testing.assert_close(y[:length, n : n + 1], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rnn", [r.value for r in RNNType])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_seqwise_fused_matches_cell_reference(rnn, share, training):
    cells = layer(rnn, "seqwise", impl="cells", share_input_weights=share)
    fused = layer(rnn, "seqwise", seed=1, impl="fused", share_input_weights=share)
    fused.load_state_dict(cells.state_dict())  # same names: a state dict moves between them
    for m in (cells, fused):
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
        m.train(training)
    fused.load_state_dict(cells.state_dict())
    x = torch.randn(T, N, D, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for m in (cells, fused):
        y = m(x, LENGTHS)
        outs.append(y)
        grads.append(torch.autograd.grad((y * torch.linspace(-1, 1, H, dtype=y.dtype)).sum(), [x, *m.parameters()]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)
    names = ["x"] + [n for n, _ in cells.named_parameters()]
    for name, a, b in zip(names, *grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")
    torch.testing.assert_close(cells.bn.running_var, fused.bn.running_var, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(cells.bn.running_mean, fused.bn.running_mean, rtol=1e-12, atol=1e-14)


def ds2_gru_by_hand(m, x, lengths):
    """DS2's recurrence written out per sequence: z = BN(W x) over all valid frames of the batch,
    then h_t = GRU(z_t, h_{t-1}) forwards and, separately, backwards from each sequence's last frame."""
    W, gamma, beta, eps = m.weight_ih, m.bn.weight, m.bn.bias, m.bn.eps
    valid = [x[: int(n), i] for i, n in enumerate(lengths)]
    frames = torch.cat(valid)  # (sum of lengths, D)
    z_all = torch.cat([frames @ W[d].T for d in range(2)], dim=1)  # (frames, 2 * 3H)
    mu, var = z_all.mean(0), z_all.var(0, unbiased=False)
    out = torch.zeros(x.shape[0], x.shape[1], H, dtype=x.dtype)
    for i, seq in enumerate(valid):
        z = (torch.cat([seq @ W[d].T for d in range(2)], 1) - mu) / torch.sqrt(var + eps) * gamma + beta
        for d, steps in enumerate([range(len(seq)), reversed(range(len(seq)))]):
            U, b = m.weight_hh[d], m.bias_hh[d]
            h = torch.zeros(H, dtype=x.dtype)
            for t in steps:
                zr, zu, zn = z[t, d * 3 * H : (d + 1) * 3 * H].split(H)
                hr, hu, hn = (U @ h + b).split(H)
                r, u = torch.sigmoid(zr + hr), torch.sigmoid(zu + hu)
                h = (1 - u) * torch.tanh(zn + r * hn) + u * h
                out[t, i] += h
    return out


@pytest.mark.parametrize("impl", ["fused", "cells"])
def test_seqwise_matches_hand_written_ds2_recurrence(impl):
    m = layer("gru", "seqwise", impl=impl)
    with torch.no_grad():
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(T, N, D, dtype=torch.float64)
    torch.testing.assert_close(m(x, LENGTHS), ds2_gru_by_hand(m, x, LENGTHS), rtol=1e-10, atol=1e-12)


def test_skip_feeds_one_projection_to_every_gate():
    m = layer("gru", "skip")
    assert m.weight_ih.shape == (2, H, D), "skip-input projects to H, not gates x H"
    assert set(dict(m.named_parameters())) == {"weight_ih", "weight_hh", "bias_hh", "bn.weight", "bn.bias"}


def test_share_input_weights_holds_one_projection():
    shared = layer("lstm", "seqwise", share_input_weights=True)
    assert shared.weight_ih.shape == (1, 4 * H, D)
    assert shared.bn.weight.shape == (4 * H,)


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="seqwise only"):
        build_recurrent_layer("gru", "post", D, H, impl="cells")
    with pytest.raises(ValueError, match="share_input_weights"):
        build_recurrent_layer("gru", "none", D, H, share_input_weights=True)
    with pytest.raises(ValueError, match="'bogus' is not a valid BNMode"):
        build_recurrent_layer("gru", "bogus", D, H)


def test_unidirectional_layer():
    m = build_recurrent_layer("gru", "seqwise", D, H, bidirectional=False)
    assert m(torch.randn(T, N, D), LENGTHS).shape == (T, N, H)
    assert Impl(m.impl) is Impl.fused


def test_gram_backward_is_autograds():
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(Gram.apply, (x,))


def test_both_moment_routes_agree_in_value_and_gradient():
    x = torch.randn(40, 6, dtype=torch.float64)
    x[35:] = 0  # padding rows are zero, as the layer hands them over
    w = torch.randn(2, 12, 6, dtype=torch.float64)
    results = []
    for route in ("gram", "direct"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        mean, second = projected_moments(xr, wr, 35, route)
        grads = torch.autograd.grad((mean.sin() + second.cos()).sum(), [xr, wr])
        results.append((mean, second, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    z = x[:35] @ w.transpose(1, 2)  # (copies, frames, width)
    torch.testing.assert_close(results[0][1], z.square().mean(1), rtol=1e-12, atol=1e-12)


def test_route_follows_cost():
    assert cheaper_route(frames=3200, d=256, copies=2, width=768) == "gram"  # long batches
    assert cheaper_route(frames=200, d=512, copies=2, width=1024) == "direct"  # short batch, wide input


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_seqwise_fused_matches_cells_on_the_direct_route(rnn):
    torch.manual_seed(0)
    lengths = torch.tensor([30, 22, 9, 30])
    cells = build_recurrent_layer(rnn, "seqwise", 48, 2, impl="cells").double()
    fused = build_recurrent_layer(rnn, "seqwise", 48, 2).double()
    fused.load_state_dict(cells.state_dict())
    assert cheaper_route(30 * 4, 48, 2, GATES[RNNType(rnn)] * 2) == "direct"
    x = torch.randn(30, 4, 48, dtype=torch.float64, requires_grad=True)
    ys = [m(x, lengths) for m in (cells, fused)]
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-10, atol=1e-12)
    for a, b in zip(*(torch.autograd.grad(y.sum(), [x, *m.parameters()]) for y, m in zip(ys, (cells, fused)))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# -- MaskedBatchNorm: BatchNorm1d's state and rule, its own type ------------------

@pytest.mark.parametrize("momentum", [0.1, None])  # None: the cumulative average
def test_masked_batchnorm_is_batchnorm1d_on_unpadded_input(momentum):
    torch.manual_seed(0)
    ours, torchs = MaskedBatchNorm(D, momentum=momentum).double(), nn.BatchNorm1d(D, momentum=momentum).double()
    with torch.no_grad():
        ours.weight.uniform_(0.5, 2)
        ours.bias.uniform_(-1, 1)
    torchs.load_state_dict(ours.state_dict())  # same names, both ways
    assert list(ours.state_dict()) == list(torchs.state_dict())
    every_frame = torch.ones(T, N, 1, dtype=torch.float64)
    for training in (True, True, True, False):
        ours.train(training), torchs.train(training)
        x = torch.randn(T, N, D, dtype=torch.float64) * 3 + 1  # (T, N, D); BatchNorm1d takes (N, D, T)
        torch.testing.assert_close(ours(x, every_frame), torchs(x.permute(1, 2, 0)).permute(2, 0, 1))
    for name, value in torchs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, msg=name)
    assert ours.num_batches_tracked == 3


def test_sync_batchnorm_conversion_leaves_masked_batchnorm_alone():
    m = nn.SyncBatchNorm.convert_sync_batchnorm(layer("gru", "post"))  # it would drop the mask
    assert type(m.bn) is MaskedBatchNorm
