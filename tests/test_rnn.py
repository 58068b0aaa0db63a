"""Every recurrent variant: shapes, gradients, padding invariance, stable names, and each fold's exactness."""
import inspect
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import batchrnn.layers.base
import batchrnn.layers.batchnorm
import batchrnn.layers.layernorm
from batchrnn.config import BNMode, Impl, RNNType
from batchrnn.model import build_recurrent_layer
from batchrnn.layers import LAYERS
from batchrnn.layers.base import GATES, Reversal, affine, cell_loop, fused_recurrence, reversal_rows, valid_mask
from batchrnn.layers.folds import Gram, MaskedBatchNorm, QuadraticForm, cheaper_route, projected_moments
from conftest import BN_MODES, STEP_LOOPS

T, N, D, H = 9, 3, 5, 4
LENGTHS = torch.tensor([9, 5, 2])
WN_RECURRENT = {"weight_norm_recurrent": True}
VARIANTS = [pytest.param(r.value, b.value, {}, id=f"{r.value}-{b.value}") for r in RNNType for b in BNMode] + [
    pytest.param(r.value, "wn", WN_RECURRENT, id=f"{r.value}-wn-recurrent") for r in RNNType]
# The variants with a step-by-step reference (impl=cells) beside their fused route.
REFERENCED = [pytest.param(b, {}, id=b) for b in ("seqwise", "ln", "wn")] + [
    pytest.param("wn", WN_RECURRENT, id="wn-recurrent")]


def layer(rnn, bn, seed=0, **kw):
    torch.manual_seed(seed)
    return build_recurrent_layer(rnn, bn, D, H, **kw).double()


def test_every_bn_mode_has_a_layer_class():
    assert set(LAYERS) == set(BNMode)
    assert all(Impl.fused in c.impls for c in LAYERS.values()), "model.impl's default must build every variant"
    # written out (conftest.BN_MODES), so that the tests parametrised by them cannot shrink with the code they test
    assert [b.value for b in BNMode] == BN_MODES
    assert [b.value for b, c in LAYERS.items() if not c.fused] == STEP_LOOPS
    assert [r.value for r in RNNType] == ["gru", "lstm", "rnn"]
    assert [b.value for b, c in LAYERS.items() if Impl.cells in c.impls] == ["seqwise", "ln", "wn"]
    assert [b.value for b, c in LAYERS.items() if "share_input_weights" in c.switches] == [
        "skip", "seqwise", "ln", "ln_full", "rbn", "wn"]


@pytest.mark.parametrize("rnn,bn,kw", VARIANTS)
def test_shape_and_backward(rnn, bn, kw):
    m = layer(rnn, bn, **kw)
    x = torch.randn(T, N, D, dtype=torch.float64, requires_grad=True)
    y = m(x, LENGTHS)
    assert y.shape == (T, N, H)
    assert torch.all(y[5:, 1] == 0) and torch.all(y[2:, 2] == 0), "padded frames must be zero"
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert x.grad[5:, 1].abs().sum() == 0, "padding must receive no gradient"


@pytest.mark.parametrize("rnn,bn,kw", VARIANTS)
@pytest.mark.parametrize("training", [True, False])
def test_padding_never_changes_valid_frames(rnn, bn, kw, training):
    m = layer(rnn, bn, **kw).train(training)
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


@pytest.mark.parametrize("rnn,bn,kw", VARIANTS)
def test_every_variant_under_bf16_autocast_is_float32_within_bf16s_rounding(rnn, bn, kw):
    """Outputs and gradients (all of them as one vector: a gradient that is 0 in exact arithmetic, such as a bias
    before BN, has no relative error of its own) within 10 and 20 of bf16's unit roundoffs (2^-8) of float32's; the
    worst variants (ln_full, rbn) measured 2e-2 and 3.6e-2. Where the CPU's fused GRU runs a whole layer in float32
    under autocast (none, post, input, wn: batchrnn.layers.cpu_gru), the two are equal and the check holds trivially."""
    torch.manual_seed(0)
    m = build_recurrent_layer(rnn, bn, D, H, **kw)
    x = torch.randn(T, N, D, requires_grad=True)

    def run(bf16):
        x.grad = None
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = m(x, LENGTHS)
        y.float().square().sum().backward()
        return y.float(), torch.cat([x.grad.flatten()] + [p.grad.flatten() for p in m.parameters()])

    (y, g), (y32, g32) = run(True), run(False)
    assert torch.isfinite(y).all() and torch.isfinite(g).all()
    unit = torch.finfo(torch.bfloat16).eps / 2  # bf16's unit roundoff, 2^-8: the bound derives from it, not a CPU
    assert (y - y32).norm() / y32.norm() < 10 * unit
    assert (g - g32).norm() / g32.norm() < 20 * unit


BF16_ON_AVX2 = """
import torch
from batchrnn.model import build_recurrent_layer
from batchrnn.layers.base import onednn_has_bf16
assert not onednn_has_bf16(), "ONEDNN_MAX_CPU_ISA=AVX2 should leave oneDNN without bf16"
m = build_recurrent_layer("lstm", "seqwise", 5, 4)
x = torch.randn(9, 3, 5, requires_grad=True)
with torch.autocast("cpu", dtype=torch.bfloat16):
    y = m(x, torch.tensor([9, 5, 2]))
y.float().square().sum().backward()
assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
"""


def test_bf16_autocast_runs_where_onednn_has_no_bf16_kernel():
    """CI's CPU (AVX2) has no oneDNN bf16 LSTM: autocast handed it bf16 and it failed, `could not create a
    primitive descriptor`. oneDNN capped at AVX2 shows that CPU here, in a fresh process."""
    env = os.environ | {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    run = subprocess.run([sys.executable, "-c", BF16_ON_AVX2], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def perturbed(m: nn.Module) -> nn.Module:
    """Every parameter moved off its initial value (gains off 1, shifts off 0), running statistics random."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.rand_like(p) - 0.5)
        if hasattr(m, "bn"):
            m.bn.running_mean.uniform_(-1, 1)
            m.bn.running_var.uniform_(0.5, 2)
    return m


@pytest.mark.parametrize("bn,kw", REFERENCED)
@pytest.mark.parametrize("rnn", [r.value for r in RNNType])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("route", ["gram", "direct"])
def test_fused_matches_cell_reference(monkeypatch, bn, kw, rnn, share, training, route):
    """The fold (BN, LN or weight norm) through the fused kernel against the variant computed as written,
    step by step: outputs, every gradient and the running statistics, float64, ragged lengths, both
    directions, on both routes to the statistics."""
    for module in (batchrnn.layers.batchnorm, batchrnn.layers.layernorm):  # where the folds call it
        monkeypatch.setattr(module, "cheaper_route", lambda *args, **kwargs: route)
    cells = perturbed(layer(rnn, bn, impl="cells", share_input_weights=share, **kw)).train(training)
    fused = layer(rnn, bn, seed=1, impl="fused", share_input_weights=share, **kw).train(training)
    fused.load_state_dict(cells.state_dict())  # same names: a state dict moves between them
    x = torch.randn(T, N, D, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for m in (cells, fused):
        y = m(x, LENGTHS)
        outs.append(y)
        grads.append(torch.autograd.grad((y * torch.linspace(-1, 1, H, dtype=y.dtype)).sum(), [x, *m.parameters()]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)
    names = ["x"] + [n for n, _ in cells.named_parameters()]
    assert names[1:] == [n for n, _ in fused.named_parameters()]
    for name, a, b in zip(names, *grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")
    for name, value in cells.named_buffers():
        torch.testing.assert_close(value, fused.get_buffer(name), rtol=1e-12, atol=1e-14, msg=name)


def gru_step_by_hand(a, b, h):
    """One GRU step from the input's pre-activations a and the recurrent ones b, gates r, u, n as torch's."""
    (a_r, a_u, a_n), (b_r, b_u, b_n) = a.split(H), b.split(H)
    r, u = torch.sigmoid(a_r + b_r), torch.sigmoid(a_u + b_u)
    return (1 - u) * torch.tanh(a_n + r * b_n) + u * h


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
                h = gru_step_by_hand(z[t, d * 3 * H : (d + 1) * 3 * H], U @ h + b, h)
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


def layer_norm_by_hand(a, gain, bias, eps=1e-5):
    mean = a.mean(-1, keepdim=True)
    return (a - mean) / torch.sqrt((a - mean).square().mean(-1, keepdim=True) + eps) * gain + bias


def ba_et_al_by_hand(m, x, lengths):
    """Ba et al.'s LayerNorm LSTM and GRU written out per sequence and per step: LN(W x_t) + LN(U h_{t-1})
    into the gates, LN of the LSTM's cell before tanh; forwards and, separately, backwards from each
    sequence's last frame."""
    out = torch.zeros(x.shape[0], x.shape[1], H, dtype=x.dtype)
    for i, n in enumerate(lengths.tolist()):
        for d, steps in enumerate([range(n), reversed(range(n))]):
            h, c = torch.zeros(H, dtype=x.dtype), torch.zeros(H, dtype=x.dtype)
            for t in steps:
                a = layer_norm_by_hand(m.weight_ih[d] @ x[t, i], m.gain_ih[d], m.bias_ih[d])
                b = layer_norm_by_hand(m.weight_hh[d] @ h, m.gain_hh[d], m.bias_hh[d])
                if m.rnn is RNNType.lstm:
                    i_, f, g, o = (a + b).split(H)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i_) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(layer_norm_by_hand(c, m.gain_cell[d], m.bias_cell[d]))
                else:
                    h = gru_step_by_hand(a, b, h)
                out[t, i] += h
    return out


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_ln_full_matches_hand_written_layer_norm_rnn(rnn):
    m = perturbed(layer(rnn, "ln_full"))
    x = torch.randn(T, N, D, dtype=torch.float64)
    torch.testing.assert_close(m(x, LENGTHS), ba_et_al_by_hand(m, x, LENGTHS), rtol=1e-10, atol=1e-12)


def cooijmans_by_hand(m, x, lengths, training):
    """Cooijmans et al.'s recurrent BN written out step by step: at step t, BN of W x_t, of U h_{t-1} and of
    the LSTM's cell, each over the sequences still running at t (batch moments, biased variance); the
    backward direction's step t is its t-th, from each sequence's last frame. In training, a step with
    fewer than two sequences running takes the moments of the last step with two. In eval, the population
    moments held before the call, of step t or, past the trained steps, of the last trained one. Returns
    the outputs and the batch moments it used."""
    lengths = lengths.tolist()
    n_seq, moments = len(lengths), {}
    pop = {name: (getattr(m, f"running_mean_{name}").clone(), getattr(m, f"running_var_{name}").clone())
           for name in ("ih", "hh", "cell") if hasattr(m, f"running_mean_{name}")}
    tmax = m.trained_steps.tolist()
    out = torch.zeros(x.shape[0], n_seq, H, dtype=x.dtype)

    last = {}

    def bn(name, d, t, v, rows, gain, bias, eps=1e-5):
        if training and len(rows) >= 2:
            mean, var = v[rows].mean(0), v[rows].var(0, unbiased=False)
            moments[name, d, t] = (mean.detach(), var.detach(), len(rows))
            last[name, d] = mean, var
        elif training and (name, d) in last:
            mean, var = last[name, d]
        else:
            slot = min(t, max(tmax[d] - 1, 0))
            mean, var = pop[name][0][d, slot], pop[name][1][d, slot]
        return (v - mean) / torch.sqrt(var + eps) * gain + bias

    for d in range(2):
        seqs = [x[:n_t, i] if d == 0 else x[:n_t, i].flip(0) for i, n_t in enumerate(lengths)]
        h, c = torch.zeros(n_seq, H, dtype=x.dtype), torch.zeros(n_seq, H, dtype=x.dtype)
        for t in range(max(lengths)):
            rows = [i for i, n_t in enumerate(lengths) if n_t > t]
            x_t = torch.stack([seqs[i][t] if i in rows else torch.zeros(x.shape[2], dtype=x.dtype)
                               for i in range(n_seq)])
            a = bn("ih", d, t, x_t @ m.weight_ih[d].t(), rows, m.gain_ih[d], m.bias_ih[d])
            b = bn("hh", d, t, h @ m.weight_hh[d].t(), rows, m.gain_hh[d], m.bias_hh[d])
            if m.rnn is RNNType.lstm:
                i_, f, g, o = (a + b).chunk(4, 1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i_) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(bn("cell", d, t, c, rows, m.gain_cell[d], m.bias_cell[d]))
            else:
                h = torch.stack([gru_step_by_hand(a[i], b[i], h[i]) for i in range(n_seq)])
            for i in rows:
                out[t if d == 0 else lengths[i] - 1 - t, i] = out[t if d == 0 else lengths[i] - 1 - t, i] + h[i]
    return out, moments


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
@pytest.mark.parametrize("lengths", [[2, 9, 5], [5, 9, 5, 1]], ids=["unsorted", "ties"])
def test_rbn_matches_hand_written_recurrent_batch_norm(rnn, lengths):
    lengths = torch.tensor(lengths)
    m = perturbed(layer(rnn, "rbn"))
    with torch.no_grad():  # every step's population moments its own; 3 steps trained so far (T_max 3)
        for name, buf in m.named_buffers():
            if name.startswith("running_"):
                buf.uniform_(0.5, 2) if "var" in name else buf.uniform_(-1, 1)
        m.trained_steps.fill_(3)
    before = {name: buf.clone() for name, buf in m.named_buffers()}
    x = torch.randn(T, len(lengths), D, dtype=torch.float64, requires_grad=True)
    want, moments = cooijmans_by_hand(m, x, lengths, training=True)
    got = m(x, lengths)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    weight = torch.linspace(-1, 1, H, dtype=x.dtype)
    for a, b in zip(*(torch.autograd.grad((y * weight).sum(), [x, *m.parameters()]) for y in (got, want))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    # each step with two sequences or more moves its population moments 0.1 of the way to the batch's
    assert moments
    for name, buf in m.named_buffers():
        if not name.startswith("running_"):
            continue
        norm, stat = name.split("_")[2], name.split("_")[1]
        for d in range(2):
            for t in range(m.MAX_STEPS if t_max_check(name) else T):
                if (norm, d, t) in moments:
                    mean, var, rows = moments[norm, d, t]
                    target = mean if stat == "mean" else var * rows / (rows - 1)
                    torch.testing.assert_close(buf[d, t], before[name][d, t].lerp(target, 0.1))
                else:  # one sequence or none at t, or a step no batch reached: left as it was
                    assert torch.equal(buf[d, t], before[name][d, t]), (name, d, t)
    assert m.trained_steps.tolist() == [5, 5], "T_max: the steps with two sequences running"
    # eval: the population moments of each step; past T_max, those of its last step
    m.eval()
    torch.testing.assert_close(m(x, lengths), cooijmans_by_hand(m, x, lengths, training=False)[0],
                               rtol=1e-10, atol=1e-12)


def t_max_check(name: str) -> bool:
    """Every step of the statistics (all MAX_STEPS of them), checked once: the one buffer of each kind."""
    return name == "running_mean_ih"


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_public_kernel_matches_the_cell_loop(rnn):
    """torch's fused GRU/LSTM through torch.func.functional_call, against the recurrence written out."""
    assert "_VF" not in inspect.getsource(batchrnn.layers.base), "torch._VF is private"
    torch.manual_seed(0)
    k = GATES[RNNType(rnn)] * H
    x = torch.randn(T, N, D, dtype=torch.float64, requires_grad=True)
    weights = [(torch.randn(*shape, dtype=torch.float64) / 2).requires_grad_()
               for shape in ((k, D), (k,), (k, H), (k,))]
    w_ih, b_ih, w_hh, b_hh = weights
    ys = [fused_recurrence(RNNType(rnn), x, *weights, training=True),
          cell_loop(RNNType(rnn), x @ w_ih.t() + b_ih, affine(w_hh, b_hh))]
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-10, atol=1e-12)
    grads = [torch.autograd.grad((y * torch.linspace(-1, 1, H, dtype=y.dtype)).sum(), [x, *weights]) for y in ys]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def shapes(rnn, bn, **kw) -> dict:
    return {name: tuple(t.shape) for name, t in build_recurrent_layer(rnn, bn, D, H, **kw).state_dict().items()}


def test_parameter_names_and_shapes_are_stable():
    """A state dict of an earlier run loads: the same names and shapes, variant by variant (gru: 3 gates)."""
    k = 3 * H
    recurrent = {"weight_hh": (2, k, H), "bias_hh": (2, k)}
    plain = recurrent | {"weight_ih": (2, k, D), "bias_ih": (2, k)}

    def bn(width):
        return {"bn.weight": (width,), "bn.bias": (width,), "bn.running_mean": (width,), "bn.running_var": (width,),
                "bn.num_batches_tracked": ()}

    ln = recurrent | {"weight_ih": (2, k, D), "gain_ih": (2, k), "bias_ih": (2, k)}
    wn = {"weight_ih_v": (2, k, D), "weight_ih_g": (2, k), "bias_ih": (2, k)}
    assert shapes("gru", "none") == plain
    assert shapes("gru", "post") == plain | bn(H)
    assert shapes("gru", "input") == plain | bn(D)
    assert shapes("gru", "skip") == recurrent | {"weight_ih": (2, H, D)} | bn(2 * H), "skip projects to H"
    assert shapes("gru", "seqwise") == recurrent | {"weight_ih": (2, k, D)} | bn(2 * k)
    assert shapes("gru", "ln") == ln
    assert shapes("gru", "ln_full") == ln | {"gain_hh": (2, k)}
    k4 = 4 * H
    assert shapes("lstm", "ln_full") == {"weight_hh": (2, k4, H), "bias_hh": (2, k4), "weight_ih": (2, k4, D),
                                         "gain_ih": (2, k4), "bias_ih": (2, k4), "gain_hh": (2, k4),
                                         "gain_cell": (2, H), "bias_cell": (2, H)}
    steps = build_recurrent_layer("lstm", "rbn", D, H).MAX_STEPS
    assert shapes("lstm", "rbn") == shapes("lstm", "ln_full") | {
        f"running_{s}_{n}": (2, steps, w) for s in ("mean", "var") for n, w in (("ih", k4), ("hh", k4), ("cell", H))
    } | {"trained_steps": (2,)}
    assert shapes("gru", "wn") == recurrent | wn
    assert shapes("gru", "wn", weight_norm_recurrent=True) == {"weight_hh_v": (2, k, H), "weight_hh_g": (2, k),
                                                                "bias_hh": (2, k)} | wn


@pytest.mark.parametrize("bn", ["skip", "seqwise", "ln", "ln_full", "rbn", "wn"])
def test_share_input_weights_holds_one_projection(bn):
    separate = shapes("lstm", bn)
    # W and what normalises it once for both directions: its gain, shift or g, and BN's statistics of W x
    # (rbn's statistics are per step of each direction, whose steps differ: they stay per direction)
    once = {name: (1, *s[1:]) if "_ih" in name and not name.startswith("running_") else
            (s[0] // 2,) if name.startswith("bn.") and s else s for name, s in separate.items()}
    assert shapes("lstm", bn, share_input_weights=True) == once != separate


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="exists for model.bn=seqwise|ln|wn only"):
        build_recurrent_layer("gru", "post", D, H, impl="cells")
    with pytest.raises(ValueError, match="model.impl=cells with model.bn=ln_full"):
        build_recurrent_layer("gru", "ln_full", D, H, impl="cells")
    with pytest.raises(ValueError, match="share_input_weights"):
        build_recurrent_layer("gru", "none", D, H, share_input_weights=True)
    with pytest.raises(ValueError, match="model.weight_norm_recurrent=true with model.bn=seqwise: .* model.bn=wn$"):
        build_recurrent_layer("gru", "seqwise", D, H, weight_norm_recurrent=True)
    with pytest.raises(ValueError, match="'bogus' is not a valid BNMode"):
        build_recurrent_layer("gru", "bogus", D, H)
    with pytest.raises(TypeError, match="no model setting imp; the settings are .*impl"):
        build_recurrent_layer("gru", "seqwise", D, H, imp="cells")


@pytest.mark.parametrize("bn", [b.value for b in BNMode])
def test_unidirectional_layer(bn):
    m = build_recurrent_layer("gru", bn, D, H, bidirectional=False)
    assert m(torch.randn(T, N, D), LENGTHS).shape == (T, N, H)


@pytest.mark.parametrize("shape", [(7, 4), (2, 7, 4)])  # x^T x (BN's statistic), batched (LN's W_c^T W_c)
def test_gram_backward_is_autograds(shape):
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(Gram.apply(x), x.mT @ x)
    assert torch.autograd.gradcheck(Gram.apply, (x,))


def test_quadratic_form_backward_is_autograds():
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, 4, 4, dtype=torch.float64)
    m = (a + a.transpose(1, 2)).requires_grad_()  # symmetric, as W_c^T W_c
    torch.testing.assert_close(QuadraticForm.apply(x, m), torch.einsum("fd,cde,fe->cf", x, m, x))
    assert torch.autograd.gradcheck(QuadraticForm.apply, (x, m))


def test_reversal_reverses_each_sequence_within_its_length_and_is_its_own_inverse():
    x = torch.randn(T, N, D, dtype=torch.float64, requires_grad=True)
    rows = reversal_rows(LENGTHS, T)
    y = Reversal.apply(x, rows)
    for n, length in enumerate(LENGTHS.tolist()):
        assert torch.equal(y[:length, n], x[:length, n].flip(0))
        assert torch.equal(y[length:, n], x[length:, n]), "padding stays in place"
    assert torch.equal(Reversal.apply(y, rows), x)
    assert torch.autograd.gradcheck(Reversal.apply, (x, rows))  # its backward is the same pick


def test_both_moment_routes_agree_in_value_and_gradient():
    x = torch.randn(40, 6, dtype=torch.float64) + 3
    x[35:] = 0  # padding rows are zero, as the layer hands them over
    mask = (torch.arange(40) < 35).double()[:, None]
    w = torch.randn(2, 12, 6, dtype=torch.float64)
    results = []
    for route in ("gram", "direct"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        mean, var, _ = projected_moments(xr, wr, mask, route)
        grads = torch.autograd.grad((mean.sin() + var.cos()).sum(), [xr, wr])
        results.append((mean, var, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    z = x[:35] @ w.transpose(1, 2)  # (copies, frames, width)
    torch.testing.assert_close(results[0][0], z.mean(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[0][1], z.var(1, unbiased=False), rtol=1e-12, atol=1e-12)


def test_route_follows_cost():
    assert cheaper_route(frames=3200, d=256, copies=2, width=768) == "gram"  # long batches
    assert cheaper_route(frames=200, d=512, copies=2, width=1024) == "direct"  # short batch, wide input
    # LN's |W_c x|^2, one D x D product per copy and W_c^T W_c at 2 K D^2: gram once frames x (3 K - 2 D) >= 2 K D
    assert cheaper_route(frames=1024, d=512, copies=2, width=768, grams=2, batch_products=2) == "gram"
    assert cheaper_route(frames=640, d=512, copies=2, width=768, grams=2, batch_products=2) == "gram"
    assert cheaper_route(frames=640, d=512, copies=2, width=768, grams=2) == "direct"  # at BN's 3 K D^2
    assert cheaper_route(frames=512, d=512, copies=2, width=768, grams=2, batch_products=2) == "direct"


@pytest.mark.parametrize("bn", ["seqwise", "ln"])
@pytest.mark.parametrize("rnn", ["gru", "lstm"])
@pytest.mark.parametrize("route", ["gram", "direct"])
def test_fold_keeps_float32_accuracy_on_features_with_a_large_mean(monkeypatch, bn, rnn, route):
    """Unit noise plus a per-feature offset up to 10, 100, 1000: the fused fold in float32 stays within 10x
    of the cells' float32 error against float64 (E[z^2] - E[z]^2 gave 2.8e-01 against 5.5e-04 at 1000)."""
    for module in (batchrnn.layers.batchnorm, batchrnn.layers.layernorm):  # where the folds call it
        monkeypatch.setattr(module, "cheaper_route", lambda *args, **kwargs: route)
    t, n, d, h = 60, 8, 128, 64
    lengths = torch.tensor([60, 57, 50, 44, 38, 30, 21, 9])
    torch.manual_seed(0)
    reference = build_recurrent_layer(rnn, bn, d, h, impl="cells").double()
    models = {impl: build_recurrent_layer(rnn, bn, d, h, impl=impl) for impl in ("fused", "cells")}
    for m in models.values():
        m.load_state_dict(reference.state_dict())
    for offset in (10, 100, 1000):
        x = torch.randn(t, n, d, dtype=torch.float64) + torch.rand(d, dtype=torch.float64) * offset
        y = reference(x, lengths)
        error = {impl: ((m(x.float(), lengths).double() - y).abs().max() / y.abs().max()).item()
                 for impl, m in models.items()}
        assert error["fused"] <= 10 * error["cells"], (offset, error)


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


def test_masked_bn_hardtanh_is_the_operations_it_fuses():
    """The conv front end's training step (MaskedBatchNorm.hardtanh: one autograd function, its backward written
    out) against the same operations one by one under autograd, in float64 on a padded batch whose values reach
    both of Hardtanh's edges: the same output, the same running averages, and the same gradients of x, the gain
    and the shift; the padding gets no gradient. Then torch's gradcheck of the function itself."""
    from batchrnn.layers.folds import MaskedBNHardtanh

    torch.manual_seed(0)
    lengths = torch.tensor([9, 5, 2])
    x = (torch.randn(3, 4, 6, 9, dtype=torch.float64) * 6 + 2).requires_grad_()  # (N, C, F, T), conv-shaped
    mask = (torch.arange(9)[None, :] < lengths[:, None]).to(x.dtype)[:, None, None, :]
    weight = torch.randn(3, 4, 6, 9, dtype=torch.float64)
    results = []
    for fused in (False, True):
        bn = MaskedBatchNorm(4).double()
        torch.manual_seed(1)  # the same gain and shift both times
        with torch.no_grad():
            bn.weight.uniform_(2, 8)  # wide enough that BN(x) crosses 0 and 5
            bn.bias.uniform_(0, 5)
        x.grad = None
        if fused:
            y = bn.hardtanh(x, mask, 0.0, 5.0, channel_dim=1)
        else:
            y = nn.functional.hardtanh(bn.normalize(x, mask, channel_dim=1), 0.0, 5.0) * mask
        (y * weight).sum().backward()
        results.append((y.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var))
    (clipped_low, clipped_high) = ((results[0][0] == 0) & (mask > 0)).sum(), (results[0][0] == 5).sum()
    assert clipped_low > 0 and clipped_high > 0, "the batch must reach both edges"
    for name, ours, theirs in zip(("y", "x.grad", "weight.grad", "bias.grad", "running_mean", "running_var"),
                                  results[1], results[0]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12, msg=name)
    assert results[1][1][2, :, :, 2:].abs().sum() == 0, "padding must receive no gradient"
    gain, shift = torch.rand(4, dtype=torch.float64) + 2, torch.rand(4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x, w, b: MaskedBNHardtanh.apply(x, mask, w, b, 1e-5, 0.0, 5.0, 1)[0],
                                    (x.detach().requires_grad_(), gain.requires_grad_(), shift.requires_grad_()))


def test_sync_batchnorm_conversion_leaves_masked_batchnorm_alone():
    m = nn.SyncBatchNorm.convert_sync_batchnorm(layer("gru", "post"))  # it would drop the mask
    assert type(m.bn) is MaskedBatchNorm


@pytest.mark.parametrize("bn", ["seqwise", "skip", "ln"])
@pytest.mark.parametrize("route", ["gram", "direct"])
def test_fold_statistics_in_bf16_products_keep_what_centring_saves(monkeypatch, bn, route):
    """Under bf16 autocast the folds' per-frame products run in bf16 (product_dtype), on the centred x:
    with a per-feature offset up to 1000, the folded weights, shifts and LN's frame scales stay within 1%
    of float64's (without the centring, E[z^2] - E[z]^2 in bf16 would lose the variance outright)."""
    for module in (batchrnn.layers.batchnorm, batchrnn.layers.layernorm):  # where the folds call it
        monkeypatch.setattr(module, "cheaper_route", lambda *args, **kwargs: route)
    t, n, d, h = 60, 8, 128, 64
    lengths = torch.tensor([60, 57, 50, 44, 38, 30, 21, 9])
    mask = valid_mask(lengths, t, torch.float32)
    torch.manual_seed(0)
    reference = perturbed(build_recurrent_layer("lstm", bn, d, h).double())
    m = build_recurrent_layer("lstm", bn, d, h)
    m.load_state_dict(reference.state_dict())
    for offset in (10, 100, 1000):
        x = (torch.randn(t, n, d, dtype=torch.float64) + torch.rand(d, dtype=torch.float64) * offset) * mask
        want = reference.input_folds(x, mask.double())
        exact = m.input_folds(x.float(), mask)  # float32 products
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert batchrnn.layers.base.product_dtype(x.float()) is torch.bfloat16
            got = m.input_folds(x.float(), mask)
        for g, e, w in zip(got, exact, want):
            for name in ("weight", "bias", "frame_scale"):
                a, b = getattr(g, name), getattr(w, name)
                if b is None:
                    continue
                if name == "frame_scale":  # LN's 1 / sigma, frame by frame; a padding frame's (x = 0) is unused
                    valid = mask.bool().expand_as(b)
                    error = ((a.double() - b).abs() / b.abs())[valid].max().item()
                else:
                    error = ((a.double() - b).abs().max() / b.abs().max()).item()  # relative to the largest
                assert error < 1e-2, (offset, name, error)
            # the bf16 products did run: their rounding shows against the float32 products'
            assert not torch.equal(g.weight if bn != "ln" else g.frame_scale, e.weight if bn != "ln" else e.frame_scale)


def an4_cpu_front_end():
    from batchrnn.config import ConvLayer, ModelConfig
    from batchrnn.model import ConvFrontEnd

    torch.manual_seed(0)
    conv = [ConvLayer(32, 11, 11, 2, 2), ConvLayer(32, 7, 7, 2, 2)]  # conf/experiment/an4_cpu.yaml's
    return ConvFrontEnd(ModelConfig(conv=conv), 64).double()


def test_conv_front_end_lengths_are_written_out():
    """Time stride 2 twice with kernels 11 and 7 (padding k // 2): L -> (L - 1) // 2 + 1, twice."""
    front = an4_cpu_front_end()
    lengths = torch.tensor([100, 37, 2, 1])
    assert front.output_lengths(lengths).tolist() == [25, 10, 1, 1]
    y, out = front(torch.randn(4, 64, 100, dtype=torch.float64), lengths)
    assert out.tolist() == [25, 10, 1, 1] and y.shape == (25, 4, 32 * 16)  # 64 bands -> 32 -> 16
    assert torch.all(y[10:, 1] == 0) and torch.all(y[1:, 2] == 0), "padded output frames are zero"


@pytest.mark.parametrize("training", [True, False])
def test_conv_front_end_padding_never_changes_valid_frames(training):
    front = an4_cpu_front_end().train(training)
    lengths = torch.tensor([100, 37, 2])
    x = torch.randn(3, 64, 100, dtype=torch.float64)
    garbage = x.clone()
    garbage[1, :, 37:] = 1e4
    garbage[2, :, 2:] = float("nan")
    y, _ = front(x, lengths)
    torch.testing.assert_close(front(garbage, lengths)[0], y, rtol=0, atol=1e-12)
    if not training:  # eval: each utterance alone, unpadded, gives the same frames
        for n, length in enumerate(lengths.tolist()):
            alone, out = front(x[n : n + 1, :, :length], lengths[n : n + 1])
            torch.testing.assert_close(y[: int(out), n : n + 1], alone, rtol=0, atol=1e-10)


def test_the_simple_rnn_is_ds2s_clipped_relu_recurrence_written_out():
    """rnn's fused route is its own cell loop, so comparing those two proves nothing: this writes DS2's
    recurrence out, h_t = min(max(W x_t + b_ih + U h_{t-1} + b_hh, 0), 20), per direction."""
    torch.manual_seed(0)
    m = build_recurrent_layer("rnn", "none", D, H).double()
    with torch.no_grad():
        m.weight_hh.mul_(8)  # large enough that the clip at 20 is reached
    x = torch.randn(T, N, D, dtype=torch.float64) * 4
    y = m(x, LENGTHS)
    expected = torch.zeros(T, N, H, dtype=torch.float64)
    for n, length in enumerate(LENGTHS.tolist()):
        for d, order in ((0, range(length)), (1, reversed(range(length)))):
            h = torch.zeros(H, dtype=torch.float64)
            for t in order:
                h = (m.weight_ih[d] @ x[t, n] + m.bias_ih[d] + m.weight_hh[d] @ h + m.bias_hh[d]).clamp(0, 20)
                expected[t, n] += h
    assert (expected == 20).any() and (expected == 0).any(), "both ends of the clip are exercised"
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_weight_norm_is_torchs_weight_norm():
    """wn's w = g v / |v| row by row, against torch.nn.utils.parametrizations.weight_norm on the same g, v."""
    from batchrnn.layers.weightnorm import weight_norm

    torch.manual_seed(0)
    m = build_recurrent_layer("gru", "wn", D, H, weight_norm_recurrent=True).double()
    for g, v in ((m.weight_ih_g[0], m.weight_ih_v[0]), (m.weight_hh_g[1], m.weight_hh_v[1])):
        linear = nn.utils.parametrizations.weight_norm(nn.Linear(v.shape[1], v.shape[0], bias=False).double(), dim=0)
        with torch.no_grad():
            linear.parametrizations.weight.original0.copy_(g[:, None] * 1.7)  # off |v|, as after training
            linear.parametrizations.weight.original1.copy_(v)
        torch.testing.assert_close(weight_norm(g * 1.7, v), linear.weight, rtol=1e-12, atol=1e-14)


def test_skip_is_cudnns_skip_input_recurrence_written_out():
    """skip written out as cuDNN's skip-input mode with DS2's BN: per direction one s = BN(W x) of size H over the
    batch's valid frames (biased variance), added to every gate of a GRU whose input bias BN's beta replaces."""
    torch.manual_seed(0)
    m = perturbed(build_recurrent_layer("gru", "skip", D, H).double()).train()
    x = torch.randn(T, N, D, dtype=torch.float64)
    y = m(x, LENGTHS)
    valid = valid_mask(LENGTHS, T, torch.float64).bool()[..., 0]  # (T, N)
    expected = torch.zeros(T, N, H, dtype=torch.float64)
    for d in range(2):
        a = x[valid] @ m.weight_ih[d].t()  # (valid frames, H)
        gamma, beta = m.bn.weight[d * H:(d + 1) * H], m.bn.bias[d * H:(d + 1) * H]
        s_valid = (a - a.mean(0)) / torch.sqrt(a.var(0, unbiased=False) + m.bn.eps) * gamma + beta
        s = torch.zeros(T, N, H, dtype=torch.float64)
        s[valid] = s_valid
        u, b = m.weight_hh[d].view(3, H, H), m.bias_hh[d].view(3, H)
        for n, length in enumerate(LENGTHS.tolist()):
            h = torch.zeros(H, dtype=torch.float64)
            for t in (range(length) if d == 0 else reversed(range(length))):
                r = torch.sigmoid(s[t, n] + u[0] @ h + b[0])
                z = torch.sigmoid(s[t, n] + u[1] @ h + b[1])
                c = torch.tanh(s[t, n] + r * (u[2] @ h + b[2]))
                h = (1 - z) * c + z * h
                expected[t, n] += h
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
