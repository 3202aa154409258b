"""Pruning inside the LLM (FastV, PyramidDrop) on the tiny 12-layer backbones: layer-averaged
budgets solved by hand, the ranking against eager attention maps, R=1 equal to vanilla, kept tokens
at their original rotary positions, and the same answers with and without an attention mask."""

import math

import pytest
import torch

from resadapt_eval.backbones.layer_pruning import LayerPruner, last_token_attention
from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE
from resadapt_eval.backbones.qwen import PrunedInputs
from resadapt_eval.baselines import fastv, pyramiddrop
from resadapt_eval.baselines.framefusion import total_budget
from resadapt_eval.baselines.inside_llm import Stage, layer_average, layer_counts
from resadapt_eval.budget.plan import InfeasibleBudget, plan_from_scales
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.kinds import IN_LLM_PRUNER
from resadapt_eval.methods import METHODS
from resadapt_eval.pipeline import VideoPipeline, VideoPipelineConfig

from .helpers import (
    BACKBONES,
    attention_input,
    chat_prompt,
    early_prune_layers,
    first_logits_and_text,
    synthetic_video,
    video_request,
)

# every in-LLM pruner, at stage layers low enough for R=0.1 on 12 layers
PRUNERS = {name: early_prune_layers(m) for name, m in METHODS.items() if m.kind is IN_LLM_PRUNER}


def test_fastv_keep_count_by_hand():
    # 28 layers, K=2, N=1000, R=0.25: k = floor((0.25 * 28 - 2) * 1000 / 26) = floor(192.3) = 192
    (stage,) = fastv.stages(28, 1000, 0.25)
    assert stage == Stage(2, 192)
    assert layer_average([stage], 28, 1000) == (2 * 1000 + 26 * 192) / 28000 <= 0.25
    # below 2 full layers and one token in the other 26 nothing is reachable
    with pytest.raises(InfeasibleBudget, match="FastV pruning after layer 2"):
        fastv.stages(28, 1000, 0.07)
    assert fastv.stages(28, 1000, 0.25, first_layer=3) == [Stage(3, math.floor((7 - 3) * 1000 / 25))]
    with pytest.raises(ValueError, match=r"must lie in \[3, 27\]"):
        fastv.stages(28, 1000, 0.25, layers=[2], first_layer=3)  # before Qwen3-VL's deepstack layers end


def test_pyramiddrop_lambda_by_hand():
    assert pyramiddrop.default_layers(32) == [8, 16, 24] and pyramiddrop.default_layers(28) == [7, 14, 21]
    # 32 layers in four equal stages: average (1000 + c1 + c2 + c3) / 4000 with c_i = floor(l^i 1000),
    # at most 0.5 while c1 + c2 + c3 <= 1000. The real root of l^3 + l^2 + l = 1 is 0.54369 (543 +
    # 295 + 160 = 998); the largest l still within is in [0.54401, 0.54406): l^3 >= 0.161 and
    # l^2 < 0.296 give 544 + 295 + 161 = 1000, R = 0.5 exactly.
    stages = pyramiddrop.stages(32, 1000, 0.5)
    assert [s.layer for s in stages] == [8, 16, 24]
    assert [s.keep for s in stages] == [544, 295, 161]
    assert layer_counts(stages, 32, 1000) == [1000] * 8 + [544] * 8 + [295] * 8 + [161] * 8
    assert layer_average(stages, 32, 1000) == 0.5
    with pytest.raises(InfeasibleBudget, match="0.25"):  # its first quarter sees every token
        pyramiddrop.stages(32, 1000, 0.25)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_ranking_is_the_last_tokens_row_of_the_eager_attention_map(eager_adapters, fixtures_dir, backbone):
    """FastV's rule, from the model's own attention maps: the top-k visual tokens by the last
    token's attention in layer K - 1 (mean over heads) are the ones kept at layer K, and the kept
    tokens enter layer K with their original rotary cos/sin."""
    adapter = eager_adapters[backbone]
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * 8, (4 * px, 6 * px), adapter.grid)
    inputs = adapter.build_inputs(chat_prompt(adapter), synthetic_video(8), plan)
    adapter.model.model.rope_deltas = None
    with torch.no_grad():
        out = adapter.model(**inputs, output_attentions=True)
    visual = torch.nonzero(inputs["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE).flatten()
    k_layer, keep = 2, 10
    row = out.attentions[k_layer - 1][0, :, -1].mean(dim=0)  # (L,) the reference rule
    expected = set(visual[torch.topk(row[visual], keep).indices].tolist())

    language_model = adapter.model.model.language_model
    pruner = LayerPruner(language_model, [Stage(k_layer, keep)], visual)
    seen = {}

    def capture(module, args, kwargs):
        seen["hidden"], seen["rotary"] = (args[0] if args else kwargs["hidden_states"]), kwargs["position_embeddings"]

    def capture_full(module, args, kwargs):
        seen.setdefault("full_rotary", kwargs["position_embeddings"])

    hooks = [
        language_model.layers[k_layer].self_attn.register_forward_pre_hook(capture, with_kwargs=True),
        language_model.layers[0].self_attn.register_forward_pre_hook(capture_full, with_kwargs=True),
    ]
    try:
        adapter.model.model.rope_deltas = None
        with torch.no_grad(), pruner.attached():
            adapter.model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    kept = pruner.kept_by_layer[k_layer]
    assert pruner.layer_tokens == [len(visual)] * k_layer + [keep] * (12 - k_layer)
    assert set(kept.tolist()) & set(visual.tolist()) == expected
    assert seen["hidden"].shape[1] == inputs["input_ids"].shape[1] - len(visual) + keep
    for ours, full in zip(seen["rotary"], seen["full_rotary"], strict=True):  # cos, sin
        assert torch.equal(ours, full[:, kept])  # each kept token at its original position
    # and our row equals the eager map's
    states, (cos, sin) = attention_input(adapter, inputs, k_layer - 1)
    with torch.no_grad():
        ours = last_token_attention(language_model.layers[k_layer - 1].self_attn, states, cos, sin)
    assert torch.allclose(ours, row, atol=1e-6)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", list(PRUNERS))
def test_at_r_1_pruning_inside_equals_vanilla(adapters, backbone, method):
    adapter = adapters[backbone]
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * 8, (4 * px, 6 * px), adapter.grid)
    inputs = adapter.build_inputs(chat_prompt(adapter), synthetic_video(8), plan)
    pruned = adapter.build_pruned_inputs(inputs, METHODS[method].prune, 1.0, None)
    with pruned.pruner.attached():
        ours, ours_tokens = first_logits_and_text(adapter, inputs)
    vanilla, vanilla_tokens = first_logits_and_text(adapter, inputs)
    assert (ours - vanilla).abs().max().item() <= 1e-5
    assert torch.equal(ours_tokens, vanilla_tokens)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", list(PRUNERS))
@pytest.mark.parametrize("retention", [0.25, 0.1])
def test_layer_averaged_budgets_and_the_same_answers_with_a_mask(
    adapters, eager_adapters, fixtures_dir, backbone, method, retention
):
    """Through the pipeline: every visual token enters the LLM, the layer average is the most within
    R (and within 0.01 of it), decoding runs on the pruned KV cache, and eager attention (which
    takes a mask we slice) answers exactly as SDPA (causal, no mask)."""
    answers = []
    for pool in (adapters, eager_adapters):
        adapter = pool[backbone]
        config = VideoPipelineConfig(
            method=method, max_num_frames=8, budget=BudgetSpec(retention=retention), prune_layers=PRUNERS[method]
        )
        text, record = VideoPipeline(adapter, config).run(video_request(adapter, fixtures_dir))
        assert record.error is None and record.output_tokens == 4
        n = record.reference_tokens
        assert record.visual_tokens == n and len(record.layer_visual_tokens) == 12
        assert record.layer_visual_tokens[0] == n and min(record.layer_visual_tokens) >= 1
        assert record.achieved_retention == record.layer_averaged_tokens / n
        assert retention - 0.01 <= record.achieved_retention <= retention
        answers.append((text, record.layer_visual_tokens))
    assert answers[0] == answers[1]


def test_pruning_inside_the_llm_is_refused_where_it_cannot_run(adapters):
    assert isinstance(
        adapters["qwen25vl"].build_pruned_inputs(
            adapters["qwen25vl"].build_inputs(
                chat_prompt(adapters["qwen25vl"]),
                synthetic_video(4),
                plan_from_scales([1.0] * 4, (56, 56), adapters["qwen25vl"].grid),
            ),
            fastv.stages,
            0.5,
            None,
        ),
        PrunedInputs,
    )
    with pytest.raises(ValueError, match="prune_layers= is only used by methods that prune inside the LLM"):
        VideoPipelineConfig(method="tome", budget=BudgetSpec(retention=0.25), prune_layers="2")
    with pytest.raises(ValueError, match="comma-separated layer indices"):
        VideoPipelineConfig(method="fastv", budget=BudgetSpec(retention=0.25), prune_layers="two")


@pytest.mark.parametrize("backbone", BACKBONES)
def test_dart_keeps_the_same_tokens_under_sdpa_and_eager(adapters, eager_adapters, backbone):
    """DART reads no attention weights: SDPA (no mask) and eager attention keep the same tokens, in
    float32, and the first logits agree."""
    kept, logits = [], []
    for pool in (adapters, eager_adapters):
        adapter = pool[backbone]
        px = adapter.grid.token_px
        plan = plan_from_scales([1.0] * 8, (4 * px, 6 * px), adapter.grid)
        inputs = adapter.build_inputs(chat_prompt(adapter), synthetic_video(8, seed=3), plan)
        pruned = adapter.build_pruned_inputs(inputs, METHODS["dart"].prune, 0.25, [2])
        with pruned.pruner.attached():
            first, _ = first_logits_and_text(adapter, inputs)
        kept.append(pruned.pruner.kept_by_layer[2])
        logits.append(first)
        visual = adapter.visual_positions(inputs)
        (stage,) = pruned.pruner.schedule
        assert len(set(kept[-1].tolist()) & set(visual.tolist())) == stage.keep < len(visual)
    assert torch.equal(kept[0], kept[1])
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backbone", BACKBONES)
def test_at_r_1_framefusion_equals_vanilla(adapters, backbone):
    """At R = 1 every token fits the budget: FrameFusion's first merging layer merges none and ends."""
    adapter = adapters[backbone]
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * 8, (4 * px, 6 * px), adapter.grid)
    inputs = adapter.build_inputs(chat_prompt(adapter), synthetic_video(8), plan)
    visual = len(adapter.visual_positions(inputs))
    pruned = adapter.fusion_inputs(inputs, total_budget(1.0, adapter.num_text_layers, visual))
    with pruned.pruner.attached():
        ours, ours_tokens = first_logits_and_text(adapter, inputs)
    vanilla, vanilla_tokens = first_logits_and_text(adapter, inputs)
    assert pruned.pruner.layer_tokens == [visual] * adapter.num_text_layers
    assert (ours - vanilla).abs().max().item() <= 1e-5
    assert torch.equal(ours_tokens, vanilla_tokens)
