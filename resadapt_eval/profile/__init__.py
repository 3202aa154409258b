"""Latency: stage clocks that run in every request (`clock.py`), the paper's latency table from
sidecar records (`latency.py`) and `resadapt-eval profile` (`run.py`)."""
