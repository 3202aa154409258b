"""Sweeps beyond one process: each cell's lmms-eval run in its own process group, ended with the
sweep (`guard`); cells as submitit jobs on SLURM or on this machine (`jobs`); the state of every
cell of a sweep folder (`status`). See docs/cluster.md."""
