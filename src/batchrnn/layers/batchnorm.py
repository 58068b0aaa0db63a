"""bn=skip and seqwise: BN(W x) folded exactly into the fused kernel's input weights (seqwise is DS2's
sequence-wise BN; skip is cuDNN's skip-input mode, one BN(W x) of size H added to every gate)."""
import torch
from torch import nn

from batchrnn.config import Impl, ModelConfig, RNNType
from batchrnn.layers.base import GATES, InputFold, ProjectedLayer, full_precision, product_dtype
from batchrnn.layers.folds import MaskedBatchNorm, cheaper_route, projected_moments


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
                mean, var, count = projected_moments(xf, wf, mf, cheaper_route(*xf.shape, *wf.shape[:2]), dtype)
                stats = (mean.flatten(), var.flatten(), count)
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
