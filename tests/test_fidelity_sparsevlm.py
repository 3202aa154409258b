"""Fidelity of SparseVLM (`baselines/sparsevlm.py`) against the Qwen2.5-VL port LightCompress runs,
ModelTC/LightCompress@9701d035, llmc/compression/token_reduction/sparsevlm.py (the same rule as the authors'
LLaVA code, Gumpest/SparseVLMs@26a5f48 llava/model/language_model/modelling_sparse_llama.py:186-320).

The reference, written out by hand below (lines of LightCompress's file), independently of our module:
- :114-119 the raters: v t^T of the LLM's input embeddings, softmax over the text, mean over the visual tokens,
  the text tokens above its mean;
- :366-424 the pruning layer's attention (q/k projections, rotary, causal mask, softmax over every key), which
  is the eager attention map of that layer; :566-604 mean over heads, the raters' rows and the visual columns,
  mean over the raters, top min(k, n - 1);
- :207-346 after the layer: the dropped tokens, the int(0.3 p) + 1 of highest relation, clustered on the
  layer's output by DPC-kNN (:658-728) into int(m / 10) + 1 merged tokens at their centres' positions.

Documented differences, and how they are tested here:
- the merged tokens stay at their centres' places in the sequence (the reference appends them after the kept
  visual tokens): the kept prompt positions and each token's state are compared as sets keyed by position;
- the DPC-kNN's random density noise (1e-6, a tie-breaker) is left out of both. Densities tie where one cluster
  is formed (k = 1 reaches each token itself: every density is 1): the reference's noise then picks the centre at
  random, ours is the first member (the best ranked); the merged token is the same. Mutual nearest pairs tie at
  k = 2: without the noise both rules leave them tied (our distances are made exactly symmetric, as the
  differences' norms are); distances by one matmul (ours) against the reference's difference norms, in float64 here;
- ranking attention softmaxed in float32 (ours) against the float64 eager map: identical kept tokens, scores
  within 1e-6.
"""

import math

import pytest
import torch

from resadapt_eval.baselines import sparsevlm
from resadapt_eval.baselines.inside_llm import RATERS, Stage, layer_average

from .helpers import BACKBONES, plain_run, pruned_run, random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CASES = 40


# ------------------------------------------------------------------ the reference, by hand
def reference_raters(hidden, v_token_start, text_token_start):
    """:114-119 (`register_module_paras`): the raters' indices among the text after the image."""
    v_t = hidden[:, v_token_start:text_token_start, :]
    t_t = hidden[:, text_token_start:, :]
    m_v_t = v_t @ t_t.transpose(1, 2)
    m_v_t = m_v_t.softmax(2).mean(1)
    return torch.where(m_v_t > m_v_t.mean())


def reference_topk(attn, v_token_start, v_token_num, text_token_start, t_token_idx, retained):
    """:578-604 (`attn_postprocess_topk`) with the table's count given: (mask, relation_vis_text)."""
    attn = attn.mean(1)
    idx = t_token_idx[1] + text_token_start
    relation_vis_text = attn[:, idx, v_token_start : v_token_start + v_token_num].mean(1)
    mask = torch.zeros_like(relation_vis_text, dtype=bool)
    _, indices = torch.topk(relation_vis_text, min(retained, v_token_num - 1), dim=1)
    mask[0][indices] = 1
    return mask, relation_vis_text


def reference_cluster_and_merge(x, cluster_num):
    """:658-728 (`cluster_and_merge`), its density noise (:671-672) left out."""
    B, N, C = x.shape
    x1, x2 = x[:, :, None, :], x[:, None, :, :]  # ein.rearrange 'b l r -> b l () r' / 'b () l r'
    dist_matrix = (x1 - x2).norm(dim=-1, p=2) / (C**0.5)
    dist_nearest, _ = torch.topk(dist_matrix, k=cluster_num, dim=-1, largest=False)
    density = (-(dist_nearest**2).mean(dim=-1)).exp()
    mask = (density[:, None, :] > density[:, :, None]).type(x.dtype)
    dist_max = dist_matrix.flatten(1).max(dim=-1)[0][:, None, None]
    dist, _ = (dist_matrix * mask + dist_max * (1 - mask)).min(dim=-1)
    score = dist * density
    _, index_down = torch.topk(score, k=cluster_num, dim=-1)
    if cluster_num == 1:  # every density is 1: the noise picks the centre at random; the documented rule, the first
        index_down = torch.zeros_like(index_down)
    idx_cluster = dist_matrix[0][index_down[0]][None].argmin(dim=1)  # index_points, B = 1
    idx_cluster[0, index_down[0]] = torch.arange(cluster_num)
    token_weight = x.new_ones(B, N, 1)
    idx = idx_cluster + torch.arange(B)[:, None] * cluster_num
    all_weight = token_weight.new_zeros(B * cluster_num, 1)
    all_weight.index_add_(dim=0, index=idx.reshape(B * N), source=token_weight.reshape(B * N, 1))
    all_weight = all_weight + 1e-6
    norm_weight = token_weight / all_weight[idx]
    x_merged = x.new_zeros(B * cluster_num, C)
    x_merged.index_add_(dim=0, index=idx.reshape(B * N), source=(x * norm_weight).reshape(B * N, C))
    return x_merged.reshape(B, cluster_num, C), index_down


def reference_stage(attn, layer_output, v_token_start, v_token_num, t_token_idx, retained):
    """:229-317 (`decoder_attn_hook`, B = 1, merging on): {prompt position: state} of the visual tokens after
    the layer: the kept ones, and the merged ones at their centres' positions."""
    text_token_start = v_token_start + v_token_num
    pred_score_vis, relation_vis_text = reference_topk(
        attn, v_token_start, v_token_num, text_token_start, t_token_idx, retained
    )
    policy = torch.ones(1, layer_output.shape[1])
    policy[:, v_token_start:text_token_start] = pred_score_vis.double()
    total_sparse_token_idx = torch.where(policy == 0)[1].unsqueeze(0)
    total_sparse_token = layer_output[:, total_sparse_token_idx[0]]
    merge_token_idx_stage1 = torch.where(pred_score_vis == 0)[1]
    merge_token_stage1 = relation_vis_text[0][merge_token_idx_stage1]
    merge_token_num_stage1 = int(merge_token_idx_stage1.shape[0] * 0.3) + 1
    merge_token_stage2_idx = merge_token_stage1.topk(merge_token_num_stage1)[1]
    merge_token_stage2 = total_sparse_token[:, merge_token_stage2_idx, :]
    cluster_num = int(merge_token_stage2.shape[1] / 10) + 1
    merge_sparse_token, index_down = reference_cluster_and_merge(merge_token_stage2, cluster_num)
    cluster_idx = total_sparse_token_idx.squeeze(0)[merge_token_stage2_idx[index_down]].squeeze(0)
    states = {int(i) + v_token_start: layer_output[0, int(i) + v_token_start] for i in torch.where(pred_score_vis)[1]}
    states.update({int(c): merge_sparse_token[0, j] for j, c in enumerate(cluster_idx)})
    return states, relation_vis_text[0]


# ------------------------------------------------------------------ the rule
def test_recycling_counts_by_hand():
    # p dropped -> m = int(0.3 p) + 1 clustered -> int(m / 10) + 1 merged tokens
    assert [sparsevlm.recycled_members(p) for p in (0, 1, 3, 4, 33, 100)] == [0, 1, 1, 2, 10, 31]
    assert [sparsevlm.cluster_count(p) for p in (0, 1, 29, 30, 33, 100)] == [0, 1, 1, 2, 2, 4]


def test_schedule_follows_the_nearest_table_and_meets_r_exactly():
    stages = sparsevlm.stages(28, 5000, 0.25)  # the 128-of-576 table (2/9 is nearest 0.25)
    assert [s.layer for s in stages] == [3, 6, 14] and all(s.rank_by == RATERS for s in stages)
    selected = [s.keep - s.recycle for s in stages]
    ratios = [t / 576 for t in sparsevlm.TABLES[128]]
    scale = selected[0] / (ratios[0] * 5000)
    assert all(abs(n - scale * r * 5000) <= 1 for n, r in zip(selected, ratios))  # one scale, floored
    entering = [5000] + [s.keep for s in stages[:-1]]
    assert [s.recycle for s in stages] == [sparsevlm.cluster_count(n - k) for n, k in zip(entering, selected)]
    counts = [5000] * 3 + [stages[0].keep] * 3 + [stages[1].keep] * 8 + [stages[2].keep] * 14
    assert layer_average(stages, 28, 5000) == sum(counts) / (28 * 5000) <= 0.25
    bigger = sparsevlm.schedule([3, 6, 14], 5000, ratios, scale * 1.001)  # the next step is above R
    assert layer_average(bigger, 28, 5000) > 0.25
    assert sparsevlm.stages(28, 5000, 1.0) == []  # R = 1: no stage, vanilla
    assert [t / 576 for t in sparsevlm.TABLES[192]] == sparsevlm.table_shape(0.5, 3)
    assert [t / 576 for t in sparsevlm.TABLES[64]][:1] == sparsevlm.table_shape(0.1, 1)


def test_bad_layers_and_unreachable_r_are_refused():
    with pytest.raises(ValueError, match="prune_layers \\[3, 6\\]: SparseVLM's reference schedules have 1 stage or 3"):
        sparsevlm.stages(28, 5000, 0.25, [3, 6])
    with pytest.raises(ValueError, match="prune_layers"):
        sparsevlm.stages(28, 5000, 0.25, [3, 30])
    with pytest.raises(Exception, match="SparseVLM with stages at \\[3, 6, 14\\]"):
        sparsevlm.stages(28, 5000, 0.1)  # three layers of every token: a floor of 3/28


@pytest.mark.parametrize("seed", range(CASES))
def test_raters_equal_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    visual = int(torch.randint(1, 60, (), generator=g))
    embeds, positions = random_prompt(g, 16, visual)
    after = torch.arange(int(positions[-1]) + 1, embeds.shape[1])
    (_, idx) = reference_raters(embeds, int(positions[0]), int(after[0]))
    expected = torch.zeros(len(after))
    expected[idx] = 1
    assert torch.equal(sparsevlm.raters(embeds[0], positions, after), expected)


@pytest.mark.parametrize("seed", range(CASES))
def test_cluster_and_merge_equals_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    m = int(torch.randint(1, 120, (), generator=g))
    x = torch.randn(m, 24, generator=g, dtype=torch.float64) * (1 + torch.rand(m, 1, generator=g, dtype=torch.float64))
    clusters = int(m / 10) + 1
    merged, centres = sparsevlm.cluster_and_merge(x, clusters)
    expected, index_down = reference_cluster_and_merge(x[None], clusters)
    assert torch.equal(centres, index_down[0])
    assert torch.allclose(merged, expected[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("seed", range(12))
def test_a_stage_on_the_tiny_llm_equals_the_reference(text_models, backbone, seed):
    """Raters at the input, the ranking in layer K - 1, recycling on its output: our stage's kept positions and
    states entering layer K equal the reference's."""
    model, first = text_models[backbone]
    g = torch.Generator().manual_seed(100 + seed)
    visual = int(torch.randint(12, 90, (), generator=g))
    embeds, positions = random_prompt(g, model.config.hidden_size, visual)
    layer = max(1, first) + int(torch.randint(0, 3, (), generator=g))
    selected = int(torch.randint(1, visual - 1, (), generator=g))
    recycle = sparsevlm.cluster_count(visual - selected)
    attention, hidden = plain_run(model, embeds, layer)
    raters = reference_raters(embeds, int(positions[0]), int(positions[-1]) + 1)
    expected, relation = reference_stage(attention, hidden, int(positions[0]), visual, raters, selected)

    kept, ours = pruned_run(model, embeds, Stage(layer, selected + recycle, RATERS, recycle=recycle), positions)
    text = [i for i in range(embeds.shape[1]) if i not in set(positions.tolist())]
    assert sorted(kept.tolist()) == sorted(text + list(expected))
    for row, position in enumerate(kept.tolist()):
        want = expected[position] if position in expected else hidden[0, position]
        assert torch.allclose(ours[0, row], want, atol=1e-6), position
    assert not math.isnan(relation.sum().item())
