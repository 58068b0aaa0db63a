"""Weights & Biases: the run's tracker (tracker.py) and the study's dashboard (dashboard.py)."""
