"""The DS2 model: a Conv2d front end, a stack of recurrent layers of one variant, a linear CTC head."""
import dataclasses
from enum import Enum

import torch
from torch import nn

from batchrnn.config import BNMode, ModelConfig
from batchrnn.layers import check_variant
from batchrnn.layers import LAYERS
from batchrnn.layers.base import RecurrentLayer
from batchrnn.layers.folds import MaskedBatchNorm


def build_recurrent_layer(rnn: str, bn: str, input_size: int, hidden_size: int, **settings) -> RecurrentLayer:
    """One recurrent layer of the variant (rnn, bn): forward(x (T, N, input_size), lengths (N,)) ->
    (T, N, hidden_size), directions summed. settings: any other ModelConfig field (impl, bidirectional,
    share_input_weights, weight_norm_recurrent), as a value or its name; ModelConfig's default otherwise."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown := sorted(set(settings) - fields):
        raise TypeError(f"build_recurrent_layer: no model setting {', '.join(unknown)}; "
                        f"the settings are {', '.join(sorted(fields))}")
    given = {"rnn": rnn, "bn": bn, "hidden_size": hidden_size, **settings}
    defaults = ModelConfig()
    # an enum field given by its name ("cells") becomes its member (Impl.cells), as the config's would be
    return recurrent_layer(ModelConfig(**{k: type(d)(v) if isinstance(d := getattr(defaults, k), Enum) else v
                                          for k, v in given.items()}), input_size)


def recurrent_layer(cfg: ModelConfig, input_size: int) -> RecurrentLayer:
    """The layer class of cfg's variant, built from cfg itself (a ModelConfig or the run's model section)."""
    check_variant(cfg)  # the combinations without a layer, refused where the config is checked too
    return LAYERS[BNMode(cfg.bn)](cfg, input_size)


def conv_output_length(lengths: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    return (lengths + 2 * (kernel // 2) - kernel) // stride + 1


class ConvFrontEnd(nn.Module):
    """DS2's Conv2d layers over (freq, time), each with sequence-wise BN and Hardtanh(0, 20); padded
    frames are zeroed after every layer so they never leak into valid ones (deepspeech.pytorch's MaskConv)."""

    def __init__(self, cfg: ModelConfig, num_features: int):
        super().__init__()
        self.layers = nn.ModuleList()
        self.norms = nn.ModuleList()
        channels, freq = 1, num_features
        for c in cfg.conv:
            self.layers.append(nn.Conv2d(channels, c.channels, (c.kernel_freq, c.kernel_time),
                                         (c.stride_freq, c.stride_time), (c.kernel_freq // 2, c.kernel_time // 2)))
            self.norms.append(MaskedBatchNorm(c.channels))
            channels, freq = c.channels, (freq + 2 * (c.kernel_freq // 2) - c.kernel_freq) // c.stride_freq + 1
        self.output_size = channels * freq

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        for conv in self.layers:
            lengths = conv_output_length(lengths, conv.kernel_size[1], conv.stride[1])
        return lengths

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.unsqueeze(1)  # (N, 1, F, T)
        x = torch.where(self.time_mask(lengths, x.shape[-1]).bool(), x, 0.0)  # even NaN padding is dropped
        for conv, norm in zip(self.layers, self.norms):
            x = conv(x)
            lengths = conv_output_length(lengths, conv.kernel_size[1], conv.stride[1])
            mask = self.time_mask(lengths, x.shape[-1])
            x = norm.hardtanh(x, mask, 0.0, 20.0, channel_dim=1)  # BN, then Hardtanh(0, 20), padding zeroed once
        n, c, f, t = x.shape
        return x.permute(3, 0, 1, 2).reshape(t, n, c * f), lengths  # (T', N, C*F')

    @staticmethod
    def time_mask(lengths: torch.Tensor, steps: int) -> torch.Tensor:
        return (torch.arange(steps, device=lengths.device)[None, :]
                < lengths[:, None]).to(torch.float32)[:, None, None, :]


class DeepSpeech2(nn.Module):
    def __init__(self, cfg: ModelConfig, num_features: int, num_classes: int):
        super().__init__()
        self.num_features = num_features  # what a checkpoint needs, beside the config, to rebuild the model
        self.front_end = ConvFrontEnd(cfg, num_features)
        sizes = [self.front_end.output_size] + [cfg.hidden_size] * cfg.num_layers
        self.rnns = nn.ModuleList(
            recurrent_layer(cfg, d_in) for d_in in sizes[:-1]
        )
        self.head = nn.Linear(cfg.hidden_size, num_classes)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, F, T) features, lengths (N,) -> logits (T', N, classes), output lengths (N,)."""
        x, lengths = self.front_end(x, lengths)  # (T', N, D)
        for rnn in self.rnns:
            x = rnn(x, lengths)  # (T', N, H)
        return self.head(x), lengths
