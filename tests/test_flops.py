"""Analytic FLOPs (`compute/flops.py`): equal to torch's FlopCounterMode on the tiny backbones, the
paper's latency-table TFLOPs from the 7B config, and the compute ratios at R = 0.25."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers.vision_utils import get_vision_window_index

from resadapt_eval.backbones.qwen import ADAPTERS
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.cli import main
from resadapt_eval.compute.flops import load_dims, row_flops, segments
from resadapt_eval.manifest import run_summary, sample_totals
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig

PAPER_TFLOPS = {16: 111.4, 32: 222.5, 64: 444.6, 128: 888.9}  # latency table, Qwen2.5-VL-7B vanilla
SOURCE_HW = (672, 896)  # a 4:3 896x672 source: 768 tokens per pair


@pytest.fixture(scope="module")
def eager_adapters(fixtures_dir):
    """The tiny backbones with eager attention, whose score matmuls FlopCounterMode sees (CPU SDPA it does not)."""
    return {
        name: cls.from_pretrained(str(fixtures_dir / name), dtype="float32", attn_implementation="eager")
        for name, cls in ADAPTERS.items()
    }


def video_request(adapter, fixtures_dir) -> Request:
    prompt = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    video = str(sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[0])
    return Request(prompt, video=video, gen_kwargs=dict(max_new_tokens=4))


# FlashVid's similarities depend on the features and are not counted: checked apart below.
COUNTED = [("vanilla", None), ("fixed_scale", 0.25), ("random_drop", 0.25), ("tome", 0.25), ("visionzip", 0.25)]


@pytest.mark.parametrize("backbone", ["qwen25vl", "qwen3vl"])
@pytest.mark.parametrize("method,retention", COUNTED)
def test_record_flops_equal_flop_counter_mode(eager_adapters, fixtures_dir, backbone, method, retention):
    adapter = eager_adapters[backbone]
    pipeline = VideoPipeline(
        adapter, VideoPipelineConfig(method=method, max_num_frames=8, budget=BudgetSpec(retention=retention))
    )
    with FlopCounterMode(display=False, depth=3) as counter:
        _, record = pipeline.run(video_request(adapter, fixtures_dir))
    assert record.error is None and record.output_tokens >= 2  # decode steps ran
    assert counter.get_total_flops() == record.total_flops
    # the tower runs inside generate, or on its own for a compressor (a root module of its own name)
    model = adapter.model
    names = (f"{type(model).__name__}.model.visual", type(model.model.visual).__name__)
    (vision,) = [counts for name, counts in counter.get_flop_counts().items() if name in names]
    assert sum(vision.values()) == record.vision_flops + record.vision_attention_flops
    parts = ("vision", "vision_attention", "llm_prefill", "llm_attention", "decode", "method")
    assert record.total_flops == sum(getattr(record, f"{p}_flops") for p in parts)
    assert (record.method_flops > 0) == (method in ("tome", "visionzip"))
    summary = run_summary(sample_totals([record]))
    assert summary["total_tflops"] == record.total_flops / 1e12


@pytest.mark.parametrize("backbone", ["qwen25vl", "qwen3vl"])
def test_flashvid_counts_its_recomputed_attention_and_no_more(eager_adapters, fixtures_dir, backbone):
    adapter = eager_adapters[backbone]
    pipeline = VideoPipeline(
        adapter, VideoPipelineConfig(method="flashvid", max_num_frames=8, budget=BudgetSpec(retention=0.5))
    )
    with FlopCounterMode(display=False) as counter:
        _, record = pipeline.run(video_request(adapter, fixtures_dir))
    # the last block's attention recomputed: qkv 2 * P * 3 D^2 and QK^T 2 * D * L^2 per pair (last block: full)
    v = adapter.model.config.vision_config
    patches = [t * h * w * 4 for t, h, w in record.grids]
    expected = sum(2 * p * 3 * v.hidden_size**2 + 2 * v.hidden_size * p * p for p in patches)
    assert record.method_flops == expected
    assert counter.get_total_flops() >= record.total_flops


def test_window_segments_match_transformers_window_index():
    dims = load_dims("qwen25vl-7b").vision
    for grid in [(1, 24, 32), (2, 21, 37), (1, 4, 4), (1, 3, 9)]:
        t, h, w = grid  # merged tokens; transformers takes patches
        _, cu = get_vision_window_index(torch.tensor([[t, 2 * h, 2 * w]]), 2, dims.window_px, dims.patch)
        assert segments(dims, grid, windowed=True) == (cu[1:] - cu[:-1]).tolist()


def test_qwen25vl_7b_vanilla_matches_the_papers_latency_table():
    dims = load_dims("qwen25vl-7b")
    for frames, paper in PAPER_TFLOPS.items():
        flops, visual = row_flops(dims, "vanilla", frames, SOURCE_HW)
        assert visual == frames // 2 * 768
        assert flops.linear / 1e12 == pytest.approx(paper, rel=0.02)
        assert flops.attention > 0 and flops.decode == 0


def test_qwen25vl_7b_vanilla_by_hand():
    """Independent arithmetic for 16 frames: 8 pairs of 24 x 32 tokens, 24 text tokens."""
    pairs, tokens, patches = 8, 768, 768 * 4
    conv = 2 * 3 * 2 * 14 * 14 * 1280
    block = 2 * (4 * 1280**2 + 3 * 1280 * 3420)
    merger = 2 * 5120 * (5120 + 3584)
    vision = pairs * (patches * (conv + 32 * block) + tokens * merger)
    layer = 2 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)
    llm = (pairs * tokens + 24) * 28 * layer + 2 * 3584 * 152064
    flops, _ = row_flops(load_dims("qwen25vl-7b"), "vanilla", 16, SOURCE_HW)
    assert (flops.vision, flops.llm_prefill) == (vision, llm)
    # attention: 28 windowed blocks of 48 windows of 64 patches, 4 full blocks of 3072, per pair
    vision_attention = pairs * 4 * 1280 * (28 * 48 * 64**2 + 4 * 3072**2)
    assert flops.vision_attention == vision_attention
    assert flops.llm_attention == 28 * 4 * (pairs * tokens + 24) ** 2 * 3584


@pytest.mark.parametrize("backbone", ["qwen25vl-7b", "qwen3vl-8b"])
def test_resizing_before_the_encoder_costs_a_quarter_dropping_after_it_more_than_a_third(backbone):
    dims = load_dims(backbone)
    for frames in PAPER_TFLOPS:
        vanilla, _ = row_flops(dims, "vanilla", frames, SOURCE_HW)
        fixed, _ = row_flops(dims, "fixed_scale", frames, SOURCE_HW, 0.25)
        dropped, _ = row_flops(dims, "random_drop", frames, SOURCE_HW, 0.25)
        assert fixed.linear < 0.26 * vanilla.linear and fixed.total < 0.26 * vanilla.total
        # in the paper's counting; with full-square attention scores beside, dropping still costs more than resizing
        assert dropped.linear > 0.33 * vanilla.linear and dropped.total > 1.5 * fixed.total


def test_flops_command_prints_the_papers_rows(capsys, fixtures_dir):
    args = ["flops", "--backbone", "qwen25vl-7b", "--size", "896x672", "--methods", "vanilla,fixed_scale,random_drop"]
    assert main(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    vanilla = {int(r[1]): float(r[3]) for r in rows if r[0] == "vanilla"}
    assert vanilla.keys() == PAPER_TFLOPS.keys()
    assert all(vanilla[t] == pytest.approx(PAPER_TFLOPS[t], rel=0.02) for t in PAPER_TFLOPS)
    ratios = {(r[0], int(r[1])): float(r[4]) for r in rows}
    assert all(ratios["fixed_scale", t] < 0.26 and ratios["random_drop", t] > 0.33 for t in PAPER_TFLOPS)
    # a pretrained folder's config.json is read the same way
    assert main(["flops", "--backbone", str(fixtures_dir / "qwen3vl"), "--frames", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:3] == [
        "vanilla",
        "8",
        str(4 * 21 * 28),
    ]  # 896x672 at 32 px per token
