"""Compressors with their own stage inside the LLM (PruneVid, HoliTom): the joint budget solved by
hand, PruneVid's question-attention ranking against the reference's unrotated, unmasked map, HoliTom's in-order
merging against the reference's loop, R=1 equal to vanilla, and layer-averaged budgets through the
pipeline on both tiny backbones."""

import pytest
import torch

from resadapt_eval.backbones.layer_pruning import LayerPruner, merge_into_nearest, text_attention
from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE
from resadapt_eval.baselines import holitom, prunevid
from resadapt_eval.baselines.inside_llm import TEXT_AFTER_VISUAL, Stage, entering_tokens, layer_counts
from resadapt_eval.budget.plan import InfeasibleBudget, plan_from_scales
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.methods import METHODS
from resadapt_eval.pipeline import VideoPipeline, VideoPipelineConfig

from .helpers import BACKBONES, attention_input, chat_prompt, first_logits_and_text, synthetic_video, video_request

TWO_STAGE = [name for name, m in METHODS.items() if m.compress is not None and m.prune is not None]


def test_the_two_stage_methods_are_prunevid_holitom_and_mustdrop():
    assert TWO_STAGE == ["prunevid", "holitom", "mustdrop"]


def test_stage_depths_and_shares_by_hand():
    # PruneVid: the first layer without the pruned tokens is 11 of 32; floor(0.4 n) stay
    assert prunevid.stages(32, 1000, 0.25) == [Stage(11, 400, rank_by=TEXT_AFTER_VISUAL)]
    assert prunevid.stages(28, 1000, 0.25)[0].layer == 10 and prunevid.stages(12, 1000, 0.25)[0].layer == 4
    assert prunevid.stages(12, 1000, 0.6)[0].keep == 600 and prunevid.stages(12, 1000, 1.0)[0].keep == 1000
    assert prunevid.stages(36, 1000, 0.25, first_layer=3)[0].layer == 12  # round(11 * 36 / 32) = 12
    # HoliTom: merge before layer 18 of 28, round(0.5 n) stay
    assert holitom.stages(28, 1001, 0.25) == [Stage(18, 500, merge=True)]  # round(500.5) = 500, as Python's round
    assert holitom.stages(12, 1000, 0.25)[0].layer == 8 and holitom.stages(12, 1000, 1.0)[0].keep == 1000


def test_the_tokens_entering_the_llm_by_hand():
    # 12 layers, PruneVid's stage at 4 keeps floor(0.4 n): the layer sum 4 n + 8 floor(0.4 n) may reach
    # R N L = 0.25 * 1000 * 12 = 3000. n = 417: 1668 + 8 * 166 = 2996; n = 418: 1672 + 8 * 167 = 3008.
    assert entering_tokens(prunevid.stages, 0.25, 1000, 4, 12, None, 0) == 417
    # HoliTom at 8 of 12 keeps round(0.5 n): 8 n + 4 round(n / 2) <= 3000 -> n = 300 (2400 + 600)
    assert entering_tokens(holitom.stages, 0.25, 1000, 4, 12, None, 0) == 300
    assert entering_tokens(holitom.stages, 1.0, 1000, 4, 12, None, 0) == 1000  # R = 1 keeps every token
    with pytest.raises(InfeasibleBudget, match="entering the LLM"):  # 40 pairs of at least one token each
        entering_tokens(prunevid.stages, 0.01, 1000, 40, 12, None, 0)


def test_merging_equals_the_reference_loop():
    torch.manual_seed(0)
    hidden = torch.randn(1, 12, 8, dtype=torch.float64)
    kept, dropped = torch.tensor([1, 4, 7]), torch.tensor([2, 3, 5, 6, 8, 9])
    expected = hidden.clone()  # HoliTom's loop: each dropped token, in order, halves into its most similar kept one
    for i in dropped.tolist():
        similarity = torch.nn.functional.cosine_similarity(hidden[0, i][None], hidden[0, kept], dim=-1)
        j = int(kept[similarity.argmax()])
        expected[0, j] = (expected[0, j] + hidden[0, i]) / 2
    torch.testing.assert_close(merge_into_nearest(hidden, kept, dropped), expected)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_prunevid_ranks_by_the_texts_unrotated_unmasked_attention(eager_adapters, backbone):
    """PruneVid's rule in a real forward: the visual tokens with the highest attention from the text after the
    video in layer K - 1 (max over heads and those tokens), on the map the reference returns,
    `attn_weights_wo_pos` (Visual-AI/PruneVid@b12600c models/pllava/llama.py :445-449, :514): q k^T / sqrt(d)
    of the attention input's projections with no rotary and no causal mask, softmax in float32 cast to the
    model's dtype. Not the model's own eager map (rotary and causal), which ranks otherwise."""
    adapter = eager_adapters[backbone]
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * 8, (4 * px, 6 * px), adapter.grid)
    inputs = adapter.build_inputs(chat_prompt(adapter), synthetic_video(8), plan)
    adapter.model.model.rope_deltas = None
    with torch.no_grad():
        out = adapter.model(**inputs, output_attentions=True)
    visual = torch.nonzero(inputs["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE).flatten()
    after = int(visual.max()) + 1
    k_layer, keep = 4, 10
    language_model = adapter.model.model.language_model
    attention = language_model.layers[k_layer - 1].self_attn
    states, (cos, sin) = attention_input(adapter, inputs, k_layer - 1)
    with torch.no_grad():  # the reference's map, written out on the whole sequence
        d, length = attention.head_dim, states.shape[1]
        q, k = attention.q_proj(states).view(length, -1, d), attention.k_proj(states).view(length, -1, d)
        if hasattr(attention, "q_norm"):
            q, k = attention.q_norm(q), attention.k_norm(k)
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        wo_pos = torch.softmax(q @ k.transpose(1, 2) / d**0.5, dim=-1, dtype=torch.float32).to(q.dtype)
    reference = wo_pos[:, after:].amax(dim=(0, 1))  # (L,)
    expected = set(visual[torch.topk(reference[visual], keep).indices].tolist())
    eager = out.attentions[k_layer - 1][0, :, after:].amax(dim=(0, 1))  # the model's map: rotary, causal
    assert set(visual[torch.topk(eager[visual], keep).indices].tolist()) != expected

    pruner = LayerPruner(language_model, [Stage(k_layer, keep, rank_by=TEXT_AFTER_VISUAL)], visual)
    adapter.model.model.rope_deltas = None
    with torch.no_grad(), pruner.attached():
        adapter.model(**inputs)
    assert set(pruner.kept_by_layer[k_layer].tolist()) & set(visual.tolist()) == expected
    with torch.no_grad():
        ours = text_attention(attention, states, cos, sin, after)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", TWO_STAGE)
def test_at_r_1_both_stages_equal_vanilla(adapters, backbone, method):
    adapter = adapters[backbone]
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * 8, (4 * px, 6 * px), adapter.grid)
    prompt, video = chat_prompt(adapter), synthetic_video(8)
    spec = METHODS[method]
    inputs, sizes = adapter.build_compressed_inputs(
        prompt, video, plan, spec.compress, 1.0, needs_attention=spec.needs_attention
    )
    pruned = adapter.build_pruned_inputs(inputs, spec.prune, 1.0, None)
    assert len(sizes) == plan.visual_tokens and set(pruned.pruner.layer_tokens) == {plan.visual_tokens}
    with pruned.pruner.attached():
        ours, ours_tokens = first_logits_and_text(adapter, inputs)
    vanilla, vanilla_tokens = first_logits_and_text(adapter, adapter.build_inputs(prompt, video, plan))
    assert (ours - vanilla).abs().max().item() <= 1e-5
    assert torch.equal(ours_tokens, vanilla_tokens)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", TWO_STAGE)
@pytest.mark.parametrize("retention", [0.25, 0.1])
def test_layer_averaged_budgets_over_both_stages(adapters, fixtures_dir, backbone, method, retention):
    adapter = adapters[backbone]
    config = VideoPipelineConfig(method=method, max_num_frames=8, budget=BudgetSpec(retention=retention))
    _, record = VideoPipeline(adapter, config).run(video_request(adapter, fixtures_dir))
    assert record.error is None and record.output_tokens == 4
    n, layers = record.reference_tokens, record.layer_visual_tokens
    stages = METHODS[method].prune(12, record.visual_tokens, retention, None, adapter.first_prunable_layer)
    # the compressor's tokens enter; each stage keeps its share of them from its layer on
    assert record.visual_tokens == len(record.merged_sizes) < n
    assert layers == layer_counts(stages, 12, record.visual_tokens)
    fewest = METHODS[method].compressor.fewest([tuple(g) for g in record.grids])  # one a pair, or MustDrop's
    assert record.visual_tokens == entering_tokens(
        METHODS[method].prune, retention, n, fewest, 12, None, adapter.first_prunable_layer
    )
    assert record.achieved_retention == sum(layers) / 12 / n
    assert retention - 0.01 <= record.achieved_retention <= retention
