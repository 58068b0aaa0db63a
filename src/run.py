"""Entry point: compose the Hydra config, validate it, hand it to the trainer.

    python src/run.py experiment=smoke
    python src/run.py -m model.rnn=gru,lstm model.bn=seqwise,post,none
"""
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from batchrnn.config import ConfigError, register_configs, validate

register_configs()
log = logging.getLogger("batchrnn")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        validate(cfg)
    except ConfigError as e:
        log.error("config error: %s", e)
        sys.exit(2)
    from batchrnn.train import train  # after validation: a bad value fails before torch loads

    results = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    return results["best_val_wer"]


if __name__ == "__main__":
    main()
