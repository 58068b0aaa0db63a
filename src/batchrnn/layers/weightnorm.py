"""bn=wn: weight normalisation (Salimans & Kingma 2016) of W, and of U with model.weight_norm_recurrent."""
import torch
from torch import nn

from batchrnn.config import Impl, ModelConfig
from batchrnn.layers.base import InputFold, ProjectedLayer


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
