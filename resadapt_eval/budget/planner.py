"""The planning stage, pure: frames' base size, scales -> resize plans, projection onto a retention.

Shared by the inference pipeline and the CAPO rollout engine, so a training rollout is planned
exactly as `method=resadapt,retention=R` plans at evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
from qwen_vl_utils.vision_process import MAX_RATIO

from .plan import ResizePlan, TokenGrid, base_size, plan_from_scales, project_jointly
from .policies import BUDGET_RULES, BudgetSpec
from .selection import Operator, select_frames, select_frames_even, select_pairs

# Base-size bounds in tokens per frame: qwen-vl-utils' video cap (768); its 128-token video floor
# is not applied, so small videos are not upscaled.
DEFAULT_MIN_TOKENS_PER_FRAME = 4
DEFAULT_MAX_TOKENS_PER_FRAME = 768


AUTHORS_BASE_GRID_PX = BUDGET_RULES["authors_code"]["base_grid_px"]  # 28, Qwen2.5-VL's grid


def check_base_grid(spec: BudgetSpec, grid: TokenGrid) -> None:
    """`spec.base_grid_px` must keep the vanilla reference: the backbone's own grid (`grid`), or
    the authors' code's 28 px; any other grid changes the base frame size R is measured against."""
    px = spec.base_grid_px
    if px is not None and px not in (grid.token_px, AUTHORS_BASE_GRID_PX):
        allowed = sorted({grid.token_px, AUTHORS_BASE_GRID_PX})
        raise ValueError(
            f"base_grid_px={px}: the base (vanilla) frame size, which R is measured against, is rounded to this "
            f"backbone's grid ({grid.token_px} px) or to the authors' code's {AUTHORS_BASE_GRID_PX} px; "
            f"allowed: {' or '.join(map(str, allowed))} (or leave it out for the backbone's)"
        )


@dataclass(frozen=True)
class Planner:
    """grid: the backbone's token grid; spec: the budget knobs; min_pixels / max_pixels: bounds on
    one frame's base (vanilla) area in pixels (None: 4 and 768 tokens per frame)."""

    grid: TokenGrid
    spec: BudgetSpec
    min_pixels: int | None = None
    max_pixels: int | None = None

    def __post_init__(self):
        check_base_grid(self.spec, self.grid)

    @property
    def base_grid(self) -> TokenGrid:
        """The grid base sizes are rounded to: the token grid, or `spec.base_grid_px`."""
        return self.grid if self.spec.base_grid_px is None else TokenGrid(token_px=self.spec.base_grid_px)

    @property
    def pixel_bounds(self) -> tuple[int, int]:
        """(min_pixels, max_pixels) of one frame's base area, the defaults counted in squares of `base_grid`."""
        area = self.base_grid.token_px**2
        lo = self.min_pixels if self.min_pixels is not None else DEFAULT_MIN_TOKENS_PER_FRAME * area
        hi = self.max_pixels if self.max_pixels is not None else DEFAULT_MAX_TOKENS_PER_FRAME * area
        return lo, hi

    def base_hw(self, frame_hw: tuple[int, int]) -> tuple[int, int]:
        """Base (vanilla) size in pixels of frames of `frame_hw` pixels, on the token grid or on
        `spec.base_grid_px` (the default bounds then count tokens of that grid)."""
        return base_size(*frame_hw, self.base_grid, *self.pixel_bounds)

    def largest_base_area(self) -> int:
        """The most squares of `base_grid` a frame's base size can cover: max_pixels' worth, or more
        where min_pixels is close to it. `smart_resize` fits a frame whose sides round to fewer than
        min_pixels up to x by y squares with x y = min_pixels in squares and ceils each side: fewer
        than (x + 1)(y + 1) = m + 1 + x + y squares, at most m + 1 + sqrt(m / 200) + sqrt(200 m)
        with a frame's aspect ratio at most qwen-vl-utils' MAX_RATIO = 200 (a bound, not a size)."""
        lo, hi = self.pixel_bounds
        square = self.base_grid.token_px**2
        m = lo / square
        return max(hi // square, math.floor(m + 1 + math.sqrt(m / MAX_RATIO) + math.sqrt(MAX_RATIO * m)))

    def base_sizes(self) -> Iterator[tuple[int, int]]:
        """Every base size in pixels a frame can have here, and more: each a x b squares of
        `base_grid` with a <= b (a pair's tokens do not depend on which side is which) covering at
        most `largest_base_area` squares, whichever aspect ratio."""
        px, area = self.base_grid.token_px, self.largest_base_area()
        for a in range(1, math.isqrt(area) + 1):
            for b in range(a, area // a + 1):
                yield a * px, b * px

    def largest_pairs(self) -> tuple[ResizePlan, ResizePlan]:
        """The largest vanilla plans: of every frame pair at the base size (`base_sizes`), planned
        as `plan` plans it, the one with the most visual tokens and the one whose vanilla pair (the
        reference R is measured against) has the most tokens; each a one-pair `ResizePlan`. The
        bound on how few tokens any video keeps per token it could have (`kinds.MethodKind.retention_floor`).
        Searched once per grid, budget settings (the retention aside) and pixel bounds."""
        return _largest_pairs(dataclasses.replace(self, spec=dataclasses.replace(self.spec, retention=None)))

    def limits_text(self) -> str:
        """The settings that bound a pair's size, as model_args spell them (for messages)."""
        lo, hi = self.pixel_bounds
        text = f"max_pixels={hi}" + (" (the default)" if self.max_pixels is None else "")
        if self.largest_base_area() > hi // self.base_grid.token_px**2:
            text += f", min_pixels={lo}"
        if self.spec.max_tokens_per_pair is not None:
            text += f", max_tokens_per_pair={self.spec.max_tokens_per_pair}"
        return text

    def plan(self, scales: Sequence[float], base_hw: tuple[int, int]) -> ResizePlan:
        """The resize plan of per-frame `scales` (linear, relative to `base_hw`)."""
        return plan_from_scales(scales, base_hw, self.grid, **self.spec.plan_bounds)

    def vanilla_tokens(self, num_frames: int, base_hw: tuple[int, int]) -> int:
        """Visual tokens of `num_frames` frames at the base size."""
        return self.plan(np.ones(num_frames), base_hw).reference_tokens

    def fit(
        self, scales: Sequence[Sequence[float]], base_hws: Sequence[tuple[int, int]], target: float | None
    ) -> list[np.ndarray]:
        """An allocation over the items of one request (scales[i] for item i at base_hws[i]):
        clipped to [s_min, s_max] without a target, else projected jointly onto `target`."""
        if target is None:
            return [np.clip(np.asarray(s, dtype=np.float64), self.spec.s_min, self.spec.s_max) for s in scales]
        return project_jointly(
            scales, target, base_hws, self.grid, self.spec.s_min, self.spec.s_max, **self.spec.plan_bounds
        )

    def select(
        self,
        raw: np.ndarray,
        base_hw: tuple[int, int],
        operator: Operator,
        top_k: int | None,
        threshold: float | None,
        target: float | None,
    ):
        """Frame selection over candidate frames with the Allocator's scales `raw` (T,): the best
        (`top_k` and/or scale >= `threshold`) are kept in time order, at the base size
        (`Operator.SELECT`) or at their scales (`Operator.SELECT_RESIZE`), projected so the tokens
        stay within `target` x the candidates' vanilla tokens (None: clipped to [s_min, s_max]).
        Returns (kept positions, their scales, the candidates' vanilla tokens: the reference R is
        measured against, as the paper reports it). Under `selection_rule=pairs` (the authors' code)
        `select` keeps the best frames rounded up to an even count and `select_resize` the best
        adjacent pairs (`select_pairs`) at their mean scores, without projection."""
        reference = self.vanilla_tokens(len(raw), base_hw)
        if self.spec.selection_rule == "pairs":
            if not operator.keeps_scales:
                positions = select_frames_even(raw, top_k, threshold, self.grid.temporal_patch)
                return positions, np.ones(len(positions)), reference
            positions, scales = select_pairs(raw, top_k, threshold, self.grid.temporal_patch)
            return positions, scales, reference
        positions = select_frames(raw, top_k, threshold)
        if not operator.keeps_scales:
            return positions, np.ones(len(positions)), reference
        if target is not None:
            target = target * reference / self.vanilla_tokens(len(positions), base_hw)
        (scales,) = self.fit([raw[positions]], [base_hw], target)
        return positions, scales, reference


@functools.lru_cache(maxsize=64)
def _largest_pairs(planner: Planner) -> tuple[ResizePlan, ResizePlan]:
    """`Planner.largest_pairs`, cached on the planner (frozen, so hashable)."""
    most_visual = most_reference = None
    ones = np.ones(planner.grid.temporal_patch)
    for base_hw in planner.base_sizes():
        try:
            plan = planner.plan(ones, base_hw)
        except ValueError:  # a size this rule cannot plan (the authors' `smart_resize` past a 200:1 aspect ratio)
            continue
        if most_visual is None or plan.visual_tokens >= most_visual.visual_tokens:  # ties: the squarer base
            most_visual = plan
        if most_reference is None or plan.reference_tokens >= most_reference.reference_tokens:
            most_reference = plan
    return most_visual, most_reference
