"""The recurrent layers: one class per model.bn variant, all over the same bidirectional machinery.

- base.py: what every variant shares (RecurrentLayer: directions, reversal, padding, the fused kernels and
  the step loop); cpu_gru.py: the CPU GRU's oneDNN kernel; cpu_front_end.py: the conv front end's CPU kernel
  (its training BatchNorm + Hardtanh); extensions.py: how both are compiled.
- folds.py: the fold mathematics (masked moments, Gram, quadratic forms, MaskedBatchNorm).
- one module per family of variants: plain.py (none, post, input), batchnorm.py (skip, seqwise),
  layernorm.py (ln, ln_full), recurrent_bn.py (rbn), weightnorm.py (wn).

A variant supplies only what it changes: a transform of the layer's input or output (BN), a fold (per
direction the kernel's input weight and bias (W', b') and optionally one scale per frame of x: BN(W x),
LN(W x) and weight norm all fold exactly, autograd differentiating through the fold), or, for the step
loop, the gate pre-activations of x and the recurrence (ln_full; the cells references). A new variant is one
class, its BNMode value and its entry in LAYERS (docs/layers.md).
"""
from omegaconf import DictConfig

from batchrnn.config import BNMode, ConfigError, Impl, ModelConfig
from batchrnn.layers.base import RecurrentLayer
from batchrnn.layers.batchnorm import SeqwiseBNLayer, SkipBNLayer
from batchrnn.layers.layernorm import FullLayerNormLayer, LayerNormLayer
from batchrnn.layers.plain import InputBNLayer, PlainLayer, PostBNLayer
from batchrnn.layers.recurrent_bn import RecurrentBNLayer
from batchrnn.layers.weightnorm import WeightNormLayer

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


def check_variant(m: ModelConfig | DictConfig) -> None:
    """The combinations of model settings that have no layer; the one place these rules live. Each layer
    class says what it takes (`impls`, `switches` on RecurrentLayer), so a new variant needs no rule here."""
    bn = BNMode(m.bn)
    layer = LAYERS[bn]
    why = {"share_input_weights": "sharing W between directions needs a separate input projection",
           "weight_norm_recurrent": "only the weight-norm variant normalises U"}
    for switch, reason in why.items():
        if getattr(m, switch) and switch not in layer.switches:
            allowed = "|".join(b.value for b, c in LAYERS.items() if switch in c.switches)
            raise ConfigError(f"model.{switch}=true with model.bn={bn.value}: {reason}, allowed with "
                              f"model.bn={allowed}")
    if m.share_input_weights and not m.bidirectional:
        raise ConfigError("model.share_input_weights=true needs model.bidirectional=true")
    impl = Impl(m.impl)
    if impl not in layer.impls:
        allowed = "|".join(b.value for b, c in LAYERS.items() if impl in c.impls)
        raise ConfigError(
            f"model.impl={impl.value} with model.bn={bn.value}: the cell reference exists for "
            f"model.bn={allowed} only; use model.impl=fused"
        )
