"""Analytic FLOPs (`compute/flops.py`): equal to torch's FlopCounterMode on the tiny backbones, the
paper's latency-table TFLOPs from the 7B config, and the compute ratios at R = 0.25."""

from types import SimpleNamespace

import pytest
import torch
from transformers.vision_utils import get_vision_window_index

from resadapt_eval.allocator.model import Allocator, AllocatorConfig
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.cli import main
from resadapt_eval.compute.flops import dims_from_config, load_dims, method_flops, segments
from resadapt_eval.estimates import row_flops, stage_flops
from resadapt_eval.kinds import IN_LLM_PRUNER
from resadapt_eval.manifest import run_summary, sample_totals
from resadapt_eval.measure.counting import flop_counter
from resadapt_eval.methods import BEFORE_ENCODER, METHODS, get_method
from resadapt_eval.pipeline import VideoPipeline, VideoPipelineConfig

from .helpers import check_kept, early_prune_layers, text_after_video, video_request

PAPER_TFLOPS = {16: 111.4, 32: 222.5, 64: 444.6, 128: 888.9}  # latency table, Qwen2.5-VL-7B vanilla
SOURCE_HW = (672, 896)  # a 4:3 896x672 source: 768 tokens per pair


COUNTED = [
    ("vanilla", None),
    ("fixed_scale", 0.25),
    ("resadapt", 0.25),
    *[(name, 0.25) for name, method in METHODS.items() if method.stage != BEFORE_ENCODER and method.hf],
]
# every in-LLM pruner, at stage layers early enough for R=0.25 on the 12-layer fixtures
PRUNE_LAYERS = {name: early_prune_layers(m) for name, m in METHODS.items() if m.kind is IN_LLM_PRUNER}


@pytest.fixture(scope="module")
def tiny_allocator(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("allocator")
    Allocator(AllocatorConfig(encoder="tiny", width=32, num_heads=4, head_init_std=0.5)).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("backbone", ["qwen25vl", "qwen3vl"])
@pytest.mark.parametrize("method,retention", COUNTED)
def test_record_flops_equal_flop_counter_mode(
    eager_adapters, fixtures_dir, tiny_allocator, backbone, method, retention
):
    adapter = eager_adapters[backbone]
    allocator = tiny_allocator if method == "resadapt" else None
    if backbone not in METHODS[method].kind.families:  # stops at start (tests/test_retention_floors.py)
        return
    config = VideoPipelineConfig(
        method=method,
        max_num_frames=8,
        budget=BudgetSpec(retention=retention),
        allocator=allocator,
        prune_layers=PRUNE_LAYERS.get(method),
    )
    pipeline = VideoPipeline(adapter, config)
    request = video_request(adapter, fixtures_dir)
    pipeline.run(request)  # the Allocator's encoders count their per-frame and per-length FLOPs on first use
    with flop_counter(depth=3) as counter:
        _, record = pipeline.run(request)
    assert record.error is None and record.output_tokens >= 2  # decode steps ran
    assert counter.get_total_flops() == record.total_flops
    check_kept(record.to_dict())  # which tokens it kept, merged and held, as counted
    # the tower runs inside generate, or on its own for a compressor (a root module of its own name)
    model = adapter.model
    names = (f"{type(model).__name__}.model.visual", type(model.model.visual).__name__)
    (vision,) = [counts for name, counts in counter.get_flop_counts().items() if name in names]
    spec = METHODS[method]
    inside = 0  # a method's own work between the tower's blocks: iLLaVA's merging, IPCV's neighbour search
    if spec.tower_merge is not None:
        inside = record.method_flops
    if spec.tower_prune is not None:
        dims = dims_from_config(adapter.model.config)
        tower = spec.kind.tower_counts(spec, dims, [t * h * w for t, h, w in record.grids], retention)
        inside = spec.kind.tower_flops(spec, tower, dims.vision.hidden)
    assert sum(vision.values()) == record.vision_flops + record.vision_attention_flops + inside
    parts = ("vision", "vision_attention", "llm_prefill", "llm_attention", "decode", "method", "allocator")
    assert record.total_flops == sum(getattr(record, f"{p}_flops") for p in parts)
    if METHODS[method].stage == BEFORE_ENCODER:
        assert record.method_flops == 0
    if METHODS[method].needs_attention or METHODS[method].prune is not None:
        assert record.method_flops > 0  # the recomputed ViT attention, or the LLM ranking
    assert (record.allocator_flops > 0) == (method == "resadapt")
    summary = run_summary(sample_totals([record]))
    assert summary["total_tflops"] == record.total_flops / 1e12


@pytest.mark.parametrize("method", ["tome", "visionzip", "random_drop"])
def test_similarities_from_configs_equal_the_counted_ones(eager_adapters, fixtures_dir, method):
    """`row_flops` computes ToMe's and VisionZip's similarity work from the grids; a run counts it."""
    adapter = eager_adapters["qwen25vl"]
    config = VideoPipelineConfig(method=method, max_num_frames=8, budget=BudgetSpec(retention=0.25))
    request = video_request(adapter, fixtures_dir)
    _, record = VideoPipeline(adapter, config).run(request)
    dims = dims_from_config(adapter.model.config)
    computed = method_flops(get_method(method), dims, [tuple(g) for g in record.grids], 0.25)
    assert computed == record.method_flops


def test_flashvid_counts_its_recomputed_attention_and_its_similarities(eager_adapters, fixtures_dir):
    adapter = eager_adapters["qwen25vl"]
    pipeline = VideoPipeline(
        adapter, VideoPipelineConfig(method="flashvid", max_num_frames=8, budget=BudgetSpec(retention=0.5))
    )
    _, record = pipeline.run(video_request(adapter, fixtures_dir))
    # the last block's attention recomputed: qkv 2 * P * 3 D^2 and QK^T 2 * D * L^2 per pair (last block: full)
    v = adapter.model.config.vision_config
    patches = [t * h * w * 4 for t, h, w in record.grids]
    recomputed = sum(2 * p * 3 * v.hidden_size**2 + 2 * v.hidden_size * p * p for p in patches)
    # and at least one cosine row per kept token against its pair (2 * n * D_out each)
    width, tokens = v.out_hidden_size, [t * h * w for t, h, w in record.grids]
    assert record.method_flops >= recomputed + sum(2 * n * width for n in tokens)
    with pytest.raises(ValueError, match="depends on the features"):
        row_flops(dims_from_config(adapter.model.config), "flashvid", 8, SOURCE_HW, 0.25)


@pytest.mark.parametrize("encoder", ["tiny", "minilm-effnet"])
@pytest.mark.parametrize("grad", [False, True])
def test_allocator_flops_equal_flop_counter_mode(encoder, grad):
    """`Allocator.flops` (encoders counted per frame and per query length, decoder by formula)
    equals a count of scoring a whole video, in inference (MultiheadAttention's fast path) and training."""
    allocator = Allocator(AllocatorConfig(encoder=encoder, width=64, num_heads=4, num_layers=2)).eval()
    frames = torch.zeros(20, 40, 56, 3, dtype=torch.uint8)
    query = "Which symbol appears in the frame with the red border?"
    with torch.set_grad_enabled(grad), flop_counter() as counter:
        feats = allocator.encoders.encode_frames(frames, chunk_size=16)[None]
        text, mask = allocator.encoders.encode_text([query])
        allocator(feats, torch.ones(1, 20, dtype=torch.bool), text, mask)
    assert allocator.flops(20, allocator.encoders.text_tokens(query)) == counter.get_total_flops()


def test_allocator_decoder_flops_by_hand():
    allocator = Allocator(AllocatorConfig(encoder="tiny", width=32, num_heads=4, num_layers=1, ffn_mult=2))
    T, L, D = 3, 5, 32  # tiny encoders: 32-wide frame and text features
    projections = 2 * T * 32 * D + 2 * L * 32 * D
    self_attention = 2 * T * D * 3 * D + 2 * (2 * T * T * D) + 2 * T * D * D
    cross_attention = 2 * T * D * D + 2 * L * D * 2 * D + 2 * (2 * T * L * D) + 2 * T * D * D
    ffn = 2 * T * D * 2 * D + 2 * T * 2 * D * D
    assert allocator.decoder_flops(T, L) == projections + self_attention + cross_attention + ffn + 2 * T * D * 2


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


def test_flops_command_counts_the_allocator(capsys, tiny_allocator):
    assert (
        main(["flops", "--methods", "fixed_scale,resadapt", "--allocator", tiny_allocator, "--frames", "16,128"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    header = lines[2].split()
    rows = {(r[0], int(r[1])): dict(zip(header, r)) for r in (line.split() for line in lines[3:])}
    allocator = Allocator.from_pretrained(tiny_allocator)
    for frames in (16, 128):
        fixed, ours = rows["fixed_scale", frames], rows["resadapt", frames]
        # the same tokens at R = 0.25, plus the Allocator's own FLOPs (16 query tokens by default)
        assert ours["visual_tokens"] == fixed["visual_tokens"] and ours["linear"] == fixed["linear"]
        vanilla, _ = row_flops(load_dims("qwen25vl-7b"), "vanilla", frames, SOURCE_HW)
        expected = allocator.flops(frames, 16) / vanilla.linear
        assert float(ours["alloc_x_van"]) == pytest.approx(expected, rel=0.01) and float(fixed["alloc_x_van"]) == 0


@pytest.mark.parametrize("method", list(PRUNE_LAYERS))
def test_ranking_inside_the_llm_from_configs_equals_the_counted_one(eager_adapters, fixtures_dir, method):
    """`stage_flops` (what `row_flops` adds for an in-LLM pruner's stages) equals what a run counted."""
    adapter = eager_adapters["qwen3vl"]
    config = VideoPipelineConfig(
        method=method, max_num_frames=8, budget=BudgetSpec(retention=0.25), prune_layers=PRUNE_LAYERS[method]
    )
    request = video_request(adapter, fixtures_dir)
    _, record = VideoPipeline(adapter, config).run(request)
    text = dims_from_config(adapter.model.config).text
    prompts = [record.input_tokens - record.visual_tokens + n for n in record.layer_visual_tokens]
    plan = SimpleNamespace(prompt=prompts, visual=record.visual_tokens)
    stages = METHODS[method].prune(12, record.visual_tokens, 0.25, [int(x) for x in PRUNE_LAYERS[method].split(",")])
    text_after = text_after_video(adapter, request.prompt)
    assert record.method_flops == sum(stage_flops(text, s, plan, text_after, i == 0) for i, s in enumerate(stages)) > 0


def test_evs_is_counted_as_its_cosines_and_the_tokens_vllm_keeps():
    """EVS (inside vLLM) by formula: 6 d FLOPs (three d-long dot products) per token of every pair after the first."""
    dims = load_dims("qwen25vl-7b")
    grids = [(1, 24, 30)] * 8  # 8 pairs of 720 tokens
    assert method_flops(get_method("evs"), dims, grids, 0.25) == 7 * 720 * 6 * dims.vision.out_hidden
    flops, visual = row_flops(dims, "evs", 16, (672, 840), retention=0.25)
    vanilla, reference = row_flops(dims, "vanilla", 16, (672, 840))
    assert visual == reference // 4 and flops.vision == vanilla.vision  # the tower sees every token
    assert flops.method == 7 * 720 * 6 * 3584  # Qwen2.5-VL-7B's merger output is 3584 wide
