"""The conv front end's CPU kernel (batchrnn.layers.cpu_front_end): MaskedBNHardtanh's stages as C++ loops compute
what its torch operations compute, on the shapes the front end has; elsewhere, or where it cannot be built, the torch
operations run, with one warning."""
import os
import sys
import warnings

import pytest
import torch

from batchrnn.layers import cpu_front_end
from batchrnn.layers.folds import MaskedBatchNorm

needs_kernel = pytest.mark.skipif(cpu_front_end.extension() is None, reason="the front end's kernel is not built here")
FLOAT32_ULPS = 8 * torch.finfo(torch.float32).eps


@pytest.fixture
def fresh_extension():
    cpu_front_end.extension.cache_clear()
    yield
    cpu_front_end.extension.cache_clear()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="`make venv` builds it where a C++ compiler is")
def test_the_kernel_is_built():
    """`make venv` builds it (python -m batchrnn.layers.build); a machine where it failed would run torch's."""
    assert os.environ.get(cpu_front_end.ENV, "native") == "native"
    assert cpu_front_end.kernel_name() == "native", "run .venv/bin/python -m batchrnn.layers.build -v"


def front_end_step(dtype: torch.dtype, kernel: bool, monkeypatch, poison: bool = False) -> list[torch.Tensor]:
    """The front end's training step of one MaskedBatchNorm on a conv-shaped padded batch whose padding holds large
    values (a conv's output there is not 0) and whose valid values reach both of Hardtanh's edges: y, the gradients
    of x, gain and shift, and the running averages. poison: the gradient reaching y is inf on padding and NaN where
    Hardtanh clips, which hardtanh_backward drops."""
    ran = []
    with monkeypatch.context() as m:
        if not kernel:
            m.setattr(cpu_front_end, "extension", lambda: None)
        takes = cpu_front_end.takes
        m.setattr(cpu_front_end, "takes", lambda *args: ran.append(takes(*args)) or ran[-1])
        torch.manual_seed(0)
        lengths = torch.tensor([37, 30, 11, 4])
        x = torch.randn(4, 5, 6, 37, dtype=torch.float64) * 6 + 2  # (N, C, F, T)
        mask = (torch.arange(37)[None, :] < lengths[:, None]).to(dtype)[:, None, None, :]
        x = torch.where(mask.bool(), x, 1e4).to(dtype).requires_grad_()
        grad = torch.randn(x.shape, dtype=dtype)
        bn = MaskedBatchNorm(5).to(dtype)
        with torch.no_grad():
            bn.weight.uniform_(2, 8)
            bn.bias.uniform_(0, 5)
        y = bn.hardtanh(x, mask, 0.0, 5.0, channel_dim=1)
        if poison:
            grad = torch.where(mask.bool(), grad, torch.inf)
            grad = torch.where((y.detach() == 0) & mask.bool() | (y.detach() == 5), torch.nan, grad)
        y.backward(grad)
        assert ((y == 0) & (mask > 0)).any() and (y == 5).any(), "the batch must reach both edges"
        assert ran and all((r is not None) == kernel for r in ran), "the kernel ran (or not) as asked"
        return [y.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var]


NAMES = ("y", "x.grad", "weight.grad", "bias.grad", "running_mean", "running_var")


@needs_kernel
def test_the_kernel_computes_the_torch_operations(monkeypatch):
    """float64: the kernel's y, gradients and running averages are the torch operations' within 1e-12. float32:
    each as close to float64's as 10 times the torch operations' own float32 result, plus a few units of rounding
    (the kernel sums in double, torch in float32 pairwise; a missed mask or a wrong term would be off by O(1))."""
    reference = front_end_step(torch.float64, False, monkeypatch)
    for ours, theirs, name in zip(front_end_step(torch.float64, True, monkeypatch), reference, NAMES):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12, msg=name)
    ours, torchs = front_end_step(torch.float32, True, monkeypatch), front_end_step(torch.float32, False, monkeypatch)
    for a, b, r, name in zip(ours, torchs, reference, NAMES):
        scale = float(r.abs().max())
        error = {k: float((v.double() - r).abs().max()) / scale for k, v in (("kernel", a), ("torch", b))}
        assert error["kernel"] <= 10 * error["torch"] + FLOAT32_ULPS, (name, error)
    assert float(ours[1][3, :, :, 4:].abs().max()) == 0, "padding must receive no gradient"


@needs_kernel
def test_a_non_finite_gradient_where_hardtanh_is_flat_is_dropped_as_torch_drops_it(monkeypatch):
    ours, theirs = (front_end_step(torch.float64, kernel, monkeypatch, poison=True) for kernel in (True, False))
    for a, b, name in zip(ours, theirs, NAMES):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


@needs_kernel
def test_it_runs_where_the_front_end_has_its_shapes():
    x, mask = torch.randn(2, 3, 4, 5), torch.ones(2, 1, 1, 5)
    assert cpu_front_end.takes(x, mask, 1) is cpu_front_end.extension()
    assert cpu_front_end.takes(x.double(), mask.double(), -3) is not None
    assert cpu_front_end.takes(x, torch.ones(2, 1, 4, 5), 1) is None, "a mask over frequency too"
    assert cpu_front_end.takes(x, mask, -1) is None, "channels last"
    assert cpu_front_end.takes(x.bfloat16(), mask.bfloat16(), 1) is None
    assert cpu_front_end.takes(torch.randn(2, 3, 5), torch.ones(2, 1, 5), 1) is None
    assert cpu_front_end.takes(x.to("meta"), mask.to("meta"), 1) is None, "another device"
    # results.json's front_end_kernel names the same choice: torch's operations on a GPU and under bf16 autocast
    assert cpu_front_end.kernel_name("cpu", torch.float32) == "native"
    assert cpu_front_end.kernel_name("cuda", torch.float32) == "aten"
    assert cpu_front_end.kernel_name("cpu", torch.bfloat16) == "aten"


@needs_kernel
def test_the_kernel_refuses_operands_it_would_misread():
    """It reads every operand as a contiguous block: anything else is refused, naming the operand, not misread."""
    kernel, x, mask = cpu_front_end.extension(), torch.randn(2, 3, 4, 5), torch.ones(2, 5)
    per_channel = torch.randn(3, 2)[:, 0]  # (C,), every second float
    with pytest.raises(RuntimeError, match=r"per-channel operand contiguous.*operand 0 is not .*strides \[2\]"):
        kernel.forward(x, mask, per_channel, torch.zeros(3), 0.0, 20.0)
    with pytest.raises(RuntimeError, match=r"operand 1 is not \(sizes \[2\]"):
        kernel.forward(x, mask, torch.zeros(3), torch.zeros(2), 0.0, 20.0)
    with pytest.raises(RuntimeError, match="x: a contiguous"):
        kernel.masked_sums(x.transpose(2, 3), mask)
    with pytest.raises(RuntimeError, match="mask: contiguous"):
        kernel.masked_sums(x, torch.ones(5, 2).t())


def test_a_failed_build_falls_back_to_torchs_operations_with_one_warning(monkeypatch, fresh_extension):
    def no_compiler(verbose=False):
        raise RuntimeError("Error building extension 'batchrnn_front_end'\nc++: not found")

    monkeypatch.setattr(cpu_front_end, "build", no_compiler)
    bn = MaskedBatchNorm(3)
    x, mask = torch.randn(2, 3, 4, 5, requires_grad=True), torch.ones(2, 1, 1, 5)
    with pytest.warns(RuntimeWarning, match=r"front end's CPU kernel is unavailable .*c\+\+: not found.*Fix: "):
        bn.hardtanh(x, mask, 0.0, 20.0, channel_dim=1).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not per call
        bn.hardtanh(x, mask, 0.0, 20.0, channel_dim=1)
    assert cpu_front_end.kernel_name() == "aten"


def test_aten_is_chosen_by_the_environment(monkeypatch, fresh_extension):
    """(extensions.chosen, which refuses any other value, is tested with the CPU GRU's variable.)"""
    monkeypatch.setenv(cpu_front_end.ENV, "aten")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_front_end.extension() is None and cpu_front_end.kernel_name() == "aten"
