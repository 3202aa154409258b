"""dtype x attention implementation (issue 31): every method the HF backbone runs, on both tiny
backbones, in float32 and bfloat16 under eager and SDPA attention, in-process through `VideoPipeline`.

In all four variants: the same plan (scales, per-pair sizes, grids), visual tokens, reference
tokens, R and visual tokens per decoder layer, and the tokens each method actually keeps number
what the record says. In float32, eager and SDPA keep the very same tokens (a compressor's groups,
a pruner's tokens per layer, DyCoKe's decoding selections) and agree on the first-token logits
within 1e-4. The received attention that VisionZip, FlashVid, FastVID and HoliTom rank by is
recomputed from the last ViT block's input under either implementation (the fused kernels return
no map), in float32, and equals the map the eager kernel computes.

Which tokens are kept is not asserted in bfloat16, neither against float32 nor between its two
attention implementations: the two kernels round differently in bfloat16, so the vision features
of bfloat16 eager and SDPA already differ by one bfloat16 step (about 5e-4 on features near 0.1),
and from float32 by about as much; a ranking with near-equal scores then swaps a token or two
(mostly 1-3 of 128-158 kept tokens on these fixtures). A choice that feeds later ones moves more:
DivPrune's greedy max-min (up to 18 of 128), DyCoKe's decoding selections after its merge stage,
and PyramidDrop, whose scores are averaged in the model's dtype as its reference does: in
bfloat16 its last stage's 88 scores take 8 distinct values, so ties decide (up to 10 of 60). The
counts, and so R, do not move.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import pytest
import torch
from transformers import LogitsProcessor

from resadapt_eval.backbones import qwen
from resadapt_eval.backbones.decode_pruning import DecodePruner
from resadapt_eval.backbones.layer_pruning import LayerPruner
from resadapt_eval.budget.plan import plan_from_scales
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.methods import METHODS, NO_RETENTION
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig
from resadapt_eval.record import SampleRecord

from .helpers import chat_prompt, synthetic_video

BACKBONES = ["qwen25vl", "qwen3vl"]
DTYPES = ["float32", "bfloat16"]
ATTENTION = ["eager", "sdpa"]
VARIANTS = [(dtype, attention) for dtype in DTYPES for attention in ATTENTION]
REFERENCE = ("float32", "eager")
RETENTION = 0.4  # above PyramidDrop's floor at its default layers on the 12-layer fixtures (0.25 is not)
NEEDS_ATTENTION = [name for name, method in METHODS.items() if method.needs_attention]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def variant_adapters(fixtures_dir):
    """Each tiny backbone loaded four times, as `dtype=` and `attn_implementation=` load it."""
    return {
        (backbone, dtype, attention): qwen.ADAPTERS[backbone].from_pretrained(
            str(fixtures_dir / backbone), dtype=dtype, attn_implementation=attention
        )
        for backbone in BACKBONES
        for dtype, attention in VARIANTS
    }


@dataclass
class Run:
    """One request answered by one method on one variant: the sidecar record, what the compressor
    was handed and returned, the pruner that ran inside the LLM, the first generated token's logits."""

    record: SampleRecord
    tokens: list
    compressions: list
    pruner: LayerPruner | DecodePruner | None
    first_logits: torch.Tensor


class FirstScores(LogitsProcessor):
    def __init__(self):
        self.scores = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores[0].detach().clone())
        return scores


def answer(adapter, name: str, request: Request) -> Run:
    """`VideoPipeline.run` with spies on the compressor (`Method.compress`) and the engine."""
    method = METHODS[name]
    settings = dict(method=name, max_num_frames=8, strict=True)
    if method.retention != NO_RETENTION:
        settings["budget"] = BudgetSpec(retention=RETENTION)
    if method.needs_allocator:
        settings["allocator"] = "untrained"
    pipeline = VideoPipeline(adapter, VideoPipelineConfig(**settings))
    tokens, compressions, requests, first = [], [], [], FirstScores()
    if method.compress is not None:

        def compress(visual_tokens, keep, seed):
            tokens.append(visual_tokens)
            compressions.append(method.compress(visual_tokens, keep, seed))
            return compressions[-1]

        spied = dataclasses.replace(method.compressor, compress=compress)
        pipeline.spec = dataclasses.replace(pipeline.spec, method=dataclasses.replace(method, compressor=spied))
    if method.tower_merge is not None:  # the merges inside the vision tower, as `compressions`

        def merge(*args):
            compressions.append(method.tower_merge.merge(*args))
            return compressions[-1]

        spied = dataclasses.replace(method.tower_merge, merge=merge)
        pipeline.spec = dataclasses.replace(pipeline.spec, method=dataclasses.replace(method, tower_merge=spied))
    generate_batch, generate_ids = adapter.generate_batch, adapter.generate_ids

    def spy_batch(built, kwargs):
        requests.extend(built)
        return generate_batch(built, kwargs)

    def spy_ids(inputs, *args, logits_processor=None, **kwargs):
        return generate_ids(inputs, *args, logits_processor=[*(logits_processor or []), first], **kwargs)

    adapter.generate_batch, adapter.generate_ids = spy_batch, spy_ids
    try:
        _, record = pipeline.run(request)
    finally:
        del adapter.generate_batch, adapter.generate_ids
    return Run(record, tokens, compressions, getattr(requests[0], "pruner", None), first.scores[0])


@pytest.fixture(scope="module")
def runs(variant_adapters, fixtures_dir):
    """runs(method, backbone) -> {(dtype, attention): Run}, each answered once per module."""
    done = {}

    def get(name: str, backbone: str) -> dict:
        if (name, backbone) not in done:
            adapter = variant_adapters[(backbone, *REFERENCE)]
            prompt = adapter.processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Colour?"}]}],
                tokenize=False,
                add_generation_prompt=True,
            )
            video = str(sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[0])
            request = Request(prompt, video=video, query="Colour?", gen_kwargs=dict(max_new_tokens=4))
            done[name, backbone] = {
                variant: answer(variant_adapters[(backbone, *variant)], name, request) for variant in VARIANTS
            }
        return done[name, backbone]

    return get


def hf_method(name: str, backbone: str):
    """The registered method, or a skip for one the registry runs on vLLM only or not on `backbone`
    (which stops at start: tests/test_retention_floors.py)."""
    method = METHODS[name]
    if not method.hf:
        assert method.vllm
        pytest.skip(f"method={name} acts {method.stage.replace('_', ' ')}: the registry runs it on vLLM only")
    if backbone not in method.kind.families:
        pytest.skip(f"method={name} runs on {', '.join(method.kind.families)} only")
    return method


def visual_kept(pruner: LayerPruner) -> dict[int, list[int]]:
    """Per decoder layer after a stage, the visual tokens it sees (prompt indices)."""
    return {layer: kept[torch.isin(kept, pruner.visual)].tolist() for layer, kept in pruner.kept_by_layer.items()}


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("name", list(METHODS))
def test_plans_visual_tokens_and_r_are_the_same_in_all_four_variants(runs, name, backbone):
    method = hf_method(name, backbone)
    out = runs(name, backbone)

    def budget(run: Run):
        r = run.record
        merged = None if r.merged_sizes is None else len(r.merged_sizes)
        return (r.scales, r.pair_sizes, r.grids, r.visual_tokens, r.reference_tokens, r.achieved_retention,
                r.layer_visual_tokens, r.layer_averaged_tokens, merged)  # fmt: skip

    assert list(out) == VARIANTS
    for variant, run in out.items():
        record = run.record
        assert record.error is None and record.output_tokens > 0, variant
        assert budget(run) == budget(out[REFERENCE]), variant
        # what the method kept numbers what the record counts
        if method.compress is not None:
            (compression,) = run.compressions
            assert len(compression.kept) == record.visual_tokens == len(record.merged_sizes), variant
        if method.tower_merge is not None:  # the last merge's survivors enter the LLM
            assert len(run.compressions[-1].survivors) == record.visual_tokens == len(record.merged_sizes), variant
        if isinstance(run.pruner, LayerPruner):
            assert visual_kept(run.pruner), variant  # a stage ran
            for layer, kept in visual_kept(run.pruner).items():
                assert len(kept) == record.layer_visual_tokens[layer], (variant, layer)
        if isinstance(run.pruner, DecodePruner):
            assert run.pruner.selections, variant  # max_new_tokens=4: three decoding steps after the first token
            assert all(len(kept) == run.pruner.stage.keep for _, kept in run.pruner.selections), variant
    assert out[REFERENCE].record.achieved_retention <= (1.0 if method.retention == NO_RETENTION else RETENTION)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("name", list(METHODS))
def test_in_float32_eager_and_sdpa_keep_the_same_tokens_and_agree_on_the_first_logits(runs, name, backbone):
    hf_method(name, backbone)
    out = runs(name, backbone)
    eager, sdpa = out["float32", "eager"], out["float32", "sdpa"]
    for ours, theirs in zip(eager.compressions, sdpa.compressions, strict=True):
        assert torch.equal(ours.assignment, theirs.assignment)
        if getattr(ours, "survivors", None) is not None:
            assert torch.equal(ours.survivors, theirs.survivors)
        if ours.weights is not None:
            torch.testing.assert_close(ours.weights, theirs.weights, atol=1e-6, rtol=0)
    if isinstance(eager.pruner, LayerPruner):
        assert eager.pruner.kept_by_layer and visual_kept(eager.pruner) == visual_kept(sdpa.pruner)
    if isinstance(eager.pruner, DecodePruner):
        assert [(s, k.tolist()) for s, k in eager.pruner.selections] == [
            (s, k.tolist()) for s, k in sdpa.pruner.selections
        ]
    assert (eager.first_logits - sdpa.first_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("name", NEEDS_ATTENTION)
def test_a_method_that_needs_attention_gets_the_same_float32_map_under_both(runs, name, backbone):
    out = runs(name, backbone)
    for variant, run in out.items():
        (tokens,) = run.tokens
        assert tokens.received_attention.dtype == tokens.keys.dtype == torch.float32, variant
        assert tokens.received_attention.shape == (tokens.features.shape[0],), variant
    eager, sdpa = out["float32", "eager"].tokens[0], out["float32", "sdpa"].tokens[0]
    torch.testing.assert_close(sdpa.received_attention, eager.received_attention, atol=1e-6, rtol=0)
    torch.testing.assert_close(sdpa.keys, eager.keys, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_the_received_attention_is_the_eager_kernels_map_under_both_implementations(
    variant_adapters, backbone, monkeypatch
):
    """The map the methods rank by, recomputed from the last ViT block's input, against the
    attention weights the eager kernel itself computes in that block (mean over heads and query
    patches within each attention segment, then over each merged token's patches, in LLM order)."""
    reference = variant_adapters[(backbone, *REFERENCE)]
    last_block = reference.model.model.visual.blocks[-1].attn
    modeling = sys.modules[type(last_block).__module__]  # the eager kernel the block calls
    kernel_maps = []

    def eager_attention(module, *args, **kwargs):
        output, weights = eager_kernel(module, *args, **kwargs)
        if module is last_block:
            kernel_maps.append(weights[0].float().mean(dim=(0, 1)))  # (keys,) of one segment
        return output, weights

    eager_kernel = modeling.eager_attention_forward
    monkeypatch.setattr(modeling, "eager_attention_forward", eager_attention)

    px = reference.grid.token_px
    plan = plan_from_scales([1.0] * 8, (4 * px, 6 * px), reference.grid)
    received = {}
    for dtype, attention in VARIANTS:
        adapter = variant_adapters[(backbone, dtype, attention)]
        handed = []

        def compress(tokens, keep, seed):
            handed.append(tokens)
            return METHODS[NEEDS_ATTENTION[0]].compress(tokens, keep, seed)

        adapter.build_compressed_inputs(
            chat_prompt(adapter), synthetic_video(8), plan, compress, RETENTION, needs_attention=True
        )
        received[dtype, attention] = handed[0].received_attention
    unit = reference.model.config.vision_config.spatial_merge_size**2
    assert len(kernel_maps) > 1  # the eager kernel ran once per attention segment of the last block
    per_unit = torch.cat(kernel_maps).reshape(-1, unit).mean(dim=1)
    grid = reference.build_inputs(chat_prompt(reference), synthetic_video(8), plan)["video_grid_thw"]
    order = reference.unit_order(grid)
    from_kernel = per_unit if order is None else per_unit[order]
    # the tiny towers attend almost uniformly (about 1/96 per token here): the tolerances below are
    # a small part of the map's own spread, so a flat or misordered map would not pass
    assert (from_kernel.max() - from_kernel.min()).item() > 2e-5
    for attention in ATTENTION:
        torch.testing.assert_close(received["float32", attention], from_kernel, atol=1e-6, rtol=0)
        # bfloat16: the same recomputation, in float32 from the bfloat16 block input (measured: 2e-7 off)
        torch.testing.assert_close(received["bfloat16", attention], from_kernel, atol=2e-6, rtol=0)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: the fixtures are float32 checkpoints
def test_flash_attention_2_in_float32_stops_before_loading_naming_both_arguments(
    fixtures_dir, backbone, dtype, monkeypatch
):
    monkeypatch.setattr(qwen.AutoModelForImageTextToText, "from_pretrained", not_loaded)
    with pytest.raises(
        ValueError, match=rf"^attn_implementation=flash_attention_2 runs in float16 or bfloat16, not dtype={dtype}"
    ):
        qwen.ADAPTERS[backbone].from_pretrained(
            str(fixtures_dir / backbone), dtype=dtype, attn_implementation="flash_attention_2"
        )


@pytest.mark.parametrize("backbone", BACKBONES)
def test_flash_attention_2_without_flash_attn_stops_before_loading_naming_the_argument(
    fixtures_dir, backbone, monkeypatch
):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not importable, whatever this machine has
    monkeypatch.setattr(qwen.AutoModelForImageTextToText, "from_pretrained", not_loaded)
    with pytest.raises(ValueError, match="^attn_implementation=flash_attention_2 needs the flash_attn package"):
        qwen.ADAPTERS[backbone].from_pretrained(
            str(fixtures_dir / backbone), dtype="bfloat16", attn_implementation="flash_attention_2"
        )


def test_the_lmms_eval_class_stops_at_start_on_flash_attention_2(fixtures_dir, tmp_path, monkeypatch):
    from resadapt_eval.lmms.models import ResAdaptQwen25VL

    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(qwen.AutoModelForImageTextToText, "from_pretrained", not_loaded)
    args = f"pretrained={fixtures_dir / 'qwen25vl'},device=cpu,sidecar_dir={tmp_path}"
    args += ",attn_implementation=flash_attention_2"
    with pytest.raises(
        ValueError, match="^attn_implementation=flash_attention_2 runs in float16 or bfloat16, not dtype=float32"
    ):
        ResAdaptQwen25VL.create_from_arg_string(f"{args},dtype=float32")
    with pytest.raises(ValueError, match="^attn_implementation=flash_attention_2 needs the flash_attn package"):
        ResAdaptQwen25VL.create_from_arg_string(f"{args},dtype=bfloat16")


def not_loaded(*args, **kwargs):
    raise AssertionError("the weights were being loaded")
