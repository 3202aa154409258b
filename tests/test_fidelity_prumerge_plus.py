"""PruMerge+ against its reference rule, written out here on one image (no batch dimension).

Reference: 42Shawn/LLaVA-PruMerge@097c041, `llava/model/multimodal_encoder/clip_encoder.py`,
`token_prune_merge_advanced_plus` (lines 174-281, called with if_adaptive=True at line 300):
`outlier_dectection` (lines 34-47: numpy percentiles of the attention in float32, outliers above
Q3 + 1.5 IQR, ratio = outliers / N); the top int(N * ratio) patches by [CLS] attention (line 205);
the grid `arange(0, 575, int(int(1 / ratio) / 3))` minus those, appended (lines 209-213); the
complement in ascending order (`complement_idx`, lines 12-25, 236); per kept patch i, the 32 most
cosine-similar L2-normalised keys among [kept before i, kept after i, unkept] (lines 241-268), the
centre x_i + sum of attention * feature over them (lines 270-276); the extra token, sum of
attention * feature over the unkept (line 278).

Documented substitutions applied to the reference: the [CLS] row is the pair's received attention
divided by its sum; the keys are `VisualTokens.keys`; 575 is n - 1; `topk(32)` takes n - 1 where
there are fewer others. The reference runs where it is defined (an outlier, stride >= 1); our
budget rule beyond its own count is written out separately (`matched_selection`), and our merge
is checked as the reference's centres minus exactly the documented difference.
"""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.baselines import VisualTokens, prumerge_plus
from resadapt_eval.baselines.common import merge_groups, per_pair_budget
from resadapt_eval.measure.syncs import counting_syncs

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest.py)


def outlier_ratio(cls_attn):
    """clip_encoder.py:34-47, literally."""
    attn_np = cls_attn.to(dtype=torch.float32).cpu().numpy().flatten()
    q1 = np.percentile(attn_np, 25)
    q3 = np.percentile(attn_np, 75)
    upper_bound = q3 + 1.5 * (q3 - q1)
    return len(np.where(attn_np > upper_bound)[0]) / len(attn_np)


def reference_selection(cls_attn):
    """clip_encoder.py:203-213 on one image of N tokens (575 -> N - 1): the kept indices in the
    reference's order, or None where the reference fails (no outlier: 1 / 0; stride 0)."""
    n = len(cls_attn)
    ratio = outlier_ratio(cls_attn)
    if ratio == 0 or int(int(1 / ratio) / 3) == 0:
        return None
    _, idx = torch.topk(cls_attn, int(n * ratio), largest=True)  # :205
    step_length = int(1 / ratio)  # :209
    arithmetic_sequence = torch.arange(0, n - 1, int(step_length / 3))  # :210
    filtered_sequence = [x for x in arithmetic_sequence.tolist() if x not in idx.tolist()]  # :212
    return idx.tolist() + filtered_sequence  # :213


def reference_merge(image_features, cls_attn, keys, idx):
    """clip_encoder.py:229-280 on one image: per kept token (in `idx` order) its centre and its
    cluster (original indices), and the extra token."""
    n = len(cls_attn)
    compl = sorted(set(range(n)) - set(idx))  # complement_idx: ascending
    key_others_norm = F.normalize(keys[idx], p=2, dim=-1)  # :241
    non_topk_key_norm = F.normalize(keys[compl], p=2, dim=-1)  # :242
    centres, clusters = {}, {}
    for i in range(len(idx)):  # :252
        rest_ids = idx[:i] + idx[i + 1 :] + compl  # :258-263, the order of rest_x_others
        rest_keys = torch.cat([key_others_norm[:i], key_others_norm[i + 1 :], non_topk_key_norm])  # :265
        cos_sim = key_others_norm[i] @ rest_keys.T  # :266
        _, cluster_indices = torch.topk(cos_sim, k=min(32, n - 1), largest=True)  # :268
        members = [rest_ids[j] for j in cluster_indices.tolist()]
        weighted_avg = (image_features[members] * cls_attn[members][:, None]).sum(dim=0)  # :270-274
        centres[idx[i]] = image_features[idx[i]] + weighted_avg  # :275
        clusters[idx[i]] = members
    extra = (image_features[compl] * cls_attn[compl][:, None]).sum(dim=0)  # :278
    return centres, clusters, extra


def matched_selection(cls_attn, k):
    """Our documented budget rule (module docstring), written out with lists: the top
    min(o, max(1, round(k o / K_ref))) by attention, then k - o_k grid samples thinned evenly
    (or, beyond the grid, every other token thinned evenly)."""
    n = len(cls_attn)
    ratio = outlier_ratio(cls_attn)
    o = int(n * ratio)
    stride = n if ratio == 0 else max(1, min(n, int(int(1 / ratio) / 3)))
    order = sorted(range(n), key=lambda i: (-float(cls_attn[i]), i))
    grid = list(range(0, n - 1, stride))
    reference_count = o + len(set(grid) - set(order[:o]))
    o_k = min(o, max(1, round(k * o / max(1, reference_count))))
    outliers = order[:o_k]
    candidates = [x for x in grid if x not in set(outliers)]
    if len(candidates) < k - o_k:
        candidates = sorted(set(range(n)) - set(outliers))
    samples = [candidates[j * len(candidates) // (k - o_k)] for j in range(k - o_k)]
    return sorted(outliers + samples), reference_count


def expected_groups(features, cls_attn, keys, kept):
    """Each kept token's feature and members by our documented merge, derived from the
    reference's centres: minus the kept neighbours' a_j x_j and minus the unkept neighbours that
    another (more similar) kept token claims. Returns ({kept: feature}, {unkept: kept or -1})."""
    centres, clusters, _ = reference_merge(features, cls_attn, keys, kept)
    cosine = (F.normalize(keys, dim=-1) @ F.normalize(keys, dim=-1).T).tolist()
    claimants = {j: [] for j in set(range(len(cls_attn))) - set(kept)}
    for i in sorted(kept):
        for j in clusters[i]:
            if j in claimants:
                claimants[j].append(i)
    owner = {j: max(c, key=lambda i: (cosine[i][j], -i)) if c else -1 for j, c in claimants.items()}
    groups = {}
    for i in kept:
        removed = [j for j in clusters[i] if j not in claimants or owner[j] != i]
        groups[i] = centres[i] - (features[removed] * cls_attn[removed][:, None]).sum(dim=0)
    return groups, owner


def random_pairs(sizes, seed, dim=6, head_dim=5, spikes=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    attention = torch.randn(n, generator=g, dtype=torch.float64).exp()  # log-normal: IQR outliers
    attention[torch.randperm(n, generator=g)[:spikes]] *= 20
    feats = torch.randn(n, dim, generator=g, dtype=torch.float64)
    keys = torch.randn(n, head_dim, generator=g, dtype=torch.float64)
    return VisualTokens(feats, sizes, [(1, 1, s) for s in sizes], attention, keys=keys)


def normalised(tokens, start, size):
    a = tokens.received_attention[start : start + size]
    return a.double() / a.double().sum()  # the documented [CLS] row


def check(tokens, keep):
    """Our compress against the written-out rule and the reference's centres, pair by pair."""
    ours = prumerge_plus.compress(tokens, keep)
    assignment = ours.assignment.tolist()
    expected = {}
    budget = per_pair_budget(tokens.pair_sizes, keep)
    for start, size, k in zip(tokens.pair_starts, tokens.pair_sizes, budget):
        span = slice(start, start + size)
        a = normalised(tokens, start, size)
        kept, _ = matched_selection(a, k)
        assert [i - start for i in range(start, start + size) if assignment[i] == i] == kept
        if k == size:
            expected.update({start + i: tokens.features[start + i] for i in kept})
            continue
        groups, owner = expected_groups(tokens.features[span], a, tokens.keys[span], kept)
        for j, i in owner.items():
            assert assignment[start + j] == (-1 if i < 0 else start + i)
        expected.update({start + i: x for i, x in groups.items()})
    destinations, _, (merged,) = merge_groups(ours, tokens.features)
    assert destinations.tolist() == sorted(expected)
    torch.testing.assert_close(merged, torch.stack([expected[i] for i in sorted(expected)]), atol=1e-6, rtol=0)


def test_fidelity_prumerge_plus_reproduces_the_reference_at_its_own_count():
    """Where the budget is the reference's adaptive count K_ref, the kept set is the reference's
    and the merged features are its centres less exactly the documented difference."""
    rng, checked = random.Random(0), 0
    for case in range(30):
        n = 576 if case < 4 else rng.randint(33, 400)
        tokens = random_pairs([n], seed=case, spikes=rng.choice([0, 3, 10]))
        a = normalised(tokens, 0, n)
        idx = reference_selection(a)
        if idx is None:
            continue
        kept, reference_count = matched_selection(a, len(idx))
        assert reference_count == len(idx) and kept == sorted(idx)
        ours = prumerge_plus.compress(tokens, len(idx))
        assert ours.kept.tolist() == sorted(idx)
        check(tokens, len(idx))
        checked += 1
    assert checked >= 25


def test_fidelity_prumerge_plus_keeps_the_reference_s_int_n_ratio():
    """int(N * ratio) is one less than the outlier count for some counts (49 tokens, 1 outlier):
    the reference keeps no outlier by attention then, and neither do we."""
    attention = torch.ones(49, dtype=torch.float64)
    attention[7] = 5.0  # Q1 = Q3 = 1: the one value above is the only outlier
    assert outlier_ratio(attention / attention.sum()) == 1 / 49 and int(49 * (1 / 49)) == 0
    tokens = VisualTokens(torch.randn(49, 4, dtype=torch.float64), [49], [(1, 7, 7)], attention, torch.randn(49, 3))
    idx = reference_selection(attention / attention.sum())
    assert idx == list(range(0, 48, 16))  # stride int(49 / 3) = 16, no outlier kept
    assert prumerge_plus.compress(tokens, len(idx)).kept.tolist() == idx


@pytest.mark.parametrize("n", [2, 5, 17, 33, 64, 100])
def test_fidelity_prumerge_plus_every_budget_one_pair(n):
    for keep in range(1, n + 1):
        check(random_pairs([n], seed=10 * n + keep, spikes=keep % 4), keep)


@pytest.mark.parametrize("num_pairs", [2, 3, 5])
def test_fidelity_prumerge_plus_several_pairs(num_pairs):
    rng = random.Random(num_pairs)
    for case in range(8):
        sizes = [rng.randint(1, 120) for _ in range(num_pairs)]
        keep = num_pairs if case == 0 else sum(sizes) if case == 1 else rng.randint(num_pairs, sum(sizes))
        check(random_pairs(sizes, seed=100 * num_pairs + case, spikes=case), keep)


def test_prumerge_plus_similarity_blocks_do_not_change_the_result(monkeypatch):
    """Kept tokens are compared in blocks of ROWS (memory only): blocks of 7 give the same groups,
    and a tie between two kept tokens' claims goes to the lower one in either case."""
    tokens = random_pairs([90, 61], seed=7)
    tokens.keys[40:50] = tokens.keys[40]  # identical keys: tied similarities
    whole = prumerge_plus.compress(tokens, 70)
    monkeypatch.setattr(prumerge_plus, "ROWS", 7)
    blocks = prumerge_plus.compress(tokens, 70)
    assert torch.equal(whole.assignment, blocks.assignment) and torch.equal(whole.weights, blocks.weights)


def test_prumerge_plus_without_outliers_samples_evenly():
    """Uniform attention has no IQR outlier (the reference divides by zero): k even samples."""
    feats, keys = torch.randn(40, 4, dtype=torch.float64), torch.randn(40, 3, dtype=torch.float64)
    tokens = VisualTokens(feats, [40], [(1, 5, 8)], torch.full((40,), 0.3, dtype=torch.float64), keys)
    assert prumerge_plus.compress(tokens, 4).kept.tolist() == [0, 10, 20, 30]
    check(tokens, 4)


def test_prumerge_plus_exact_keep_at_least_one_per_pair():
    tokens = random_pairs([30, 1, 64, 7], seed=3)
    for keep in range(4, 103):
        ours = prumerge_plus.compress(tokens, keep)
        assert len(ours.kept) == keep
        pair_of = torch.repeat_interleave(torch.arange(4), torch.tensor([30, 1, 64, 7]))
        assert set(pair_of[ours.kept].tolist()) == {0, 1, 2, 3}


def test_prumerge_plus_keep_all_is_unchanged():
    tokens = random_pairs([20, 36], seed=4)
    ours = prumerge_plus.compress(tokens, 56)
    assert ours.assignment.tolist() == list(range(56))
    _, sizes, (merged,) = merge_groups(ours, tokens.features)
    assert sizes.tolist() == [1] * 56
    assert torch.equal(merged, tokens.features)


def test_prumerge_plus_bfloat16():
    tokens = random_pairs([64, 64], seed=5)
    low = VisualTokens(
        tokens.features.bfloat16(),
        tokens.pair_sizes,
        tokens.grids,
        tokens.received_attention.float(),
        tokens.keys.bfloat16(),
    )
    ours = prumerge_plus.compress(low, 40)
    assert len(ours.kept) == 40
    _, _, (merged,) = merge_groups(ours, low.features)
    assert merged.dtype == torch.bfloat16 and merged.shape == (40, 6) and torch.isfinite(merged.float()).all()


def test_prumerge_plus_host_syncs_do_not_grow_with_the_pairs():
    counts = []
    for pairs in (4, 16):
        tokens = random_pairs([100] * pairs, seed=pairs, dim=64, head_dim=16, spikes=pairs)
        with counting_syncs() as syncs:
            prumerge_plus.compress(tokens, 25 * pairs)
        counts.append(syncs["n"])
    assert counts == [0, 0]


def test_prumerge_plus_impossible_keep_and_missing_keys():
    tokens = random_pairs([10, 10, 10], seed=6)
    for keep in (2, 31):
        with pytest.raises(ValueError, match="outside"):
            prumerge_plus.compress(tokens, keep)
    with pytest.raises(ValueError, match="keys"):
        prumerge_plus.compress(VisualTokens(tokens.features, [30], [(1, 5, 6)], tokens.received_attention), 3)
