"""A trained model in the form to serve it: every normalisation that can fold, folded (docs/export.md).

With running statistics BatchNorm is an affine map, and weight normalisation a fixed W. So the conv front
end's BN folds into its convolutions; input, skip, seqwise and wn into each direction's input weights;
post into the next layer's input weights or the head. Each recurrent layer then runs as torch's plain
nn.GRU/nn.LSTM, one per direction; ln keeps its one scale per frame of x. ln_full and rbn are step loops
and DS2's clipped-ReLU rnn has no fused kernel: those are refused. Before it writes, an export checks itself
against the trained model on the run's validation utterances (export_checks).
"""
import io
import json
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchrnn.config import BNMode, ModelConfig, RNNType
from batchrnn.data.corpus import sha256
from batchrnn.data.features import FeatureSet, collate, make_batches
from batchrnn.errors import one_line
from batchrnn.layers import LAYERS
from batchrnn.layers.base import (GATES, KERNELS, fused_recurrence, reversal_rows, reverse_rows,
                                  valid_mask)
from batchrnn.layers.layernorm import inverse_sigma
from batchrnn.model import ConvFrontEnd, DeepSpeech2
from batchrnn.storage import atomic_write
from batchrnn.training.checkpoint import ALPHABET, SAME_VERSION, CheckpointError, load_model, typed

FORMATS = ("torch", "onnx")
EXPORT_FORMAT = 1  # bump when an exported file's layout changes, so an older reader refuses a newer file
TOLERANCE = 1e-4  # largest difference in log-probability, exported against trained, that an export accepts
SUFFIX = {"torch": ".export.pt", "onnx": ".onnx"}  # best.pt -> best.export.pt, best.onnx
PADDING = 37  # frames of noise appended to every utterance in the padding check (an odd count, any will do)
SERVE_UNFOLDED = "serve the run's best.pt instead (python -m batchrnn.evaluate transcribe RUN AUDIO)"


class ExportError(CheckpointError):
    """A model that cannot be exported, or an export that failed its check; the message says why."""


def unfoldable(cfg: ModelConfig) -> str | None:
    """Why cfg's variant has no plain-kernel form, or None. The one place the export's refusals live."""
    if RNNType(cfg.rnn) is RNNType.rnn:
        return ("model.rnn=rnn is DS2's clipped ReLU, min(max(x, 0), 20), which no fused kernel computes "
                "(nn.RNN's relu is unclipped)")
    if not LAYERS[cfg.bn].fused:
        return (f"model.bn={BNMode(cfg.bn).value} normalises U h at every step, a step loop that nn.GRU/nn.LSTM cannot "
                "run, so it has no folded form")
    return None


class MaskOnly(nn.Module):
    """Stands for a MaskedBatchNorm folded into the convolution before it: only the padding mask is left."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor, channel_dim: int = -1) -> torch.Tensor:
        return x * mask

    def hardtanh(self, x: torch.Tensor, mask: torch.Tensor, lo: float, hi: float,
                 channel_dim: int = -1) -> torch.Tensor:
        """MaskedBatchNorm.hardtanh's twin: Hardtanh(lo, hi), padding zeroed."""
        return nn.functional.hardtanh(x, lo, hi) * mask


class FrameScale(nn.Module):
    """ln's one scale per frame of x, 1 / sigma(x) with sigma(x)^2 = x^T M x / K + eps, M = W_c^T W_c."""

    def __init__(self, size: int, width: int):
        super().__init__()
        self.width = width
        self.register_buffer("matrix", torch.zeros(size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, N, D) -> (T, N, 1)
        return inverse_sigma(((x @ self.matrix) * x).sum(-1, keepdim=True), self.width)


class FoldedLayer(nn.Module):
    """One recurrent layer as torch's nn.GRU/nn.LSTM, a module per direction, the directions summed and the
    backward one read reversed within each length, as RecurrentLayer does. harness_kernels: run the same
    weights through batchrnn's fused_recurrence instead (the CPU GRU's oneDNN lbr_gru), as training does."""

    def __init__(self, rnn: RNNType, input_size: int, hidden_size: int, directions: int, frame_scales: int):
        super().__init__()
        self.rnn = rnn
        self.kernels = nn.ModuleList(KERNELS[rnn](input_size, hidden_size) for _ in range(directions))
        # one per copy of W: 1 when both directions share it, else one per direction; 0 without a frame scale
        width = GATES[rnn] * hidden_size  # what LN(W x) normalises over
        self.frame_scales = nn.ModuleList(FrameScale(input_size, width) for _ in range(frame_scales))
        self.harness_kernels = False

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = valid_mask(lengths, x.shape[0], x.dtype)  # (T, N, 1)
        x = torch.where(mask.bool(), x, 0.0)  # whatever padded frames hold, they contribute nothing
        rev = reversal_rows(lengths, x.shape[0])
        scales = [s(x) for s in self.frame_scales]  # per copy (T, N, 1)
        out = 0
        for d, kernel in enumerate(self.kernels):
            xd = x * scales[min(d, len(scales) - 1)] if scales else x
            h = self.recurrence(kernel, xd if d == 0 else reverse_rows(xd, rev))
            out = out + (h if d == 0 else reverse_rows(h, rev))  # (T, N, H)
        return out * mask

    def recurrence(self, kernel: nn.RNNBase, x: torch.Tensor) -> torch.Tensor:
        if self.harness_kernels:
            return fused_recurrence(self.rnn, x, kernel.weight_ih_l0, kernel.bias_ih_l0, kernel.weight_hh_l0,
                                    kernel.bias_hh_l0, training=False)
        # h0 from x's batch size, not left out: ONNX would otherwise fix the batch the model was exported with
        h0 = x.new_zeros((1, x.shape[1], kernel.hidden_size))
        return kernel(x, h0 if self.rnn is RNNType.gru else (h0, h0))[0]


class FoldedDS2(nn.Module):
    """DeepSpeech2 in eval with its normalisations folded: Conv2d (BN folded in), Hardtanh(0, 20), FoldedLayer
    x num_layers, Linear. forward(x (N, F, T), lengths (N,)) -> log-probabilities (T', N, classes), lengths."""

    def __init__(self, cfg: ModelConfig, num_features: int, num_classes: int, frame_scales: int = 0):
        super().__init__()
        self.front_end = ConvFrontEnd(cfg, num_features)
        self.front_end.norms = nn.ModuleList(MaskOnly() for _ in self.front_end.norms)
        directions = 2 if cfg.bidirectional else 1
        sizes = [self.front_end.output_size] + [cfg.hidden_size] * cfg.num_layers
        self.rnns = nn.ModuleList(FoldedLayer(RNNType(cfg.rnn), d_in, cfg.hidden_size, directions, frame_scales)
                                  for d_in in sizes[:-1])
        self.head = nn.Linear(cfg.hidden_size, num_classes)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, lengths = self.front_end(x, lengths)  # (T', N, D)
        for rnn in self.rnns:
            x = rnn(x, lengths)  # (T', N, H)
        return self.head(x).log_softmax(-1), lengths


def use_harness_kernels(model: FoldedDS2, on: bool = True) -> FoldedDS2:
    for layer in model.rnns:
        layer.harness_kernels = on
    return model


def then(first, second):
    """Two per-channel affine maps (scale, shift), or None for the identity, as one: second after first."""
    if first is None or second is None:
        return first or second
    return second[0] * first[0], second[0] * first[1] + second[1]


def fold_into(weight: torch.Tensor, bias: torch.Tensor, affine) -> tuple[torch.Tensor, torch.Tensor]:
    """W' and b' with W' x + b' = W (scale x + shift) + b: an affine map of x taken into the weights after it."""
    if affine is None:
        return weight, bias
    scale, shift = affine
    return weight * scale, bias + weight @ shift


@torch.no_grad()
def fold(model: DeepSpeech2, cfg: ModelConfig) -> FoldedDS2:
    """The folded twin of a DeepSpeech2 of cfg; ExportError where cfg's variant has none (unfoldable)."""
    if why := unfoldable(cfg):
        raise ExportError(why)
    model = model.eval()
    norms = [layer.eval_frame_norm() for layer in model.rnns]
    folded = FoldedDS2(cfg, model.num_features, model.head.out_features, 0 if norms[0] is None else len(norms[0]))
    folded = folded.to(next(model.parameters()).dtype)
    for conv, norm, out in zip(model.front_end.layers, model.front_end.norms, folded.front_end.layers):
        scale, shift = norm.eval_affine()
        out.weight.copy_(conv.weight * scale[:, None, None, None])
        out.bias.copy_(conv.bias * scale + shift)
    pending = None  # what the previous layer's output passes through (post's BN), for this layer to take in
    for layer, out, norm in zip(model.rnns, folded.rnns, norms):
        affine = then(pending, layer.eval_input_affine())
        if norm is not None and affine is not None:  # x^T M x would then be of the affine map's output
            raise ExportError("a per-frame scale after an affine map of x has no fold here")
        probe = torch.zeros(1, 1, layer.input_size, dtype=folded.head.weight.dtype)  # eval: W', b' need no x
        folds = layer.input_folds(probe, torch.ones(1, 1, 1, dtype=probe.dtype))
        for d, kernel in enumerate(out.kernels):
            kernel.weight_ih_l0[:], kernel.bias_ih_l0[:] = fold_into(folds[d].weight, folds[d].bias, affine)
            kernel.weight_hh_l0[:], kernel.bias_hh_l0[:] = layer.recurrent_weights(d)
        for scale, matrix in zip(out.frame_scales, norm if norm is not None else []):
            scale.matrix.copy_(matrix)
        pending = layer.eval_output_affine()
    folded.head.weight[:], folded.head.bias[:] = fold_into(model.head.weight, model.head.bias, pending)
    for kernel in (k for layer in folded.rnns for k in layer.kernels):
        kernel.flatten_parameters()
    return folded.eval()


def export_checks(reference: DeepSpeech2, exported, fs: FeatureSet, batch_size: int) -> tuple[float, float]:
    """On every utterance of fs, batched as scoring batches them: the largest difference in log-probability
    on valid frames between the exported model and the trained one in eval, and between the exported model
    with PADDING frames of noise after every utterance and without. exported: (x, lengths) -> log-probs, lengths."""
    worst = padded_worst = 0.0
    generator = torch.Generator().manual_seed(0)
    for indices in make_batches(fs.lengths, batch_size, shuffle=False, seed=0):
        x, x_lens = collate(fs, indices)[:2]
        with torch.no_grad():
            logits, lengths = reference(x, x_lens)
        expected = logits.float().log_softmax(-1)
        got, got_lens = exported(x, x_lens)
        noise = 10 * torch.randn(*x.shape[:2], PADDING, generator=generator)
        padded, _ = exported(torch.cat([x, noise], -1), x_lens)
        if not torch.equal(got_lens.cpu(), lengths.cpu()):
            return float("inf"), float("inf")
        valid = valid_mask(lengths.cpu(), expected.shape[0], torch.float32).bool()
        worst = max(worst, (got - expected).abs().masked_fill(~valid, 0).max().item())
        padded_worst = max(padded_worst, (padded[: got.shape[0]] - got).abs().masked_fill(~valid, 0).max().item())
    return worst, padded_worst


def onnx_bytes(model: FoldedDS2, num_features: int, metadata: dict) -> bytes:
    """The model as ONNX, dynamic batch and length, its metadata (config, alphabet, hash) in metadata_props.
    The TorchScript exporter: torch 2.11's dynamo exporter fixes the length at the example's (it unrolls
    nn.GRU/nn.LSTM per step), where this one maps them onto ONNX's GRU and LSTM operators."""
    import onnx

    x, lengths = torch.zeros(2, num_features, 64), torch.tensor([64, 40])
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # that h0 fixes the batch: FoldedLayer gives h0 of x's own batch size
        warnings.filterwarnings("ignore", "Exporting a model to ONNX with a batch_size other than 1")
        # nn.GRU's checks of its input's width and h0's shape, the same for every input this model takes
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(model, (x, lengths), buffer, dynamo=False, input_names=["features", "lengths"],
                          output_names=["log_probs", "output_lengths"],
                          dynamic_axes={"features": {0: "batch", 2: "frames"}, "lengths": {0: "batch"},
                                        "log_probs": {0: "output_frames", 1: "batch"},
                                        "output_lengths": {0: "batch"}})
    proto = onnx.load_from_string(buffer.getvalue())
    onnx.helper.set_model_props(proto, {k: json.dumps(v) for k, v in metadata.items()})
    return proto.SerializeToString()


class OnnxModel:
    """An ONNX export run by onnxruntime, called as the torch model is: (x, lengths) -> log-probs, lengths."""

    def __init__(self, model: bytes | str, threads: int = 0):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = threads  # 0: onnxruntime's default
        options.log_severity_level = 3  # its warnings about unused initialisers are no news to a user
        self.session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])

    def metadata(self) -> dict:
        return self.session.get_modelmeta().custom_metadata_map

    def __call__(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, out_lens = self.session.run(None, {"features": x.cpu().float().numpy(),
                                                      "lengths": lengths.cpu().long().numpy()})
        return torch.from_numpy(log_probs), torch.from_numpy(out_lens)

    def eval(self):  # called as a torch module is
        return self


def export(checkpoint: Path, model: DeepSpeech2, info: dict, fmt: str, out: Path,
           validation: Callable[[], FeatureSet]) -> tuple[float, float]:
    """Folds the model of checkpoint (load_model's model and info), checks it on validation() (the run's
    validation set) and writes it to out as fmt; returns the two checks' differences. ExportError, with
    nothing written, where it cannot fold or fails a check."""
    cfg = typed(ModelConfig, info["config"]["model"])
    if why := unfoldable(cfg):  # before the corpus is read
        raise ExportError(f"{checkpoint}: {why}; {SERVE_UNFOLDED}")
    folded = fold(model, cfg)
    metadata = {"exported": EXPORT_FORMAT, "config": info["config"], "labels": ALPHABET,
                "num_features": model.num_features, "frame_scales": len(folded.rnns[0].frame_scales),
                "checkpoint_sha256": sha256(checkpoint), "epoch": info.get("epoch"), "val_wer": info.get("val_wer")}
    if fmt == "onnx":
        blob = onnx_bytes(folded, model.num_features, metadata)
        exported = OnnxModel(blob)
    else:
        buffer = io.BytesIO()
        torch.save(metadata | {"state_dict": folded.state_dict()}, buffer)
        blob = buffer.getvalue()
        exported = torch_export_of(torch.load(io.BytesIO(blob), weights_only=True), checkpoint)[0]
    batch_size = info["config"]["train"]["batch_size"]
    with torch.no_grad():
        worst, padded = export_checks(model, exported, validation(), batch_size)
    if not (worst <= TOLERANCE and padded <= TOLERANCE):
        raise ExportError(f"{checkpoint}: the {fmt} export differs from the trained model by {worst:.2g} in "
                          f"log-probability (padding changes it by {padded:.2g}); the tolerance is {TOLERANCE:g}. "
                          "Nothing was written; this is a bug in batchrnn.export: please report it")
    atomic_write(out, lambda tmp: tmp.write_bytes(blob))
    return worst, padded


def default_out(checkpoint: Path, fmt: str) -> Path:
    return checkpoint.with_name(checkpoint.name.removesuffix(".pt") + SUFFIX[fmt])


def torch_export_of(blob: dict, path: Path) -> tuple[FoldedDS2, dict]:
    """The FoldedDS2 of a torch export's contents, in eval, and its other entries."""
    check_metadata(blob, path)
    cfg = typed(ModelConfig, blob["config"]["model"])
    try:
        model = FoldedDS2(cfg, blob["num_features"], len(ALPHABET), blob["frame_scales"])
        model.load_state_dict(blob.pop("state_dict"))
    except (RuntimeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: an export that does not fit its own config ({one_line(e)}); export "
                              "the run again") from e
    return model.eval(), blob


def check_metadata(meta: dict, path: Path) -> None:
    if meta.get("exported") != EXPORT_FORMAT:
        raise CheckpointError(f"{path}: export format {meta.get('exported')}, this version reads format "
                              f"{EXPORT_FORMAT}; {SAME_VERSION}, or export the run again")
    if meta.get("labels") != ALPHABET:
        raise CheckpointError(f"{path}: exported with the alphabet {meta.get('labels')!r}, this version's is "
                              f"{ALPHABET!r}; {SAME_VERSION}")


def load_any(path: Path, device: str | torch.device = "cpu"):
    """The model of a best.pt, a torch export or an ONNX export, called as (x, lengths) -> (scores, lengths),
    and the file's entries (config, ...). Scores: logits of a best.pt, log-probabilities of an export."""
    path = Path(path)
    if path.is_file() and path.suffix == ".onnx":
        try:
            model = OnnxModel(str(path))
        except Exception as e:  # onnxruntime's InvalidProtobuf, a torn file
            raise CheckpointError(f"{path}: not a readable ONNX model ({one_line(e)}); export the run again "
                                  "(python -m batchrnn.evaluate export RUN --format onnx)") from e
        meta = model.metadata()
        if "exported" not in meta:
            raise CheckpointError(f"{path}: an ONNX model that batchrnn did not export (no config or alphabet in "
                                  "its metadata); give one written by python -m batchrnn.evaluate export")
        info = {k: json.loads(v) for k, v in meta.items()}
        check_metadata(info, path)
        return model, info
    if path.is_file():
        try:
            blob = torch.load(path, map_location=device, weights_only=True)
        except Exception:
            blob = None  # load_model names what is wrong with it
        if isinstance(blob, dict) and "exported" in blob:
            model, info = torch_export_of(blob, path)
            return model.to(device), info
    return load_model(path, device)
