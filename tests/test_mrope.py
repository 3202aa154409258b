"""The Qwen2.5-VL M-RoPE rule shared by the HF adapter and the vLLM model class, by hand."""

import pytest
import torch

from resadapt_eval.backbones.mrope import VisionRun, qwen25_mrope_positions, temporal_indices


def test_positions_of_a_two_pair_run_by_hand():
    # 2 text tokens, pair 0 with a 1x2 merged grid and pair 1 with 2x1, then 6 text tokens.
    # tokens_per_second 2, 0.5 s a pair -> temporal indices 0, 1; the run starts at position 2;
    # text after continues from 2 + max(1, 2, 2, 1) = 4.
    run = VisionRun(offset=2, grids=[(1, 1, 2), (1, 2, 1)], second_per_grid_ts=[0.5, 0.5])
    positions = qwen25_mrope_positions(12, [run], tokens_per_second=2)
    expected = [[0, 0, 0], [1, 1, 1], [2, 2, 2], [2, 2, 3], [3, 2, 2], [3, 3, 2]] + [[p, p, p] for p in range(4, 10)]
    assert positions.T.tolist() == expected


def test_text_between_runs_counts_on_and_images_sit_at_temporal_zero():
    image = VisionRun(offset=1, grids=[(1, 2, 2)], second_per_grid_ts=[1.0])
    video = VisionRun(offset=7, grids=[(2, 1, 1)], second_per_grid_ts=[1.0])  # one item, two temporal groups
    positions = qwen25_mrope_positions(10, [video, image], tokens_per_second=3)
    # text 0 | image (tokens 1-4) from 1: t 1, h/w 1..2 | after = 1 + 2: text 3, 4 |
    # video (tokens 7-8) from 5: t 5 + 3k, h/w 5 | after = 5 + 1: text 6
    assert positions[:, 0].tolist() == [0, 0, 0]
    assert positions[:, 1:5].T.tolist() == [[1, 1, 1], [1, 1, 2], [1, 2, 1], [1, 2, 2]]
    assert positions[0, 5:7].tolist() == [3, 4]
    assert positions[:, 7:9].T.tolist() == [[5, 5, 5], [8, 5, 5]]
    assert positions[:, 9].tolist() == [6, 6, 6]


def test_temporal_indices_uniform_is_the_stock_float32_rule():
    # stock: int(k * tokens_per_second * second_per_grid) in float32
    seconds = [2 / 3] * 4
    stock = (torch.arange(4) * (2 * torch.tensor(2 / 3, dtype=torch.float32))).long()
    assert temporal_indices(seconds, 2).tolist() == stock.tolist() == [0, 1, 2, 4]


def test_temporal_indices_after_selection_follow_elapsed_seconds():
    # pairs start at 0, 2.5 and 6.0 s (durations 2.5, 3.5, then anything); tokens_per_second 2
    assert temporal_indices([2.5, 3.5, 1.0], 2).tolist() == [0, 5, 12]
    # float32(0.7) * 10 = 6.9999998: rounded to 1e-3 of a position, 0.7 s is still index 7
    assert temporal_indices([0.7, 0.1], 10).tolist() == [0, 7]


def test_runs_beyond_the_prompt_are_refused():
    with pytest.raises(ValueError, match="beyond the prompt"):
        qwen25_mrope_positions(
            3, [VisionRun(offset=1, grids=[(1, 2, 2)], second_per_grid_ts=[1.0])], tokens_per_second=2
        )
