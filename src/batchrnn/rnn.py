"""Recurrent layers: one class per model.bn variant, all over the same bidirectional machinery.

Every layer maps x (T, N, D) and lengths (N,) to (T, N, H) with the directions summed (DS2), zero on
padded frames. RecurrentLayer owns what every variant shares: the directions (the backward one reads each
sequence reversed within its own length, so padding never reaches a valid frame and the fused kernels run
on padded input, without PackedSequence, which was 2.3x slower on the CPU), the masking, and the backend:
torch's fused kernel, or a step loop written out with autograd.

A variant supplies only what it changes: a transform of the layer's input or output (BN), a fold (per
direction the kernel's input weight and bias (W', b') and optionally one scale per frame of x: BN(W x),
LN(W x) and weight norm all fold exactly, autograd differentiating through the fold), or, for the step
loop, the gate pre-activations of x and the recurrence (ln_full; the cells references).
"""
import functools
import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchrnn import cpu_gru
from batchrnn.config import BNMode, Impl, ModelConfig, RNNType

GATES = {RNNType.gru: 3, RNNType.lstm: 4, RNNType.rnn: 1}
RELU_CLIP = 20.0  # DS2's clipped ReLU: min(max(x, 0), 20)
LN_EPS = 1e-5  # nn.LayerNorm's


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


def product_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the folds' per-frame statistic products (the D^2-per-frame work): bf16 where bf16
    autocast is on, since once x is centred, bf16 products (accumulated in float32, rounded to bf16 once)
    keep what the statistics need (issue 12); x's own (float32, float64) otherwise, and under an fp16
    autocast, whose range a sum over thousands of frames can overflow. Call it outside the fold's
    autocast-disabled block."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) is torch.bfloat16 \
            and x.dtype is not torch.float64:
        return torch.bfloat16
    return full_precision(x).dtype


def masked_moments(x: torch.Tensor, mask: torch.Tensor, channel_dim: int):
    """Mean and biased variance per channel over valid positions; mask is 0/1, broadcastable to x."""
    x, mask = full_precision(x), full_precision(mask)  # statistics in float32 even under autocast
    dims = [d for d in range(x.dim()) if d != channel_dim % x.dim()]
    count = mask.sum() * math.prod(x.shape[d] for d in dims if mask.shape[d] == 1)
    mean = (x * mask).sum(dims, keepdim=True) / count
    var = ((x - mean).square() * mask).sum(dims, keepdim=True) / count
    return mean.flatten(), var.flatten(), count


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
    """Mean and variance of z = W x over valid frames, each (copies, width); x (frames, D) is zero on
    padding, mask (frames, 1), w (copies, width, D). x is centred before its second moment: in float32,
    E[z^2] - E[z]^2 loses what features with a large mean carry. Both routes are exact; they differ
    only in cost. dtype: that of the per-frame products (default x's): with bf16, the gram route's x^T x
    (accumulated in float32, rounded to bf16 once) or the direct route's W x; the mean, the count, the
    direct route's sum of squares and the batch-level products stay in x's dtype."""
    count = mask.sum()
    mean_x = x.sum(0) / count
    xc = (x - mean_x) * mask  # (frames, D), still zero on padding
    xp = xc.to(dtype or xc.dtype)
    if route == "gram":
        var = ((w @ (Gram.apply(xp).to(x.dtype) / count)) * w).sum(-1)
    else:
        var = torch.einsum("fd,cwd->fcw", xp, w.to(xp.dtype)).to(x.dtype).square().sum(0) / count
    return w @ mean_x, var


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
            with torch.no_grad():
                self.num_batches_tracked += 1
                # A tensor, not a float, so reading the count never waits for the GPU.
                factor = (self.momentum if self.momentum is not None
                          else self.num_batches_tracked.reciprocal().to(self.running_mean.dtype))
            track_moments(self.running_mean, self.running_var, mean, var, count, factor)
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


def affine(w: torch.Tensor, b: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """(h, t) -> U h + b: the plain recurrent pre-activations, the same at every step."""
    return lambda h, t: torch.addmm(b, h, w.t())


def cell_loop(rnn: RNNType, z: torch.Tensor, recurrent: Callable, cell_norm: Callable | None = None) -> torch.Tensor:
    """The recurrence written out per step over input pre-activations z (T, N, gates x H), gate order as
    torch's. recurrent(h, t) gives step t's recurrent pre-activations (U h + b; ln_full's LN(U h); rbn's
    BN_t(U h)); cell_norm(c, t)
    normalises the LSTM's cell before its output gate (ln_full). rnn is DS2's clipped ReLU, which no
    fused kernel has."""
    h = z.new_zeros(z.shape[1], z.shape[2] // GATES[rnn])
    c = torch.zeros_like(h)
    out = []
    for t, z_t in enumerate(z):
        g_h = recurrent(h, t)
        if rnn is RNNType.rnn:
            h = torch.clamp(z_t + g_h, 0.0, RELU_CLIP)
        elif rnn is RNNType.gru:
            x_r, x_u, x_n = z_t.chunk(3, 1)
            h_r, h_u, h_n = g_h.chunk(3, 1)
            r, u = torch.sigmoid(x_r + h_r), torch.sigmoid(x_u + h_u)
            n = torch.tanh(x_n + r * h_n)
            h = (1 - u) * n + u * h
        else:
            i, f, g, o = (z_t + g_h).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c if cell_norm is None else cell_norm(c, t))
        out.append(h)
    return torch.stack(out)


KERNELS = {RNNType.gru: nn.GRU, RNNType.lstm: nn.LSTM}
KERNEL_WEIGHTS = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")


@functools.cache
def fused_kernel(rnn: RNNType, input_size: int, hidden_size: int) -> nn.RNNBase:
    """torch's one-layer, one-direction nn.GRU or nn.LSTM on the meta device: the fused kernel behind a
    public API, holding no weights of its own (torch.func.functional_call hands it ours)."""
    return KERNELS[rnn](input_size, hidden_size, device="meta")


@functools.cache
def onednn_has_bf16() -> bool:
    """Whether oneDNN, torch's CPU LSTM kernel, computes bf16 on this CPU (AVX512 and newer; honours
    ONEDNN_MAX_CPU_ISA). Where it does not (AVX2 and older), torch's CPU autocast still hands the LSTM
    bf16 tensors and oneDNN refuses them: `could not create a primitive descriptor for the LSTM forward
    propagation primitive`. Not config.cpu_has_native_bf16 (the trainer's test for train.cpu_bf16): oneDNN also
    takes bf16 on AVX512 CPUs with no native bf16, converting, which works but is no faster."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # what torch's own tests ask
    return probe is None or bool(probe())


def fused_recurrence(rnn: RNNType, x, w_ih, b_ih, w_hh, b_hh, training: bool) -> torch.Tensor:
    """One direction over the whole padded batch with a fused kernel: cuDNN on CUDA; on the CPU oneDNN's (torch's
    LSTM, batchrnn.cpu_gru's GRU), or torch's step loop where cpu_gru cannot load."""
    if rnn is RNNType.rnn:
        return cell_loop(rnn, torch.addmm(b_ih, x.flatten(0, 1), w_ih.t()).view(*x.shape[:2], -1), affine(w_hh, b_hh))
    if rnn is RNNType.gru and x.device.type == "cpu" and cpu_gru.available():
        # torch's CPU GRU is ATen's step loop; oneDNN's lbr_gru is the same function, fused (batchrnn.cpu_gru).
        # Under bf16 autocast it stays float32, as torch's GRU does. float64 (the exactness tests) runs torch's.
        with torch.autocast("cpu", enabled=False):
            args = [full_precision(t) for t in (x, w_ih, b_ih, w_hh, b_hh)]
            if all(t.dtype == torch.float32 for t in args):
                return cpu_gru.recurrence(*args)
    kernel = fused_kernel(rnn, x.shape[-1], w_hh.shape[1]).train(training)
    # On CUDA the module flattens the weights it is handed into one buffer in place (set_). On a view of a
    # parameter, or of a fold both directions read, that would bump a version the other direction's
    # backward checks; copies keep them out of it (the weights only, next to the kernel's own copy).
    weights = dict(zip(KERNEL_WEIGHTS, (t.clone() for t in (w_ih, w_hh, b_ih, b_hh))))
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu") and not onednn_has_bf16():
        # bf16 autocast on a CPU whose oneDNN has no bf16 kernel: the recurrence in float32 instead of an
        # error (the trainer refuses train.cpu_bf16 there anyway; this keeps tests and benches running).
        with torch.autocast("cpu", enabled=False):
            weights = {k: full_precision(t) for k, t in weights.items()}
            return torch.func.functional_call(kernel, weights, (full_precision(x),))[0]
    return torch.func.functional_call(kernel, weights, (x,))[0]


class InputFold(NamedTuple):
    """How x enters one direction's fused kernel: gate pre-activations W' (x * frame_scale) + b'."""
    weight: torch.Tensor  # W' (gates x H, D)
    bias: torch.Tensor  # b' (gates x H,)
    frame_scale: torch.Tensor | None = None  # (T, N, 1), one scalar per frame (LN), or None


class RecurrentLayer(nn.Module):
    """The shared machinery: recurrent weights per direction, directions and reversal, padding, backend.

    A variant overrides what it changes: input_transform / output_transform (the layer's input or output);
    input_folds (per direction an InputFold, for the fused kernel); input_preactivations (per direction
    z (T, N, gates x H), for the step loop: impl=cells, or a variant with no fused route);
    recurrent_weights and recurrence (what U is; the step loop's recurrence). Its class attributes say
    which model settings it takes (config.check_variant reads them).
    """

    impls: tuple[Impl, ...] = (Impl.fused,)  # model.impl values; cells where a step-by-step reference exists
    fused = True  # impl=fused runs torch's fused kernel; False: the variant is a step loop (ln_full)
    switches: frozenset[str] = frozenset()  # model.share_input_weights, model.weight_norm_recurrent

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__()
        self.rnn, self.impl = RNNType(cfg.rnn), Impl(cfg.impl)
        self.input_size, self.hidden_size = input_size, cfg.hidden_size
        self.directions = 2 if cfg.bidirectional else 1
        self.width = GATES[self.rnn] * cfg.hidden_size  # one direction's gate pre-activations, gates x H
        self.weight_hh = nn.Parameter(torch.empty(self.directions, self.width, self.hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(self.directions, self.width))

    def reset_parameters(self) -> None:
        # torch's RNN initialisation: U(-1/sqrt(H), 1/sqrt(H)) for every weight and bias.
        bound = 1.0 / math.sqrt(self.hidden_size)
        for name, p in self.named_parameters(recurse=False):
            nn.init.uniform_(p, -bound, bound)

    @property
    def step_loop(self) -> bool:
        return self.impl is Impl.cells or not self.fused

    def recurrence_kernel(self, device: torch.device) -> str:
        """What runs this layer's float32 recurrence on device, as results.json records it: run identity
        cannot see it (a machine without the oneDNN GRU trains the same run with torch's)."""
        if self.step_loop or self.rnn is RNNType.rnn:
            return "step loop"
        if device.type == "cuda":
            return "cudnn"
        return cpu_gru.kernel_name() if self.rnn is RNNType.gru else "onednn lstm (torch)"

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = valid_mask(lengths, x.shape[0], x.dtype)  # (T, N, 1)
        x = torch.where(mask.bool(), x, 0.0)  # whatever padded frames hold (even NaN), they contribute nothing
        rev = reverse_index(lengths, x.shape[0])
        x = self.input_transform(x, mask)
        if self.step_loop:
            inputs = self.input_preactivations(x, mask)  # per direction (T, N, gates x H)
        else:
            folds = self.input_folds(x, mask)
            inputs = [x if f.frame_scale is None else x * f.frame_scale for f in folds]  # per direction (T, N, D)
        out = 0
        for d in range(self.directions):
            seq = inputs[d] if d == 0 else gather_time(inputs[d], rev)
            if self.step_loop:
                h = self.recurrence(seq, d, mask)
            else:
                h = fused_recurrence(self.rnn, seq, folds[d].weight, folds[d].bias, *self.recurrent_weights(d),
                                     self.training)
            out = out + (h if d == 0 else gather_time(h, rev))  # (T, N, H)
        return self.output_transform(out, mask) * mask

    def input_transform(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x

    def output_transform(self, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return y

    def input_folds(self, x: torch.Tensor, mask: torch.Tensor) -> list[InputFold]:
        raise NotImplementedError

    def input_preactivations(self, x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def recurrent_weights(self, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight_hh[d], self.bias_hh[d]

    def recurrence(self, z: torch.Tensor, d: int, mask: torch.Tensor) -> torch.Tensor:
        """Direction d's outputs (T, N, H) from its input pre-activations z (T, N, gates x H), in the order it
        reads them (the backward direction's reversed within each length); mask (T, N, 1): valid steps."""
        return cell_loop(self.rnn, z, affine(*self.recurrent_weights(d)))


class PlainLayer(RecurrentLayer):
    """bn=none: the fused RNN as it comes, W x + b into every gate."""

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        self.weight_ih = nn.Parameter(torch.empty(self.directions, self.width, input_size))
        self.bias_ih = nn.Parameter(torch.empty(self.directions, self.width))
        self.reset_parameters()

    def input_folds(self, x, mask):
        return [InputFold(w, b) for w, b in zip(self.weight_ih, self.bias_ih)]


class PostBNLayer(PlainLayer):
    """bn=post: sequence-wise BN on the layer's output (directions summed)."""

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        self.bn = MaskedBatchNorm(self.hidden_size)

    def output_transform(self, y, mask):
        return self.bn(y, mask)


class InputBNLayer(PlainLayer):
    """bn=input: sequence-wise BN on x, then the fused RNN (deepspeech.pytorch's approximation)."""

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        self.bn = MaskedBatchNorm(input_size)

    def input_transform(self, x, mask):
        return self.bn(x, mask)


class ProjectedLayer(RecurrentLayer):
    """A variant whose input projection is its own, (copies, width, D): a copy per direction, or one that
    both directions read with model.share_input_weights (DS2)."""

    switches = frozenset({"share_input_weights"})

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        self.share_input_weights = cfg.share_input_weights
        self.copies = 1 if cfg.share_input_weights else self.directions
        self.copy_of = [0 if cfg.share_input_weights else d for d in range(self.directions)]  # per direction


class ProjectedBNLayer(ProjectedLayer):
    """BN(W x) folded into the fused kernel's input weights. `width` is the normalised projection's size
    per direction: gates x H (seqwise) or H (skip)."""

    def __init__(self, cfg: ModelConfig, input_size: int, width: int):
        super().__init__(cfg, input_size)
        self.weight_ih = nn.Parameter(torch.empty(self.copies, width, input_size))
        self.reset_parameters()
        # BN's beta replaces the input bias, as in DS2.
        self.bn = MaskedBatchNorm(self.copies * width)

    def projection_fold(self, x, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W (copies, width, D) and BN(W x)'s scale and shift, each (copies, width)."""
        w = self.weight_ih
        if self.training:
            # Sums, mean and count in float32 even under autocast (a bf16 count would round); the
            # per-frame products of the centred x in autocast's dtype (product_dtype).
            dtype = product_dtype(x)
            with torch.autocast(x.device.type, enabled=False):
                xf, wf = full_precision(x.flatten(0, 1)), full_precision(w)  # (T*N, D), zero on padding
                mf = full_precision(mask.flatten(0, 1))  # (T*N, 1)
                mean, var = projected_moments(xf, wf, mf, cheaper_route(*xf.shape, *wf.shape[:2]), dtype)
                stats = (mean.flatten(), var.flatten(), mf.sum())
        else:
            stats = (None, None, 0)
        scale, shift = self.bn.fold(*stats)
        return w, scale.view(w.shape[:2]), shift.view(w.shape[:2])


class SkipBNLayer(ProjectedBNLayer):
    """bn=skip: cuDNN skip-input; one BN(W x) of size H added to every gate. Exact DS2 for rnn."""

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size, cfg.hidden_size)

    def input_folds(self, x, mask):
        w, scale, shift = self.projection_fold(x, mask)
        g = GATES[self.rnn]
        return [InputFold((scale[k, :, None] * w[k]).repeat(g, 1), shift[k].repeat(g)) for k in self.copy_of]


class SeqwiseBNLayer(ProjectedBNLayer):
    """bn=seqwise: exact DS2, h_t = f(BN(W x_t) + U h_{t-1}), each gate its own slice of BN(W x).

    impl=fused folds the BN into the fused kernel; impl=cells normalises W x as written and runs the
    recurrence with autograd cells (the slow reference). Both hold the same parameters under the same names.
    """

    impls = (Impl.fused, Impl.cells)

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size, GATES[RNNType(cfg.rnn)] * cfg.hidden_size)

    def input_folds(self, x, mask):
        w, scale, shift = self.projection_fold(x, mask)
        return [InputFold(scale[k, :, None] * w[k], shift[k]) for k in self.copy_of]

    def input_preactivations(self, x, mask):
        z = torch.einsum("tnd,cgd->tncg", x, self.weight_ih).flatten(2)  # (T, N, copies*G*H)
        z = self.bn(z, mask).view(*z.shape[:2], self.copies, -1)
        return [z[:, :, k] for k in self.copy_of]


class LayerNormLayer(ProjectedLayer):
    """bn=ln: LayerNorm of W x over one frame's gates x H, h_t = f(LN(W x_t) + U h_{t-1}), folded into
    the fused kernel, exact.

    With W_c = W minus the mean of its rows, W_c x = W x - mean(W x), so LN(W x) = diag(gain) W_c (x /
    sigma(x)) + bias with sigma(x)^2 = |W_c x|^2 / K + eps, K = gates x H: the kernel gets W' = diag(gain)
    W_c, b' = bias, and x scaled by one scalar per frame. |W_c x|^2 comes from x^T (W_c^T W_c) x or from
    W_c x, whichever is cheaper for the batch; autograd carries the gradient through sigma. impl=cells
    computes LN(W x) as written (the reference).
    """

    impls = (Impl.fused, Impl.cells)

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        self.weight_ih = nn.Parameter(torch.empty(self.copies, self.width, input_size))
        self.gain_ih = nn.Parameter(torch.empty(self.copies, self.width))
        self.bias_ih = nn.Parameter(torch.empty(self.copies, self.width))  # LN's shift replaces the input bias
        self.reset_parameters()
        nn.init.ones_(self.gain_ih)
        nn.init.zeros_(self.bias_ih)

    def input_folds(self, x, mask):
        wc = self.weight_ih - self.weight_ih.mean(1, keepdim=True)  # (copies, K, D), rows centred
        # Under bf16 autocast the products in bf16, accumulated in float32 and rounded once: M = W_c^T W_c
        # and the per-frame ones that use it (LN's frame scales stay within 1.1e-3 of float64's); the
        # per-frame sums, sigma and its inverse in float32.
        dtype = product_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xf, wcf = full_precision(x.flatten(0, 1)), full_precision(wc)  # (T*N, D), zero on padding
            xp = xf.to(dtype)
            if cheaper_route(*xf.shape, *wcf.shape[:2], grams=self.copies, batch_products=2) == "gram":
                m = Gram.apply(wcf.to(dtype))  # W_c^T W_c per copy, a batch-level product
                square = QuadraticForm.apply(xp, m).to(xf.dtype)  # (copies, T*N): |W_c x|^2
            else:
                square = (xp @ wcf.transpose(1, 2).to(dtype)).to(xf.dtype).square().sum(-1)
            inv_sigma = torch.rsqrt(square.clamp_min(0) / self.width + LN_EPS).view(self.copies, *x.shape[:2], 1)
        return [InputFold(self.gain_ih[k, :, None] * wc[k], self.bias_ih[k], inv_sigma[k].to(x.dtype))
                for k in self.copy_of]

    def input_preactivations(self, x, mask):
        return [F.layer_norm(x @ self.weight_ih[k].t(), (self.width,), self.gain_ih[k], self.bias_ih[k], LN_EPS)
                for k in self.copy_of]


class FullLayerNormLayer(LayerNormLayer):
    """bn=ln_full: Ba et al.'s (2016) LayerNorm LSTM and GRU, a step loop (no fused kernel normalises U h).

    LSTM (their eq. 20-22): (i, f, g, o) = LN(W x_t) + LN(U h_{t-1}), c_t = s(f) c_{t-1} + s(i) tanh(g),
    h_t = s(o) tanh(LN(c_t)). GRU, the same rule on torch's gates, each LN over all gates of its term:
    a = LN(W x_t), b = LN(U h_{t-1}), r = s(a_r + b_r), u = s(a_u + b_u), n = tanh(a_n + r b_n),
    h_t = (1 - u) n + u h_{t-1}. rnn: h_t = clip(LN(W x_t) + LN(U h_{t-1})). Each LN has its gain and
    shift: W x's are ln's (gain_ih, bias_ih), U h's gain_hh and bias_hh, the LSTM cell's gain_cell and
    bias_cell.
    """

    impls = (Impl.fused,)  # one implementation, its step loop; model.impl stays at its default
    fused = False

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        self.gain_hh = nn.Parameter(torch.ones(self.directions, self.width))
        if self.rnn is RNNType.lstm:
            self.gain_cell = nn.Parameter(torch.ones(self.directions, self.hidden_size))
            self.bias_cell = nn.Parameter(torch.zeros(self.directions, self.hidden_size))

    def recurrence(self, z, d, mask):
        w_hh, b_hh = self.recurrent_weights(d)
        gain_hh = self.gain_hh[d]

        def recurrent(h, t):
            return F.layer_norm(h @ w_hh.t(), (self.width,), gain_hh, b_hh, LN_EPS)

        def cell_norm(c, t):
            return F.layer_norm(c, (self.hidden_size,), self.gain_cell[d], self.bias_cell[d], LN_EPS)

        return cell_loop(self.rnn, z, recurrent, cell_norm if self.rnn is RNNType.lstm else None)


def step_moments(z: torch.Tensor, mask: torch.Tensor):
    """Mean and biased variance of z (S, N, F) over each step's valid rows (mask (S, N, 1)), each (S, F),
    and the count (S, 1); in float32 under autocast. A step with no valid row gets 0 and 0."""
    z, mask = full_precision(z), full_precision(mask)
    count = mask.sum(1)
    safe = count.clamp_min(1)
    mean = (z * mask).sum(1) / safe
    return mean, ((z - mean[:, None]).square() * mask).sum(1) / safe, count


class RecurrentBNLayer(FullLayerNormLayer):
    """bn=rbn: Cooijmans et al.'s (2016) recurrent batch normalisation, a step loop: ln_full's structure
    with a BN in place of each LN, its statistics per time step. LSTM (their eq. 6-8): (i, f, g, o) =
    BN_t(W x_t) + BN_t(U h_{t-1}), c_t = s(f) c_{t-1} + s(i) tanh(g), h_t = s(o) tanh(BN_t(c_t)); GRU and rnn
    as ln_full's. In training, BN_t takes the moments of step t over the batch's sequences still running
    at t (for the backward direction, its own t-th step) while at least MIN_ROWS run, and the later steps
    those of the last such step; in eval, the population moments of step t, averaged as BatchNorm's running
    ones, steps beyond the longest trained one (`trained_steps`, per direction: their T_max) taking its.
    The gains start at 0.1 and the shifts at 0, as theirs; parameters under ln_full's names, the moments
    in buffers running_{mean,var}_{ih,hh,cell} of (directions, MAX_STEPS, features).
    """

    MAX_STEPS = 512  # frames after the front end: AN4's longest utterance is under this at time stride 2
    MIN_ROWS = 2  # a variance needs two sequences; one alone would normalise to the shift exactly
    GAIN, MOMENTUM, EPS = 0.1, 0.1, 1e-5

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        norms = {"ih": self.width, "hh": self.width} | ({"cell": self.hidden_size} if self.rnn is RNNType.lstm else {})
        with torch.no_grad():
            for name in norms:
                getattr(self, f"gain_{name}").fill_(self.GAIN)
                getattr(self, f"bias_{name}").zero_()
        for name, width in norms.items():
            self.register_buffer(f"running_mean_{name}", torch.zeros(self.directions, self.MAX_STEPS, width))
            self.register_buffer(f"running_var_{name}", torch.ones(self.directions, self.MAX_STEPS, width))
        # per direction, how many steps have had batch moments so far: their T_max
        self.register_buffer("trained_steps", torch.zeros(self.directions, dtype=torch.long))

    def population(self, name: str, d: int, steps) -> tuple[torch.Tensor, torch.Tensor]:
        """The population mean and variance of direction d at steps (an int or a tensor of them), detached."""
        last = max(min(int(self.trained_steps[d]), self.MAX_STEPS) - 1, 0)
        slots = steps.clamp_max(last) if torch.is_tensor(steps) else min(steps, last)
        return (getattr(self, f"running_mean_{name}")[d, slots].detach().clone(),
                getattr(self, f"running_var_{name}")[d, slots].detach().clone())

    def remember(self, name: str, d: int, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        """The population moments of steps 0..S-1 (those below MAX_STEPS with MIN_ROWS running) take a step
        of MOMENTUM towards the batch's (mean, var (S, F), count (S, 1)), as BatchNorm's running ones."""
        n = min(mean.shape[0], self.MAX_STEPS)
        means, variances = getattr(self, f"running_mean_{name}")[d, :n], getattr(self, f"running_var_{name}")[d, :n]
        count = count[:n].to(means.dtype)
        track_moments(means, variances, mean[:n], var[:n], count, self.MOMENTUM, keep=count >= self.MIN_ROWS)

    def normalise(self, v: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, gain, bias) -> torch.Tensor:
        scale = gain * torch.rsqrt(var + self.EPS)
        return torch.addcmul(bias - mean * scale, full_precision(v), scale)

    def input_preactivations(self, x, mask):  # W x as it comes: its BN_t is per step of each direction
        return [x @ self.weight_ih[k].t() for k in self.copy_of]

    def recurrence(self, z, d, mask):
        k, w_hh, lstm = self.copy_of[d], self.weight_hh[d], self.rnn is RNNType.lstm
        steps = torch.arange(z.shape[0], device=z.device)
        mean, var = self.population("ih", d, steps)
        if not self.training:
            z = self.normalise(z, mean[:, None], var[:, None], self.gain_ih[k], self.bias_ih[k])
            return cell_loop(self.rnn, z, lambda h, t: self.normalise(h @ w_hh.t(), *self.population("hh", d, t),
                                                                      self.gain_hh[d], self.bias_hh[d]),
                             (lambda c, t: self.normalise(c, *self.population("cell", d, t), self.gain_cell[d],
                                                          self.bias_cell[d])) if lstm else None)
        valid = mask[:, :, 0] > 0
        running = valid.sum(1).tolist()  # sequences running at each step, never more at a later step
        enough = sum(r >= self.MIN_ROWS for r in running)  # the steps with batch moments: a prefix
        batch_mean, batch_var, count = step_moments(z, mask)
        if enough:  # the later steps take the last such step's moments (a batch of one: the population's)
            mean, var = batch_mean[steps.clamp_max(enough - 1)], batch_var[steps.clamp_max(enough - 1)]
        z = self.normalise(z, mean[:, None], var[:, None], self.gain_ih[k], self.bias_ih[k])
        # The rows longest first, so that the sequences still running at step t are the first running[t]:
        # each step's moments are one var_mean over a slice.
        order = torch.argsort(valid.sum(0), descending=True, stable=True)
        seen = {"hh": [], "cell": []}
        last = {}

        def step(name, v, t, gain, bias):  # BN_t of v (N, F), the rows in `order`
            if t < enough:
                var, mean = torch.var_mean(full_precision(v[: running[t]]), dim=0, correction=0)
                seen[name].append((mean.detach(), var.detach()))
                last[name] = mean, var
            return self.normalise(v, *last.get(name) or self.population(name, d, t), gain, bias)

        out = cell_loop(self.rnn, z[:, order],
                        lambda h, t: step("hh", h @ w_hh.t(), t, self.gain_hh[d], self.bias_hh[d]),
                        (lambda c, t: step("cell", c, t, self.gain_cell[d], self.bias_cell[d])) if lstm else None)
        self.remember("ih", d, batch_mean.detach(), batch_var.detach(), count)
        for name, moments in seen.items():  # the steps with MIN_ROWS running: a prefix, as running falls with t
            if moments:
                self.remember(name, d, *(torch.stack(m) for m in zip(*moments)),
                              torch.tensor(running[: len(moments)], device=z.device)[:, None])
        with torch.no_grad():
            self.trained_steps[d].clamp_(min=min(enough, self.MAX_STEPS))
        return out[:, torch.argsort(order)]


def weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Salimans & Kingma's w = g v / |v|, per row: g (..., rows), v (..., rows, columns)."""
    return g[..., None] * v / torch.linalg.vector_norm(v, dim=-1, keepdim=True)


class WeightNormLayer(ProjectedLayer):
    """bn=wn: weight normalisation (Salimans & Kingma 2016) of W, each output unit's row w = g v / |v|,
    folded into the fused kernel's input weights: exact, and no statistics. With
    model.weight_norm_recurrent=true, U's rows the same way. impl=cells projects x with v and scales by
    g / |v| after (the reference)."""

    impls = (Impl.fused, Impl.cells)
    switches = ProjectedLayer.switches | {"weight_norm_recurrent"}

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        self.weight_norm_recurrent = cfg.weight_norm_recurrent
        if self.weight_norm_recurrent:  # U's rows become v and g
            self.weight_hh_v = self.weight_hh
            del self.weight_hh
            self.weight_hh_g = nn.Parameter(torch.empty(self.directions, self.width))
        self.weight_ih_v = nn.Parameter(torch.empty(self.copies, self.width, input_size))
        self.weight_ih_g = nn.Parameter(torch.empty(self.copies, self.width))
        self.bias_ih = nn.Parameter(torch.empty(self.copies, self.width))
        self.reset_parameters()
        with torch.no_grad():  # g = |v| at the start, so w = v: torch's initialisation, as weight_norm keeps it
            self.weight_ih_g.copy_(torch.linalg.vector_norm(self.weight_ih_v, dim=-1))
            if self.weight_norm_recurrent:
                self.weight_hh_g.copy_(torch.linalg.vector_norm(self.weight_hh_v, dim=-1))

    def input_folds(self, x, mask):
        w = weight_norm(self.weight_ih_g, self.weight_ih_v)  # (copies, gates x H, D)
        return [InputFold(w[k], self.bias_ih[k]) for k in self.copy_of]

    def input_preactivations(self, x, mask):
        scale = self.weight_ih_g / torch.linalg.vector_norm(self.weight_ih_v, dim=-1)  # (copies, gates x H)
        return [(x @ self.weight_ih_v[k].t()) * scale[k] + self.bias_ih[k] for k in self.copy_of]

    def recurrent_weights(self, d):
        if not self.weight_norm_recurrent:
            return super().recurrent_weights(d)
        return weight_norm(self.weight_hh_g[d], self.weight_hh_v[d]), self.bias_hh[d]


LAYERS: dict[BNMode, type[RecurrentLayer]] = {
    BNMode.none: PlainLayer,
    BNMode.post: PostBNLayer,
    BNMode.input: InputBNLayer,
    BNMode.skip: SkipBNLayer,
    BNMode.seqwise: SeqwiseBNLayer,
    BNMode.ln: LayerNormLayer,
    BNMode.ln_full: FullLayerNormLayer,
    BNMode.rbn: RecurrentBNLayer,
    BNMode.wn: WeightNormLayer,
}


def backend(bn: str, impl: str) -> str:
    """What computes a variant's recurrence, as tables name it: `fused` (torch's kernel), `cells` (the
    step-by-step reference), or `loop` where impl=fused builds a variant with no fused route (ln_full, rbn)."""
    return "loop" if Impl(impl) is Impl.fused and not LAYERS[BNMode(bn)].fused else Impl(impl).value
