"""The CPU GRU's oneDNN kernel (batchrnn.layers.cpu_gru): torch's GRU function, used by every fused GRU variant, float32
under autocast, recorded, and a fallback to torch's kernel with a warning where it cannot be built."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from batchrnn.layers import cpu_gru
from batchrnn.model import build_recurrent_layer
from batchrnn.layers import LAYERS
from conftest import FUSED_MODES
from batchrnn.layers.base import KERNEL_WEIGHTS

LENGTHS = torch.tensor([23, 17, 9, 2])  # ragged, the longest first as the trainer's buckets are not
T, N, D, H = 23, 4, 19, 16
# Every variant whose impl=fused route calls the fused kernel: every variant but conftest's written-out step loops (a
# variant that stopped calling the kernel fails test_the_fused_variants_are_the_seven).
FUSED = sorted(FUSED_MODES)
# Where the kernel is missing, test_the_kernel_is_built says so (on Linux x86-64 it fails); the rest need it.
needs_kernel = pytest.mark.skipif(not cpu_gru.available(), reason="the oneDNN GRU is not built here")
VARIANTS = [pytest.param(b, {}, id=b) for b in FUSED] + [
    pytest.param("wn", {"weight_norm_recurrent": True}, id="wn-recurrent")]


# A float32 result may be up to 10 times as far from float64's as torch's own float32 kernel's, measured beside it on
# the CPU at hand (vector widths and kernels differ, so no fixed bound fits every CPU), plus a few units of
# float32's rounding where torch's happens to be exact; a wrong gate order or bias would be off by O(1). On an AMD
# EPYC with AVX-512 the oneDNN kernel's errors were at most 3.3 times torch's (1e-7 of the largest value).
FLOAT32_ULPS = 8 * torch.finfo(torch.float32).eps


def assert_as_close_as_torchs(ours: list, torchs: list, reference: list, what: list[str]) -> None:
    """Each of ours against its float64 reference, as close as torch's float32 one comes; errors relative to the
    largest reference value of all (a gradient that is 0 in exact arithmetic, a bias before BN, has no scale of its
    own)."""
    scale = max(float(r.detach().abs().max()) for r in reference)
    for a, b, r, name in zip(ours, torchs, reference, what, strict=True):
        error = {kernel: float((v.detach().double() - r.detach()).abs().max()) / scale
                 for kernel, v in (("ours", a), ("torch's", b))}
        assert error["ours"] <= 10 * error["torch's"] + FLOAT32_ULPS, (name, error)


def test_the_fused_variants_are_the_seven():
    assert sorted(b.value for b, c in LAYERS.items() if c.fused) == FUSED


@pytest.mark.skipif(not (sys.platform == "linux" and os.uname().machine == "x86_64"),
                    reason="PyPI's oneDNN wheels are for Linux x86-64; elsewhere the CPU GRU is torch's")
def test_the_kernel_is_built():
    """`make venv` builds it (python -m batchrnn.layers.build); a machine where it failed would train at half speed."""
    assert os.environ.get(cpu_gru.ENV, "onednn") == "onednn"
    assert cpu_gru.available(), "the oneDNN GRU did not build: run .venv/bin/python -m batchrnn.layers.build -v"
    assert cpu_gru.kernel_name().startswith("onednn lbr_gru ")
    assert {"none", "post", "input", "skip", "seqwise", "ln", "wn"} <= set(FUSED)


@needs_kernel
@pytest.mark.parametrize("shape", [(6, 3, 7, 5), (67, 16, 64, 32)], ids=["tiny", "an4-length"])
def test_lbr_gru_is_torchs_gru(shape):
    """Against nn.GRU in float64 on the same float32 values: outputs and the gradient of every input, as close as
    torch's float32 nn.GRU comes (FLOAT32_ULPS). oneDNN's RNNs have no float64, so this is float32's accuracy."""
    t, n, d, h = shape
    torch.manual_seed(0)
    gru = nn.GRU(d, h, dtype=torch.float64)
    x = torch.randn(t, n, d, requires_grad=True)
    ours = [p.detach().float().requires_grad_() for p in
            (gru.weight_ih_l0, gru.bias_ih_l0, gru.weight_hh_l0, gru.bias_hh_l0)]
    ours.insert(0, x)
    ref, torchs = ([p.detach().to(dtype).requires_grad_() for p in ours] for dtype in (torch.float64, torch.float32))

    def nn_gru(inputs):
        return torch.func.functional_call(gru, dict(zip(KERNEL_WEIGHTS, (inputs[1], inputs[3], inputs[2], inputs[4]))),
                                          (inputs[0],))[0]

    y, y_ref, y_torch = cpu_gru.recurrence(*ours), nn_gru(ref), nn_gru(torchs)
    assert y.dtype == torch.float32 and y_torch.dtype == torch.float32
    assert_as_close_as_torchs([y], [y_torch], [y_ref], ["output"])
    weight = torch.linspace(-1, 1, h)
    grads = torch.autograd.grad((y * weight).sum(), ours)
    grads_ref = torch.autograd.grad((y_ref * weight.double()).sum(), ref)
    grads_torch = torch.autograd.grad((y_torch * weight).sum(), torchs)
    assert_as_close_as_torchs(grads, grads_torch, grads_ref, ["x", "w_ih", "b_ih", "w_hh", "b_hh"])


def run_layer(bn, kw, bidirectional, aten, monkeypatch, dtype=torch.float32):
    """Output and every gradient of one layer on ragged lengths, with the oneDNN kernel or torch's; float64 (the same
    values) runs torch's."""
    calls = []
    recurrence = cpu_gru.recurrence
    monkeypatch.setattr(cpu_gru, "recurrence", lambda *a: calls.append(a) or recurrence(*a))
    monkeypatch.setattr(cpu_gru, "available", lambda: not aten)
    torch.manual_seed(0)
    m = build_recurrent_layer("gru", bn, D, H, bidirectional=bidirectional, **kw)
    with torch.no_grad():  # off the initial values: gains off 1, shifts off 0
        for p in m.parameters():
            p.add_(torch.rand_like(p) * 0.2 - 0.1)
    torch.manual_seed(1)
    m, x = m.to(dtype), torch.randn(T, N, D).to(dtype).requires_grad_()
    y = m(x, LENGTHS)
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, H, dtype=dtype)).sum(), [x, *m.parameters()])
    return y, grads, calls


@needs_kernel
@pytest.mark.parametrize("bidirectional", [True, False], ids=["bi", "uni"])
@pytest.mark.parametrize("bn,kw", VARIANTS)
def test_every_fused_gru_variant_runs_it_and_equals_torchs_kernel(bn, kw, bidirectional, monkeypatch):
    y, grads, calls = run_layer(bn, kw, bidirectional, aten=False, monkeypatch=monkeypatch)
    assert len(calls) == (2 if bidirectional else 1), "each direction is one oneDNN call"
    assert all(t.dtype == torch.float32 for a in calls for t in a)
    y_torch, grads_torch, calls_torch = run_layer(bn, kw, bidirectional, aten=True, monkeypatch=monkeypatch)
    assert not calls_torch
    y_ref, grads_ref, _ = run_layer(bn, kw, bidirectional, aten=True, monkeypatch=monkeypatch, dtype=torch.float64)
    assert_as_close_as_torchs([y], [y_torch], [y_ref], ["output"])
    assert torch.all(y[LENGTHS[-1]:, -1] == 0), "padded frames stay zero"
    assert_as_close_as_torchs(grads, grads_torch, grads_ref, [f"gradient {i}" for i in range(len(grads))])


def test_float64_and_the_lstm_keep_torchs_kernel(monkeypatch):
    """float64 (what the exactness tests use) has no oneDNN RNN; the LSTM is oneDNN's through torch already."""
    calls = []
    monkeypatch.setattr(cpu_gru, "recurrence", lambda *a: calls.append(a))
    build_recurrent_layer("gru", "none", D, H).double()(torch.randn(T, N, D, dtype=torch.float64), LENGTHS)
    build_recurrent_layer("lstm", "none", D, H)(torch.randn(T, N, D), LENGTHS)
    assert not calls


@needs_kernel
@pytest.mark.parametrize("bn", ["none", "seqwise", "ln"])
def test_bf16_autocast_keeps_the_recurrence_float32(bn, monkeypatch):
    calls = []
    recurrence = cpu_gru.recurrence
    monkeypatch.setattr(cpu_gru, "recurrence", lambda *a: calls.append(a) or recurrence(*a))
    torch.manual_seed(0)
    m = build_recurrent_layer("gru", bn, D, H)
    x = torch.randn(T, N, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, LENGTHS)
    y.float().square().sum().backward()
    assert len(calls) == 2 and all(t.dtype == torch.float32 for a in calls for t in a)
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in m.parameters())


@needs_kernel
def test_eval_without_grad_needs_no_workspace():
    cpu_gru.WORKSPACES.__init__()
    m = build_recurrent_layer("gru", "seqwise", D, H).eval()
    x = torch.randn(T, N, D)
    with torch.no_grad():
        y = m(x, LENGTHS)
        cpu_gru.recurrence(x, m.weight_ih[0], m.bias_hh[0], m.weight_hh[0], m.bias_hh[0])  # leaf parameters too
    assert cpu_gru.WORKSPACES.largest == 0, "no workspace was taken"
    torch.testing.assert_close(y, m(x, LENGTHS).detach())


@pytest.fixture
def fresh_extension():
    cpu_gru.extension.cache_clear()
    yield
    cpu_gru.extension.cache_clear()


def test_a_failed_build_falls_back_to_torchs_kernel_with_one_warning(monkeypatch, fresh_extension):
    def no_compiler(verbose=False):
        raise RuntimeError("Error building extension 'batchrnn_onednn_gru'\nc++: not found")

    monkeypatch.setattr(cpu_gru, "build", no_compiler)
    m = build_recurrent_layer("gru", "seqwise", D, H)
    with pytest.warns(RuntimeWarning, match=r"oneDNN CPU GRU kernel is unavailable .*c\+\+: not found.*Fix: "):
        y = m(torch.randn(T, N, D), LENGTHS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not per call
        torch.testing.assert_close(m(torch.randn(T, N, D), LENGTHS).shape, y.shape)
    assert cpu_gru.kernel_name() == "aten" and m.recurrence_kernel(torch.device("cpu")) == "aten"


def test_aten_is_chosen_by_the_environment(monkeypatch, fresh_extension):
    monkeypatch.setenv(cpu_gru.ENV, "aten")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_gru.extension() is None and cpu_gru.kernel_name() == "aten"
    cpu_gru.extension.cache_clear()
    monkeypatch.setenv(cpu_gru.ENV, "mkl")
    with pytest.raises(ValueError, match="BATCHRNN_CPU_GRU='mkl': expected onednn"):
        cpu_gru.extension()


FAILED_BUILD = """
import sys, warnings, torch
from batchrnn.layers import cpu_gru
from batchrnn.model import build_recurrent_layer
cpu_gru.build_directory = lambda: __import__("pathlib").Path(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = build_recurrent_layer("gru", "none", 5, 4)(torch.randn(7, 2, 5), torch.tensor([7, 3]))
assert y.shape == (7, 2, 4) and cpu_gru.kernel_name() == "aten", cpu_gru.kernel_name()
print(*[str(w.message) for w in caught], sep="\\n")
"""


def test_a_machine_without_a_compiler_trains_with_torchs_kernel(tmp_path):
    """End to end in a fresh process: the compiler is missing, the build fails, the warning names the fix."""
    env = os.environ | {"CXX": str(tmp_path / "no-such-compiler")}
    run = subprocess.run([sys.executable, "-c", FAILED_BUILD, str(tmp_path / "build")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "oneDNN CPU GRU kernel is unavailable" in run.stdout and "make venv" in run.stdout, run.stdout


@needs_kernel
def test_workspaces_are_reused_and_a_second_backward_is_refused():
    """Each backward hands its workspace back for the next forward (fresh tens of MB a step cost the GRU a tenth
    of its time); a second backward through the same forward would read a reused workspace, so it is refused."""
    cpu_gru.WORKSPACES.__init__()
    m = build_recurrent_layer("gru", "none", D, H)
    x = torch.randn(T, N, D, requires_grad=True)
    m(x, LENGTHS).sum().backward()
    spare = [w.data_ptr() for w in cpu_gru.WORKSPACES.spare]
    assert len(spare) == 2  # one per direction
    y = m(x, LENGTHS)
    assert not cpu_gru.WORKSPACES.spare, "the next forward takes them"
    y.sum().backward(retain_graph=True)
    assert sorted(w.data_ptr() for w in cpu_gru.WORKSPACES.spare) == sorted(spare)
    with pytest.raises(RuntimeError, match="backward ran twice through one forward"):
        y.sum().backward()
