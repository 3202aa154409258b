"""Frame selection and frame times reaching the backbones."""

import numpy as np
import pytest
import torch

from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE
from resadapt_eval.budget.plan import plan_from_scales
from resadapt_eval.budget.selection import select_frames
from resadapt_eval.video import DecodedVideo

from .helpers import chat_prompt, video_position_blocks


def test_select_frames():
    scores = [0.3, 0.9, 0.1, 0.9, 0.5, 0.7]
    assert select_frames(scores, top_k=3) == [1, 3, 5]  # the best three, in time order
    assert select_frames(scores, threshold=0.6) == [1, 3, 5]
    assert select_frames(scores, top_k=2, threshold=0.6) == [1, 3]
    assert select_frames(scores, threshold=5.0) == [1]  # at least the best frame
    with pytest.raises(ValueError, match="top_k or a score threshold"):
        select_frames(scores)


def selected_video(num_candidates=16, keep=(0, 1, 5, 6, 12, 13)):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (num_candidates, 112, 140, 3), dtype=np.uint8)
    candidates = DecodedVideo(
        frames=frames, indices=[3 * i for i in range(num_candidates)], total_frames=3 * num_candidates, fps=6.0
    )
    return candidates.subset(list(keep))


def test_qwen25vl_pair_positions_follow_frame_time_after_selection(adapters):
    adapter = adapters["qwen25vl"]
    video = selected_video()
    assert not video.uniform and video.indices == [0, 3, 15, 18, 36, 39]
    plan = plan_from_scales([1.0, 1.0, 0.5, 0.5, 1.5, 1.5], (112, 140), adapter.grid)
    inputs = adapter.build_inputs(
        chat_prompt(adapter, "When does the square appear? Answer with start and end seconds."), video, plan
    )
    blocks = video_position_blocks(inputs["position_ids"][:, 0], inputs["mm_token_type_ids"], plan.grids)
    start = int(torch.nonzero(inputs["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE)[0])
    tps = adapter.model.config.vision_config.tokens_per_second
    # pair k starts at frame index 0, 15, 36 of a 6 fps file: 0, 2.5, 6.0 seconds
    for block, seconds in zip(blocks, [0.0, 2.5, 6.0], strict=True):
        assert set(block[0].tolist()) == {start + int(np.floor(tps * seconds))}
    assert adapter.generate(inputs, max_new_tokens=2)[1] == 2


def test_qwen3vl_grounding_prompt_has_one_timestamp_per_pair(adapters):
    adapter = adapters["qwen3vl"]
    video = selected_video()
    plan = plan_from_scales([1.0] * 6, (128, 160), adapter.grid)
    inputs = adapter.build_inputs(
        chat_prompt(adapter, "When does the square appear? Answer with start and end seconds."), video, plan
    )
    text = adapter.tokenizer.decode(inputs["input_ids"][0])
    # pair timestamps = mean of the pair's frame times: (0+3)/2/6, (15+18)/2/6, (36+39)/2/6 seconds
    assert [part.split(" seconds>")[0] for part in text.split("<")[1:] if " seconds>" in part] == ["0.2", "2.8", "6.2"]
    assert text.count("seconds>") == len(plan.grids)
