"""The fold mathematics: masked moments over valid frames, the Gram matrix and quadratic forms that give
BN(W x)'s and LN(W x)'s statistics from x's (exactly, autograd differentiating through them), and the masked,
sequence-wise BatchNorm that every BN placement and the conv front end use."""
import math

import torch
from torch import nn

from batchrnn.layers import cpu_front_end
from batchrnn.layers.base import full_precision
from batchrnn.training.distributed import all_sum, ghosting


def masked_moments(x: torch.Tensor, mask: torch.Tensor, channel_dim: int):
    """Mean and biased variance per channel over valid positions; mask is 0/1, broadcastable to x."""
    x, mask = full_precision(x), full_precision(mask)  # statistics in float32 even under autocast
    _, mean, var, count = centred_moments(x, mask, channel_dim)
    return mean.flatten(), var.flatten(), count


def centred_moments(x: torch.Tensor, mask: torch.Tensor, channel_dim: int):
    """(x - mean) * mask, and the per-channel mean and biased variance over valid positions (kept dims, x's
    dtype), and the count: masked_moments' computation, with the centred x that BatchNorm's backward reuses."""
    dims = [d for d in range(x.dim()) if d != channel_dim % x.dim()]
    count = mask.sum() * math.prod(x.shape[d] for d in dims if mask.shape[d] == 1)
    # data-parallel: the count and sum of every rank first, then the squares around that shared mean
    total, count = all_sum((x * mask).sum(dims, keepdim=True), count)
    mean = total / count
    # (x - mean) * mask value for value, in one pass: x * 1 - mean, or 0 + -0
    centred = torch.addcmul(mask * -mean, x, mask)
    (var,) = all_sum(centred.square().sum(dims, keepdim=True) / count)
    return centred, mean, var, count


class MaskedBNHardtanh(torch.autograd.Function):
    """Training's BatchNorm over valid positions, then Hardtanh(lo, hi), padding zeroed: the conv front end's
    step, with the backward written out (BatchNorm's closed form), where autograd would differentiate each of
    the moments' and the affine map's elementwise passes over the model's largest tensors in turn. As torch
    operations, the forward computes what masked_moments (through centred_moments, whose centred x the backward
    keeps) and MaskedBatchNorm.normalize compute, value for value; the backward is the same gradient, rounded in
    another order. On the CPU, where cpu_front_end's kernel is built, each stage is one C++ loop instead: the same
    quantities, their sums in double until every rank's is summed. Data-parallel: the batch-level sums of the
    backward are summed over the ranks (one all-reduce), as autograd of all_sum would; a rank running a stand-in
    (ghost) passes no gradient to x.
    Returns y and the batch's mean and biased variance (no gradient: the running averages')."""

    @staticmethod
    def forward(ctx, x, mask, weight, bias, eps: float, lo: float, hi: float, channel_dim: int):
        dims = [d for d in range(x.dim()) if d != channel_dim % x.dim()]
        shape = [1] * x.dim()
        shape[channel_dim] = -1
        kernel = cpu_front_end.takes(x, mask, channel_dim)
        if kernel is None:
            centred, mean, var, count = centred_moments(x, mask, channel_dim)
            mean, var = mean.flatten(), var.flatten()
        else:  # the same moments, each sum one loop over x, in double until every rank's is summed; mask as (N, T)
            x, mask = x.contiguous(), mask.reshape(x.shape[0], x.shape[3]).contiguous()
            total, count = all_sum(kernel.masked_sums(x, mask), mask.sum() * x.shape[2])
            mean = (total / count).to(x.dtype)
            (var,) = all_sum(kernel.centred_square_sums(x, mask, mean))
            var = (var / count).to(x.dtype)
        inv_std = torch.rsqrt(var + eps)
        scale = weight * inv_std
        shift = bias - mean * scale
        if kernel is None:
            # MaskedBatchNorm.normalize's x * scale + shift, then Hardtanh and the mask in place (no new tensors)
            y = torch.addcmul(shift.view(shape), x, scale.view(shape)).clamp_(lo, hi).mul_(mask)
            ctx.save_for_backward(centred, y, mask, inv_std, scale, count)  # lo < y < hi where lo < BN(x) < hi
        else:
            y = kernel.forward(x, mask, scale, shift, lo, hi)  # per-channel operands: 1-D, contiguous
            ctx.save_for_backward(x, y, mask, inv_std, scale, count, mean)  # x and mean: the kernel centres anew
        ctx.kernel, ctx.shape, ctx.dims, ctx.lo, ctx.hi, ctx.ghost = kernel, shape, dims, lo, hi, ghosting()
        ctx.mark_non_differentiable(mean, var, count)
        return y, mean, var, count

    @staticmethod
    def backward(ctx, grad_y, _mean, _var, _count):
        kernel, shape, dims = ctx.kernel, ctx.shape, ctx.dims
        if kernel is None:
            centred, y, mask, inv_std, scale, count = ctx.saved_tensors
            g = torch.ops.aten.hardtanh_backward(grad_y * mask, y, ctx.lo, ctx.hi)  # dL/dBN(x), 0 on padding
            sum_g = g.sum(dims)
            sum_gc = (g * centred).sum(dims)  # sum of g (x - mean) over valid positions
        else:  # the sums in double, as the moments' (the kernel recomputes g from grad_y and y)
            x, y, mask, inv_std, scale, count, mean = ctx.saved_tensors
            grad_y = grad_y.contiguous()
            sum_g, sum_gc = kernel.backward_sums(grad_y, y, x, mask, mean, ctx.lo, ctx.hi)
        # this rank's: DDP sums the parameters' gradients
        grad_bias, grad_weight = sum_g.to(scale.dtype), (sum_gc * inv_std).to(scale.dtype)
        # x's gradient through the moments needs every rank's sums, as the moments did
        total_g, total_gc = all_sum(sum_g, sum_gc)
        on_mask = (-scale * total_g / count).to(scale.dtype)
        on_centred = (-scale * inv_std.square() * total_gc / count).to(scale.dtype)
        if kernel is None:
            grad_x = g.mul_(scale.view(shape)).addcmul_(mask, on_mask.view(shape))
            grad_x = grad_x.addcmul_(centred, on_centred.view(shape))
        else:  # g scale + mask on_mask + (x - mean) mask on_centred
            grad_x = kernel.backward_x(grad_y, y, x, mask, mean, scale, on_mask, on_centred, ctx.lo, ctx.hi)
        if ctx.ghost:
            grad_x = grad_x * 0
        return grad_x, None, grad_weight, grad_bias, None, None, None, None


class Gram(torch.autograd.Function):
    """x^T x (over the last two dims, batched over any before) with the backward that uses its symmetry:
    one matmul, where autograd of `x.mT @ x` would do two (one per operand). On the BN fold's hot path,
    the statistic that costs D^2 per frame; in the LN fold, W_c^T W_c per copy (K D^2 per batch)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.mT @ x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return x @ (grad + grad.mT)


class QuadraticForm(torch.autograd.Function):
    """x_f^T M_c x_f for every row x_f of x (F, D) and every symmetric M_c of m (C, D, D): (C, F). The
    backward reuses the forward's x M for x's gradient (2 M x), so it costs one D^2 product per row (M's
    gradient), where autograd would do two. The LN fold's |W_c x|^2, through M = W_c^T W_c. Every product
    is one plain matrix product over the C matrices side by side: a batched product over a broadcast x
    ran 2.5x slower on the CPU (F 3200, D 256, C 2)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        c, d = m.shape[:2]
        xm = (x @ m.transpose(0, 1).reshape(d, c * d)).view(-1, c, d)  # (F, C, D): x M_c for every c
        ctx.save_for_backward(x, xm)
        # The per-frame sums in float32 at least: with bf16 x, of the products rounded to bf16 as xm already
        # is (casting xm and x to float32 first cost 8x the time on the CPU for no accuracy the test sees).
        return (xm * x[:, None, :]).sum(-1, dtype=torch.promote_types(x.dtype, torch.float32)).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, xm = ctx.saved_tensors
        f, c, d = xm.shape
        g = grad.t().to(x.dtype)  # (F, C), in the products' dtype
        grad_x = xm[:, 0] * (2 * g[:, :1])  # 2 sum_c grad_c M_c x, one frame-sized product at a time
        for k in range(1, c):
            grad_x = torch.addcmul(grad_x, xm[:, k], 2 * g[:, k:k + 1])
        grad_m = ((g[:, :, None] * x[:, None, :]).reshape(f, c * d).t() @ x).view(c, d, d)  # x^T diag(g_c) x
        return grad_x, grad_m


def cheaper_route(frames: int, d: int, copies: int, width: int, grams: int = 1, batch_products: int = 3) -> str:
    """Fewer multiply-adds (forward and backward) for a statistic of W x (copies, width, D) over a batch.
    "gram" goes through D x D products: `grams` of them per frame at 2 D^2 each (BN: E[x x^T], one for
    every copy; LN: x^T W_c^T W_c x, one per copy), then `batch_products` x copies x width x D^2 per batch
    (BN: w_k^T S w_k and its backward, 3; LN: the Gram W_c^T W_c and its one-matmul backward, 2); "direct"
    computes W x (3 copies x width x D per frame). Long batches favour gram, short ones with a wide input
    direct."""
    gram = 2 * grams * d * d * frames + batch_products * copies * width * d * d
    return "gram" if gram <= 3 * copies * width * d * frames else "direct"


def projected_moments(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, route: str,
                      dtype: torch.dtype | None = None):
    """Mean and variance of z = W x over valid frames, each (copies, width), and the count; x (frames, D) is zero on
    padding, mask (frames, 1), w (copies, width, D). x is centred before its second moment: in float32,
    E[z^2] - E[z]^2 loses what features with a large mean carry. Both routes are exact; they differ
    only in cost. dtype: that of the per-frame products (default x's): with bf16, the gram route's x^T x
    (accumulated in float32, rounded to bf16 once) or the direct route's W x; the mean, the count, the
    direct route's sum of squares and the batch-level products stay in x's dtype."""
    total, count = all_sum(x.sum(0), mask.sum())  # data-parallel: every rank's frames, then the shared mean
    mean_x = total / count
    xc = (x - mean_x) * mask  # (frames, D), still zero on padding
    xp = xc.to(dtype or xc.dtype)
    if route == "gram":
        var = ((w @ (Gram.apply(xp).to(x.dtype) / count)) * w).sum(-1)
    else:
        var = torch.einsum("fd,cwd->fcw", xp, w.to(xp.dtype)).to(x.dtype).square().sum(0) / count
    # each rank's part of the variance, (copies, width) whichever route it took (the cheaper one for its frames)
    (var,) = all_sum(var)
    return w @ mean_x, var, count


def track_moments(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor,
                  var: torch.Tensor, count, factor, keep: torch.Tensor | None = None) -> None:
    """BatchNorm's running-average rule, in place: the running moments take a step of `factor` towards
    the batch's mean and its variance unbiased over `count` rows (var * n / (n - 1)); where `keep` is
    False they stay as they are."""
    with torch.no_grad():
        unbiased = var.detach() * count / (count - 1).clamp_min(1)
        means = running_mean.lerp(mean.detach().to(running_mean.dtype), factor)
        variances = running_var.lerp(unbiased.to(running_var.dtype), factor)
        if keep is not None:
            means, variances = torch.where(keep, means, running_mean), torch.where(keep, variances, running_var)
        running_mean.copy_(means)
        running_var.copy_(variances)


class MaskedBatchNorm(nn.Module):
    """Sequence-wise BatchNorm whose statistics count valid frames only (never padding).

    Not an nn.BatchNorm1d, whose forward takes no mask: code that finds BatchNorm modules by type
    (nn.SyncBatchNorm.convert_sync_batchnorm, fusers) must leave this one alone. It holds BatchNorm1d's
    parameters and buffers under the same names and follows its running-average rule (momentum=None:
    the cumulative average), so state dicts move between the two.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"

    def fold(self, mean: torch.Tensor | None, var: torch.Tensor | None, count) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and shift that apply this BN: batch moments in training (updating the running
        averages), running averages in eval."""
        if self.training:
            self.track(mean, var, count)
        else:
            mean, var = self.running_mean, self.running_var
        scale = self.weight * torch.rsqrt(var + self.eps)
        return scale, self.bias - mean * scale

    def track(self, mean: torch.Tensor, var: torch.Tensor, count) -> None:
        """The running averages' step towards a training batch's moments."""
        with torch.no_grad():
            self.num_batches_tracked += 1
            # A tensor, not a float, so reading the count never waits for the GPU.
            factor = (self.momentum if self.momentum is not None
                      else self.num_batches_tracked.reciprocal().to(self.running_mean.dtype))
        track_moments(self.running_mean, self.running_var, mean, var, count, factor)

    def eval_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """In eval, this BN as the per-channel (scale, shift) its running moments give: an affine map."""
        if self.training:
            raise RuntimeError("MaskedBatchNorm.eval_affine: in training the batch's moments apply; call .eval()")
        return self.fold(None, None, 0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, channel_dim: int = -1) -> torch.Tensor:
        return self.normalize(x, mask, channel_dim) * mask

    def hardtanh(self, x: torch.Tensor, mask: torch.Tensor, lo: float, hi: float,
                 channel_dim: int = -1) -> torch.Tensor:
        """Hardtanh(lo, hi) of this BN of x, padding zeroed: the conv front end's step. In training with float32 or
        float64 x, one autograd function (MaskedBNHardtanh) whose backward takes a few passes over x, where
        autograd's of the same operations takes about twice as many; otherwise (eval, autocast) the same
        operations one by one."""
        if self.training and x.dtype in (torch.float32, torch.float64):
            y, mean, var, count = MaskedBNHardtanh.apply(x, mask.to(x.dtype), self.weight, self.bias, self.eps, lo,
                                                         hi, channel_dim)
            self.track(mean, var, count)
            return y
        return nn.functional.hardtanh(self.normalize(x, mask, channel_dim), lo, hi) * mask

    def normalize(self, x: torch.Tensor, mask: torch.Tensor, channel_dim: int = -1) -> torch.Tensor:
        """BN of x with the statistics of its valid positions, its padded ones left unmasked: for a caller that
        masks its own output once, after what follows (the conv front end's Hardtanh)."""
        stats = masked_moments(x, mask, channel_dim) if self.training else (None, None, 0)
        scale, shift = self.fold(*stats)
        shape = [1] * x.dim()
        shape[channel_dim] = -1
        return torch.addcmul(shift.view(shape).to(x.dtype), x, scale.view(shape).to(x.dtype))  # x * scale + shift
