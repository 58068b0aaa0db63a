"""batchrnn.sweep.SweepStatus and StudyFolder, the names conf/config.yaml and users' configs give Hydra
(batchrnn.study.sweep)."""
from batchrnn.study.sweep import StudyFolder, SweepStatus

__all__ = ["StudyFolder", "SweepStatus"]
