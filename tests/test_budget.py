import numpy as np
import pytest

from resadapt_eval.budget.plan import (
    QWEN3VL_GRID,
    QWEN25VL_GRID,
    base_size,
    fixed_scale_for_retention,
    pair_frames,
    plan_from_scales,
    uniform_frame_indices,
)
from resadapt_eval.budget.policies import POLICIES, BudgetSpec

GRIDS = {"qwen25vl": QWEN25VL_GRID, "qwen3vl": QWEN3VL_GRID}


def test_pairs_pad_an_odd_tail_with_the_last_frame():
    assert pair_frames(5) == [(0, 1), (2, 3), (4, 4)]
    assert pair_frames(4) == [(0, 1), (2, 3)]
    assert pair_frames(1) == [(0, 0)]


def test_base_size_is_qwens_smart_resize():
    # 240x320 at 28 px: sides round to 252x308 (9x11 tokens); a 768-token cap shrinks 720x1280.
    assert base_size(240, 320, QWEN25VL_GRID, 4 * 28 * 28, 768 * 28 * 28) == (252, 308)
    h, w = base_size(720, 1280, QWEN25VL_GRID, 4 * 28 * 28, 768 * 28 * 28)
    assert (h % 28, w % 28) == (0, 0) and (h // 28) * (w // 28) <= 768
    assert base_size(240, 320, QWEN3VL_GRID, 4 * 32 * 32, 768 * 32 * 32) == (256, 320)


def test_plan_counts_tokens_per_pair_by_hand():
    # Base 252x308 px = 9x11 tokens. Scales per frame; pairs take the mean of their two frames.
    plan = plan_from_scales([1.0, 1.0, 0.5, 0.5, 0.2], (252, 308), QWEN25VL_GRID)
    # pair 0 s=1 -> 9x11=99; pair 1 s=0.5 -> round(4.5)=4 x round(5.5)=6 = 24;
    # pair 2 (frame 4 repeated) s=0.2 -> round(1.8)=2 x round(2.2)=2 = 4.
    assert plan.pair_sizes == [(252, 308), (112, 168), (56, 56)]
    assert plan.pair_tokens == [99, 24, 4]
    assert plan.grids == [(1, 9, 11), (1, 4, 6), (1, 2, 2)]
    assert plan.visual_tokens == 127
    assert plan.reference_tokens == 3 * 99
    assert plan.retention == pytest.approx(127 / 297)


def test_pair_reduction_max_and_min():
    plan_max = plan_from_scales([1.0, 0.5], (252, 308), QWEN25VL_GRID, pair_reduction="max")
    plan_min = plan_from_scales([1.0, 0.5], (252, 308), QWEN25VL_GRID, pair_reduction="min")
    assert plan_max.pair_tokens == [99] and plan_min.pair_tokens == [24]
    with pytest.raises(ValueError, match="pair reduction"):
        plan_from_scales([1.0, 0.5], (252, 308), QWEN25VL_GRID, pair_reduction="median")


def test_explicit_token_bounds_per_pair():
    # s=0.1 of 9x11 would round to 1x1 token; a floor of 12 tokens lifts it, keeping the aspect.
    plan = plan_from_scales([0.1, 0.1], (252, 308), QWEN25VL_GRID, min_tokens_per_pair=12)
    assert plan.pair_tokens[0] >= 12
    no_floor = plan_from_scales([0.1, 0.1], (252, 308), QWEN25VL_GRID)
    assert no_floor.pair_tokens == [1]
    capped = plan_from_scales([1.8, 1.8], (252, 308), QWEN25VL_GRID, max_tokens_per_pair=100)
    assert capped.pair_tokens[0] <= 100


def test_fixed_scale_hand_computed_case():
    # 9x11 tokens: s=0.5 gives 4x6=24 tokens (R=24/99=0.2424); any larger s gives 5x6=30 (0.303).
    s = fixed_scale_for_retention(0.25, 8, (252, 308), QWEN25VL_GRID, s_min=0.05, s_max=1.0)
    plan = plan_from_scales([s] * 8, (252, 308), QWEN25VL_GRID)
    assert plan.retention == pytest.approx(24 / 99)


@pytest.mark.parametrize("backbone", ["qwen25vl", "qwen3vl"])
@pytest.mark.parametrize("target", [0.25, 0.10])
@pytest.mark.parametrize("num_frames", [7, 9, 32])
@pytest.mark.parametrize(
    "frame_hw",
    [(1080, 1920), (1920, 1080), (240, 320), (480, 360), (720, 720)],
    ids=["wide", "tall", "small-wide", "tall-4:3", "square"],
)
def test_fixed_scale_lands_within_one_grid_step_below_target(backbone, target, num_frames, frame_hw):
    grid = GRIDS[backbone]
    px = grid.token_px
    base = base_size(*frame_hw, grid, 4 * px * px, 768 * px * px)
    spec = BudgetSpec(retention=target, s_min=0.05, s_max=1.0)
    scales = POLICIES["fixed_scale"](num_frames, base, grid, spec)
    assert np.allclose(scales, scales[0])
    plan = plan_from_scales(scales, base, grid)
    assert len(plan.pair_sizes) == (num_frames + 1) // 2
    assert plan.retention <= target
    # Closest without exceeding: no single scale on a fine sweep lands between R and the target.
    for s in np.linspace(0.05, 1.0, 400):
        r = plan_from_scales([s] * num_frames, base, grid).retention
        assert not plan.retention < r <= target, f"scale {s} gives R={r}, closer to {target} than {plan.retention}"
    # One grid step: every pair one token row and one token column larger.
    _, h, w = plan.grids[0]
    grid_step = ((h + 1) * (w + 1) - h * w) * len(plan.grids) / plan.reference_tokens
    assert target - plan.retention <= grid_step


def test_impossible_retention_says_so():
    # 9x11 tokens at s=0.2: round(1.8) x round(2.2) = 2x2 = 4 of 99 tokens.
    with pytest.raises(ValueError, match=r"retention 0.001 is below the reachable floor R=0\.0404 of fixed_scale"):
        fixed_scale_for_retention(0.001, 8, (252, 308), QWEN25VL_GRID, s_min=0.2, s_max=1.8)


def test_budget_spec_rejects_bad_ranges():
    with pytest.raises(ValueError, match="s_min"):
        BudgetSpec(s_min=1.5, s_max=1.0)
    with pytest.raises(ValueError, match="retention"):
        BudgetSpec(retention=-0.1)
    with pytest.raises(ValueError, match="fixed_scale needs a target"):
        POLICIES["fixed_scale"](8, (252, 308), QWEN25VL_GRID, BudgetSpec())


def test_uniform_frame_indices():
    assert uniform_frame_indices(32, 8) == [0, 4, 9, 13, 18, 22, 27, 31]
    assert uniform_frame_indices(5, 8) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        uniform_frame_indices(0, 8)
