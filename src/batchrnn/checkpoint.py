"""batchrnn.checkpoint.load_model, where scripts and notebooks find it: the model of a best.pt
(batchrnn.training.checkpoint)."""
from batchrnn.training.checkpoint import load_model

__all__ = ["load_model"]
