"""One training run.

- loop.py: the run (data, model, optimizer, CTC), its epochs, patience and results.json.
- rundir.py: the run folder (results.json, checkpoint.pt, best.pt, run.log) and resume.
- identity.py: what a run is, from its resolved settings: its folder's name, and which runs are seeds of one.
- checkpoint.py: best.pt, and rebuilding its model (load_model).
- device.py: the device, peak memory and bf16.
- stopping.py: a SIGTERM ends a run between two steps.
- distributed.py: data-parallel ranks (torchrun, SLURM tasks) that compute what one process computes.
"""
