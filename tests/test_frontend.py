"""The front end scales linearly: chunked frame encoding, cached fixed-scale search, threads per process."""

import os

import numpy as np
import pytest
import torch

from resadapt_eval.allocator import Allocator, AllocatorConfig, AllocatorPolicy, build_encoders, encoders
from resadapt_eval.budget import plan
from resadapt_eval.budget.plan import QWEN3VL_GRID, QWEN25VL_GRID, InfeasibleBudget, fixed_scale_for_retention
from resadapt_eval.budget.policies import BudgetSpec, fixed_scale
from resadapt_eval.pipeline import VideoPipelineConfig


def frames(num_frames, seed=0, height=60, width=80):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8))


@pytest.fixture
def threads():
    """Restores torch's intra-op threads after a test that sets them."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["tiny", "minilm-effnet"])
def test_chunked_frame_features_equal_one_batch(name):
    enc = build_encoders(name)
    video = frames(20)
    one_batch = enc.encode_frames(video, chunk_size=20)
    # float32 rounding only: EfficientNet's convolutions may take another kernel for another batch size
    # (on one torch thread up to 5e-6 on features of size ~5; a chunking bug moves them by O(1))
    for chunk_size in (1, 7, 16):
        torch.testing.assert_close(enc.encode_frames(video, chunk_size=chunk_size), one_batch, rtol=1e-5, atol=1e-5)


def test_only_one_chunk_is_converted_to_float_at_full_resolution(monkeypatch):
    enc = build_encoders("tiny")
    seen = []

    def recording(x, size, mean, std, resize):
        seen.append(tuple(x.shape))
        return coarse(x, size, mean, std, resize)

    coarse = encoders.coarse_frames
    monkeypatch.setattr(encoders, "coarse_frames", recording)
    assert enc.encode_frames(frames(37), chunk_size=16).shape == (37, enc.frame_dim)
    assert seen == [(16, 60, 80, 3), (16, 60, 80, 3), (5, 60, 80, 3)]
    with pytest.raises(ValueError, match="chunk_size must be at least 1"):
        enc.encode_frames(frames(2), chunk_size=0)


def test_allocator_scales_do_not_depend_on_the_frame_chunk():
    allocator = Allocator(AllocatorConfig(encoder="tiny", width=32, num_heads=4, head_init_std=0.5)).eval()
    video, images = frames(19).numpy(), [frames(1, seed=s).numpy() for s in (1, 2, 3)]
    (one_batch, *_), _ = AllocatorPolicy(allocator, frame_chunk=64).raw_scales_batch([[video], images], ["a", "b"])
    for chunk in (1, 4, 16):
        (scales, *_), _ = AllocatorPolicy(allocator, frame_chunk=chunk).raw_scales_batch([[video], images], ["a", "b"])
        np.testing.assert_allclose(scales, one_batch, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="frame_chunk must be at least 1"):
        AllocatorPolicy(allocator, frame_chunk=0)


@pytest.mark.parametrize(
    "target, num_frames, base_hw, grid, s_min, s_max, bounds",
    [
        (0.25, 8, (252, 308), QWEN25VL_GRID, 0.2, 1.8, {}),
        (0.5, 31, (448, 640), QWEN3VL_GRID, 0.05, 1.0, dict(pair_reduction="max", max_tokens_per_pair=90)),
        (0.1, 128, (476, 644), QWEN25VL_GRID, 0.2, 1.8, dict(min_tokens_per_pair=4, pair_reduction="min")),
    ],
)
def test_the_cached_fixed_scale_search_equals_the_search_and_runs_once(
    target, num_frames, base_hw, grid, s_min, s_max, bounds
):
    plan.fixed_scale_cache.cache_clear()
    searched = fixed_scale_for_retention(target, num_frames, base_hw, grid, s_min, s_max, **bounds)
    args = (target, num_frames, list(np.int64(base_hw)), grid, s_min, s_max)  # as a request may pass them
    assert plan.cached_fixed_scale_for_retention(*args, **bounds) == searched
    assert plan.fixed_scale_cache.cache_info().misses == 1
    assert plan.cached_fixed_scale_for_retention(*args, **dict(reversed(bounds.items()))) == searched
    assert plan.fixed_scale_cache.cache_info()[:2] == (1, 1)  # (hits, misses): the second call did not search


def test_the_fixed_scale_policy_searches_once_per_frames_base_size_and_budget():
    plan.fixed_scale_cache.cache_clear()
    spec = BudgetSpec(retention=0.25, max_tokens_per_pair=100)
    for _ in range(3):
        scales = fixed_scale(16, (252, 308), QWEN25VL_GRID, spec)
    s = fixed_scale_for_retention(0.25, 16, (252, 308), QWEN25VL_GRID, 0.2, 1.8, **spec.plan_bounds)
    np.testing.assert_array_equal(scales, np.full(16, s))
    assert plan.fixed_scale_cache.cache_info()[:2] == (2, 1)
    fixed_scale(17, (252, 308), QWEN25VL_GRID, spec)  # another frame count is another search
    assert plan.fixed_scale_cache.cache_info().misses == 2
    with pytest.raises(InfeasibleBudget):  # an infeasible target still raises on every call
        fixed_scale(16, (252, 308), QWEN25VL_GRID, BudgetSpec(retention=0.001))
    with pytest.raises(InfeasibleBudget):
        fixed_scale(16, (252, 308), QWEN25VL_GRID, BudgetSpec(retention=0.001))


def test_num_threads_is_set_per_process(threads):
    with pytest.raises(ValueError, match="num_threads must be at least 1"):
        VideoPipelineConfig(num_threads=0)
    default = torch.get_num_threads()
    assert VideoPipelineConfig().apply_num_threads(processes=1) == default  # one process: torch's default
    assert VideoPipelineConfig(num_threads=1).apply_num_threads(processes=1) == 1 == torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    assert VideoPipelineConfig().apply_num_threads(processes=2) == max(1, cpus // 2)
    assert VideoPipelineConfig().apply_num_threads(processes=4 * cpus) == 1
    assert VideoPipelineConfig(num_threads=3).apply_num_threads(processes=2) == 3  # given: taken as is


def test_the_num_threads_model_arg_sets_the_threads_of_the_evaluating_process(fixtures_dir, threads):
    from resadapt_eval.lmms.models import ResAdaptQwen25VL

    torch.set_num_threads(2)
    model = ResAdaptQwen25VL(pretrained=str(fixtures_dir / "qwen25vl"), method="vanilla", device="cpu", num_threads=1)
    assert torch.get_num_threads() == 1 and model.model_args["num_threads"] == 1


def test_fast_coarse_frames_use_the_uint8_kernel_within_a_few_levels_of_the_float_path():
    """`coarse_frames(resize="fast")`: the Allocator's square input through torchvision's uint8
    bilinear kernel, each value a few uint8 levels from the float path's on a 720p frame, and the
    encoders' features close to exact's."""
    g = np.random.default_rng(0)
    x, y = np.linspace(0, 1, 1280)[None, :, None], np.linspace(0, 1, 720)[:, None, None]
    frame = (127 + 60 * np.sin(20 * x + 7 * y) + g.normal(0, 20, (720, 1280, 3))).clip(0, 255).astype(np.uint8)
    frames = torch.from_numpy(np.stack([frame, frame[::-1].copy()]))
    exact = encoders.coarse_frames(frames, 224, (0.0,) * 3, (1.0,) * 3)
    fast = encoders.coarse_frames(frames, 224, (0.0,) * 3, (1.0,) * 3, "fast")
    assert exact.shape == fast.shape == (2, 3, 224, 224) and fast.dtype == torch.float32
    levels = 255 * (exact - fast).abs()
    assert 0 < levels.max() <= 3 and levels.mean() < 0.5
    assert torch.equal(fast * 255, (fast * 255).round())  # uint8 levels
    enc = build_encoders("tiny")
    torch.testing.assert_close(enc.encode_frames(frames, resize="fast"), enc.encode_frames(frames), atol=0.05, rtol=0)
