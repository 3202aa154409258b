"""Frame selection: the budget operator that keeps the highest-scoring candidate frames.

The Allocator's per-frame scales serve as importance scores (paper, operator-generalisation
table): rank the candidates, keep the `top_k` highest (and/or those scoring at least
`threshold`), in time order.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Sequence

import numpy as np


class Operator(Enum):
    """The budget operator (`operator=`): resize every frame (`resize`), or keep the best-scoring
    candidate frames at the base size (`select`) or at their scales (`select_resize`)."""

    RESIZE = "resize"
    SELECT = "select"
    SELECT_RESIZE = "select_resize"

    @property
    def selects_frames(self) -> bool:
        """It keeps some of the candidate frames (`Planner.select`)."""
        return self is not Operator.RESIZE

    @property
    def keeps_scales(self) -> bool:
        """Frame selection that keeps the kept frames at their scales, not at the base size."""
        return self is Operator.SELECT_RESIZE


OPERATORS = tuple(op.value for op in Operator)


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


def select_frames_even(
    scores: Sequence[float], top_k: int | None = None, threshold: float | None = None, temporal_patch: int = 2
) -> list[int]:
    """The authors' code's `select` (no resize): frames ranked by their float32 score (ties to the
    earlier frame), the best `top_k` (and/or those scoring at least `threshold`, at least one
    pair's worth when none does) rounded up to a multiple of `temporal_patch` from the ranking, so
    the kept frames fill whole pairs; positions in time order."""
    if top_k is None and threshold is None:
        raise ValueError("frame selection needs top_k or a score threshold")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    scores = np.asarray(scores, dtype=np.float32)
    ranked = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    count = len(ranked) if threshold is None else sum(float(s) >= threshold for s in scores) or temporal_patch
    if top_k is not None:
        count = min(count, top_k)
    count = min(len(ranked), math.ceil(count / temporal_patch) * temporal_patch)
    return sorted(ranked[:count])


def select_pairs(
    scores: Sequence[float], top_k: int | None = None, threshold: float | None = None, temporal_patch: int = 2
) -> tuple[list[int], np.ndarray]:
    """The authors' code's `select_resize`: adjacent pairs of frames (an odd tail alone) ranked by
    their float32 mean score (ties to the earlier pair), the best max(1, ceil(top_k / 2)) (and/or
    those whose mean is at least `threshold`; the best pair when none is). Returns the kept
    frames' positions in time order and each frame's scale: its pair's mean, raw (not clipped or
    projected)."""
    if top_k is None and threshold is None:
        raise ValueError("frame selection needs top_k or a score threshold")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    scores = np.asarray(scores, dtype=np.float32)
    groups = [list(range(i, min(i + temporal_patch, len(scores)))) for i in range(0, len(scores), temporal_patch)]
    means = [float(scores[g].mean()) for g in groups]
    order = sorted(range(len(groups)), key=lambda k: (-means[k], k))
    if threshold is not None:
        order = [k for k in order if means[k] >= threshold] or order[:1]
    if top_k is not None:
        order = order[: max(1, math.ceil(top_k / temporal_patch))]
    kept = sorted(order)
    positions = [i for k in kept for i in groups[k]]
    return positions, np.array([means[k] for k in kept for _ in groups[k]], dtype=np.float64)
