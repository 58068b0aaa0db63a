"""Recurrent layers: one class per model.bn variant, all over the same bidirectional machinery.

Every layer maps x (T, N, D) and lengths (N,) to (T, N, H) with the directions summed (DS2), zero on
padded frames. The backward direction reads each sequence reversed within its own length, so padding
never reaches a valid frame, and the library's fused kernels run on padded input (no PackedSequence,
which was 2.3x slower on the CPU).

How x enters the gates is all that differs between variants. Each gives, per direction, an effective
input weight and bias (W', b') with gate pre-activations W' x + b'. For sequence-wise BN of W x that is
the fold BN(W x) = diag(s) W x + (beta - s mu), s = gamma / sqrt(var + eps), with mu and var the
moments of W x over valid frames, computed through E[x x^T] or W x, whichever is cheaper for the
batch: exact either way, and autograd differentiates through s and mu.
"""
import math

import torch
from torch import _VF, nn

from batchrnn.config import BNMode, Impl, RNNType

GATES = {RNNType.gru: 3, RNNType.lstm: 4, RNNType.rnn: 1}
RELU_CLIP = 20.0  # DS2's clipped ReLU: min(max(x, 0), 20)


def valid_mask(lengths: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """(T, N, 1): 1 on valid frames, 0 on padding."""
    t = torch.arange(steps, device=lengths.device)
    return (t[:, None] < lengths[None, :]).to(dtype)[..., None]


def reverse_index(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """(T, N): time index that reverses each sequence within its length and leaves padding in place."""
    t = torch.arange(steps, device=lengths.device)[:, None]
    lengths = lengths[None, :]
    return torch.where(t < lengths, lengths - 1 - t, t)


def gather_time(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(0, index[..., None].expand_as(x))


def full_precision(t: torch.Tensor) -> torch.Tensor:
    """Half-precision tensors (autocast) up to float32; float32 and float64 stay as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def masked_moments(x: torch.Tensor, mask: torch.Tensor, channel_dim: int):
    """Mean and biased variance per channel over valid positions; mask is 0/1, broadcastable to x."""
    x = full_precision(x)  # statistics in float32 even under autocast
    dims = [d for d in range(x.dim()) if d != channel_dim % x.dim()]
    count = mask.sum() * math.prod(x.shape[d] for d in dims if mask.shape[d] == 1)
    mean = (x * mask).sum(dims, keepdim=True) / count
    var = ((x - mean).square() * mask).sum(dims, keepdim=True) / count
    return mean.flatten(), var.flatten(), count


class Gram(torch.autograd.Function):
    """x^T x with the backward that uses its symmetry: one matmul, where autograd of `x.t() @ x` would
    do two (one per operand). On the fold's hot path, the statistic that costs D^2 per frame."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.t() @ x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return x @ (grad + grad.t())


def cheaper_route(frames: int, d: int, copies: int, width: int) -> str:
    """Fewer multiply-adds (forward and backward) for the moments of W x: "gram" goes through
    E[x x^T] (2 D^2 per frame, then 3 copies x width x D^2 per batch), "direct" computes W x
    (3 copies x width x D per frame). Long batches favour gram, short ones with a wide input direct."""
    gram = 2 * d * d * frames + 3 * copies * width * d * d
    return "gram" if gram <= 3 * copies * width * d * frames else "direct"


def projected_moments(x: torch.Tensor, w: torch.Tensor, count, route: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and second moment of z = W x over valid frames, each (copies, width); x (frames, D) is zero
    on padding, w (copies, width, D). Both routes are exact; they differ only in cost."""
    mean = w @ (x.sum(0) / count)
    if route == "gram":
        return mean, ((w @ (Gram.apply(x) / count)) * w).sum(-1)
    z = torch.einsum("fd,cwd->fcw", x, w)  # (frames, copies, width)
    return mean, z.square().sum(0) / count


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
            with torch.no_grad():
                self.num_batches_tracked += 1
                # A tensor, not a float, so reading the count never waits for the GPU.
                factor = (self.momentum if self.momentum is not None
                          else self.num_batches_tracked.reciprocal().to(self.running_mean.dtype))
                unbiased = var.detach() * count / (count - 1).clamp_min(1)
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        else:
            mean, var = self.running_mean, self.running_var
        scale = self.weight * torch.rsqrt(var + self.eps)
        return scale, self.bias - mean * scale

    def forward(self, x: torch.Tensor, mask: torch.Tensor, channel_dim: int = -1) -> torch.Tensor:
        stats = masked_moments(x, mask, channel_dim) if self.training else (None, None, 0)
        scale, shift = self.fold(*stats)
        shape = [1] * x.dim()
        shape[channel_dim] = -1
        return (x * scale.view(shape).to(x.dtype) + shift.view(shape).to(x.dtype)) * mask


def clipped_relu_loop(z: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor) -> torch.Tensor:
    """DS2 simple RNN over precomputed input pre-activations z (T, N, H). No fused kernel clips."""
    h = z.new_zeros(z.shape[1:])
    out = []
    for z_t in z:
        h = torch.clamp(z_t + torch.addmm(b_hh, h, w_hh.t()), 0.0, RELU_CLIP)
        out.append(h)
    return torch.stack(out)


def cell_loop(rnn: RNNType, z: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor) -> torch.Tensor:
    """The autograd-cell reference: the recurrence written out per step, gate order as torch's."""
    if rnn is RNNType.rnn:
        return clipped_relu_loop(z, w_hh, b_hh)
    h = z.new_zeros(z.shape[1], w_hh.shape[1])
    c = torch.zeros_like(h)
    out = []
    for z_t in z:
        g_h = torch.addmm(b_hh, h, w_hh.t())
        if rnn is RNNType.gru:
            x_r, x_u, x_n = z_t.chunk(3, 1)
            h_r, h_u, h_n = g_h.chunk(3, 1)
            r, u = torch.sigmoid(x_r + h_r), torch.sigmoid(x_u + h_u)
            n = torch.tanh(x_n + r * h_n)
            h = (1 - u) * n + u * h
        else:
            i, f, g, o = (z_t + g_h).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        out.append(h)
    return torch.stack(out)


def fused_recurrence(rnn: RNNType, x, w_ih, b_ih, w_hh, b_hh, training: bool) -> torch.Tensor:
    """One direction over the whole padded batch with the library's fused kernel (cuDNN on CUDA)."""
    if rnn is RNNType.rnn:
        return clipped_relu_loop(torch.addmm(b_ih, x.flatten(0, 1), w_ih.t()).view(*x.shape[:2], -1), w_hh, b_hh)
    params = [w_ih, w_hh, b_ih, b_hh]
    h0 = x.new_zeros(1, x.shape[1], w_hh.shape[1])
    if rnn is RNNType.gru:
        return _VF.gru(x, h0, params, True, 1, 0.0, training, False, False)[0]
    return _VF.lstm(x, (h0, h0), params, True, 1, 0.0, training, False, False)[0]


class RecurrentLayer(nn.Module):
    """Shared machinery: recurrent weights per direction, direction handling, padding."""

    def __init__(self, rnn: str, input_size: int, hidden_size: int, bidirectional: bool = True):
        super().__init__()
        self.rnn = RNNType(rnn)
        self.input_size, self.hidden_size = input_size, hidden_size
        self.directions = 2 if bidirectional else 1
        gh = GATES[self.rnn] * hidden_size
        self.weight_hh = nn.Parameter(torch.empty(self.directions, gh, hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(self.directions, gh))

    def reset_parameters(self) -> None:
        # torch's RNN initialisation: U(-1/sqrt(H), 1/sqrt(H)) for every weight and bias.
        bound = 1.0 / math.sqrt(self.hidden_size)
        for name, p in self.named_parameters(recurse=False):
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = valid_mask(lengths, x.shape[0], x.dtype)  # (T, N, 1)
        x = torch.where(mask.bool(), x, 0.0)  # whatever padded frames hold (even NaN), they contribute nothing
        return self.recur(x, mask, reverse_index(lengths, x.shape[0])) * mask

    def recur(self, x, mask, rev) -> torch.Tensor:
        """Default: fused kernel per direction with the weights from input_weights."""
        out = 0
        for d, (w_ih, b_ih) in enumerate(self.input_weights(x, mask)):
            x_d = x if d == 0 else gather_time(x, rev)
            h = fused_recurrence(self.rnn, x_d, w_ih, b_ih, self.weight_hh[d], self.bias_hh[d], self.training)
            out = out + (h if d == 0 else gather_time(h, rev))
        return out

    def input_weights(self, x, mask) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError


class PlainLayer(RecurrentLayer):
    """bn=none: the fused RNN as it comes, W x + b into every gate."""

    def __init__(self, rnn, input_size, hidden_size, bidirectional=True):
        super().__init__(rnn, input_size, hidden_size, bidirectional)
        gh = GATES[self.rnn] * hidden_size
        self.weight_ih = nn.Parameter(torch.empty(self.directions, gh, input_size))
        self.bias_ih = nn.Parameter(torch.empty(self.directions, gh))
        self.reset_parameters()

    def input_weights(self, x, mask):
        return list(zip(self.weight_ih, self.bias_ih))


class PostBNLayer(PlainLayer):
    """bn=post: sequence-wise BN on the layer's output (directions summed)."""

    def __init__(self, rnn, input_size, hidden_size, bidirectional=True):
        super().__init__(rnn, input_size, hidden_size, bidirectional)
        self.bn = MaskedBatchNorm(hidden_size)

    def recur(self, x, mask, rev):
        return self.bn(super().recur(x, mask, rev), mask)


class InputBNLayer(PlainLayer):
    """bn=input: sequence-wise BN on x, then the fused RNN (deepspeech.pytorch's approximation)."""

    def __init__(self, rnn, input_size, hidden_size, bidirectional=True):
        super().__init__(rnn, input_size, hidden_size, bidirectional)
        self.bn = MaskedBatchNorm(input_size)

    def recur(self, x, mask, rev):
        return super().recur(self.bn(x, mask), mask, rev)


class ProjectedBNLayer(RecurrentLayer):
    """BN(W x) folded into the fused kernel's input weights; W optionally shared by both directions.

    `width` is the normalised projection's size per direction: gates x H (seqwise) or H (skip).
    """

    def __init__(self, rnn, input_size, hidden_size, bidirectional, width, share_input_weights):
        super().__init__(rnn, input_size, hidden_size, bidirectional)
        self.share_input_weights = share_input_weights
        copies = 1 if share_input_weights else self.directions
        self.weight_ih = nn.Parameter(torch.empty(copies, width, input_size))
        self.reset_parameters()
        # BN's beta replaces the input bias, as in DS2.
        self.bn = MaskedBatchNorm(copies * width)

    def projection_fold(self, x, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W (copies, width, D) and BN(W x)'s scale and shift, each (copies, width)."""
        w = self.weight_ih
        if self.training:
            # Statistics in float32 even under autocast: E[z^2] - E[z]^2 in bf16 would be noise.
            with torch.autocast(x.device.type, enabled=False):
                xf, wf = full_precision(x.flatten(0, 1)), full_precision(w)  # (T*N, D), zero on padding
                count = mask.sum()
                mean, second = projected_moments(xf, wf, count, cheaper_route(*xf.shape, *wf.shape[:2]))
                stats = (mean.flatten(), (second - mean.square()).flatten(), count)
        else:
            stats = (None, None, 0)
        scale, shift = self.bn.fold(*stats)
        return w, scale.view(w.shape[:2]), shift.view(w.shape[:2])

    def direction_copy(self, d: int) -> int:
        return 0 if self.share_input_weights else d


class SkipBNLayer(ProjectedBNLayer):
    """bn=skip: cuDNN skip-input; one BN(W x) of size H added to every gate. Exact DS2 for rnn."""

    def __init__(self, rnn, input_size, hidden_size, bidirectional=True, share_input_weights=False):
        super().__init__(rnn, input_size, hidden_size, bidirectional, hidden_size, share_input_weights)

    def input_weights(self, x, mask):
        w, scale, shift = self.projection_fold(x, mask)
        g = GATES[self.rnn]
        out = []
        for d in range(self.directions):
            k = self.direction_copy(d)
            out.append(((scale[k, :, None] * w[k]).repeat(g, 1), shift[k].repeat(g)))
        return out


class SeqwiseBNLayer(ProjectedBNLayer):
    """bn=seqwise: exact DS2, h_t = f(BN(W x_t) + U h_{t-1}), each gate its own slice of BN(W x).

    impl=fused folds the BN into the fused kernel; impl=cells runs the explicit recurrence with
    autograd cells (the slow reference). Both hold the same parameters under the same names.
    """

    def __init__(self, rnn, input_size, hidden_size, bidirectional=True, share_input_weights=False,
                 impl: str = "fused"):
        width = GATES[RNNType(rnn)] * hidden_size
        super().__init__(rnn, input_size, hidden_size, bidirectional, width, share_input_weights)
        self.impl = Impl(impl)

    def input_weights(self, x, mask):
        w, scale, shift = self.projection_fold(x, mask)
        return [(scale[k, :, None] * w[k], shift[k]) for k in map(self.direction_copy, range(self.directions))]

    def recur(self, x, mask, rev):
        if self.impl is Impl.fused:
            return super().recur(x, mask, rev)
        copies = self.weight_ih.shape[0]
        z = torch.einsum("tnd,cgd->tncg", x, self.weight_ih).flatten(2)  # (T, N, copies*G*H)
        z = self.bn(z, mask).view(*z.shape[:2], copies, -1)
        out = 0
        for d in range(self.directions):
            z_d = z[:, :, self.direction_copy(d)]
            if d == 1:
                z_d = gather_time(z_d, rev)
            h = cell_loop(self.rnn, z_d, self.weight_hh[d], self.bias_hh[d])
            out = out + (h if d == 0 else gather_time(h, rev))
        return out


LAYERS: dict[BNMode, type[RecurrentLayer]] = {
    BNMode.none: PlainLayer,
    BNMode.post: PostBNLayer,
    BNMode.input: InputBNLayer,
    BNMode.skip: SkipBNLayer,
    BNMode.seqwise: SeqwiseBNLayer,
}
