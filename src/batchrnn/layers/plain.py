"""bn=none, post and input: the fused RNN as it comes, with BN on its output or on its input."""
import torch
from torch import nn

from batchrnn.config import ModelConfig
from batchrnn.layers.base import InputFold, RecurrentLayer
from batchrnn.layers.folds import MaskedBatchNorm


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

    def eval_output_affine(self):
        return self.bn.eval_affine()


class InputBNLayer(PlainLayer):
    """bn=input: sequence-wise BN on x, then the fused RNN (deepspeech.pytorch's approximation)."""

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        self.bn = MaskedBatchNorm(input_size)

    def input_transform(self, x, mask):
        return self.bn(x, mask)

    def eval_input_affine(self):
        return self.bn.eval_affine()
