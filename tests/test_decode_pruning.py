"""DyCoke's KV pruning while decoding on the tiny 12-layer backbones: its stage by hand, the first
step's selection against the eager attention map, a stage keeping every token equal to vanilla, the
same answers with and without an attention mask, and through the pipeline R stays TTM's while the
decoding FLOPs drop."""

import pytest
import torch

from resadapt_eval.backbones.decode_pruning import DecodePruner
from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE
from resadapt_eval.baselines import dycoke
from resadapt_eval.baselines.inside_llm import DecodeStage
from resadapt_eval.budget.plan import plan_from_scales
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.compute.flops import decode_flops, dims_from_config
from resadapt_eval.methods import METHODS
from resadapt_eval.pipeline import VideoPipeline, VideoPipelineConfig

from .helpers import BACKBONES, chat_prompt, synthetic_video, video_request


def test_dycoke_decoding_stage_by_hand():
    # layer 3 of 28 (dycoke_l), int((1 - 0.7) n) tokens, re-selected below cosine 0.9
    assert dycoke.decode_stage(28, 1000, 0.25) == DecodeStage(3, 300, 0.9)
    assert dycoke.decode_stage(12, 101, 0.1).layer == 1 and dycoke.decode_stage(12, 101, 0.1).keep == 30
    assert dycoke.decode_stage(12, 101, 0.1, first_layer=3).layer == 3  # after Qwen3-VL's deepstack layers
    assert dycoke.decode_stage(28, 1000, 0.5).keep == 500 and dycoke.decode_stage(28, 1000, 1.0).keep == 1000
    assert METHODS["dycoke"].decode_prune is dycoke.decode_stage


def video_inputs(adapter, frames=8):
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * frames, (4 * px, 6 * px), adapter.grid)
    inputs = adapter.build_inputs(chat_prompt(adapter), synthetic_video(frames), plan)
    return inputs, torch.nonzero(inputs["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE).flatten()


def generate(adapter, inputs, pruner, steps=4):
    with pruner.attached():
        _, tokens = adapter.generate_ids(inputs, max_new_tokens=steps, **pruner.generate_kwargs())
    return tokens


@pytest.mark.parametrize("backbone", BACKBONES)
def test_the_first_steps_selection_is_the_eager_maps_top_k(eager_adapters, backbone):
    """The reference rule: at the first decoding step, the visual tokens the current token attends
    to most in layer K - 1 (mean over heads, over every key) are the ones layers K on attend to."""
    adapter = eager_adapters[backbone]
    inputs, visual = video_inputs(adapter)
    stage = DecodeStage(layer=3, keep=10, threshold=0.9)
    pruner = DecodePruner(adapter.model.model.language_model, stage, visual)
    tokens = generate(adapter, inputs, pruner, steps=2)
    (step, kept), *_ = pruner.selections
    assert step == 1 and len(kept) == 10
    assert pruner.seconds() > 0 and len(pruner.work.spans) == 1  # one decoding step ranked (rank_s)
    # the map of the prompt plus the first generated token: its last row is the first decoding step's query
    longer = dict(inputs, input_ids=torch.cat([inputs["input_ids"], tokens[None, :1]], dim=1))
    longer["attention_mask"] = torch.ones_like(longer["input_ids"])
    longer["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(tokens[None, :1])], dim=1)
    if "position_ids" in inputs:  # a text token after the prompt: one past its largest position
        positions = inputs["position_ids"]
        longer["position_ids"] = torch.cat([positions, positions.amax(dim=-1, keepdim=True) + 1], dim=-1)
    adapter.model.model.rope_deltas = None
    with torch.no_grad():
        out = adapter.model(**longer, output_attentions=True)
    row = out.attentions[stage.layer - 1][0, :, -1].mean(dim=0)
    assert set(kept.tolist()) == set(visual[torch.topk(row[visual], 10).indices].tolist())
    assert pruner.keys_dropped == len(pruner.selections) * (len(visual) - 10) * (12 - stage.layer)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_a_stage_keeping_every_token_equals_vanilla_and_a_mask_changes_nothing(
    adapters,
    eager_adapters,
    backbone,
):
    inputs, visual = video_inputs(adapters[backbone])
    vanilla = adapters[backbone].generate_ids(inputs, max_new_tokens=6)[1]
    everything = DecodePruner(adapters[backbone].model.model.language_model, DecodeStage(3, len(visual), 0.9), visual)
    assert torch.equal(generate(adapters[backbone], inputs, everything, steps=6), vanilla)
    # eager attention takes a mask, cut to the selected columns; SDPA (causal, no mask) answers the same
    answers = []
    for pool in (adapters, eager_adapters):
        pruner = DecodePruner(pool[backbone].model.model.language_model, DecodeStage(3, 5, 0.9), visual)
        answers.append((generate(pool[backbone], inputs, pruner, steps=6).tolist(), pruner.selections[0][1].tolist()))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("backbone", BACKBONES)
def test_dycoke_at_r_1_answers_as_vanilla(adapters, fixtures_dir, backbone):
    adapter, request = adapters[backbone], video_request(adapters[backbone], fixtures_dir)
    runs = {}
    for method, retention in (("vanilla", None), ("dycoke", 1.0)):
        config = VideoPipelineConfig(method=method, max_num_frames=8, budget=BudgetSpec(retention=retention))
        runs[method] = VideoPipeline(adapter, config).run(request)
    (text, record), (vanilla_text, vanilla) = runs["dycoke"], runs["vanilla"]
    assert record.error is None and text == vanilla_text and record.achieved_retention == 1.0
    assert record.decode_flops == vanilla.decode_flops  # no decoding step left a key out


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("retention", [0.25, 0.1])
def test_dycoke_keeps_ttms_retention_and_saves_decoding_flops(adapters, fixtures_dir, backbone, retention):
    adapter = adapters[backbone]
    config = VideoPipelineConfig(method="dycoke", max_num_frames=8, budget=BudgetSpec(retention=retention))
    request = video_request(adapter, fixtures_dir)
    _, record = VideoPipeline(adapter, config).run(request)
    assert record.error is None and record.output_tokens == 4 and record.layer_visual_tokens is None
    assert record.visual_tokens == len(record.merged_sizes) == int(record.reference_tokens * retention + 1e-9)
    assert retention - 0.01 <= record.achieved_retention <= retention
    # the same tokens with every decoding step attending to all of them cost more: at least the first
    # step re-selects, dropping n - keep keys in each layer from the stage on (4 FLOPs per key, head and dim)
    text = dims_from_config(adapter.model.config).text
    stage = dycoke.decode_stage(12, record.visual_tokens, retention, adapter.first_prunable_layer)
    dropped = (record.visual_tokens - stage.keep) * (12 - stage.layer)
    unpruned = decode_flops(text, record.input_tokens, record.output_tokens)
    assert record.decode_flops <= unpruned - 4 * dropped * text.heads * text.head_dim
