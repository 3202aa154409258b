"""iLLaVA's merge inside the vision tower against its reference rule, written out here.

Reference: hulianyuyy/iLLaVA@4068149e2cce51d691fe08c0eab80c364c8fcdd9,
`src/transformers-4.46.0/src/transformers/models/qwen2_vl/modeling_qwen2_vl.py`:
- :332-356 (VisionAttention, eager): attention weights softmax(q k^T / sqrt(d)) within each segment;
- :461-487 (Qwen2VLVisionBlock.forward, per segment): the weights averaged over heads, then over
  query tokens (`attn_weights.mean(0)`, then `.mean(0)`); `topk(r + 1, largest=False)` (ascending);
  sizes arange(r + 1, 0, -1); the weighted average written into the last of those indices; the
  others removed; the rest kept in order, with their rotary rows;
- :1125-1131 (the tower): merging blocks `illava_vit_k`, 12-15 for Qwen2-VL-7B
  (`src/VLMEvalKit/vlmeval/config.py:339`).
Documented deviations applied to the reference here: whole merge units are its tokens (a unit's
score is the mean of its patches' received attention; its features are its patches, merged patch by
patch), r is the count the budget asks for, float64 throughout.
"""

import random

import pytest
import torch

from resadapt_eval.backbones.tower_reduction import TowerReducer
from resadapt_eval.backbones.vision_attention import received_attention_and_keys
from resadapt_eval.baselines import illava


def reference_segment(hidden: torch.Tensor, scores: torch.Tensor, r: int):
    """modeling_qwen2_vl.py:466-487 on one segment of tokens `hidden` (n, c) with received-attention
    `scores` (n,): (kept indices, new hidden)."""
    n = hidden.shape[0]
    indice = scores.topk(r + 1, largest=False)[1]  # :474
    values = hidden[indice]  # :478
    size = torch.arange(r + 1, 0, -1).to(values.dtype)  # :479
    hidden = hidden.clone()
    hidden[indice[-1]] = size @ values / size.sum()  # :481
    selected = sorted(set(range(n)) - set(indice[:-1].tolist()))  # :482-486
    return torch.tensor(selected), hidden[selected]


def reference_received(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """VisionAttention (:340-351) weights of one segment, q and k (heads, n, d), then :473-477."""
    weights = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
    return weights.mean(0).mean(0)


def cases():
    rng = random.Random(0)
    for n in (2, 3, 7, 8, 16, 25):
        for _ in range(20):
            segments = [n + rng.randrange(0, 3) for _ in range(rng.randrange(1, 4))]
            after = [rng.randrange(1, s + 1) for s in segments]
            yield segments, after, rng.randrange(10**6)


@pytest.mark.parametrize("segments,after,seed", list(cases()))
def test_merge_units_keeps_and_averages_what_the_reference_does(segments, after, seed):
    g = torch.Generator().manual_seed(seed)
    unit, width = 4, 6
    total = sum(segments)
    hidden = torch.randn(total, unit, width, generator=g, dtype=torch.float64)
    scores = torch.rand(total, generator=g, dtype=torch.float64)
    merge = illava.merge_units(scores, segments, after)
    ours = merge.apply(hidden)

    kept, expected, start = [], [], 0
    for n, k in zip(segments, after):
        index, merged = reference_segment(hidden[start : start + n].reshape(n, -1), scores[start : start + n], n - k)
        kept.append(index + start)
        expected.append(merged)
        start += n
    assert merge.survivors.tolist() == torch.cat(kept).tolist()
    torch.testing.assert_close(ours.reshape(ours.shape[0], -1), torch.cat(expected), rtol=0, atol=1e-6)


def test_a_unit_score_is_the_mean_received_attention_of_its_patches():
    """`received_attention_and_keys` (what the reducer ranks by) against :340-351 and :473-477 on
    every patch of two segments, averaged over each unit's 4 patches."""
    g = torch.Generator().manual_seed(1)
    heads, d, unit = 2, 8, 4
    lengths = [8 * unit, 5 * unit]
    attn = torch.nn.Module()
    attn.qkv = torch.nn.Linear(heads * d, 3 * heads * d, dtype=torch.float64)
    torch.nn.init.normal_(attn.qkv.weight, generator=g)
    attn.num_heads, attn.scaling = heads, d**-0.5
    hidden = torch.randn(sum(lengths), heads * d, generator=g, dtype=torch.float64)
    cos, sin = torch.ones(sum(lengths), d, dtype=torch.float64), torch.zeros(sum(lengths), d, dtype=torch.float64)
    captured = dict(
        module=attn,
        hidden_states=hidden,
        cu_seqlens=torch.tensor([0, lengths[0], sum(lengths)]),
        position_embeddings=(cos, sin),
    )
    received, _ = received_attention_and_keys(captured, lambda q, k, c, s: (q, k), unit)
    q, k, _ = attn.qkv(hidden).reshape(-1, 3, heads, d).permute(1, 2, 0, 3)
    expected = torch.cat(
        [reference_received(q[:, lo:hi], k[:, lo:hi]) for lo, hi in ((0, lengths[0]), (lengths[0], sum(lengths)))]
    )
    torch.testing.assert_close(received.double(), expected.reshape(-1, unit).mean(1), rtol=0, atol=1e-6)


def test_the_merging_blocks_are_the_references_at_the_same_relative_depth():
    assert illava.default_layers(32) == [12, 13, 14, 15]  # config.py:339
    assert illava.default_layers(27) == [10, 11, 12, 13]  # Qwen3-VL-8B
    assert illava.default_layers(4) == [1, 2]
    assert illava.default_layers(2) == [0]
    assert illava.default_layers(1) == []


def test_a_pair_reaches_its_share_geometrically_over_the_merging_blocks():
    # 100 units to 25 over 4 blocks: ceil(100 * 0.25^(j/4)) = 71, 50, 36, then 25
    assert illava.layer_counts(100, 25, 4) == [71, 50, 36, 25]
    assert illava.layer_counts(100, 100, 4) == [100] * 4
    assert illava.layer_counts(9, 1, 1) == [1]
    with pytest.raises(ValueError, match="keep=0 units"):
        illava.layer_counts(9, 0, 2)


def test_features_tapped_before_a_merging_block_follow_the_kept_units():
    """`TowerReducer.follow`: a DeepStack feature tapped after block 0 goes through the merge after
    block 2 (units 1, 2 and 0, the 3 least attended, average into unit 0 with weights 3, 2, 1); one
    tapped after block 2 through none."""
    merge = illava.merge_units(torch.tensor([0.3, 0.1, 0.2, 0.9]), [4], [2])
    reducer = TowerReducer.__new__(TowerReducer)
    reducer.merges = [(2, merge)]
    early, late = torch.arange(8.0).reshape(4, 2), torch.arange(4.0).reshape(2, 2)
    followed = reducer.follow([early, late], [0, 2])
    assert merge.survivors.tolist() == [0, 3]
    torch.testing.assert_close(followed[0], torch.stack([(3 * early[1] + 2 * early[2] + early[0]) / 6, early[3]]))
    torch.testing.assert_close(followed[1], late)
