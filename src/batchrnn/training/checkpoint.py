"""Self-describing model files: the weights with the config, alphabet and feature width that rebuild the
model, so a trained model can be used outside its run folder (batchrnn.evaluate). Plain tensors, strings
and numbers only, so `torch.load(..., weights_only=True)` reads them without running pickled code.
"""
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from batchrnn.config import ModelConfig
from batchrnn.errors import one_line
from batchrnn.model import DeepSpeech2
from batchrnn.storage import atomic_save
from batchrnn.data.text import LABELS

FORMAT = 1  # bump when the layout below changes, so an older reader refuses a newer file
ALPHABET = "".join(LABELS)
SAME_VERSION = "use the batchrnn version that trained it"  # the fix for a file this version cannot rebuild


class CheckpointError(ValueError):
    """A model file that cannot be used; the message names the file and the fix."""


def save_model(path: Path, model: DeepSpeech2, config: dict, weights: dict | None = None, **extra) -> None:
    """config: the run's whole resolved config as a plain dict (config.to_container); weights: a state dict of
    model's shape, the model's own by default; extra: epoch, val_wer..."""
    blob = {"format": FORMAT, "config": config, "labels": ALPHABET, "num_features": model.num_features,
            "state_dict": model.state_dict() if weights is None else weights, **extra}
    atomic_save(path, blob)


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[DeepSpeech2, dict]:
    """The model of a save_model file, in eval mode on device, and the file's other entries."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file; give a run folder holding best.pt, or a best.pt itself")
    try:
        blob = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # torn, not a torch file, or pickled objects weights_only refuses
        raise CheckpointError(f"{path}: not a readable model file ({one_line(e)}); give a best.pt written "
                              "by a training run") from e
    if isinstance(blob, dict) and blob and all(isinstance(v, torch.Tensor) for v in blob.values()):
        raise CheckpointError(f"{path}: a bare state dict without the config that rebuilds the model (best.pt "
                              "of a run trained before checkpoints held their config); only runs trained by "
                              "this version can be used: train it again (train.rerun=true)")
    if not isinstance(blob, dict) or "format" not in blob:
        raise CheckpointError(f"{path}: not a model checkpoint (a run's checkpoint.pt is its resume state); give "
                              "a run folder or its best.pt")
    if blob["format"] != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {blob['format']}, this version reads format {FORMAT}; "
                              f"{SAME_VERSION}")
    if blob["labels"] != ALPHABET:
        raise CheckpointError(f"{path}: trained on the alphabet {blob['labels']!r}, this version's is "
                              f"{ALPHABET!r}; {SAME_VERSION}")
    try:
        model = model_of(blob)
        model.load_state_dict(blob.pop("state_dict"))
    except (OmegaConfBaseException, RuntimeError, KeyError) as e:  # the model's code changed since
        raise CheckpointError(f"{path}: does not fit this version's model ({one_line(e)}); {SAME_VERSION}") from e
    return model.to(device).eval(), blob


def model_of(blob: dict) -> DeepSpeech2:
    """A freshly initialised model of a save_model file's config (torch's generator sets its weights)."""
    return DeepSpeech2(typed(ModelConfig, blob["config"]["model"]), blob["num_features"], len(ALPHABET))


def typed(schema: type, values: dict):
    """A section of a saved plain config typed again (enums, nested dataclasses): ModelConfig, DataConfig."""
    return OmegaConf.merge(OmegaConf.structured(schema), values)
