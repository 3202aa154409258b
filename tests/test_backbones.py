"""Per-pair inputs against the stock single-video path of transformers, on the tiny fp32 models."""

import pytest
import torch
from transformers.video_utils import VideoMetadata

from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE, resize_frames
from resadapt_eval.budget.plan import plan_from_scales

from .helpers import BACKBONES, chat_prompt, first_logits_and_text, synthetic_video, video_position_blocks


def stock_inputs(adapter, prompt, video, base_hw):
    """transformers' own single-video path: one video of all frames at the base size."""
    frames = resize_frames(video.frames, *base_hw)
    if len(frames) % 2:
        frames = torch.cat([frames, frames[-1:]])
    metadata = VideoMetadata(total_num_frames=video.total_frames, fps=video.fps, frames_indices=list(video.indices))
    inputs = adapter.processor(
        text=[prompt],
        videos=[frames],
        video_metadata=[metadata],
        do_resize=False,
        do_sample_frames=False,
        return_tensors="pt",
    )
    return dict(inputs)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("num_frames", [8, 7])
def test_equal_sizes_match_the_stock_single_video_path(adapters, backbone, num_frames):
    adapter = adapters[backbone]
    prompt = chat_prompt(adapter)
    video = synthetic_video(num_frames)
    px = adapter.grid.token_px
    base_hw = (4 * px, 5 * px)
    plan = plan_from_scales([1.0] * num_frames, base_hw, adapter.grid)
    ours = adapter.build_inputs(prompt, video, plan)
    stock = stock_inputs(adapter, prompt, video, base_hw)

    assert torch.equal(ours["input_ids"], stock["input_ids"])
    assert torch.equal(ours["pixel_values_videos"], stock["pixel_values_videos"])
    assert ours["video_grid_thw"].tolist() == [[1, 4 * 2, 5 * 2]] * len(plan.pair_sizes)

    ours_logits, ours_tokens = first_logits_and_text(adapter, ours)
    stock_logits, stock_tokens = first_logits_and_text(adapter, stock)
    assert (ours_logits - stock_logits).abs().max().item() <= 1e-5
    assert adapter.tokenizer.decode(ours_tokens) == adapter.tokenizer.decode(stock_tokens)

    # The comparison can fail: shifting the video's positions moves the logits far past 1e-5.
    shifted = dict(ours)
    if "position_ids" in ours:
        shifted["position_ids"] = ours["position_ids"] + 3 * (ours["mm_token_type_ids"] == VIDEO_TOKEN_TYPE).long()
    else:
        shifted["mm_token_type_ids"] = torch.zeros_like(ours["mm_token_type_ids"])  # 1-D positions instead of M-RoPE
    shifted_logits, _ = first_logits_and_text(adapter, shifted, steps=1)
    assert (shifted_logits - stock_logits).abs().max().item() > 1e-4


def test_qwen25vl_mixed_sizes_keep_each_pairs_time_and_own_grid(adapters):
    adapter = adapters["qwen25vl"]
    prompt = chat_prompt(adapter)
    video = synthetic_video(8)
    base_hw = (112, 140)
    stock = stock_inputs(adapter, prompt, video, base_hw)
    stock_pos, _ = adapter.model.model.get_rope_index(
        stock["input_ids"],
        stock["mm_token_type_ids"],
        video_grid_thw=stock["video_grid_thw"],
        second_per_grid_ts=stock["second_per_grid_ts"],
    )
    stock_grid = plan_from_scales([1.0] * 8, base_hw, adapter.grid).grids
    stock_blocks = video_position_blocks(stock_pos[:, 0], stock["mm_token_type_ids"], stock_grid)

    plan = plan_from_scales([1.0, 1.0, 0.5, 0.5, 1.5, 1.5, 0.25, 0.25], base_hw, adapter.grid)
    assert len(set(plan.pair_sizes)) == 4
    ours = adapter.build_inputs(prompt, video, plan)
    blocks = video_position_blocks(ours["position_ids"][:, 0], ours["mm_token_type_ids"], plan.grids)
    start = int(torch.nonzero(ours["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE)[0])
    for k, ((_, h, w), block, stock_block) in enumerate(zip(plan.grids, blocks, stock_blocks, strict=True)):
        assert set(block[0].tolist()) == {int(stock_block[0, 0])}, f"pair {k} time differs from the stock path"
        assert sorted(set(block[1].tolist())) == list(range(start, start + h))
        assert sorted(set(block[2].tolist())) == list(range(start, start + w))
    # Text after the video continues from the largest grid side, as the stock rule does.
    after = ours["position_ids"][0, 0, int(torch.nonzero(ours["mm_token_type_ids"][0])[-1]) + 1]
    assert int(after) == start + max(max(h, w) for _, h, w in plan.grids)
    # And the model runs on these inputs.
    text, n = adapter.generate(ours, max_new_tokens=3)
    assert n == 3


def test_qwen3vl_mixed_sizes_keep_each_pairs_timestamp_and_own_grid(adapters):
    adapter = adapters["qwen3vl"]
    prompt = chat_prompt(adapter)
    video = synthetic_video(8)
    base_hw = (128, 160)
    stock = stock_inputs(adapter, prompt, video, base_hw)
    plan = plan_from_scales([1.0, 1.0, 0.5, 0.5, 1.5, 1.5, 0.25, 0.25], base_hw, adapter.grid)
    ours = adapter.build_inputs(prompt, video, plan)

    # Qwen3-VL carries time as text: the timestamp before pair k equals the stock one.
    def timestamps(ids):
        text = adapter.tokenizer.decode(ids[0])
        return [part.split(" seconds>")[0] for part in text.split("<")[1:] if " seconds>" in part]

    assert timestamps(ours["input_ids"]) == timestamps(stock["input_ids"])
    assert len(timestamps(ours["input_ids"])) == len(plan.grids)

    positions, _ = adapter.model.model.get_rope_index(
        ours["input_ids"], ours["mm_token_type_ids"], video_grid_thw=ours["video_grid_thw"]
    )
    blocks = video_position_blocks(positions[:, 0], ours["mm_token_type_ids"], plan.grids)
    for (_, h, w), block in zip(plan.grids, blocks, strict=True):
        t0 = int(block[0, 0])
        assert set(block[0].tolist()) == {t0}
        assert sorted(set(block[1].tolist())) == list(range(t0, t0 + h))
        assert sorted(set(block[2].tolist())) == list(range(t0, t0 + w))
    text, n = adapter.generate(ours, max_new_tokens=3)
    assert n == 3


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("scales", [[1.0, 0.9, 0.3, 0.2, 1.7], [0.5] * 6, [0.2, 1.8, 1.0, 0.6]])
def test_placeholders_equal_grid_tokens_equal_plan_tokens(adapters, backbone, scales):
    adapter = adapters[backbone]
    video = synthetic_video(len(scales), height=180, width=120)
    px = adapter.grid.token_px
    plan = plan_from_scales(scales, (6 * px, 4 * px), adapter.grid)
    inputs = adapter.build_inputs(chat_prompt(adapter), video, plan)
    merge = adapter.model.config.vision_config.spatial_merge_size
    placeholders = int((inputs["input_ids"] == adapter.processor.video_token_id).sum())
    grid_tokens = int(sum(t * h * w for t, h, w in inputs["video_grid_thw"].tolist()) // merge**2)
    assert placeholders == grid_tokens == plan.visual_tokens
    assert inputs["video_grid_thw"].tolist() == [[1, h * merge, w * merge] for _, h, w in plan.grids]


def test_prompt_without_a_video_placeholder_is_rejected(adapters):
    adapter = adapters["qwen25vl"]
    video = synthetic_video(2)
    plan = plan_from_scales([1.0, 1.0], (56, 56), adapter.grid)
    with pytest.raises(ValueError, match="exactly one <\\|video_pad\\|>"):
        adapter.build_inputs("no video here", video, plan)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_pairs_of_one_size_are_resized_in_one_batch_with_the_same_pixels_as_one_by_one(adapters, mode):
    """`resized_pairs` batches every pair of a size; resizing is per frame, so the pixels are those of
    resizing each pair alone, in the plan's pair order (an odd tail repeats its last frame)."""
    adapter = adapters["qwen25vl"]
    video = synthetic_video(7)
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0, 1.0, 0.5, 0.5, 1.0, 1.0, 1.5], (4 * px, 5 * px), adapter.grid)
    assert len(set(plan.pair_sizes)) < len(plan.pair_sizes)  # two pairs share a size
    pairs = adapter.layout.resized_pairs(video, plan, mode)
    assert [tuple(p.shape) for p in pairs] == [(2, 3, h, w) for h, w in plan.pair_sizes]
    for pair, group, (h, w) in zip(pairs, plan.pair_frames, plan.pair_sizes):
        assert torch.equal(pair, resize_frames(video.frames[list(group)], h, w, mode))
