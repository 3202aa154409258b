"""Budget policies: per-frame scales s_t for one video.

A policy is `policy(num_frames, base_hw, grid, spec, context) -> np.ndarray (T,)` of linear scales
relative to the base (vanilla) size. `context` carries what content-aware policies need (the
decoded frames and the query); the policies here ignore it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .plan import PAIR_REDUCTIONS, TokenGrid, cached_fixed_scale_for_retention


@dataclass(frozen=True)
class BudgetSpec:
    """User-set budget knobs.

    retention: target R (visual tokens / vanilla tokens), or None where the method has no target.
    s_min, s_max: allowed range of per-frame scales.
    min_tokens_per_pair, max_tokens_per_pair: explicit bounds on one pair's LLM tokens.
    pair_reduction: how a pair's two frame scales become one (`mean`, `max`, `min`).
    """

    retention: float | None = None
    s_min: float = 0.2
    s_max: float = 1.8
    min_tokens_per_pair: int = 1
    max_tokens_per_pair: int | None = None
    pair_reduction: str = "mean"

    def __post_init__(self):
        if not 0 < self.s_min <= self.s_max < math.inf:
            raise ValueError(f"need 0 < s_min <= s_max < inf, got s_min={self.s_min}, s_max={self.s_max}")
        if self.retention is not None and not 0 < self.retention < math.inf:
            raise ValueError(f"retention must be a finite positive number, got {self.retention}")
        if self.pair_reduction not in PAIR_REDUCTIONS:
            raise ValueError(f"pair_reduction must be one of {PAIR_REDUCTIONS}, got {self.pair_reduction!r}")
        if self.min_tokens_per_pair < 1:
            raise ValueError(f"min_tokens_per_pair must be at least 1, got {self.min_tokens_per_pair}")
        if self.max_tokens_per_pair is not None and self.max_tokens_per_pair < self.min_tokens_per_pair:
            raise ValueError("max_tokens_per_pair is below min_tokens_per_pair")

    @property
    def plan_bounds(self) -> dict:
        """Keyword arguments for `plan_from_scales`."""
        return dict(
            pair_reduction=self.pair_reduction,
            min_tokens_per_pair=self.min_tokens_per_pair,
            max_tokens_per_pair=self.max_tokens_per_pair,
        )


def vanilla(num_frames: int, base_hw: tuple[int, int], grid: TokenGrid, spec: BudgetSpec, context=None) -> np.ndarray:
    """Every frame at the base resolution (scale 1)."""
    return np.ones(num_frames)


def fixed_scale(
    num_frames: int, base_hw: tuple[int, int], grid: TokenGrid, spec: BudgetSpec, context=None
) -> np.ndarray:
    """One scale for all frames: the largest in [s_min, s_max] whose plan keeps R <= retention
    (searched once per frame count, base size and budget, then cached)."""
    if spec.retention is None:
        raise ValueError("fixed_scale needs a target retention (model_args retention=...)")
    s = cached_fixed_scale_for_retention(
        spec.retention, num_frames, base_hw, grid, spec.s_min, spec.s_max, **spec.plan_bounds
    )
    return np.full(num_frames, s)


POLICIES = {"vanilla": vanilla, "fixed_scale": fixed_scale}
