"""batchrnn.sweep.SweepStatus, the name conf/config.yaml and users' configs give Hydra
(batchrnn.study.sweep)."""
from batchrnn.study.sweep import SweepStatus

__all__ = ["SweepStatus"]
