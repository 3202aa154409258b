"""Token compressors on the tiny fp32 backbones: budgets, positions, merging, equality at R=1."""

import math
from fractions import Fraction

import pytest
import torch

from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE
from resadapt_eval.backbones.vision_attention import last_block_input
from resadapt_eval.baselines import VisualTokens, kept_count, mustdrop
from resadapt_eval.baselines.common import per_pair_budget
from resadapt_eval.budget.plan import InfeasibleBudget
from resadapt_eval.methods import AFTER_MERGER
from resadapt_eval.methods import METHODS as REGISTRY

from .helpers import BACKBONES, first_logits_and_text, vanilla_setup

# vLLM's own VidCom2 (`vidcom2_engine`, vLLM classes only): tests/test_fidelity_vidcom2_engine.py
METHODS = sorted(name for name, m in REGISTRY.items() if m.stage == AFTER_MERGER and m.hf)


def compressed(adapter, method, retention, seed=0, num_frames=8):
    prompt, v, plan = vanilla_setup(adapter, num_frames)
    inputs, sizes = adapter.build_compressed_inputs(
        prompt,
        v,
        plan,
        REGISTRY[method].compress,
        retention,
        seed=seed,
        needs_attention=REGISTRY[method].needs_attention,
        query=adapter.question_embeddings("Which colour is the square?") if REGISTRY[method].needs_query else None,
    )
    full = adapter.build_inputs(prompt, v, plan)
    return inputs, sizes, full, plan


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", METHODS)
def test_at_r_1_every_method_equals_vanilla(adapters, backbone, method):
    adapter = adapters[backbone]
    inputs, sizes, full, plan = compressed(adapter, method, 1.0)
    assert sizes.tolist() == [1] * plan.visual_tokens
    ours, ours_tokens = first_logits_and_text(adapter, inputs)
    vanilla, vanilla_tokens = first_logits_and_text(adapter, full)
    assert (ours - vanilla).abs().max().item() <= 1e-5
    assert torch.equal(ours_tokens, vanilla_tokens)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("retention", [0.25, 0.1])
def test_budgets_and_positions_at_low_retention(adapters, backbone, method, retention):
    adapter = adapters[backbone]
    _, _, plan = vanilla_setup(adapter, 9)
    merged_at_most = 8 * len(mustdrop.windows(plan.grids, "cpu"))  # MustDrop's vision stage: 8 a whole 3x3 window
    if method == "mustdrop" and math.floor(retention * plan.visual_tokens) < plan.visual_tokens - merged_at_most:
        with pytest.raises(InfeasibleBudget, match=f"MustDrop's merge of {merged_at_most // 8} whole 3x3 windows"):
            compressed(adapter, method, retention, num_frames=9)
        return
    inputs, sizes, full, plan = compressed(adapter, method, retention, num_frames=9)
    n = plan.visual_tokens
    expected = max(len(plan.grids), math.floor(Fraction(str(retention)) * n))  # never above the target R
    video_tokens = int((inputs["mm_token_type_ids"] == VIDEO_TOKEN_TYPE).sum())
    assert video_tokens == expected == len(sizes)
    assert inputs["mm_encoder_outputs"]["video"].pooler_output[0].shape[0] == expected
    assert int(sizes.sum()) <= n

    full_positions = adapter.full_positions(full)
    full_video = torch.nonzero(full["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE).flatten()
    kept_video = inputs["position_ids"][..., inputs["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE]
    # every kept token sits at one of the vanilla video positions, in order
    vanilla_video = full_positions[..., full_video]
    columns = {tuple(vanilla_video[:, 0, j].tolist()): j for j in range(vanilla_video.shape[-1])}
    order = [columns[tuple(kept_video[:, 0, j].tolist())] for j in range(kept_video.shape[-1])]
    assert order == sorted(order) and len(set(order)) == expected
    # text before and after the video keeps its vanilla positions
    text = full["mm_token_type_ids"][0] != VIDEO_TOKEN_TYPE
    assert torch.equal(
        inputs["position_ids"][..., inputs["mm_token_type_ids"][0] != VIDEO_TOKEN_TYPE], full_positions[..., text]
    )
    text_ids = full["input_ids"][0][text]
    assert torch.equal(inputs["input_ids"][0][inputs["mm_token_type_ids"][0] != VIDEO_TOKEN_TYPE], text_ids)
    _, generated = first_logits_and_text(adapter, inputs, steps=3)
    assert generated.numel() == 3


@pytest.mark.parametrize("backbone", BACKBONES)
def test_tome_merges_rather_than_drops(adapters, backbone):
    inputs, sizes, _, plan = compressed(adapters[backbone], "tome", 0.25)
    assert int(sizes.sum()) == plan.visual_tokens
    assert sizes.max() > 1


def test_random_drop_is_reproducible_by_seed(adapters):
    adapter = adapters["qwen25vl"]
    a, _, _, _ = compressed(adapter, "random_drop", 0.25, seed=1)
    b, _, _, _ = compressed(adapter, "random_drop", 0.25, seed=1)
    c, _, _, _ = compressed(adapter, "random_drop", 0.25, seed=2)
    assert torch.equal(a["position_ids"], b["position_ids"])
    assert not torch.equal(a["position_ids"], c["position_ids"])


def test_kept_count_and_pair_budgets():
    assert kept_count(0.25, 400, 4) == 100
    assert kept_count(0.01, 400, 4) == 4  # the floor: one token per pair
    assert kept_count(1.0, 400, 4) == 400
    assert per_pair_budget([10, 20, 30], 12) == [2, 4, 6]
    assert sum(per_pair_budget([7, 7, 7], 10)) == 10
    assert per_pair_budget([100, 1], 3) == [2, 1]


def test_compressors_on_hand_made_tokens():
    # Pair 0: tokens 0-3 with 0 and 1 identical; pair 1: tokens 4-7.
    feats = torch.tensor(
        [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.7, 0.7], [1.0, 0.1], [0.1, 1.0], [-1.0, 0.0], [0.0, -1.0]]
    )
    tokens = VisualTokens(
        features=feats,
        pair_sizes=[4, 4],
        grids=[(1, 2, 2), (1, 2, 2)],
        received_attention=torch.tensor([0.1, 0.2, 0.9, 0.3, 0.5, 0.1, 0.2, 0.8]),
    )
    # ToMe at 3 of 4 per pair: first merges the most similar edge, identical tokens 0 -> 1
    tome = REGISTRY["tome"].compress(tokens, 6).assignment
    assert tome[0].item() == 1 and len(set(tome.tolist())) == 6
    # VisionZip with one token per pair keeps the most attended one
    with_keys = VisualTokens(feats, tokens.pair_sizes, tokens.grids, tokens.received_attention, keys=feats)
    vz = REGISTRY["visionzip"].compress(with_keys, 2).assignment
    assert sorted(set(vz.tolist()) - {-1}) == [2, 7]
    assert (vz[[0, 1, 3, 4, 5, 6]] == -1).all()


def test_qwen25vl_window_order_is_undone(adapters):
    """The merger applied to the last block's output (window order), re-indexed with
    `unit_order`, is exactly the vision tower's merged output (LLM order)."""
    adapter = adapters["qwen25vl"]
    prompt, v, plan = vanilla_setup(adapter)
    full = adapter.build_inputs(prompt, v, plan)
    captured = {}
    hook = adapter.model.model.visual.blocks[-1].register_forward_hook(lambda m, a, out: captured.update(out=out))
    with torch.no_grad():
        merged = torch.cat(
            adapter.model.model.get_video_features(
                full["pixel_values_videos"], full["video_grid_thw"], return_dict=True
            ).pooler_output
        )
        window_merged = adapter.model.model.visual.merger(captured["out"])
    hook.remove()
    order = adapter.unit_order(full["video_grid_thw"])
    assert not torch.equal(order, torch.arange(len(order)))  # the windows really reorder here
    assert torch.allclose(window_merged[order], merged, atol=1e-6)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_received_attention_is_a_distribution_per_attention_segment(adapters, backbone):
    adapter = adapters[backbone]
    prompt, v, plan = vanilla_setup(adapter)
    full = adapter.build_inputs(prompt, v, plan)
    with torch.no_grad():
        with last_block_input(adapter.model) as captured:
            adapter.model.model.get_video_features(
                full["pixel_values_videos"], full["video_grid_thw"], return_dict=True
            )
        received, _ = adapter.last_block_scores(captured, full["video_grid_thw"])
    assert received.shape == (plan.visual_tokens,) and (received > 0).all()
    # Softmax rows sum to 1 within each attention segment; averaged over 4-patch units the
    # total is (segments) / 4.
    segments = len(captured["cu_seqlens"]) - 1
    assert received.sum().item() == pytest.approx(segments / 4, rel=1e-4)
