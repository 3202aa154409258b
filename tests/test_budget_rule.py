"""budget_rule=paper|authors_code: the paper's token rule and the authors' public code's, checked
against each rule written out here independently (no code under test computes an expected value)."""

import math

import numpy as np
import pytest

from resadapt_eval.budget.plan import QWEN3VL_GRID, QWEN25VL_GRID
from resadapt_eval.budget.planner import Planner
from resadapt_eval.budget.policies import BudgetSpec, fixed_scale
from resadapt_eval.budget.selection import Operator
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig
from resadapt_eval.runspec import config_from_model_args

GRIDS = {"qwen25vl": QWEN25VL_GRID, "qwen3vl": QWEN3VL_GRID}
SOURCES = {"1280x720": (720, 1280), "640x360": (360, 640), "1920x1080": (1080, 1920), "480x640": (640, 480)}
SOURCES["320x240"] = (240, 320)  # (height, width) of width x height sources
SCALES = [round(0.2 + 0.05 * i, 2) for i in range(33)]  # 0.2, 0.25, ..., 1.8


def hf_smart_resize(height, width, factor, min_pixels, max_pixels):
    """transformers' Qwen2-VL smart_resize, which the authors' code calls per pair."""
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


def base_frame(source_hw, factor):
    """A frame's base size: sides rounded to `factor`, area capped at 768 tokens of `factor`."""
    return hf_smart_resize(*source_hw, factor, 4 * factor * factor, 768 * factor * factor)


def authors_pair_tokens(base_hw, frame_scales, token_px):
    """The authors' pair: float32 scales, the pair's float32 mean, int(side * s) px (at least a
    patch), then `authors_sides_tokens`."""
    s = float(np.asarray(frame_scales, dtype=np.float32).mean())
    h = max(token_px // 2, int(base_hw[0] * s))
    w = max(token_px // 2, int(base_hw[1] * s))
    return authors_sides_tokens(h, w, token_px)


def authors_sides_tokens(h, w, token_px):
    """Tokens of an h x w px pair after smart_resize on the backbone's grid, min 56x56 px, max 768 tokens."""
    h, w = hf_smart_resize(h, w, token_px, 56 * 56, 768 * token_px * token_px)
    return (h // token_px) * (w // token_px)


def paper_pair_tokens(base_hw, s, token_px):
    """The paper's n(s) ~ s^2 HW / P^2, each side s * side / P rounded to a whole token (half to
    even, as Qwen rounds a side to its grid)."""
    return max(1, round(s * base_hw[0] / token_px)) * max(1, round(s * base_hw[1] / token_px))


@pytest.mark.parametrize("backbone", GRIDS)
@pytest.mark.parametrize("source", SOURCES)
def test_authors_code_and_paper_token_counts_over_the_grid(backbone, source):
    grid, source_hw = GRIDS[backbone], SOURCES[source]
    px = grid.token_px
    authors, paper = Planner(grid, BudgetSpec(budget_rule="authors_code")), Planner(grid, BudgetSpec())
    authors_base, paper_base = authors.base_hw(source_hw), paper.base_hw(source_hw)
    assert authors_base == base_frame(source_hw, 28)  # the authors' base is on 28 px on both backbones
    assert paper_base == base_frame(source_hw, px)
    for s in SCALES:
        plan = authors.plan([s, s, s], authors_base)  # two pairs, the second an odd tail
        assert plan.pair_tokens == [authors_pair_tokens(authors_base, [s, s], px)] * 2, s
        # vanilla: the base, its sides re-rounded to the grid (576 tokens for a 720p pair on Qwen3-VL)
        assert plan.reference_tokens == 2 * round(authors_base[0] / px) * round(authors_base[1] / px)

        plan = paper.plan([s, s, s], paper_base)
        tokens = paper_pair_tokens(paper_base, s, px)
        assert plan.pair_tokens == [tokens] * 2, s
        assert plan.reference_tokens == 2 * paper_base[0] * paper_base[1] // px**2
        exact = s * s * paper_base[0] * paper_base[1] / px**2  # within half a token of each side
        assert abs(tokens - exact) <= (s * paper_base[0] + s * paper_base[1]) / px / 2 + 0.25


@pytest.mark.parametrize("backbone", GRIDS)
def test_mixed_scale_vectors_follow_each_rule_pair_by_pair(backbone):
    grid = GRIDS[backbone]
    px, rng = grid.token_px, np.random.default_rng(7)
    authors, paper = Planner(grid, BudgetSpec(budget_rule="authors_code")), Planner(grid, BudgetSpec())
    for source_hw in SOURCES.values():
        for num_frames in (31, 32):
            scales = rng.uniform(0.2, 1.8, num_frames)
            pairs = [scales[i : i + 2] if i + 1 < num_frames else scales[i : i + 1] for i in range(0, num_frames, 2)]
            base = authors.base_hw(source_hw)
            assert authors.plan(scales, base).pair_tokens == [authors_pair_tokens(base, p, px) for p in pairs]
            base = paper.base_hw(source_hw)
            assert paper.plan(scales, base).pair_tokens == [paper_pair_tokens(base, p.mean(), px) for p in pairs]


def test_the_numbers_in_the_readme():
    a25, p25 = Planner(QWEN25VL_GRID, BudgetSpec(budget_rule="authors_code")), Planner(QWEN25VL_GRID, BudgetSpec())
    base = p25.base_hw((720, 1280))
    assert base == a25.base_hw((720, 1280)) == (560, 1008)
    # s=1.8 on 720p: the paper's rule lets the pair grow to 36x65 tokens, the authors' caps it at 768
    assert p25.plan([1.8, 1.8], base).pair_tokens == [2340] and a25.plan([1.8, 1.8], base).pair_tokens == [740]
    # truncation in float32: int(560 * float32(0.475)) = 265 px, 9 rows; 560 * 0.475 = 266 px, 9.5 -> 10
    assert a25.plan([0.475, 0.475], base).pair_tokens == [9 * 17]
    assert p25.plan([0.475, 0.475], base).pair_tokens == [10 * 17]
    scales = np.random.default_rng(0).uniform(0.2, 1.8, 32)
    ours, theirs = p25.plan(scales, base), a25.plan(scales, base)
    assert (ours.visual_tokens, theirs.visual_tokens, ours.reference_tokens) == (14626, 9514, 11520)
    # Qwen3-VL: 720 tokens a pair on its own 32 px grid; 576 from the authors' 28 px base re-rounded
    a3, p3 = Planner(QWEN3VL_GRID, BudgetSpec(budget_rule="authors_code")), Planner(QWEN3VL_GRID, BudgetSpec())
    assert p3.vanilla_tokens(2, p3.base_hw((720, 1280))) == 720
    assert a3.vanilla_tokens(2, a3.base_hw((720, 1280))) == 576


# FixedScale on 32 frames of 1280x720: (backbone, target) -> (paper's achieved R, authors' achieved R)
FIXED_SCALE_R = {
    ("qwen25vl", 0.10): (72 / 720, 66 / 720),
    ("qwen25vl", 0.25): (180 / 720, 180 / 720),
    ("qwen25vl", 0.50): (350 / 720, 350 / 720),
    ("qwen3vl", 0.10): (72 / 720, 60 / 576),
    ("qwen3vl", 0.25): (180 / 720, 144 / 576),
    ("qwen3vl", 0.50): (350 / 720, 264 / 576),
}


@pytest.mark.parametrize("backbone, target", FIXED_SCALE_R)
def test_fixed_scale_under_each_rule(backbone, target):
    grid = GRIDS[backbone]
    paper_r, authors_r = FIXED_SCALE_R[backbone, target]
    spec = BudgetSpec(retention=target, budget_rule="authors_code")
    planner = Planner(grid, spec)
    base = planner.base_hw((720, 1280))
    scales = fixed_scale(32, base, grid, spec)
    assert (scales == math.sqrt(target)).all()  # s = sqrt(R): R is nominal
    plan = planner.plan(scales, base)
    assert plan.retention == authors_r
    assert plan.pair_tokens[0] == authors_pair_tokens(base, [math.sqrt(target)] * 2, grid.token_px)

    spec = BudgetSpec(retention=target)
    planner = Planner(grid, spec)
    base = planner.base_hw((720, 1280))
    plan = planner.plan(fixed_scale(32, base, grid, spec), base)
    assert plan.retention == paper_r <= target


@pytest.mark.parametrize("backbone", GRIDS)
@pytest.mark.parametrize("target", [0.10, 0.25, 0.50])
def test_fixed_scale_search_also_works_on_the_authors_sizes(backbone, target):
    # fixed_scale_rule=search under authors_code: the best of every scale where a plan can change
    grid = GRIDS[backbone]
    spec = BudgetSpec(retention=target, budget_rule="authors_code", fixed_scale_rule="search")
    planner = Planner(grid, spec)
    base = planner.base_hw((360, 640))
    s = fixed_scale(32, base, grid, spec)[0]
    best = planner.plan([s] * 32, base).retention
    assert best <= target
    # every (int(H s), int(W s)) a float32 scale on a 1e-5 grid reaches (this base's levels are
    # at least 28 / (364 * 644) = 1.2e-4 wide)
    px, vanilla = grid.token_px, planner.vanilla_tokens(2, base)
    s32 = np.append(np.arange(0.2, 1.8, 1e-5), 1.8).astype(np.float32).astype(np.float64)
    sides = {(max(px // 2, int(h)), max(px // 2, int(w))) for h, w in zip(base[0] * s32, base[1] * s32)}
    assert best == max(r for h, w in sides if (r := authors_sides_tokens(h, w, px) / vanilla) <= target)


def test_selection_by_pairs_keeps_raw_pair_means_without_projection():
    raw = np.array([0.25, 0.5, 1.5, 1.25, 0.125, 0.375, 1.0, 1.5, 0.875])  # means .375 1.375 .25 1.25, .875
    spec = BudgetSpec(retention=0.1, budget_rule="authors_code")
    planner = Planner(QWEN25VL_GRID, spec)
    base = planner.base_hw((720, 1280))
    positions, scales, reference = planner.select(
        raw, base, Operator.SELECT_RESIZE, 3, None, 0.1
    )  # ceil(3/2) = 2 pairs
    assert positions == [2, 3, 6, 7]
    assert scales.tolist() == [1.375, 1.375, 1.25, 1.25]
    assert reference == 5 * 720  # the 9 candidates' vanilla tokens: R is not projected onto 0.1
    assert planner.plan(scales, base).visual_tokens / reference > 0.1
    positions, _, _ = planner.select(raw, base, Operator.SELECT_RESIZE, None, 1.0, 0.1)
    assert positions == [2, 3, 6, 7]
    positions, _, _ = planner.select(raw, base, Operator.SELECT_RESIZE, None, 5.0, 0.1)
    assert positions == [2, 3]  # none reaches the threshold: the best pair
    positions, _, _ = planner.select(raw, base, Operator.SELECT_RESIZE, 1, None, 0.1)
    assert positions == [2, 3]  # max(1, ceil(1/2)) pairs
    positions, _, _ = planner.select(raw, base, Operator.SELECT_RESIZE, 9, None, 0.1)
    assert positions == list(range(9))  # the odd tail is a pair of one frame
    # select (no resize): the best top_k frames rounded up to an even count, at the base size
    positions, scales, _ = planner.select(raw, base, Operator.SELECT, 3, None, 0.1)
    assert positions == [2, 3, 6, 7] and scales.tolist() == [1.0] * 4
    positions, _, _ = planner.select(raw, base, Operator.SELECT, None, 1.1, 0.1)
    assert positions == [2, 3, 6, 7]  # 1.5 1.25 1.5 pass, then one more from the ranking (1.0)
    # the paper's rule: the best frames, projected onto the retention
    paper = Planner(QWEN25VL_GRID, BudgetSpec(retention=0.1))
    positions, scales, reference = paper.select(raw, base, Operator.SELECT_RESIZE, 3, None, 0.1)
    assert positions == [2, 3, 7] and paper.plan(scales, base).visual_tokens <= 0.1 * reference


def test_the_preset_fills_only_the_settings_not_given():
    paper, authors = BudgetSpec(), BudgetSpec(budget_rule="authors_code")
    assert (paper.min_tokens_per_pair, paper.max_tokens_per_pair, paper.truncate_scaled_side) == (1, None, False)
    assert (paper.base_grid_px, paper.selection_rule, paper.fixed_scale_rule) == (None, "frames", "search")
    assert (authors.min_tokens_per_pair, authors.max_tokens_per_pair, authors.truncate_scaled_side) == (4, 768, True)
    assert (authors.base_grid_px, authors.selection_rule, authors.fixed_scale_rule) == (28, "pairs", "sqrt")
    assert (paper.rule_label, authors.rule_label) == ("paper", "authors_code")
    mixed = BudgetSpec(budget_rule="authors_code", fixed_scale_rule="search", max_tokens_per_pair=1024)
    assert mixed.truncate_scaled_side and mixed.max_tokens_per_pair == 1024 and mixed.fixed_scale_rule == "search"
    assert mixed.rule_label == "authors_code (max_tokens_per_pair=1024, fixed_scale_rule=search)"
    assert BudgetSpec(truncate_scaled_side=True).rule_label == "paper (truncate_scaled_side=true)"
    # model_args: the preset and each setting by name
    config = config_from_model_args(
        method="fixed_scale", retention="0.25", budget_rule="authors_code", truncate_scaled_side="false"
    )
    assert config.budget.fixed_scale_rule == "sqrt" and config.budget.truncate_scaled_side is False
    with pytest.raises(ValueError, match="truncate_scaled_side"):
        config_from_model_args(truncate_scaled_side="maybe")


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(budget_rule="authors"), "budget_rule must be one of"),
        (dict(selection_rule="pair"), "selection_rule must be one of"),
        (dict(fixed_scale_rule="exact"), "fixed_scale_rule must be one of"),
        (dict(base_grid_px=0), "base_grid_px must be at least 1"),
        (dict(budget_rule="authors_code", min_tokens_per_pair=800), "max_tokens_per_pair is below min_tokens_per_pair"),
    ],
)
def test_a_bad_setting_is_named(args, message):
    with pytest.raises(ValueError, match=message):
        BudgetSpec(**args)


def test_a_request_under_the_authors_rule_on_qwen3vl(adapters, fixtures_dir):
    # Qwen3-VL under authors_code: a 28 px base, pairs on the 32 px grid; the engine's placeholders
    # equal the plan (a mismatch fails the sample) and the sidecar names the rule.
    adapter = adapters["qwen3vl"]
    prompt = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    video = str(sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[0])
    budget = BudgetSpec(retention=0.25, budget_rule="authors_code")
    pipeline = VideoPipeline(adapter, VideoPipelineConfig(method="fixed_scale", max_num_frames=8, budget=budget))
    _, record = pipeline.run(Request(prompt, video=video, gen_kwargs=dict(max_new_tokens=2)))
    assert record.error is None and record.budget_rule == "authors_code"
    base = tuple(record.base_size)
    assert base == base_frame((240, 320), 28) == (252, 308)
    vanilla = round(base[0] / 32) * round(base[1] / 32)
    assert record.reference_tokens == 4 * vanilla
    assert record.visual_tokens == 4 * authors_pair_tokens(base, [0.5, 0.5], 32)
    assert record.scales == [0.5] * 8 and record.achieved_retention == record.visual_tokens / (4 * vanilla)
