"""Budget searches are bounded for any valid s-range, and one infeasibility rule covers every method."""

import math

import numpy as np
import pytest
import torch
from qwen_vl_utils import smart_resize

from resadapt_eval.baselines import VisualTokens, kept_count, random_drop
from resadapt_eval.baselines.common import DROPPED, per_pair_budget
from resadapt_eval.budget.plan import (
    QWEN3VL_GRID,
    QWEN25VL_GRID,
    InfeasibleBudget,
    fixed_scale_for_retention,
    project_to_retention,
    retention_of_scale,
    scaled_size,
)
from resadapt_eval.budget.policies import BudgetSpec

FLOOR_MESSAGE = r"retention {} is below the reachable floor R={:.4f} of "


def brute_force_fixed_scale(target, num_frames, base_hw, grid, s_min, s_max, **bounds):
    """Reference: every rounding crossing (k + 1/2) / n of both sides, at and 1e-9 around it, the
    range ends and a fine grid, each planned; the largest R not above target, smallest scale on ties."""
    px = grid.token_px
    crossings = [
        (k + 0.5) / n + d
        for n in (base_hw[0] // px, base_hw[1] // px)
        for k in range(int(s_max * n) + 1)
        for d in (-1e-9, 0.0, 1e-9)
    ]
    exact = sorted(s for s in {s_min, s_max, *crossings} if s_min <= s <= s_max)
    grid_scales = np.linspace(s_min, s_max, 2001).tolist()
    best_r = max(
        (r for s in exact + grid_scales if (r := retention_of_scale(s, num_frames, base_hw, grid, **bounds)) <= target),
        default=None,
    )
    if best_r is None:
        return None, None
    first = next(s for s in exact if retention_of_scale(s, num_frames, base_hw, grid, **bounds) == best_r)
    return first, best_r


CASES = [
    # base in px, token grid, bounds
    ((252, 308), QWEN25VL_GRID, {}),
    ((252, 308), QWEN25VL_GRID, dict(max_tokens_per_pair=64)),
    ((252, 308), QWEN25VL_GRID, dict(min_tokens_per_pair=30)),
    ((868, 868), QWEN25VL_GRID, dict(max_tokens_per_pair=64)),  # 31x31: the cap is exactly 8x8
    ((320, 96), QWEN3VL_GRID, dict(min_tokens_per_pair=5, max_tokens_per_pair=20)),
    ((28, 560), QWEN25VL_GRID, {}),
]


@pytest.mark.parametrize("base_hw, grid, bounds", CASES)
@pytest.mark.parametrize("target", [0.03, 0.1, 0.25, 0.5, 0.65, 1.0])
def test_fixed_scale_matches_brute_force_and_ignores_a_huge_s_max(base_hw, grid, bounds, target):
    # At s=2 every case is past its bounds or past every target here, so nothing above 2 can win.
    s_min, s_sat = 0.05, 2.0
    expected_s, expected_r = brute_force_fixed_scale(target, 5, base_hw, grid, s_min, s_sat, **bounds)
    for s_max in (s_sat, 1e6):
        if expected_s is None:
            with pytest.raises(InfeasibleBudget):
                fixed_scale_for_retention(target, 5, base_hw, grid, s_min, s_max, **bounds)
            continue
        s = fixed_scale_for_retention(target, 5, base_hw, grid, s_min, s_max, **bounds)
        assert s == expected_s
        assert retention_of_scale(s, 5, base_hw, grid, **bounds) == expected_r


def test_fixed_scale_hand_computed_with_huge_and_tiny_ranges():
    # 9x11 tokens: s=0.5 gives round(4.5) x round(5.5) = 4x6 = 24 tokens (R=24/99); any larger
    # scale gives at least 5x6=30. The old search enumerated 10^6 x 20 crossings here (hours).
    for s_min, s_max in [(1e-9, 1e6), (1e-9, 1e300), (0.05, 1.0)]:
        s = fixed_scale_for_retention(0.25, 8, (252, 308), QWEN25VL_GRID, s_min, s_max)
        assert s == 0.5
    # Every scale up to 0.5/11 leaves 1x1 token: the floor is 1/99, reached at s_min itself.
    assert fixed_scale_for_retention(1 / 99, 8, (252, 308), QWEN25VL_GRID, 1e-9, 1e6) == 1e-9
    # A target far above anything reachable below the 2**40-token cap: the largest in-bounds plan.
    s = fixed_scale_for_retention(1e9, 8, (252, 308), QWEN25VL_GRID, 1e-9, 1e6)
    assert retention_of_scale(s, 8, (252, 308), QWEN25VL_GRID) <= 1e9


def test_scaled_size_is_smart_resize_in_bounds_and_exact_past_them():
    # In bounds: Qwen's rule. 9x11 tokens at s=0.7: round(6.3) x round(7.7) = 6x8.
    assert scaled_size((252, 308), 0.7, QWEN25VL_GRID) == (168, 224)
    assert scaled_size((252, 308), 0.7, QWEN25VL_GRID) == smart_resize(252 * 0.7, 308 * 0.7, 28, 784, 784 << 40)
    # Past a 64-token cap a 31x31 base is floor(sqrt(64)) = 8 tokens a side at every scale;
    # smart_resize's float beta gives 7 or 8 depending on the scale.
    sizes = {scaled_size((868, 868), s, QWEN25VL_GRID, 1, 64) for s in np.linspace(0.3, 50, 500)}
    assert sizes == {(224, 224)}
    # Under a 12-token floor a 12x1 base is ceil(sqrt(12 * 12)) x ceil(sqrt(12 / 12)) = 12x1 tokens.
    sizes = {scaled_size((336, 28), s, QWEN25VL_GRID, 12) for s in np.linspace(1e-6, 0.9, 500)}
    assert sizes == {(336, 28)}


def test_floor_below_the_smallest_scale_is_named():
    # 9x11 tokens, at least 30 per pair. At s_min=0.2 the 2x2 rounding is lifted to
    # ceil(sqrt(30*9/11)) x ceil(sqrt(30*11/9)) = 5x7 = 35, but s=0.55 rounds to 5x6 = 30: the floor.
    with pytest.raises(InfeasibleBudget, match=FLOOR_MESSAGE.format(0.2, 30 / 99)) as raised:
        fixed_scale_for_retention(0.2, 4, (252, 308), QWEN25VL_GRID, 0.2, 1.8, min_tokens_per_pair=30)
    assert (raised.value.target, raised.value.floor) == (0.2, 30 / 99)
    s = fixed_scale_for_retention(30 / 99, 4, (252, 308), QWEN25VL_GRID, 0.2, 1.8, min_tokens_per_pair=30)
    assert retention_of_scale(s, 4, (252, 308), QWEN25VL_GRID, min_tokens_per_pair=30) == 30 / 99


def test_one_infeasibility_message_for_every_method():
    base = (252, 308)  # 9x11 tokens; s=0.2 gives 2x2
    with pytest.raises(InfeasibleBudget, match=FLOOR_MESSAGE.format(0.001, 4 / 99) + "fixed_scale"):
        fixed_scale_for_retention(0.001, 8, base, QWEN25VL_GRID, 0.2, 1.8)
    with pytest.raises(InfeasibleBudget, match=FLOOR_MESSAGE.format(0.001, 4 / 99) + "scales in"):
        project_to_retention([1.0] * 8, 0.001, base, QWEN25VL_GRID, 0.2, 1.8)
    with pytest.raises(InfeasibleBudget, match=FLOOR_MESSAGE.format(0.001, 6 / 144) + "token compression") as raised:
        kept_count(0.001, 144, 6)
    assert (raised.value.target, raised.value.floor) == (0.001, 6 / 144)
    assert str(raised.value).endswith("one token per frame pair (6 of 144 tokens)")


def test_projection_is_exact_for_huge_and_tiny_ranges():
    # One frame pair at scale g, 9x11 tokens: below 0.5 the best is round(9g) x round(11g) = 4x5 = 20
    # for g in (4.5/11, 0.5); 4x6 exists at g=0.5 alone, a point bisection does not land on; above
    # 0.5 it is at least 5x6 = 30 > 0.25 * 99.
    for s_min, s_max in [(1e-9, 1e6), (1e-9, 1e300), (0.05, 1.0)]:
        scales = project_to_retention([1.0, 1.0], 0.25, (252, 308), QWEN25VL_GRID, s_min, s_max)
        assert retention_of_scale(scales[0], 2, (252, 308), QWEN25VL_GRID) == 20 / 99


def test_compressor_floor_is_one_token_per_pair():
    assert kept_count(6 / 144, 144, 6) == 6  # exactly at the floor
    assert kept_count(1.0, 144, 6) == kept_count(3.0, 144, 6) == 144
    with pytest.raises(InfeasibleBudget):
        kept_count(0.04, 144, 6)  # 5.76 tokens would round to 6, but 0.04 < 6/144
    with pytest.raises(ValueError, match=r"keep=2 tokens is outside \[3 pairs, 12 tokens\]"):
        per_pair_budget([4, 4, 4], 2)
    tokens = VisualTokens(features=torch.randn(12, 3), pair_sizes=[4, 4, 4], grids=[(1, 2, 2)] * 3)
    kept = random_drop.compress(tokens, 3).assignment != DROPPED
    assert [int(kept[i : i + 4].sum()) for i in (0, 4, 8)] == [1, 1, 1]
    with pytest.raises(ValueError, match="keep=2"):
        random_drop.compress(tokens, 2).assignment


def test_budget_spec_rejects_an_unbounded_range():
    with pytest.raises(ValueError, match="s_max < inf"):
        BudgetSpec(s_min=0.2, s_max=math.inf)
