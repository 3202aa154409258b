"""Floors that hold for every video stop at start, for every method (issue 39, item 5): a retention below
the lowest R any video reaches under the settings (`MethodKind.retention_floor`, from the configs alone)
is refused when the pipeline is built, in one line naming `retention` and the floor; a target above it
that a given video cannot reach stays a failure of that sample."""

import json
import math
from types import SimpleNamespace

import pytest

from resadapt_eval.backbones.layout import Qwen3VLLayout, Qwen25VLLayout
from resadapt_eval.budget.plan import QWEN3VL_GRID, QWEN25VL_GRID, InfeasibleBudget
from resadapt_eval.budget.planner import Planner
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.compute.flops import dims_from_config
from resadapt_eval.kinds import COMPRESSOR, COMPRESSOR_THEN_PRUNER, IN_LLM_PRUNER, rounded_up
from resadapt_eval.methods import METHODS, NO_RETENTION
from resadapt_eval.pipeline import VideoPipeline
from resadapt_eval.runspec import RunSpec, VideoPipelineConfig

from .helpers import BACKBONES

GRIDS = {"qwen25vl": Qwen25VLLayout.grid, "qwen3vl": Qwen3VLLayout.grid}
# but vLLM's own VidCom2, whose engine needs vLLM (tests/test_kinds.py); its floor is every compressor's
TAKING_RETENTION = [
    name for name, method in METHODS.items() if method.retention != NO_RETENTION and name != "vidcom2_engine"
]


def spec_of(method: str, retention: float, **settings) -> RunSpec:
    budget = {k: settings.pop(k) for k in list(settings) if k in BudgetSpec.__dataclass_fields__}
    allocator = dict(allocator="untrained") if METHODS[method].needs_allocator else {}
    config = VideoPipelineConfig(method, budget=BudgetSpec(retention=retention, **budget), **allocator, **settings)
    return RunSpec.resolve(config)


@pytest.fixture(scope="module")
def configs(fixtures_dir):
    """Each tiny backbone's config.json (its LLM depth: 12 layers)."""
    return {name: json.loads((fixtures_dir / name / "config.json").read_text()) for name in BACKBONES}


def floor_of(spec: RunSpec, backbone: str, config: dict):
    planner = Planner(GRIDS[backbone], spec.budget, spec.min_pixels, spec.max_pixels)
    return spec.kind.retention_floor(spec, planner, dims_from_config(config))


def stub_backbone(spec: RunSpec, backbone: str, config: dict):
    """What `VideoPipeline.__init__` reads of an engine before any request, without weights: its layout's
    grid and config, and the engine's own pruning (vLLM's, set for the engine pruner)."""
    pruning = spec.kind.engine_args(spec)
    return SimpleNamespace(
        layout=SimpleNamespace(grid=GRIDS[backbone], config=config),
        compresses_tokens=spec.method.hf,
        compresses_in_engine=False,
        video_pruning_method=pruning.get("video_pruning_method"),
        video_pruning_rate=pruning.get("video_pruning_rate"),
        device="cpu",
    )


def build(spec: RunSpec, backbone: str, config: dict) -> VideoPipeline:
    return VideoPipeline(stub_backbone(spec, backbone, config), spec)


# ---------------------------------------------------------------- the floors, by hand


def test_the_largest_vanilla_pair_and_the_compressor_floor_by_hand(configs):
    # Qwen2.5-VL: patch 14 x merge 2 = 28 px tokens; the default max_pixels is 768 tokens of 28 px,
    # 768 x 28 x 28 = 602112 px. A 672x896 px base (24 x 32 tokens) covers it exactly: 768 tokens a
    # pair, and no base has more. One token of each pair kept: R = 1/768 = 0.00130208...
    planner = Planner(QWEN25VL_GRID, BudgetSpec())
    assert planner.pixel_bounds == (4 * 784, 602112)
    most_visual, most_reference = planner.largest_pairs()
    assert most_visual.visual_tokens == most_reference.reference_tokens == 768
    assert most_visual.base_hw[0] * most_visual.base_hw[1] == 602112
    floor = floor_of(spec_of("tome", 0.25), "qwen25vl", configs["qwen25vl"])
    assert floor.value == 1 / 768 and rounded_up(floor.value) == "0.001303"
    # Qwen3-VL: patch 16 x merge 2 = 32 px, its default max_pixels 768 x 32 x 32 = 786432 px: 768 tokens too.
    assert Planner(QWEN3VL_GRID, BudgetSpec()).largest_pairs()[0].visual_tokens == 768
    # Under the authors' code its base is rounded to 28 px (768 squares at most) and re-rounded to 32 px,
    # half to even: a 4 x 192-square base becomes round(3.5) x round(168) = 4 x 168 = 672 tokens, the most.
    authors = Planner(QWEN3VL_GRID, BudgetSpec(budget_rule="authors_code"))
    assert authors.largest_pairs()[1].reference_tokens == 672
    assert floor_of(spec_of("tome", 0.25, budget_rule="authors_code"), "qwen3vl", configs["qwen3vl"]).value == 1 / 672


def test_each_kinds_floor_by_hand(configs):
    config = configs["qwen25vl"]
    # a resize policy keeps at least min_tokens_per_pair of each pair's at most 768 tokens
    assert floor_of(spec_of("fixed_scale", 0.25), "qwen25vl", config).value == 1 / 768
    assert floor_of(spec_of("resadapt", 0.25, min_tokens_per_pair=4), "qwen25vl", config).value == 4 / 768
    # max_pixels bounds the largest pair: 48 tokens of 28 px
    assert floor_of(spec_of("random_drop", 0.25, max_pixels=48 * 784), "qwen25vl", config).value == 1 / 48
    # vLLM's EVS keeps the first pair whole: 1 of the 16 pairs of 32 frames, of the 4 of 8
    assert floor_of(spec_of("evs", 0.25), "qwen25vl", config).value == 1 / 16
    assert floor_of(spec_of("evs", 0.25, max_num_frames=8), "qwen25vl", config).value == 1 / 4
    # frame selection: R against all 128 candidates (64 pairs); top_k=32 keeps at least 16 pairs, a
    # score threshold at least one frame (one pair)
    selecting = dict(operator="select_resize", candidates=128)
    assert floor_of(spec_of("resadapt", 0.25, **selecting), "qwen25vl", config).value == 16 / (64 * 768)
    thresholded = spec_of("resadapt", 0.25, **selecting, top_k=None, score_threshold=1.0)
    assert floor_of(thresholded, "qwen25vl", config).value == 1 / (64 * 768)
    # a compressor then a stage inside the 12-layer LLM (the stages' shares at targets below 0.4): P
    # pairs enter with one token each, then
    # PruneVid keeps max(1, floor(0.4 P)) from layer round(11 x 12 / 32) = 4: at P = 4, 1 token, a
    # layer average of (4 x 4 + 8 x 1) / 12 = 2 of 4 x 768 tokens; HoliTom round(0.5 P) from layer
    # round(18 x 12 / 28) = 8: at P = 5, round(2.5) = 2, (8 x 5 + 4 x 2) / 12 = 4 of 5 x 768
    assert floor_of(spec_of("prunevid", 0.01), "qwen25vl", config).value == 2 / (4 * 768)
    assert floor_of(spec_of("holitom", 0.01), "qwen25vl", config).value == 4 / (5 * 768)
    # FastV and PyramidDrop: every token enters; their floor is check_llm's (on the LLM's depth)
    assert floor_of(spec_of("fastv", 0.25), "qwen25vl", config) is None


@pytest.mark.parametrize("min_tokens, max_tokens", [(4, 768), (4, 24), (24, 24), (100, 120)])
def test_no_frame_gets_a_base_larger_than_the_planner_allows_for(min_tokens, max_tokens):
    """`Planner.largest_base_area` bounds every base `smart_resize` gives, also where min_pixels upsizes a
    small frame past max_pixels (each side ceiled): frames of every aspect ratio up to 200, tiny to large."""
    planner = Planner(QWEN25VL_GRID, BudgetSpec(), min_tokens * 784, max_tokens * 784)
    largest = planner.largest_base_area()
    assert largest >= max_tokens
    sizes = sorted({1, 2, 3, 5, 7, 10, 14, 20, 27, 28, 29, 41, 55, 70, 99, 140, 200, 333, 560, 1000, 4000})
    for h in sizes:
        for w in sizes:
            if max(h, w) / min(h, w) <= 200:
                bh, bw = planner.base_hw((h, w))
                assert bh * bw <= largest * 784, (h, w, bh, bw)
    for w in range(1, 400):  # one pixel high: the widest frames the upsizing path takes
        bh, bw = planner.base_hw((1, w)) if w <= 200 else planner.base_hw((2, w))
        assert bh * bw <= largest * 784, (w, bh, bw)


def test_a_floor_is_printed_rounded_up_so_the_number_printed_is_accepted():
    assert rounded_up(1 / 768) == "0.001303" and rounded_up(0.0625) == "0.0625"
    assert rounded_up(2 / (4 * 768)) == "0.0006511" and rounded_up(1 / (64 * 768)) == "2.035e-05"
    for value in (1 / 768, 1 / 672, 2 / 3072, 1 / 49152, 1 / 3, 0.1 + 0.2):
        assert value <= float(rounded_up(value)) < value * (1 + 1e-3)


# ---------------------------------------------------------------- at start, for every method


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", TAKING_RETENTION)
def test_a_retention_below_every_videos_floor_stops_the_pipeline_at_start(configs, backbone, method):
    config = configs[backbone]
    if backbone not in METHODS[method].kind.families:  # stops at start on any retention, naming why
        with pytest.raises(ValueError, match=rf"^method={method} \w+ inside the vision tower on Qwen3-VL only"):
            build(spec_of(method, 0.25), backbone, config)
        return
    for retention in (0.001, 1e-6):
        spec = spec_of(method, retention)
        floor = floor_of(spec, backbone, config)
        if floor is None:  # FastV, PyramidDrop: check_llm's floor on the LLM's depth, as before
            assert isinstance(spec.kind, type(IN_LLM_PRUNER))
            message = rf"^retention={retention} with the default prune_layers: .* above 0\."
            with pytest.raises(ValueError, match=message):
                build(spec, backbone, config)
            continue
        if retention >= floor.value:  # PruneVid at 0.001: four pairs of 768 tokens reach it (below);
            # FrameFusion on Qwen2.5-VL: one token in each layer of the largest video is below 0.001
            assert (method, retention) in {("prunevid", 0.001), ("framefusion", 0.001)}
            build(spec, backbone, config)
            continue
        with pytest.raises(ValueError) as refused:
            build(spec, backbone, config)
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith(f"retention={retention}: method={method} ")
        assert f"so no video reaches R below {rounded_up(floor.value)} (" in message
        assert message.endswith(f"; raise retention to at least {rounded_up(floor.value)}")


@pytest.mark.parametrize("operator", ["select", "select_resize"])
def test_frame_selection_below_its_floor_stops_at_start(configs, operator):
    spec = spec_of("resadapt", 1e-6, operator=operator)
    message = rf"^retention=1e-06: method=resadapt, operator={operator} keeps at least 32 of candidates=128 frames"
    with pytest.raises(ValueError, match=message):
        build(spec, "qwen3vl", configs["qwen3vl"])
    assert floor_of(spec, "qwen3vl", configs["qwen3vl"]).value == 16 / (64 * 768)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", TAKING_RETENTION)
def test_the_floor_printed_builds(configs, backbone, method):
    config = configs[backbone]
    if backbone not in METHODS[method].kind.families:  # refused at start (the test above)
        return
    floor = floor_of(spec_of(method, 1e-6), backbone, config)  # PruneVid's and HoliTom's depend on R (above 0.4)
    if floor is None:
        return
    spec = spec_of(method, float(rounded_up(floor.value)))
    planner = Planner(GRIDS[backbone], spec.budget, spec.min_pixels, spec.max_pixels)
    spec.kind.check_llm(spec, dims_from_config(config))
    spec.kind.check_retention(spec, planner, dims_from_config(config))
    if not spec.method.needs_allocator:  # the rest builds no Allocator
        build(spec, backbone, config)


def test_the_floor_is_reached_by_the_largest_video_under_each_kinds_own_token_rule(configs):
    """At its floor the compressors', PruneVid's, HoliTom's and EVS's token rule (`token_budget`, what a
    sample runs) holds on the largest video; just below it, it fails that video too."""
    config = configs["qwen25vl"]
    dims = dims_from_config(config)
    planner = Planner(QWEN25VL_GRID, BudgetSpec())
    largest, _ = planner.largest_pairs()
    for method, pairs in (("tome", 16), ("dycoke", 16), ("prunevid", 4), ("holitom", 5), ("evs", 16)):
        floor = floor_of(spec_of(method, 1e-6), "qwen25vl", config).value
        plan = planner.plan([1.0] * (2 * pairs), largest.base_hw)
        at = spec_of(method, floor)
        assert math.isclose(at.kind.token_budget(at, (plan,), plan.reference_tokens, dims).achieved_retention, floor)
        below = spec_of(method, floor * (1 - 1e-4))
        with pytest.raises(InfeasibleBudget):
            below.kind.token_budget(below, (plan,), plan.reference_tokens, dims)
    # 0.001 is above PruneVid's floor: the largest video reaches it
    spec = spec_of("prunevid", 0.001)
    plan = planner.plan([1.0] * 8, largest.base_hw)
    assert spec.kind.token_budget(spec, (plan,), plan.reference_tokens, dims).achieved_retention <= 0.001


def test_a_compressor_then_pruner_floor_needs_the_llms_depth():
    spec = spec_of("holitom", 1e-6)
    assert spec.kind is COMPRESSOR_THEN_PRUNER
    assert spec.kind.retention_floor(spec, Planner(QWEN25VL_GRID, spec.budget), None) is None
    tome = spec_of("tome", 1e-6)
    assert COMPRESSOR.retention_floor(tome, Planner(QWEN25VL_GRID, tome.budget), None).value == 1 / 768


# ---------------------------------------------------------------- the lmms-eval model, in process


def lmms_model(fixtures_dir, tmp_path, backbone, **model_args):
    from resadapt_eval.lmms import models

    cls = models.ResAdaptQwen25VL if backbone == "qwen25vl" else models.ResAdaptQwen3VL
    args = dict(pretrained=str(fixtures_dir / backbone), max_num_frames=8, device="cpu", dtype="float32")
    return cls(**{**args, "sidecar_dir": str(tmp_path / "sidecars"), **model_args})


@pytest.mark.parametrize("backbone, method", [("qwen25vl", "tome"), ("qwen3vl", "fixed_scale")])
def test_the_lmms_eval_model_stops_at_start_naming_the_floor(fixtures_dir, tmp_path, backbone, method):
    with pytest.raises(ValueError) as refused:
        lmms_model(fixtures_dir, tmp_path, backbone, method=method, retention=0.001)
    message = str(refused.value)
    assert message.startswith(f"retention=0.001: method={method} ") and "\n" not in message
    assert "no video reaches R below 0.001303 (1 of 768 tokens per pair" in message
    assert not (tmp_path / "sidecars").exists()  # no sample ran


def test_a_target_above_the_floor_that_a_small_video_cannot_reach_stays_per_sample(fixtures_dir, tmp_path):
    """Just above tome's floor: a video of 768-token pairs reaches it, so the run starts; the smoke
    video's pairs are smaller, so its sample fails alone, naming its own floor."""
    from lmms_eval.api.instance import Instance

    model = lmms_model(fixtures_dir, tmp_path, "qwen25vl", method="tome", retention=0.001303)
    video = str(sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[0])
    model.task_dict = {"t": {"test": {0: dict(video=video)}}}

    def messages(doc):
        return [{"role": "user", "content": [{"type": "video", "url": doc["video"]}, {"type": "text", "text": "Q?"}]}]

    arguments = ("", messages, dict(max_new_tokens=2), 0, "t", "test")
    instance = Instance("generate_until", arguments, 0, dict(task="t", doc_id=0, repeats=1))
    (text,) = [r.text for r in model.generate_until([instance])]
    (record,) = [json.loads(line) for line in model.sidecar_path.read_text().splitlines()]
    assert text == ""
    assert record["error"].startswith("InfeasibleBudget: retention 0.001303 is below the reachable floor")
