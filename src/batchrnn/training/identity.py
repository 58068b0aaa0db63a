"""What a run is, and which runs are seeds of one setting: its identity, from its resolved settings.

A run is identified by its resolved settings, not by the overrides that were typed: `model.bn=none`, no
override at all and `seed=0` are one run. Settings that cannot change a result (NEUTRAL) stay out.
"""
import hashlib
import json

from omegaconf import OmegaConf

from batchrnn.config import Config, Impl

# Where the data comes from, where things are written, how fast, and the study's bookkeeping: none of
# these changes what a run computes, so a run restarted with another of them is the same run. A manifest
# corpus is known by what its manifests hold (data.manifest_sha256), not by where they lie. How a trained model is
# decoded (decode, and the LM's text) is not how it trains: one run is decoded in many ways.
NEUTRAL = ("study", "protocol", "logger", "decode", "data.lm_text", "data.archive", "data.mirrors", "data.root",
           "data.train", "data.val", "data.test", "train.device", "train.threads", "train.rerun", "train.dist_timeout_s")
SEED, LR = "seed", "train.lr"
AUGMENT = "train.spec_augment.enabled"  # tuned beside the rate where protocol.tune_spec_augment is set
# The plateau schedule's patience, tuned as one where protocol.tune_patience is set: the waits and the cap together
SCHEDULE = ("train.plateau_wait", "train.patience", "train.epochs")


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"model.rnn": "gru", "model.conv": [...], ...}: nested dicts flattened, lists kept whole."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def settings(config: dict) -> dict:
    """The flat settings of a resolved config (a plain dict, as results.json holds it) that can change
    a result, the seed among them."""
    return {k: v for k, v in flatten(config).items() if not any(k == n or k.startswith(n + ".") for n in NEUTRAL)}


_DEFAULTS = None


def default_settings() -> dict:
    global _DEFAULTS
    if _DEFAULTS is None:  # the schema's defaults; resolving them reads $AN4_ARCHIVE, a neutral key
        _DEFAULTS = settings(OmegaConf.to_container(OmegaConf.structured(Config), resolve=True, enum_to_str=True))
    return _DEFAULTS


def known_settings(config: dict) -> dict:
    """settings(config) with the schema's default for each setting the config lacks (one added to the schema
    after it was written), so that runs from before and after a new setting are one setting."""
    return default_settings() | settings(config)


def canonical(values: dict) -> str:
    return json.dumps(values, sort_keys=True, separators=(",", ":"))


def placement(s: dict) -> str:
    """bn, or bn-cells for the cell reference; s: flat settings (`settings`)."""
    return s["model.bn"] + ("-cells" if s.get("model.impl", Impl.fused.value) == Impl.cells.value else "")


def variant_label(s: dict) -> str:
    """rnn-bn[-cells]: how runs, W&B runs and report rows name a variant; s: flat settings."""
    return f"{s['model.rnn']}-{placement(s)}"


def run_name(config: dict) -> str:
    """The run folder's name: readable (rnn-bn[-cells]-L<layers>-lr<lr>-s<seed>) and unique, through a
    hash of the settings that differ from the schema's defaults (so a new setting with a default does
    not rename every earlier run)."""
    s, defaults = settings(config), default_settings()
    changed = {k: v for k, v in s.items() if k not in defaults or defaults[k] != v}
    digest = hashlib.sha1(canonical(changed).encode()).hexdigest()[:8]
    return f"{variant_label(s)}-L{s['model.num_layers']}-lr{s[LR]:g}-s{s[SEED]}-{digest}"


def mismatch(stored: dict, current: dict) -> list[str]:
    """Settings in which a run folder's stored config differs from the current one. A setting only one
    side knows (added to the schema later) counts as its default."""
    a, b, defaults = settings(stored), settings(current), default_settings()
    return sorted(k for k in a.keys() | b.keys() if a.get(k, defaults.get(k)) != b.get(k, defaults.get(k)))


def setting_key(config: dict, without: tuple[str, ...] = (SEED,)) -> str:
    """Runs with equal keys are repetitions of one setting: by default, seeds of one configuration."""
    return canonical({k: v for k, v in known_settings(config).items() if k not in without})


def tunes_augment(config: dict) -> bool:
    """Whether the run's study tunes SpecAugment beside the rate (protocol.tune_spec_augment)."""
    return bool((config.get("protocol") or {}).get("tune_spec_augment"))


def augment_on(config: dict) -> bool:
    """train.spec_augment.enabled (true in runs made before the setting existed)."""
    return bool(config.get("train", {}).get("spec_augment", {}).get("enabled", True))


def tunes_patience(config: dict) -> bool:
    """Whether the run's study tunes the plateau schedule's patience (protocol.tune_patience)."""
    return bool((config.get("protocol") or {}).get("tune_patience"))


def variant_key(config: dict) -> str:
    """What the tuning stages choose for: every setting but the seed, the rate and, where the study tunes them,
    whether SpecAugment is on and the schedule's patience (SCHEDULE)."""
    return setting_key(config, (SEED, LR) + (AUGMENT,) * tunes_augment(config) + SCHEDULE * tunes_patience(config))
