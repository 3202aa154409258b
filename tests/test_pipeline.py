"""The request flow: multi-image Allocator requests, the error convention, batches of one and many."""

import numpy as np
import pytest
import torch
from PIL import Image

from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.methods import get_method
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig
from resadapt_eval.video import VideoDecodeError


def image_prompt(adapter, n: int) -> str:
    content = [{"type": "image"}] * n + [{"type": "text", "text": "Which image shows a square?"}]
    return adapter.processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def three_images() -> tuple:
    rng = np.random.default_rng(0)
    smooth = np.full((240, 320, 3), 120, dtype=np.uint8)
    noise = rng.integers(0, 256, (200, 200, 3), dtype=np.uint8)
    square = np.zeros((180, 300, 3), dtype=np.uint8)
    square[40:140, 100:200] = 255
    return tuple(Image.fromarray(a) for a in (smooth, noise, square))


@pytest.mark.parametrize("backbone", ["qwen25vl", "qwen3vl"])
def test_the_images_of_a_request_are_scored_together_and_projected_jointly(adapters, backbone):
    adapter = adapters[backbone]
    images = three_images()
    request = Request(
        image_prompt(adapter, 3), images=images, query="Which image shows a square?", gen_kwargs=dict(max_new_tokens=2)
    )
    free = VideoPipeline(adapter, VideoPipelineConfig(method="resadapt", allocator="untrained"))
    _, record = free.run(request)
    assert record.error is None
    # one Allocator call over the three images as one sequence: three different scales
    arrays = [np.asarray(im) for im in images]
    (raw,), _ = free.allocator.raw_scales_batch([[a[None] for a in arrays]], [request.query])
    assert record.raw_scales == [round(float(s), 6) for s in raw]
    assert len(set(record.scales)) == 3
    np.testing.assert_allclose(record.scales, np.clip(raw, 0.2, 1.8), atol=1e-6)

    projected = VideoPipeline(
        adapter, VideoPipelineConfig(method="resadapt", allocator="untrained", budget=BudgetSpec(retention=0.25))
    )
    _, record = projected.run(request)
    assert record.error is None
    vanilla = VideoPipeline(adapter, VideoPipelineConfig(method="vanilla"))
    _, reference = vanilla.run(request)
    assert record.reference_tokens == reference.visual_tokens == reference.reference_tokens
    assert record.visual_tokens <= 0.25 * reference.visual_tokens
    assert record.achieved_retention == pytest.approx(record.visual_tokens / reference.visual_tokens)
    # the request's budget, not each image's: one global factor keeps the Allocator's allocation
    scales = np.array(record.scales)
    free_of_bounds = (scales > 0.2 + 1e-9) & (scales < 1.8 - 1e-9)
    ratios = scales[free_of_bounds] / raw[free_of_bounds]
    assert free_of_bounds.sum() >= 2 and np.allclose(ratios, ratios[0], rtol=1e-5)


def test_a_failed_sample_keeps_its_exception_and_strict_raises_the_original(adapters, fixtures_dir, tmp_path):
    adapter = adapters["qwen25vl"]
    prompt = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    good = str(sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[0])
    requests = [
        Request(prompt, video=str(tmp_path / "missing.mp4"), doc_id=0),
        Request(prompt, video=good, gen_kwargs=dict(max_new_tokens=2), doc_id=1),
    ]
    config = dict(method="fixed_scale", max_num_frames=8, budget=BudgetSpec(retention=0.25))
    (text0, missing), (_, done) = VideoPipeline(adapter, VideoPipelineConfig(**config)).run_batch(requests)
    assert (
        text0 == "" and missing.error.startswith("VideoDecodeError: video not found") and "missing.mp4" in missing.error
    )
    assert missing.video.endswith("missing.mp4") and missing.target_retention == 0.25 and missing.visual_tokens == 0
    assert done.error is None and done.doc_id == 1 and 0.20 <= done.achieved_retention <= 0.25
    with pytest.raises(VideoDecodeError, match="missing.mp4"):
        VideoPipeline(adapter, VideoPipelineConfig(**config, strict=True)).run_batch(requests)


def test_a_batch_answers_as_its_requests_do_one_at_a_time(adapters, fixtures_dir):
    adapter = adapters["qwen3vl"]
    prompt = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    videos = sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[:3]
    requests = [
        Request(prompt, video=str(v), query=q, gen_kwargs=dict(max_new_tokens=3), doc_id=i)
        for i, (v, q) in enumerate(zip(videos, ["Colour?", "Where is the square?", "How many?"]))
    ]
    pipeline = VideoPipeline(
        adapter,
        VideoPipelineConfig(
            method="resadapt", allocator="untrained", max_num_frames=8, budget=BudgetSpec(retention=0.5)
        ),
    )
    together = pipeline.run_batch(requests)
    assert len(requests) == 3
    for request, (text, record) in zip(requests, together, strict=True):
        alone_text, alone = pipeline.run(request)
        assert text == alone_text
        np.testing.assert_allclose(record.raw_scales, alone.raw_scales, atol=1e-5)
        assert (record.grids, record.visual_tokens) == (alone.grids, alone.visual_tokens)


def test_an_engine_that_prunes_runs_only_its_pruning_method(adapters):
    """vLLM's EVS needs an engine pruning at the rate for its R; no other method may run on such an engine."""
    with pytest.raises(ValueError, match="needs an engine pruning video tokens with evs at rate 0.75"):
        VideoPipeline(adapters["qwen25vl"], VideoPipelineConfig(method="evs", budget=BudgetSpec(retention=0.25)))

    class PruningEngine:  # what VideoPipeline reads of a vLLM engine built for evs at R=0.1
        layout, device, compresses_tokens = adapters["qwen25vl"].layout, torch.device("cpu"), False
        compresses_in_engine = False
        video_pruning_method, video_pruning_rate = "evs", get_method("evs").pruning_rate(0.1)

    assert 1.0 - PruningEngine.video_pruning_rate >= 0.1  # floor(R N) tokens are kept, not one fewer
    VideoPipeline(PruningEngine(), VideoPipelineConfig(method="evs", budget=BudgetSpec(retention=0.1)))
    with pytest.raises(ValueError, match="needs an engine pruning"):
        VideoPipeline(PruningEngine(), VideoPipelineConfig(method="evs", budget=BudgetSpec(retention=0.25)))
    with pytest.raises(ValueError, match="does not prune, but this engine prunes"):
        VideoPipeline(PruningEngine(), VideoPipelineConfig(method="vanilla"))


def test_allocator_query_empty_scores_with_an_empty_query_and_the_backbone_keeps_the_question(adapters):
    adapter = adapters["qwen25vl"]
    images = three_images()
    question = "Which image shows a square?"
    request = Request(image_prompt(adapter, 3), images=images, query=question, gen_kwargs=dict(max_new_tokens=2))
    ablated = VideoPipeline(
        adapter, VideoPipelineConfig(method="resadapt", allocator="untrained", allocator_query="empty")
    )
    _, record = ablated.run(request)
    arrays = [np.asarray(im)[None] for im in images]
    (empty,), _ = ablated.allocator.raw_scales_batch([arrays], [""])
    (asked,), _ = ablated.allocator.raw_scales_batch([arrays], [question])
    assert record.raw_scales == [round(float(s), 6) for s in empty] != [round(float(s), 6) for s in asked]
    assert record.allocator_flops == ablated.allocator.flops(3, "")  # FLOPs of what it read
    assert record.allocator_query == "empty"  # the sidecar says which query the Allocator read
    _, with_question = VideoPipeline(adapter, VideoPipelineConfig(method="resadapt", allocator="untrained")).run(
        request
    )
    assert with_question.allocator_query == "question"
    # the backbone reads the same question: text tokens equal, only the visual tokens differ
    assert record.input_tokens - record.visual_tokens == with_question.input_tokens - with_question.visual_tokens
    with pytest.raises(ValueError, match="allocator_query must be one of"):
        VideoPipelineConfig(method="resadapt", allocator="untrained", allocator_query="none")
    with pytest.raises(ValueError, match="allocator_query= is only used by method=resadapt"):
        VideoPipelineConfig(method="vanilla", allocator_query="empty")
