"""The study: many runs under the fair protocol, and what they found.

- scheduler.py: `python -m batchrnn.study`, which runs a study's stages (tune, widen, augment, patience, final) as jobs.
- protocol.py: which learning rate (SpecAugment, patience) each variant gets, from its tuning runs.
- sweep.py: a sweep's exit status under any launcher (SweepStatus, a Hydra callback).
- report/: `python -m batchrnn.report`, the study's tables, verdicts and plots.
"""
