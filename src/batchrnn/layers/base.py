"""The shared machinery of every recurrent layer: RecurrentLayer (directions, reversal, padding, backend),
the masks and time reversal, the fused kernels (cuDNN; on the CPU oneDNN through torch for the LSTM and
batchrnn.layers.cpu_gru for the GRU) and the step loop.

Every layer maps x (T, N, D) and lengths (N,) to (T, N, H) with the directions summed (DS2), zero on
padded frames. The backward direction reads each sequence reversed within its own length, so padding never
reaches a valid frame and the fused kernels run on padded input, without PackedSequence, which was 2.3x
slower on the CPU.
"""
import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import nn

import batchrnn.layers.cpu_gru as cpu_gru
from batchrnn.config import Impl, ModelConfig, RNNType


GATES = {RNNType.gru: 3, RNNType.lstm: 4, RNNType.rnn: 1}
RELU_CLIP = 20.0  # DS2's clipped ReLU: min(max(x, 0), 20)
LN_EPS = 1e-5  # nn.LayerNorm's


def valid_mask(lengths: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """(T, N, 1): 1 on valid frames, 0 on padding."""
    t = torch.arange(steps, device=lengths.device)
    return (t[:, None] < lengths[None, :]).to(dtype)[..., None]


def reversal_rows(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """(T * N,): for each row of a (T * N, ...) view of a (T, N, ...) batch, the row that reverses its sequence
    within its length; padding stays in place."""
    batch = lengths.shape[0]  # not len(): a traced export (ONNX) keeps N free
    t = torch.arange(steps, device=lengths.device)[:, None]
    n = torch.arange(batch, device=lengths.device)
    lengths = lengths[None, :]
    return (torch.where(t < lengths, lengths - 1 - t, t) * batch + n).flatten()


def reverse_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (T, N, ...) with each sequence reversed within its length: rows from reversal_rows (no autograd of its own:
    Reversal's forward and backward, and the exported eval model, which needs no backward)."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows).view(x.shape)  # -1: a traced export keeps T and N free


class Reversal(torch.autograd.Function):
    """x (T, N, ...) with each sequence reversed within its length: whole rows of the (T * N, ...) view, picked by
    reversal_rows. The pick is a permutation that is its own inverse, so the backward is the same pick, where
    gather's is a zero fill and a scatter-add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        return reverse_rows(x, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        return Reversal.apply(grad, rows), None


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
    LSTM, batchrnn.layers.cpu_gru's GRU), or torch's step loop where cpu_gru cannot load."""
    if rnn is RNNType.rnn:
        return cell_loop(rnn, torch.addmm(b_ih, x.flatten(0, 1), w_ih.t()).view(*x.shape[:2], -1), affine(w_hh, b_hh))
    autocast = x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
    if rnn is RNNType.gru and x.device.type == "cpu" and (autocast or x.dtype == torch.float32) and cpu_gru.available():
        # torch's CPU GRU is ATen's step loop; oneDNN's lbr_gru is the same function, fused (layers.cpu_gru).
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
        rev = reversal_rows(lengths, x.shape[0])
        x = self.input_transform(x, mask)
        if self.step_loop:
            inputs = self.input_preactivations(x, mask)  # per direction (T, N, gates x H)
        else:
            folds = self.input_folds(x, mask)
            inputs = [x if f.frame_scale is None else x * f.frame_scale for f in folds]  # per direction (T, N, D)
        out = 0
        for d in range(self.directions):
            seq = inputs[d] if d == 0 else Reversal.apply(inputs[d], rev)
            if self.step_loop:
                h = self.recurrence(seq, d, mask)
            else:
                h = fused_recurrence(self.rnn, seq, folds[d].weight, folds[d].bias, *self.recurrent_weights(d),
                                     self.training)
            out = out + (h if d == 0 else Reversal.apply(h, rev))  # (T, N, H)
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

    # The eval form, for batchrnn.export's fold: in eval each hook below says what the layer does beyond
    # input_folds' (constant) W' and b' and recurrent_weights' U, so that a plain nn.GRU/nn.LSTM can run it.

    def eval_input_affine(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """input_transform in eval as a per-channel (scale, shift) of x; None: x as it comes."""
        return None

    def eval_output_affine(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """output_transform in eval as a per-channel (scale, shift) of the summed directions; None: none."""
        return None

    def eval_frame_norm(self) -> torch.Tensor | None:
        """Where input_folds scales x per frame (ln): M (copies, D, D) with frame_scale = inverse_sigma(x^T M x,
        width); None: no per-frame scale."""
        return None

    def recurrence(self, z: torch.Tensor, d: int, mask: torch.Tensor) -> torch.Tensor:
        """Direction d's outputs (T, N, H) from its input pre-activations z (T, N, gates x H), in the order it
        reads them (the backward direction's reversed within each length); mask (T, N, 1): valid steps."""
        return cell_loop(self.rnn, z, affine(*self.recurrent_weights(d)))



class ProjectedLayer(RecurrentLayer):
    """A variant whose input projection is its own, (copies, width, D): a copy per direction, or one that
    both directions read with model.share_input_weights (DS2)."""

    switches = frozenset({"share_input_weights"})

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        self.share_input_weights = cfg.share_input_weights
        self.copies = 1 if cfg.share_input_weights else self.directions
        self.copy_of = [0 if cfg.share_input_weights else d for d in range(self.directions)]  # per direction
