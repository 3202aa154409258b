"""VisionZip against its reference rule, written out here on one sequence (no batch dimension).

Reference: dvlab-research/VisionZip@3151f6d. `visionzip/clip_encoder.py:43-83` (dominant tokens:
top `dominant_num` of the [CLS] row of layer -2's attention summed over heads, kept in original
order; the rest, in original order, compared on their L2-normalised keys; targets
`arange(0, n, max(1, n // c))[:c]`; every other token to its argmax-similar target; contextual
token = target hidden + mean of its members, counts clamped to 1; output [dominant, contextual]),
`visionzip/utils.py:22-24,89` (the metric: the key projection, mean over heads). Documented
deviations applied to the reference: no [CLS] token, so the scores are one per visual token (our
`received_attention`) and all `dominant_num` dominant tokens are visual tokens; the metric is our
`keys`; each pair gets its `per_pair_budget` share, split by `visionzip.split`, and is compressed
on its own; the output is compared by original index (we keep every token in place). With no
contextual token (c = 0, pair budgets below 4) the reference would divide by zero
(`clip_encoder.py:67`); there the pair keeps its dominant tokens only.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from resadapt_eval.backbones.vision_attention import last_block_input
from resadapt_eval.baselines import VisualTokens, visionzip
from resadapt_eval.baselines.common import merge_groups, per_pair_budget

from .helpers import vanilla_setup


def reference_sequence(hidden, scores, metric, dominant_num: int, contextual_num: int):
    """clip_encoder.py:49-83 on one sequence without [CLS]. Returns the dominant indices, the
    target indices, each non-target's target, the merged tokens by original index (dict), and the
    number of similarities computed."""
    n = hidden.shape[0]
    topk_indices = scores.topk(dominant_num).indices  # :51-53 (no [CLS]: no +1, no index 0 added)
    mask = torch.ones(n, dtype=torch.bool).scatter_(0, topk_indices, False)  # :56
    dominant_at = torch.arange(n)[~mask]  # :57, masked_select keeps the original order
    merged = {int(i): hidden[i] for i in dominant_at}
    if contextual_num == 0:  # the reference's step would divide by zero
        return dominant_at.tolist(), [], {}, merged, 0
    rest_at = torch.arange(n)[mask]
    metric_filtered = metric[mask]  # :60
    hidden_filtered = hidden[mask]  # :62
    metric_normalized = metric_filtered / metric_filtered.norm(dim=-1, keepdim=True)  # :64
    m = metric_normalized.shape[0]
    step = max(1, m // contextual_num)  # :67
    target_indices = torch.arange(0, m, step)[:contextual_num]  # :68
    target_tokens = metric_normalized[target_indices]  # :69
    not_target = ~torch.isin(torch.arange(m), target_indices)
    tokens_to_merge = metric_normalized[not_target]  # :71
    similarity = tokens_to_merge @ target_tokens.T  # :72
    assign_one_hot = torch.zeros(tokens_to_merge.shape[0], contextual_num, dtype=hidden.dtype)  # :73
    assign_one_hot.scatter_(1, similarity.argmax(dim=1)[:, None], 1)  # :74
    counts = assign_one_hot.sum(dim=0).clamp(min=1)[:, None]  # :75
    hidden_to_merge = hidden_filtered[not_target]  # :76
    aggregated_hidden = assign_one_hot.T @ hidden_to_merge / counts  # :77
    contextual_tokens = hidden_filtered[target_indices] + aggregated_hidden  # :78-80
    targets_at = rest_at[target_indices]
    merged.update({int(t): x for t, x in zip(targets_at, contextual_tokens)})
    member_of = {int(i): int(targets_at[j]) for i, j in zip(rest_at[not_target], similarity.argmax(dim=1))}
    return dominant_at.tolist(), targets_at.tolist(), member_of, merged, similarity.numel()


def check(pair_sizes: list[int], keep: int, seed: int, dim: int = 6, head_dim: int = 5) -> int:
    """Our compress against the reference per pair on its budget share; returns the contextual
    tokens made."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(pair_sizes)
    feats = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    attention = torch.rand(n, generator=gen, dtype=torch.float64)
    keys = torch.randn(n, head_dim, generator=gen, dtype=torch.float64)
    tokens = VisualTokens(feats, pair_sizes, [(1, 1, s) for s in pair_sizes], attention, keys=keys)
    ours = visionzip.compress(tokens, keep)
    assignment = ours.assignment.tolist()

    kept, ref_merged, similarities, contextual, dropped = [], {}, 0, 0, 0
    for start, size, k in zip(tokens.pair_starts, pair_sizes, per_pair_budget(pair_sizes, keep)):
        n_dom, n_ctx = visionzip.split(k)
        assert n_dom >= 1 and n_dom + n_ctx == k
        span = slice(start, start + size)
        dominant, targets, member_of, merged, count = reference_sequence(
            feats[span], attention[span], keys[span], n_dom, n_ctx
        )
        assert len(dominant) + len(targets) == k
        for i in dominant + targets:  # kept tokens point at themselves
            assert assignment[start + i] == start + i
        for i, t in member_of.items():  # every other token is merged into the reference's target
            assert assignment[start + i] == start + t
        kept += [start + i for i in dominant + targets]
        ref_merged.update({start + i: x for i, x in merged.items()})
        similarities, contextual = similarities + count, contextual + len(targets)
        dropped += size - k if n_ctx == 0 else 0
    # nothing else is kept or merged: dropped tokens are only those the reference leaves out
    assert sorted(kept) == ours.kept.tolist()
    assert all(a == -1 for i, a in enumerate(assignment) if i not in ref_merged and a not in ref_merged)

    destinations, sizes, (merged,) = merge_groups(ours, feats)
    assert destinations.tolist() == sorted(ref_merged)
    torch.testing.assert_close(merged, torch.stack([ref_merged[i] for i in sorted(ref_merged)]), atol=1e-6, rtol=0)
    # group sizes (for records): every original token a kept token stands for
    assert sizes.tolist() == [assignment.count(d) for d in destinations.tolist()]
    # every token is kept or merged, except in pairs without a contextual token
    assert sizes.sum().item() == n - dropped
    # the count from configs (`visionzip.similarity_flops`) is the reference's (non-targets x targets) cosines
    vision = SimpleNamespace(hidden=2 * head_dim, heads=2)  # keys of the vision head size
    assert visionzip.similarity_flops(pair_sizes, keep, vision) == 2 * similarities * head_dim
    return contextual


def test_fidelity_visionzip_split_reproduces_the_reference_settings():
    assert visionzip.split(64) == (54, 10)  # README: dominant=54, contextual=10
    assert visionzip.split(128) == (108, 20)
    assert [visionzip.split(k)[1] for k in range(1, 8)] == [0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 15, 16, 33, 64, 71])
def test_fidelity_visionzip_single_pair_every_budget(n):
    """One pair, odd and even sizes, every budget from 1 token to all but one."""
    contextual = [check([n], keep, seed=100 * n + keep) for keep in range(1, n)]
    if n >= 8:
        assert max(contextual) >= 1


def test_fidelity_visionzip_random_single_pairs():
    rng = random.Random(0)
    for case in range(40):
        n = rng.randint(2, 300)
        check([n], rng.randint(1, n - 1), seed=case, dim=rng.choice([3, 8, 16]), head_dim=rng.choice([2, 4, 7]))


@pytest.mark.parametrize("num_pairs", [2, 3, 5])
def test_fidelity_visionzip_several_pairs_budget_split(num_pairs):
    """Several pairs (odd and even sizes), keep from one token per pair to all but one."""
    rng = random.Random(num_pairs)
    checked = 0
    for case in range(25):
        sizes = [rng.randint(1, 80) for _ in range(num_pairs)]
        total = sum(sizes)
        if total <= num_pairs:
            continue
        keep = num_pairs if case == 0 else total - 1 if case == 1 else rng.randint(num_pairs, total - 1)
        check(sizes, keep, seed=1000 * num_pairs + case)
        checked += 1
    assert checked >= 20  # a case is skipped only when every pair has one token


def test_fidelity_visionzip_contextual_token_is_target_plus_member_mean():
    """One pair of 8 at k = 4: 3 dominant (highest attention), 1 contextual: the only target is
    the first remaining token (step 5 // 1), and it is its own feature plus the mean of the 4
    others (not the mean of all 5)."""
    feats = torch.arange(16, dtype=torch.float64).reshape(8, 2)
    attention = torch.tensor([0.9, 0.1, 0.8, 0.2, 0.3, 0.7, 0.0, 0.1], dtype=torch.float64)
    tokens = VisualTokens(feats, [8], [(1, 2, 4)], attention, keys=torch.ones(8, 3, dtype=torch.float64))
    ours = visionzip.compress(tokens, 4)
    assert ours.assignment.tolist() == [0, 1, 2, 1, 1, 5, 1, 1]
    _, sizes, (merged,) = merge_groups(ours, feats)
    assert sizes.tolist() == [1, 5, 1, 1]
    torch.testing.assert_close(merged[1], feats[1] + feats[[3, 4, 6, 7]].mean(dim=0))


def test_fidelity_visionzip_needs_keys():
    tokens = VisualTokens(torch.zeros(4, 2), [4], [(1, 2, 2)], torch.rand(4))
    with pytest.raises(ValueError, match="keys"):
        visionzip.compress(tokens, 2)


@pytest.mark.parametrize("backbone", ["qwen25vl", "qwen3vl"])
def test_fidelity_visionzip_keys_are_the_last_blocks_keys(adapters, backbone):
    """The keys VisionZip receives through `build_compressed_inputs` equal a hand computation
    from the last vision block's qkv weights on its captured input: the key rows of the
    projection (with bias, no rotary), mean over heads, mean over each merge unit's 4 patches, in
    LLM order (Qwen2.5-VL's window order undone)."""
    adapter = adapters[backbone]
    vision = adapter.model.config.vision_config
    prompt, v, plan = vanilla_setup(adapter)
    seen = {}

    def spy(tokens, keep, seed=0):
        seen["tokens"] = tokens
        return visionzip.compress(tokens, keep, seed)

    with last_block_input(adapter.model) as captured:
        adapter.build_compressed_inputs(prompt, v, plan, spy, 0.5, needs_attention=True)
    if backbone == "qwen25vl":  # the last block attends over each whole temporal patch
        assert vision.depth - 1 in vision.fullatt_block_indexes
        assert len(captured["cu_seqlens"]) - 1 == sum(t for t, _, _ in plan.grids)
    attn, x = captured["module"], captured["hidden_states"].double()
    width, head_dim = vision.hidden_size, vision.hidden_size // vision.num_heads
    with torch.no_grad():
        w_k, b_k = attn.qkv.weight.double()[width : 2 * width], attn.qkv.bias.double()[width : 2 * width]
        keys = (x @ w_k.T + b_k).reshape(len(x), vision.num_heads, head_dim).mean(dim=1)
        keys = keys.reshape(-1, vision.spatial_merge_size**2, head_dim).mean(dim=1)
    full = adapter.build_inputs(prompt, v, plan)
    order = adapter.unit_order(full["video_grid_thw"])
    if order is not None:
        assert not torch.equal(order, torch.arange(len(order)))
        keys = keys[order]
    tokens = seen["tokens"]
    assert tokens.keys.shape == (plan.visual_tokens, head_dim)
    torch.testing.assert_close(tokens.keys.double(), keys, atol=1e-5, rtol=1e-5)
    assert tokens.received_attention.shape == (plan.visual_tokens,)
