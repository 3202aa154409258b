"""Measuring while a request runs: stage clocks (`clock.py`) and FLOPs counted by torch's
FlopCounterMode (`counting.py`). The floor everything that runs a model stands on: it imports
nothing else of this package."""
