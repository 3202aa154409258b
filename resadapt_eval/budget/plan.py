"""Per-frame scales -> per-pair resize plan, with exact visual-token accounting.

Qwen video encoders fuse two consecutive frames into one temporal patch, so both frames of a
pair share one size. A plan therefore holds one (height, width) in pixels per pair, each a
multiple of the backbone's token edge (28 px for Qwen2.5-VL, 32 px for Qwen3-VL), and counts
one LLM token per token-edge x token-edge square of a pair.

Two rules size a pair (`BudgetSpec.budget_rule`): the paper's text (each side of base x s rounded
to the grid, `scaled_size`) and the authors' public code (`int(side * s)` pixels, then transformers'
Qwen2-VL `smart_resize` with a per-pair pixel cap, `truncated_size`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from qwen_vl_utils import smart_resize

PAIR_REDUCTIONS = ("mean", "max", "min")
NO_CAP_TOKENS = 1 << 40  # a pair's token cap when max_tokens is None


@dataclass(frozen=True)
class TokenGrid:
    """Geometry of a backbone's visual tokens.

    token_px: side in pixels of the square that becomes one LLM token after the merger
        (patch size x spatial merge: 14 x 2 = 28 for Qwen2.5-VL, 16 x 2 = 32 for Qwen3-VL).
    temporal_patch: frames fused into one temporal patch (2 for both backbones).
    """

    token_px: int
    temporal_patch: int = 2

    def tokens(self, height: int, width: int) -> int:
        """LLM tokens of one temporal group of frames at (height, width) pixels."""
        if height % self.token_px or width % self.token_px:
            raise ValueError(f"size {height}x{width} px is not a multiple of the {self.token_px} px token grid")
        return (height // self.token_px) * (width // self.token_px)


QWEN25VL_GRID = TokenGrid(token_px=28)
QWEN3VL_GRID = TokenGrid(token_px=32)


def base_size(height: int, width: int, grid: TokenGrid, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Vanilla (scale 1) size of one frame in pixels: Qwen's `smart_resize` rule.

    Both sides are rounded to the token grid, then the area is brought into
    [min_pixels, max_pixels] with the aspect ratio kept.
    """
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels={min_pixels} exceeds max_pixels={max_pixels}")
    return smart_resize(height, width, factor=grid.token_px, min_pixels=min_pixels, max_pixels=max_pixels)


def rounded_sides(base_hw: tuple[int, int], scale: float, grid: TokenGrid) -> tuple[int, int]:
    """Sides in tokens of `base_hw` pixels times `scale`, each rounded (half to even), at least 1.

    Their product is non-decreasing in `scale`; `scaled_size` keeps it unless it leaves the bounds.
    `base_hw` need not be on the grid (the authors' Qwen3-VL base is on a 28 px grid).
    """
    px = grid.token_px
    return max(1, round(base_hw[0] * scale / px)), max(1, round(base_hw[1] * scale / px))


def scaled_size(
    base_hw: tuple[int, int],
    scale: float,
    grid: TokenGrid,
    min_tokens: int = 1,
    max_tokens: int | None = None,
) -> tuple[int, int]:
    """Size in pixels of a frame pair resized by `scale` (linear, per side) from `base_hw`.

    Qwen's `smart_resize` rule in token units: each side is rounded to the token grid with the
    aspect ratio kept; a token count outside [min_tokens, max_tokens] (explicit bounds, no hidden
    floor; max_tokens None: NO_CAP_TOKENS) is replaced by the base's aspect ratio fitted to the
    bound, sides floored under the cap or ceiled over the floor. That replacement depends on the
    base alone and is computed in integers, so it is the same for every scale past the bound (no
    float jitter, unlike `smart_resize`). The aspect ratio is taken from `base_hw` in pixels, which
    for a base on the token grid is the ratio of its sides in tokens exactly.
    """
    if not 0 < scale < math.inf:
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    h, w = rounded_sides(base_hw, scale, grid)
    cap = max_tokens if max_tokens is not None else NO_CAP_TOKENS
    n_h, n_w = int(base_hw[0]), int(base_hw[1])
    if h * w > cap:  # floor(sqrt(cap * n_h / n_w)) and its transpose
        h, w = math.isqrt(cap * n_h // n_w), math.isqrt(cap * n_w // n_h)
    elif h * w < min_tokens:  # ceil(sqrt(min_tokens * n_h / n_w)) and its transpose
        h, w = ceil_sqrt_ratio(min_tokens * n_h, n_w), ceil_sqrt_ratio(min_tokens * n_w, n_h)
    return h * grid.token_px, w * grid.token_px


def qwen2vl_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize` (image_processing_qwen2_vl), which the authors' code
    applies to every pair: sides rounded to `factor` (half to even); an area over `max_pixels`
    refit as floor(side / beta) with beta = sqrt(height * width / max_pixels), one under
    `min_pixels` as ceil(side * beta), in floats, from the sides given (not from the base)."""
    if (ratio := max(height, width) / min(height, width)) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def truncated_size(
    base_hw: tuple[int, int],
    scale: float,
    grid: TokenGrid,
    min_tokens: int = 1,
    max_tokens: int | None = None,
) -> tuple[int, int]:
    """Size in pixels of a frame pair under the authors' code (`truncate_scaled_side=true`): each
    side `int(side * scale)` pixels (at least one patch, token_px / 2), then `qwen2vl_smart_resize`
    on the token grid with min_pixels / max_pixels = min_tokens / max_tokens x token_px^2 (their
    768-token `max_pixels` per pair; their `min_pixels` is 56 x 56 px, 4 tokens at 28 px). `scale`
    is used as given: `plan_from_scales` passes the pair's scale rounded to float32 first, as their
    scales are float32 tensors."""
    if not 0 < scale < math.inf:
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    px, patch = grid.token_px, grid.token_px // 2
    h, w = max(patch, int(base_hw[0] * scale)), max(patch, int(base_hw[1] * scale))
    cap = max_tokens if max_tokens is not None else NO_CAP_TOKENS
    return qwen2vl_smart_resize(h, w, px, min_tokens * px * px, cap * px * px)


def pair_size(
    base_hw: tuple[int, int],
    scale: float,
    grid: TokenGrid,
    min_tokens: int = 1,
    max_tokens: int | None = None,
    truncate: bool = False,
) -> tuple[int, int]:
    """A pair's size in pixels at the pair's `scale`: `truncated_size` of the scale rounded to
    float32 (the authors' code) when `truncate`, else `scaled_size` (the paper's text)."""
    if truncate:
        return truncated_size(base_hw, float(np.float32(scale)), grid, min_tokens, max_tokens)
    return scaled_size(base_hw, scale, grid, min_tokens, max_tokens)


def ceil_sqrt_ratio(a: int, b: int) -> int:
    """ceil(sqrt(a / b)) for positive integers, exactly."""
    k = math.isqrt(a // b)
    return k if k * k * b >= a else k + 1


def pair_frames(num_frames: int, temporal_patch: int = 2) -> list[tuple[int, ...]]:
    """Positions (0..T-1) of the frames in each temporal group; an odd tail repeats the last frame,
    as Qwen's processors pad it."""
    if num_frames < 1:
        raise ValueError("a video needs at least one frame")
    groups = []
    for start in range(0, num_frames, temporal_patch):
        group = list(range(start, min(start + temporal_patch, num_frames)))
        group += [group[-1]] * (temporal_patch - len(group))
        groups.append(tuple(group))
    return groups


def reduce_pair_scales(
    scales: Sequence[float], groups: Sequence[tuple[int, ...]], how: str = "mean", dtype=np.float64
) -> np.ndarray:
    """One scale per pair from its frames' scales: `mean` (default), `max` or `min`, computed in
    `dtype` (float32 under the authors' code, whose scales are float32 tensors)."""
    if how not in PAIR_REDUCTIONS:
        raise ValueError(f"pair reduction must be one of {PAIR_REDUCTIONS}, got {how!r}")
    s = np.asarray(scales, dtype=dtype)
    return np.array([getattr(np, how)(s[list(g)]) for g in groups])


@dataclass
class ResizePlan:
    """Sizes of every frame pair of one video and the tokens they cost.

    frame_scales: per-frame scales s_t, length T.
    pair_frames: frame positions of each pair (an odd tail repeats the last frame).
    pair_sizes: (height, width) in pixels per pair, multiples of grid.token_px.
    reference_tokens: tokens of the vanilla plan (every pair at base_hw, its sides rounded to the
        token grid where the base is not on it) for the same frames.
    """

    grid: TokenGrid
    base_hw: tuple[int, int]
    frame_scales: list[float]
    pair_frames: list[tuple[int, ...]]
    pair_sizes: list[tuple[int, int]]
    pair_tokens: list[int] = field(init=False)
    reference_tokens: int = field(init=False)

    def __post_init__(self):
        self.pair_tokens = [self.grid.tokens(h, w) for h, w in self.pair_sizes]
        self.reference_tokens = len(self.pair_sizes) * self.vanilla_pair_tokens

    @property
    def vanilla_pair_tokens(self) -> int:
        """Tokens of one pair at the base size: base_hw in tokens, each side rounded to the grid
        (half to even, as the processor re-rounds a 28 px base on Qwen3-VL's 32 px grid)."""
        h, w = rounded_sides(self.base_hw, 1.0, self.grid)
        return h * w

    @property
    def visual_tokens(self) -> int:
        """Visual tokens this plan puts into the LLM."""
        return sum(self.pair_tokens)

    @property
    def retention(self) -> float:
        """R = visual tokens / vanilla tokens for the same frames and base resolution."""
        return self.visual_tokens / self.reference_tokens

    @property
    def grids(self) -> list[tuple[int, int, int]]:
        """Merged-token grid (t, h, w) per pair: t=1 temporal patch, h/w in tokens."""
        px = self.grid.token_px
        return [(1, h // px, w // px) for h, w in self.pair_sizes]


def plan_from_scales(
    scales: Sequence[float],
    base_hw: tuple[int, int],
    grid: TokenGrid,
    pair_reduction: str = "mean",
    min_tokens_per_pair: int = 1,
    max_tokens_per_pair: int | None = None,
    truncate_scaled_side: bool = False,
) -> ResizePlan:
    """Resize plan for T frames with per-frame scales `scales` (linear, relative to `base_hw`).

    truncate_scaled_side: size pairs as the authors' code does (`truncated_size`, the pair's scale
    reduced in float32); else as the paper's text (`scaled_size`)."""
    scales = [float(s) for s in scales]
    groups = pair_frames(len(scales), grid.temporal_patch)
    dtype = np.float32 if truncate_scaled_side else np.float64
    pair_scales = reduce_pair_scales(scales, groups, pair_reduction, dtype)
    bounds = (min_tokens_per_pair, max_tokens_per_pair, truncate_scaled_side)
    sizes = [pair_size(base_hw, float(s), grid, *bounds) for s in pair_scales]
    return ResizePlan(grid=grid, base_hw=tuple(base_hw), frame_scales=scales, pair_frames=groups, pair_sizes=sizes)


def uniform_frame_indices(total_frames: int, max_num_frames: int) -> list[int]:
    """`min(total, max_num_frames)` uniformly spaced frame indices into a video of `total_frames`."""
    if total_frames < 1:
        raise ValueError("the video has no frames")
    n = min(total_frames, max_num_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int).tolist()


def retention_of_scale(scale: float, num_frames: int, base_hw: tuple[int, int], grid: TokenGrid, **bounds) -> float:
    """R of the plan that gives every frame the same scale."""
    return plan_from_scales([scale] * num_frames, base_hw, grid, **bounds).retention


class InfeasibleBudget(ValueError):
    """A retention target below the smallest R a method can reach on this sample.

    target: the requested R; floor: the smallest reachable R; what: the method's limit, in words.
    """

    def __init__(self, target: float, floor: float, what: str):
        super().__init__(target, floor, what)
        self.target, self.floor, self.what = target, floor, what

    def __str__(self) -> str:
        return f"retention {self.target} is below the reachable floor R={self.floor:.4f} of {self.what}"


CROSSING_OFFSETS = (-1e-9, 0.0, 1e-9)


def fixed_scale_for_retention(
    target: float,
    num_frames: int,
    base_hw: tuple[int, int],
    grid: TokenGrid,
    s_min: float,
    s_max: float,
    **bounds,
) -> float:
    """The single scale in [s_min, s_max] whose plan has the largest R not above `target`
    (the smallest such scale on ties).

    A side of n tokens changes its rounded length only where n*s crosses k + 1/2, and Python's
    round-half-to-even makes some lengths exist at that exact point alone (9 tokens at s=0.5 give
    round(4.5)=4 rows, just above give 5, just below 4). So the candidates are every crossing, just
    below and just above it, plus the range ends. A plan's tokens depend on the scale only through
    the rounded count u(s) = rows x columns, non-decreasing in s: u itself inside the token bounds,
    one constant below them, another above. So three candidates decide: s_min, the first scale of
    the largest in-bounds u not above the target, the first scale above the cap. Each is found by
    bisection on u and a look at the few crossings around the step, in O(log(s_max / s_min)) plans.
    Raises `InfeasibleBudget` when every candidate exceeds the target.

    Pairs sized as the authors' code does (`truncate_scaled_side`), or a base off the token grid,
    break that structure: `uniform_scale_steps` lists every scale where such a plan can change
    and the best is picked among them.
    """
    if not 0 < target:
        raise ValueError(f"retention must be positive, got {target}")
    if not 0 < s_min <= s_max < math.inf:
        raise ValueError(f"need 0 < s_min <= s_max < inf, got s_min={s_min}, s_max={s_max}")
    px = grid.token_px
    if bounds.get("truncate_scaled_side") or base_hw[0] % px or base_hw[1] % px:
        return fixed_scale_by_steps(target, num_frames, base_hw, grid, s_min, s_max, **bounds)
    sides = (base_hw[0] // px, base_hw[1] // px)
    vanilla = sides[0] * sides[1]
    cap = bounds.get("max_tokens_per_pair") or NO_CAP_TOKENS
    floor_tokens = bounds.get("min_tokens_per_pair", 1)

    def u(s: float) -> int:
        h, w = rounded_sides(base_hw, s, grid)
        return h * w

    def candidates(lo: float, hi: float) -> list[float]:
        """Candidate scales in [lo, hi], sorted."""
        found = {c for c in (s_min, s_max) if lo <= c <= hi}
        for n in sides:
            for k in range(max(0, math.floor(lo * n - 1)), math.ceil(hi * n) + 1):
                found.update(c for d in CROSSING_OFFSETS if lo <= (c := (k + 0.5) / n + d) <= hi)
        return sorted(found)

    def first_where(fails) -> float | None:
        """The smallest candidate whose u fails `fails` (a predicate that, once true, stays true as
        u grows), or None."""
        if fails(u(s_min)):
            return s_min
        if not fails(u(s_max)):
            return None
        a, b = s_min, s_max  # u(a) passes, u(b) fails
        while b - a > 0.25 / max(sides):  # geometric steps first: O(log log) over wide ranges
            mid = math.sqrt(a) * math.sqrt(b) if b > 4 * a else 0.5 * (a + b)
            if not a < mid < b:  # adjacent floats
                break
            a, b = (a, mid) if fails(u(mid)) else (mid, b)
        # The first failing candidate is above a and at most the first candidate past b; a side of
        # n = min(sides) tokens crosses once in any 1/n, so a window of 2/n above b holds one.
        return next(c for c in candidates(a, min(s_max, b + 2 / min(sides))) if c > a and fails(u(c)))

    def retention(s: float) -> float:
        return retention_of_scale(s, num_frames, base_hw, grid, **bounds)

    top = first_where(lambda t: t > cap or t / vanilla > target)  # just past the best in-bounds u
    # The candidate just below `top`: a side of n = min(sides) tokens crosses once in any 1/n.
    below = None if top is None else [c for c in candidates(max(s_min, top - 2 / min(sides)), top) if c < top]
    best_u = s_max if top is None else max(below, default=None)
    contenders = [s_min]
    if best_u is not None:
        level = u(best_u)
        contenders.append(first_where(lambda t: t >= level))
    over_cap = first_where(lambda t: t > cap)
    if over_cap is not None:
        contenders.append(over_cap)
    reached = {s: retention(s) for s in contenders}  # each contender's plan, built once
    feasible = [(-r, s) for s, r in reached.items() if r <= target]
    if feasible:
        return min(feasible)[1]
    floor = min(reached.values())
    lowest_in_bounds = first_where(lambda t: t >= floor_tokens)
    if lowest_in_bounds is not None:
        floor = min(floor, retention(lowest_in_bounds))
    raise InfeasibleBudget(
        target,
        floor,
        f"fixed_scale (one scale in [{s_min:g}, {s_max:g}], {base_hw[0]}x{base_hw[1]} px base, {px} px tokens)",
    )


MAX_SCALE_STEPS = 200_000  # candidate scales `fixed_scale_by_steps` tries at most


def uniform_scale_steps(
    base_hw: tuple[int, int], grid: TokenGrid, s_min: float, s_max: float, truncate: bool = False
) -> list[float]:
    """Every scale in [s_min, s_max] where the plan of one scale for all frames can change, and
    the range ends, sorted. Truncated sides (the authors' rule) depend on the scale only through
    int(side * float32(s)): the steps are the first float32 at which that reaches each integer m.
    Rounded sides of a base off the grid change where side * s / token_px crosses k + 1/2: that
    point and just around it (round half to even), as in `fixed_scale_for_retention`."""
    px = grid.token_px
    found = {float(s_min), float(s_max)}
    for side in (int(base_hw[0]), int(base_hw[1])):
        if truncate:
            m = np.arange(max(1, math.floor(s_min * side)), math.ceil(s_max * side) + 1, dtype=np.float64)
            c = (m / side).astype(np.float32)
            up, down = np.float32(np.inf), np.float32(0)
            for _ in range(4):  # float32(m / side) is within one step of the first float32 reaching m
                c = np.where(np.floor(side * c.astype(np.float64)) < m, np.nextafter(c, up), c)
                lower = np.nextafter(c, down)
                c = np.where(np.floor(side * lower.astype(np.float64)) >= m, lower, c)
            steps = c.astype(np.float64)
        else:
            k = np.arange(max(0, math.floor(s_min * side / px - 1)), math.ceil(s_max * side / px) + 1)
            crossings = (k + 0.5) * px / side
            steps = np.concatenate([crossings + d for d in CROSSING_OFFSETS])
        found.update(float(c) for c in steps if s_min <= c <= s_max)
        if len(found) > MAX_SCALE_STEPS:
            raise ValueError(
                f"s_max={s_max} leaves more than {MAX_SCALE_STEPS} candidate scales on a {base_hw[0]}x{base_hw[1]} "
                "px base; use a smaller s_max or fixed_scale_rule=sqrt"
            )
    return sorted(found)


def fixed_scale_by_steps(
    target: float,
    num_frames: int,
    base_hw: tuple[int, int],
    grid: TokenGrid,
    s_min: float,
    s_max: float,
    **bounds,
) -> float:
    """`fixed_scale_for_retention` by trying every step of `uniform_scale_steps`: the step whose
    plan has the largest R not above `target`, the smallest on ties. A plan of one scale has the
    same R as one of its pairs, so each step costs one pair size. Raises `InfeasibleBudget`."""
    truncate = bool(bounds.get("truncate_scaled_side"))
    lo, hi = bounds.get("min_tokens_per_pair", 1), bounds.get("max_tokens_per_pair")
    vanilla = plan_from_scales([1.0], base_hw, grid, **bounds).reference_tokens
    best, floor = None, math.inf
    for s in uniform_scale_steps(base_hw, grid, s_min, s_max, truncate):
        r = grid.tokens(*pair_size(base_hw, s, grid, lo, hi, truncate)) / vanilla
        floor = min(floor, r)
        if r <= target and (best is None or r > best[0]):
            best = (r, s)
    if best is None:
        raise InfeasibleBudget(
            target,
            floor,
            f"fixed_scale (one scale in [{s_min:g}, {s_max:g}], {base_hw[0]}x{base_hw[1]} px base, "
            f"{grid.token_px} px tokens)",
        )
    return best[1]


@functools.lru_cache(maxsize=4096)
def fixed_scale_cache(
    target: float,
    num_frames: int,
    base_hw: tuple[int, int],
    grid: TokenGrid,
    s_min: float,
    s_max: float,
    bounds: tuple[tuple[str, object], ...],
) -> float:
    """`fixed_scale_for_retention` memoised on hashable arguments (`bounds` as sorted (name, value)
    pairs); call it through `cached_fixed_scale_for_retention`."""
    return fixed_scale_for_retention(target, num_frames, base_hw, grid, s_min, s_max, **dict(bounds))


def cached_fixed_scale_for_retention(
    target: float,
    num_frames: int,
    base_hw: tuple[int, int],
    grid: TokenGrid,
    s_min: float,
    s_max: float,
    **bounds,
) -> float:
    """`fixed_scale_for_retention`, searched once per (target, frames, base size, grid, scale range,
    bounds) in a process: the search depends on nothing else, and every request of a run repeats it."""
    base = (int(base_hw[0]), int(base_hw[1]))
    args = (float(target), int(num_frames), base, grid, float(s_min), float(s_max))
    return fixed_scale_cache(*args, tuple(sorted(bounds.items())))


def project_to_retention(
    scales: Sequence[float],
    target: float,
    base_hw: tuple[int, int],
    grid: TokenGrid,
    s_min: float,
    s_max: float,
    **bounds,
) -> np.ndarray:
    """Rescale per-frame `scales` by one global factor g, clipped to [s_min, s_max], so that the
    exact plan has the largest R not above `target`; the relative allocation is kept."""
    (projected,) = project_jointly([scales], target, [base_hw], grid, s_min, s_max, **bounds)
    return projected


def project_jointly(
    scales: Sequence[Sequence[float]],
    target: float,
    base_hws: Sequence[tuple[int, int]],
    grid: TokenGrid,
    s_min: float,
    s_max: float,
    **bounds,
) -> list[np.ndarray]:
    """`project_to_retention` for several visual items of one request (the images of a prompt),
    item i with per-frame `scales[i]` at base size `base_hws[i]`: one global factor g for all of
    them, so that the request's R (all items' tokens / all items' vanilla tokens) is the largest
    not above `target`, and the Allocator's allocation across items is kept.

    R(g) is non-decreasing in g, from the all-s_min plans to the all-s_max plans; bisection on g
    finds the last step at or below the target. A target below the all-s_min plan raises
    `InfeasibleBudget`; one above the all-s_max plan, ValueError.
    """
    if not 0 < s_min <= s_max < math.inf:
        raise ValueError(f"need 0 < s_min <= s_max < inf, got s_min={s_min}, s_max={s_max}")
    items = [np.asarray(s, dtype=np.float64) for s in scales]
    if not items or any(s.ndim != 1 or not len(s) or not (s > 0).all() for s in items):
        raise ValueError("scales must be non-empty 1-D arrays of positive numbers")
    if len(items) != len(base_hws):
        raise ValueError(f"{len(items)} scale arrays for {len(base_hws)} base sizes")

    def retention_at(g: float) -> float:
        plans = [plan_from_scales(np.clip(g * s, s_min, s_max), hw, grid, **bounds) for s, hw in zip(items, base_hws)]
        return sum(p.visual_tokens for p in plans) / sum(p.reference_tokens for p in plans)

    flat = np.concatenate(items)
    g_lo, g_hi = s_min / flat.max(), s_max / flat.min()  # every frame at s_min / at s_max
    r_lo, r_hi = retention_at(g_lo), retention_at(g_hi)
    if not r_lo <= target:
        raise InfeasibleBudget(target, r_lo, f"scales in [{s_min:g}, {s_max:g}] (every frame at s_min={s_min:g})")
    if target > r_hi:
        raise ValueError(f"retention {target} is above the largest plan (every frame at s_max={s_max}: R={r_hi:.4f})")
    if target == r_hi:
        g_lo = g_hi
    # Geometric bisection: a relative width of 1e-12 in about 40 + log2(ln(g_hi / g_lo)) steps, for
    # any s-range; each step halves ln(g_hi / g_lo), which stays far above the float resolution.
    while g_hi - g_lo > 1e-12 * g_hi:
        mid = math.sqrt(g_lo) * math.sqrt(g_hi)
        if retention_at(mid) <= target:
            g_lo = mid
        else:
            g_hi = mid
    return [np.clip(g_lo * s, s_min, s_max) for s in items]
