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

SELECTION_RULES = ("frames", "pairs")
FIXED_SCALE_RULES = ("search", "sqrt")
# Each budget rule's value of every setting it decides (a setting given explicitly wins).
BUDGET_RULES = {
    "paper": dict(
        min_tokens_per_pair=1,
        max_tokens_per_pair=None,
        truncate_scaled_side=False,
        base_grid_px=None,
        selection_rule="frames",
        fixed_scale_rule="search",
    ),
    "authors_code": dict(
        min_tokens_per_pair=4,
        max_tokens_per_pair=768,
        truncate_scaled_side=True,
        base_grid_px=28,
        selection_rule="pairs",
        fixed_scale_rule="sqrt",
    ),
}


@dataclass(frozen=True)
class BudgetSpec:
    """User-set budget knobs.

    retention: target R (visual tokens / vanilla tokens), or None where the method has no target.
    s_min, s_max: allowed range of per-frame scales.
    min_tokens_per_pair, max_tokens_per_pair: explicit bounds on one pair's LLM tokens.
    pair_reduction: how a pair's two frame scales become one (`mean`, `max`, `min`).
    budget_rule: `paper` (the paper's text, the default) or `authors_code` (what the authors'
        public code does, which produced the paper's numbers): sets every setting below, and the
        token bounds above, that is not given (None) to the rule's value (`BUDGET_RULES`), once, at
        construction. Under `authors_code` no pair cap is spelled as a large max_tokens_per_pair.
    truncate_scaled_side: a pair's sides are `int(side * s)` pixels with s its float32 scale, then
        Qwen's `smart_resize` (`plan.truncated_size`; authors_code) instead of base x s rounded to
        the grid in token units (`plan.scaled_size`; paper).
    base_grid_px: the grid the base (vanilla) frame size is rounded to; None: the backbone's token
        grid (paper); authors_code: 28, also on Qwen3-VL, whose pairs are re-rounded to 32 px.
    selection_rule: frame selection (`operator=select|select_resize`) by `frames` (paper: the best
        `top_k` frames; select_resize projects their scales onto the retention) or `pairs`
        (authors_code: select_resize keeps the ceil(top_k / 2) adjacent pairs of best float32
        mean score at those raw means, no projection; select keeps the best top_k frames rounded
        up to an even count).
    fixed_scale_rule: `search` (paper: the scale whose exact plan has the largest R not above the
        target) or `sqrt` (authors_code: s = sqrt(retention), so R is nominal).
    """

    retention: float | None = None
    s_min: float = 0.2
    s_max: float = 1.8
    min_tokens_per_pair: int | None = None
    max_tokens_per_pair: int | None = None
    pair_reduction: str = "mean"
    budget_rule: str = "paper"
    truncate_scaled_side: bool | None = None
    base_grid_px: int | None = None
    selection_rule: str | None = None
    fixed_scale_rule: str | None = None

    def __post_init__(self):
        if self.budget_rule not in BUDGET_RULES:
            raise ValueError(f"budget_rule must be one of {tuple(BUDGET_RULES)}, got {self.budget_rule!r}")
        for name, value in BUDGET_RULES[self.budget_rule].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.selection_rule not in SELECTION_RULES:
            raise ValueError(f"selection_rule must be one of {SELECTION_RULES}, got {self.selection_rule!r}")
        if self.fixed_scale_rule not in FIXED_SCALE_RULES:
            raise ValueError(f"fixed_scale_rule must be one of {FIXED_SCALE_RULES}, got {self.fixed_scale_rule!r}")
        if not isinstance(self.truncate_scaled_side, bool):
            raise ValueError(f"truncate_scaled_side must be true or false, got {self.truncate_scaled_side!r}")
        if self.base_grid_px is not None and self.base_grid_px < 1:
            raise ValueError(f"base_grid_px must be at least 1, got {self.base_grid_px}")
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
            truncate_scaled_side=self.truncate_scaled_side,
        )

    @property
    def rule_label(self) -> str:
        """Which rule produced a plan, as recorded per sample: `budget_rule`, followed by the
        settings given explicitly with a value other than the rule's, e.g.
        `authors_code (fixed_scale_rule=search)`."""
        changed = [
            f"{name}={_model_arg(getattr(self, name))}"
            for name, value in BUDGET_RULES[self.budget_rule].items()
            if getattr(self, name) != value
        ]
        return self.budget_rule + (f" ({', '.join(changed)})" if changed else "")


def _model_arg(value) -> str:
    """A setting's value as a model_arg spells it."""
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def vanilla(num_frames: int, base_hw: tuple[int, int], grid: TokenGrid, spec: BudgetSpec, context=None) -> np.ndarray:
    """Every frame at the base resolution (scale 1)."""
    return np.ones(num_frames)


def fixed_scale(
    num_frames: int, base_hw: tuple[int, int], grid: TokenGrid, spec: BudgetSpec, context=None
) -> np.ndarray:
    """One scale for all frames: the largest in [s_min, s_max] whose plan keeps R <= retention
    (searched once per frame count, base size and budget, then cached); under
    `fixed_scale_rule=sqrt` (the authors' code) s = sqrt(retention) as is, not clipped to [s_min, s_max]."""
    if spec.retention is None:
        raise ValueError("fixed_scale needs a target retention (model_args retention=...)")
    if spec.fixed_scale_rule == "sqrt":
        return np.full(num_frames, math.sqrt(spec.retention))
    s = cached_fixed_scale_for_retention(
        spec.retention, num_frames, base_hw, grid, spec.s_min, spec.s_max, **spec.plan_bounds
    )
    return np.full(num_frames, s)


POLICIES = {"vanilla": vanilla, "fixed_scale": fixed_scale}
