"""The checks the schema's types cannot express, run before any work starts (ConfigError names the setting)."""
from omegaconf import DictConfig, OmegaConf

from batchrnn.config import BadText, BNMode, Config, ConfigError, CorpusName, Schedule, Stage, check_known_keys


def validate(cfg: Config | DictConfig) -> None:
    """Checks the schema's types cannot express; raises ConfigError before any work starts."""
    if isinstance(cfg, DictConfig):
        check_known_keys(cfg, OmegaConf.structured(Config))
    m, t, d, p = cfg.model, cfg.train, cfg.data, cfg.protocol
    positive = {
        "model.hidden_size": m.hidden_size,
        "model.num_layers": m.num_layers,
        "train.epochs": t.epochs,
        "train.batch_size": t.batch_size,
        "train.lr": t.lr,
        "train.max_grad_norm": t.max_grad_norm,
        "train.max_skipped_steps": t.max_skipped_steps,
        "train.dist_timeout_s": t.dist_timeout_s,
        "data.window_ms": d.window_ms,
        "data.hop_ms": d.hop_ms,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}={value}: must be positive")
    sa = t.spec_augment
    for key, value in {"train.weight_decay": t.weight_decay, "train.warmup_steps": t.warmup_steps,
                       "train.patience": t.patience, "train.threads": t.threads, "data.n_mels": d.n_mels,
                       "train.spec_augment.freq_masks": sa.freq_masks, "train.spec_augment.freq_width": sa.freq_width,
                       "train.spec_augment.time_masks": sa.time_masks,
                       "train.spec_augment.time_width": sa.time_width}.items():
        if value < 0:
            raise ConfigError(f"{key}={value}: must be 0 or more")
    if not 0 <= t.patience_loss_drop < 1:
        raise ConfigError(f"train.patience_loss_drop={t.patience_loss_drop}: must be in [0, 1)")
    if not 0 < t.lr_gamma <= 1:
        raise ConfigError(f"train.lr_gamma={t.lr_gamma}: must be in (0, 1]")
    if not 0 < t.plateau_factor < 1:
        raise ConfigError(f"train.plateau_factor={t.plateau_factor}: must be in (0, 1), or the rate never falls")
    if not 0 < t.plateau_floor < 1:
        raise ConfigError(f"train.plateau_floor={t.plateau_floor}: must be in (0, 1), a share of train.lr")
    if t.plateau_wait < 1:
        raise ConfigError(f"train.plateau_wait={t.plateau_wait}: must be 1 or more epochs")
    if t.plateau_min_cuts < 0:
        raise ConfigError(f"train.plateau_min_cuts={t.plateau_min_cuts}: must be 0 or more")
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction}: must be between 0 and 1")
    manifests = {"data.train": d.train, "data.val": d.val, "data.test": d.test}
    if CorpusName(d.corpus) is CorpusName.manifest:
        for key, what in (("data.train", "the training manifest"), ("data.test", "the test manifest, scored once "
                                                                                  "with the best checkpoint")):
            if not manifests[key]:
                raise ConfigError(f"{key}: not given; data=manifest needs {what}: {key}=PATH.jsonl")
    else:
        for key, value in manifests.items():
            if value:
                raise ConfigError(f"{key}={value}: a manifest, read only by data=manifest (data.corpus is "
                                  f"{CorpusName(d.corpus).value}); add data=manifest, or drop {key}")
        if BadText(d.bad_text) is not BadText.refuse:
            raise ConfigError(f"data.bad_text={BadText(d.bad_text).value}: only data=manifest reads it; drop it")
    if any(lr <= 0 for lr in p.lrs):
        raise ConfigError(f"protocol.lrs={list(p.lrs)}: every learning rate must be positive")
    if not p.seeds or not p.tune_seeds:
        raise ConfigError("protocol.seeds and protocol.tune_seeds: need at least one seed each")
    if Stage(p.stage) in (Stage.final, Stage.widen, Stage.augment, Stage.patience) and not p.lrs:
        raise ConfigError(f"protocol.stage={Stage(p.stage).value}: protocol.lrs is empty, so there is no tuning stage "
                          f"to take a rate from; set protocol.lrs, or drop protocol.stage and give train.lr")
    if p.tune_spec_augment and t.spec_augment.freq_masks + t.spec_augment.time_masks == 0:
        raise ConfigError("protocol.tune_spec_augment=true: SpecAugment has no masks (train.spec_augment.freq_masks "
                          "and time_masks are 0), so there is nothing to tune it against; give it masks, or drop "
                          "protocol.tune_spec_augment")
    if Stage(p.stage) is Stage.augment and not p.tune_spec_augment:
        raise ConfigError("protocol.stage=augment: protocol.tune_spec_augment is false, so no stage tunes SpecAugment; "
                          "set protocol.tune_spec_augment=true, or pick another stage")
    if p.widen < 0:
        raise ConfigError(f"protocol.widen={p.widen}: must be 0 (never) or more")
    if p.tune_patience < 0:
        raise ConfigError(f"protocol.tune_patience={p.tune_patience}: must be 0 (never) or more")
    if unknown := [bn for bn in p.reuse_needs_model if bn not in {b.value for b in BNMode}]:
        raise ConfigError(f"protocol.reuse_needs_model: {', '.join(map(str, unknown))} is no model.bn; give placements "
                          f"among {', '.join(b.value for b in BNMode)}")
    if p.tune_patience and (Schedule(t.schedule) is not Schedule.plateau or not t.patience):
        raise ConfigError("protocol.tune_patience: the patience stage doubles the plateau schedule's waits, so it needs "
                          "train.schedule=plateau and train.patience > 0; set both, or protocol.tune_patience=0")
    if Stage(p.stage) is Stage.patience and not p.tune_patience:
        raise ConfigError("protocol.stage=patience: protocol.tune_patience is 0, so no stage tunes the patience; set "
                          "protocol.tune_patience=1 or more, or pick another stage")
    if not m.conv:
        raise ConfigError("model.conv: needs at least one conv layer")
    for i, layer in enumerate(m.conv):
        for name in ("channels", "kernel_freq", "kernel_time", "stride_freq", "stride_time"):
            if getattr(layer, name) <= 0:
                raise ConfigError(f"model.conv[{i}].{name}={getattr(layer, name)}: must be positive")
    # here: these load torch, and a bad value fails faster without
    from batchrnn.data.base import feature_bins
    from batchrnn.decoding.beam import check as check_decoding
    from batchrnn.layers import check_variant

    # Each mask is up to freq_width bins wide, so together they can cover up to freq_masks x freq_width bins: where
    # that is every bin, a batch may train on all-zero inputs (torchaudio's masks wider than the input cover it all).
    if sa.freq_masks * sa.freq_width > (bins := feature_bins(d)):
        raise ConfigError(f"train.spec_augment.freq_width={sa.freq_width}: {sa.freq_masks} masks of up to "
                          f"{sa.freq_width} bins could cover all {bins} feature bins, and train on zeros; give "
                          f"freq_masks x freq_width at most {bins} (Park et al.'s LD policy: 2 masks of up to 27 of "
                          "80 bins)")
    check_variant(m)
    check_decoding(cfg.decode)
