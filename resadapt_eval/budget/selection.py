"""Frame selection: the budget operator that keeps the highest-scoring candidate frames.

The Allocator's per-frame scales serve as importance scores (paper, operator-generalisation
table): rank the candidates, keep the `top_k` highest (and/or those scoring at least
`threshold`), in time order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

OPERATORS = ("resize", "select", "select_resize")


def select_frames(scores: Sequence[float], top_k: int | None = None, threshold: float | None = None) -> list[int]:
    """Positions of the kept frames in time order: the `top_k` best (ties to the earlier frame),
    restricted to scores >= `threshold` when given; at least the single best frame."""
    scores = np.asarray(scores, dtype=np.float64)
    if top_k is None and threshold is None:
        raise ValueError("frame selection needs top_k or a score threshold")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    order = np.argsort(-scores, kind="stable")
    if threshold is not None:
        order = [i for i in order if scores[i] >= threshold] or [int(order[0])]
    if top_k is not None:
        order = order[:top_k]
    return sorted(int(i) for i in order)
