"""Sweeps beyond one process: cells as submitit jobs on SLURM or on this machine (`jobs`), their
SLURM settings (`settings`), and the state of every cell of a sweep folder (`status`). Each cell's
lmms-eval run is in its own process group either way (`resadapt_eval/guard.py`). See docs/cluster.md."""
