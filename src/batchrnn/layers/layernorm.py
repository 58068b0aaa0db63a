"""bn=ln (LN(W x) folded into the fused kernel) and ln_full (Ba et al.'s LayerNorm LSTM/GRU, a step loop)."""
import torch
import torch.nn.functional as F
from torch import nn

from batchrnn.config import Impl, ModelConfig, RNNType
from batchrnn.layers.base import InputFold, LN_EPS, ProjectedLayer, cell_loop, full_precision, product_dtype
from batchrnn.layers.folds import Gram, QuadraticForm, cheaper_route


def inverse_sigma(square: torch.Tensor, width: int) -> torch.Tensor:
    """LN(W x)'s 1 / sigma(x) from |W_c x|^2 over the K = width gate pre-activations: the frame's scale of x."""
    return torch.rsqrt(square.clamp_min(0) / width + LN_EPS)


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
            inv_sigma = inverse_sigma(square, self.width).view(self.copies, *x.shape[:2], 1)
        return [InputFold(self.gain_ih[k, :, None] * wc[k], self.bias_ih[k], inv_sigma[k].to(x.dtype))
                for k in self.copy_of]

    def eval_frame_norm(self):
        wc = self.weight_ih - self.weight_ih.mean(1, keepdim=True)
        return wc.transpose(1, 2) @ wc  # W_c^T W_c per copy: |W_c x|^2 = x^T M x

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
