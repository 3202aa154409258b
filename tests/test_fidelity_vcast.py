"""V-CAST against its reference rule, written out here from the authors' Qwen3-VL code.

Reference: xinyouu/V-CAST@c235ef3c0a88a77edf5e84956a02d90d718325c6,
`compressor/v_cast/modeling_qwen3_vl_v_cast.py` (REF below):
- `:33-45` `_compute_curvature`, `:48-111` `_allocate_budget_per_frame`, `:114-185`
  `_v_cast_compress_frames` (frame means, curvature, softmax at 0.7, the video budget, the per-frame
  hybrid score and top-k), `:14-16` the defaults, `:224-253` one video at a time, its tokens viewed
  as (T, n, D).

Documented deviations applied to the reference: its total `round(0.25 T n)` (`:135-139`) is given
as `keep` instead (every method keeps floor(R N); where 0.25 N is whole the reference's own budget
is used and agrees); the pairs are its frames. The features are float64, where our float32
promotion of bfloat16 features is the identity and the reference's own `.float()` steps are the
same float32 steps as ours. Random float64 scores have no ties, so the reference's unstable top-k
and argsort are not exercised (ours: lower index first).
"""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.baselines import vcast
from resadapt_eval.baselines.common import DROPPED, VisualTokens, kept_count, merge_groups
from resadapt_eval.measure.syncs import counting_syncs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

DEFAULT_RETAIN_RATIO, DEFAULT_MIN_K, DEFAULT_BUDGET_TEMP = 0.25, 1, 0.7  # REF:14-16


def ref_compute_curvature(frame_reps):
    """REF:33-45."""
    t = int(frame_reps.shape[0])
    if t <= 1:
        return torch.ones((t,), device=frame_reps.device, dtype=torch.float32)
    v_in = frame_reps[1:-1] - frame_reps[:-2]
    v_out = frame_reps[2:] - frame_reps[1:-1]
    curv = 1.0 - F.cosine_similarity(v_in, v_out, dim=-1, eps=1e-6)
    ones = torch.ones((1,), device=frame_reps.device, dtype=curv.dtype)
    return torch.cat([ones, curv, ones], dim=0)


def ref_take_back(alloc, weights, over, min_k_eff):
    """REF:101-109 (the `remaining < 0` branch), in place on alloc."""
    order = torch.argsort(weights, descending=False)
    for idx in order:
        if over <= 0:
            break
        if alloc[idx] > min_k_eff:
            alloc[idx] -= 1
            over -= 1
    return alloc


def ref_allocate_budget_per_frame(curvature, total_budget, *, min_k, max_k):
    """REF:48-111, line for line."""
    t = int(curvature.shape[0])
    if t <= 0:
        return torch.zeros((0,), device=curvature.device, dtype=torch.long)
    total_budget = int(max(0, min(int(total_budget), int(t * max_k))))  # :64
    min_k = int(max(0, min(int(min_k), int(max_k))))  # :65
    min_k_eff = 0 if total_budget < t * min_k else min_k  # :67-70
    base = torch.full((t,), int(min_k_eff), device=curvature.device, dtype=torch.long)  # :72
    remaining = int(total_budget - int(base.sum().item()))  # :73
    if remaining <= 0:
        return base
    weights = curvature.float().clamp_min(0.0)  # :77
    if float(weights.sum().item()) <= 0.0:  # :78-79
        weights = torch.ones_like(weights)
    weights = weights / weights.sum().clamp_min(1e-6)  # :80
    raw = weights * float(remaining)  # :82
    extra = torch.floor(raw).to(torch.long)  # :83
    max_extra = max(0, max_k - min_k_eff)  # :84-86
    extra = torch.minimum(extra, torch.full_like(extra, int(max_extra)))  # :87
    alloc = base + extra  # :88
    remaining = int(total_budget - int(alloc.sum().item()))  # :90
    if remaining > 0:  # :91-100
        frac = raw - torch.floor(raw)
        frac = frac.masked_fill(alloc >= max_k, -1.0)
        for _ in range(remaining):
            idx = torch.argmax(frac)
            if frac[idx].item() < 0:
                break
            alloc[idx] += 1
            if alloc[idx] >= max_k:
                frac[idx] = -1.0
    elif remaining < 0:  # :101-109
        alloc = ref_take_back(alloc, weights, -remaining, min_k_eff)
    return alloc


def ref_total_budget(t, tokens_per_frame, retain_ratio, min_k):
    """REF:135-139."""
    total_budget = int(round(float(t * tokens_per_frame) * float(retain_ratio)))
    total_budget = max(1, min(int(t * tokens_per_frame), total_budget))
    min_k = int(max(0, min(int(min_k), int(tokens_per_frame))))
    if min_k > 0:
        total_budget = max(total_budget, int(t * min_k))
    return total_budget, min_k


def ref_compress_frames(frames, deepstack_frames, total_budget=None):
    """REF:114-185 (`_v_cast_compress_frames`) with retain_ratio 0.25 and min_k 1 (REF:317-318);
    `total_budget`, where given, replaces REF:135-136 (the documented floor(R N) budget)."""
    t, tokens_per_frame, dim = frames.shape
    frame_reps = F.normalize(frames.mean(dim=1), dim=-1, eps=1e-6)  # :131
    curvature = ref_compute_curvature(frame_reps)  # :132
    weights = torch.softmax(curvature.float() / float(DEFAULT_BUDGET_TEMP), dim=0)  # :133
    own_total, min_k = ref_total_budget(t, tokens_per_frame, DEFAULT_RETAIN_RATIO, DEFAULT_MIN_K)
    total_budget = own_total if total_budget is None else total_budget
    k_t = ref_allocate_budget_per_frame(weights, total_budget, min_k=min_k, max_k=tokens_per_frame)  # :140-145
    tokens_out, keep_indices, deepstack_out = [], [], [[] for _ in deepstack_frames]
    for frame_idx in range(t):  # :151-171
        k = int(k_t[frame_idx].item())
        if k <= 0:
            continue
        frame_tokens = frames[frame_idx]
        rep = frame_reps[frame_idx]
        sim = F.cosine_similarity(frame_tokens, rep.unsqueeze(0), dim=-1, eps=1e-6)
        outlier = (1.0 - sim).float()
        norm = frame_tokens.float().norm(dim=-1)
        norm = (norm - norm.min()) / (norm.max() - norm.min() + 1e-6)
        score = outlier + norm
        topk_idx = torch.topk(score, k=k, largest=True, sorted=False).indices
        topk_idx, _ = torch.sort(topk_idx)
        tokens_out.append(frame_tokens.index_select(0, topk_idx))
        keep_indices.append(topk_idx + frame_idx * tokens_per_frame)
        for ds_idx, ds in enumerate(deepstack_frames):
            deepstack_out[ds_idx].append(ds[frame_idx].index_select(0, topk_idx))
    deepstack_comp = [torch.cat(chunks, dim=0) for chunks in deepstack_out]  # :179-184
    return torch.cat(tokens_out, dim=0), deepstack_comp, torch.cat(keep_indices, dim=0), k_t


def video(frames: int, n: int, dim: int, seed: int, drift: float = 1.0, dtype=torch.float64) -> torch.Tensor:
    """(frames n, dim) tokens: a random-walk frame content plus per-token noise, so that the frame
    trajectory turns by different amounts (varied curvature, so varied budgets)."""
    g = torch.Generator().manual_seed(seed)
    walk = torch.cumsum(drift * torch.randn(frames, 1, dim, generator=g, dtype=torch.float64), dim=0)
    scale = torch.rand(frames, n, 1, generator=g, dtype=torch.float64) * 2
    tokens = walk + scale * torch.randn(frames, n, dim, generator=g, dtype=torch.float64)
    return tokens.reshape(frames * n, dim).to(dtype)


def ours(feats: torch.Tensor, pair_sizes: list[int], keep: int, *extra: torch.Tensor):
    tokens = VisualTokens(feats, pair_sizes, [(1, 1, s) for s in pair_sizes])
    compression = vcast.compress(tokens, keep)
    destinations, sizes, merged = merge_groups(compression, feats, *extra)
    return compression, destinations, sizes, merged


def check(
    frames: int, n: int, keep: int | None, seed: int, dim: int = 8, drift: float = 1.0, dtype=torch.float64
) -> list[int]:
    """Ours against REF on one video; keep None: the reference's own budget. Returns its k_t."""
    feats = video(frames, n, dim, seed, drift, dtype)
    deepstack = torch.randn(frames * n, 3, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    ref_tokens, (ref_ds,), ref_keep, k_t = ref_compress_frames(
        feats.view(frames, n, dim), [deepstack.view(frames, n, 3)], keep
    )
    keep = len(ref_keep) if keep is None else keep
    compression, destinations, sizes, (merged, merged_ds) = ours(feats, [n] * frames, keep, deepstack)
    assert destinations.tolist() == ref_keep.tolist()  # the same kept tokens, in original order
    assert compression.kept.tolist() == ref_keep.tolist()
    assert torch.equal(merged, ref_tokens) and torch.equal(merged_ds, ref_ds)  # pure selection, no merging
    assert sizes.tolist() == [1] * keep
    dropped = torch.ones(frames * n, dtype=torch.bool)
    dropped[ref_keep] = False
    assert (compression.assignment[dropped] == DROPPED).all()
    return k_t.tolist()


@pytest.mark.parametrize("frames,n", [(2, 9), (3, 16), (4, 12), (5, 7), (8, 36), (16, 20)])
def test_fidelity_vcast_matches_the_reference(frames, n):
    """From one token per frame to all, on several videos each."""
    total = frames * n
    keeps = sorted({frames, frames + 1, total // 4, total // 2, total - 1, total})
    budgets = [check(frames, n, keep, seed=1000 * frames + 10 * n + i) for i, keep in enumerate(keeps)]
    assert all(sum(b) == k for b, k in zip(budgets, keeps))


def test_fidelity_vcast_random_videos_spread_budgets_unevenly():
    rng = random.Random(0)
    uneven = 0
    for case in range(40):
        frames, n = rng.randint(2, 12), rng.randint(1, 40)
        keep = rng.randint(frames, frames * n)
        budget = check(frames, n, keep, seed=case, dim=rng.choice([3, 8, 16]), drift=rng.choice([0.1, 1.0, 3.0]))
        uneven += max(budget) - min(budget) >= 2
    assert uneven >= 20  # the curvature moves budgets between frames (not just the remainder)


def test_fidelity_vcast_float32_features_match_too():
    """float32 features: our cosine (one matrix-vector product) and per-pair means round differently
    from REF's, which could only flip float32 near-ties; none here."""
    for case, (frames, n, dim) in enumerate([(4, 36, 64), (8, 48, 128), (16, 30, 256)]):
        for keep in (frames, frames * n // 4, frames * n // 2):
            check(frames, n, keep, seed=case, dim=dim, dtype=torch.float32)


def test_fidelity_vcast_reference_syncs_grow_with_the_frames():
    """The docstring's count of REF's host syncs (its compress step, without the grid reads at
    REF:24-26, :307): 3 in the allocation, 6 per leftover token, 1 per frame."""
    counts = []
    for pairs in (4, 16, 32):
        feats = video(pairs, 36, 64, seed=pairs, dtype=torch.float32)
        with counting_syncs() as syncs:
            ref_compress_frames(feats.view(pairs, 36, 64), [], math.floor(0.25 * len(feats)))
        counts.append(syncs["n"])
    assert counts == [19, 73, 131]


@pytest.mark.parametrize("frames,n", [(4, 36), (8, 48), (6, 10)])
def test_fidelity_vcast_reference_own_budget_at_its_default(frames, n):
    """Where 0.25 N is whole, the reference's round(0.25 N) is our floor(0.25 N): the reference
    run with its own budget (REF:135-139) keeps what ours keeps at R = 0.25."""
    assert frames * n % 4 == 0
    ref_total, _ = ref_total_budget(frames, n, DEFAULT_RETAIN_RATIO, DEFAULT_MIN_K)
    assert ref_total == kept_count(0.25, frames * n, frames)
    check(frames, n, None, seed=frames * n)


def test_fidelity_vcast_allocation_matches_the_reference():
    """`allocate` against REF:48-111 on float32 weights, peaked ones too (so caps bind)."""
    g = torch.Generator().manual_seed(3)
    for case in range(300):
        t = int(torch.randint(1, 20, (1,), generator=g))
        n = int(torch.randint(1, 30, (1,), generator=g))
        total = int(torch.randint(t, t * n + 1, (1,), generator=g))
        sharp = [0.5, 3.0, 10.0][case % 3]
        weights = torch.softmax(sharp * torch.randn(t, generator=g), dim=0)
        expected = ref_allocate_budget_per_frame(weights, total, min_k=1, max_k=n)
        got = vcast.allocate(weights, total, torch.full((t,), n, dtype=torch.long))
        assert got.tolist() == expected.tolist(), (case, t, n, total)
        assert got.sum().item() == total and got.min().item() >= 1 and got.max().item() <= n


def test_fidelity_vcast_leftover_goes_to_the_largest_fraction_until_its_cap():
    """REF:94-100 never lowers the fraction it adds to: 4 frames, weights 0.26 0.26 0.26 0.22, 6
    tokens beyond one each (raw 1.56 1.56 1.56 1.32): floors 1 each leave 2, and both go to the
    first frame of largest fraction (largest remainder would give one to each of the first two)."""
    weights = torch.tensor([0.26, 0.26, 0.26, 0.22])
    sizes = torch.full((4,), 10, dtype=torch.long)
    expected = ref_allocate_budget_per_frame(weights, 10, min_k=1, max_k=10)
    assert expected.tolist() == [4, 2, 2, 2]
    assert vcast.allocate(weights, 10, sizes).tolist() == [4, 2, 2, 2]
    # with the first frame's cap at 3 tokens, the next leftover goes to the next largest fraction
    assert vcast.allocate(weights, 10, torch.tensor([3, 10, 10, 10])).tolist() == [3, 3, 2, 2]


def test_fidelity_vcast_take_back_matches_the_reference():
    """REF:101-109, reached only through float32 rounding of the floors (never at these sizes), on
    hand-made allocations: one pass in ascending weight, one token from each frame above min_k."""
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        t = int(torch.randint(1, 12, (1,), generator=g))
        alloc = torch.randint(1, 6, (t,), generator=g)
        weights = torch.rand(t, generator=g)
        over = int(torch.randint(0, t + 2, (1,), generator=g))
        expected = ref_take_back(alloc.clone(), weights, over, 1)
        assert vcast.take_back(alloc, weights, torch.tensor(over), 1).tolist() == expected.tolist()


def test_fidelity_vcast_curvature_and_weights():
    """Our curvature and softmax weights are REF:33-45, :133 (float64 frame representations)."""
    reps = F.normalize(torch.randn(9, 5, dtype=torch.float64), dim=-1)
    assert torch.equal(vcast.curvature(reps), ref_compute_curvature(reps))
    assert vcast.curvature(reps)[[0, -1]].tolist() == [1.0, 1.0]
    assert torch.equal(vcast.curvature(reps[:1]), torch.ones(1))
    expected = torch.softmax(ref_compute_curvature(reps).float() / 0.7, dim=0)
    assert torch.equal(vcast.budget_weights(vcast.curvature(reps)), expected)


# what users rely on


@pytest.mark.parametrize("sizes", [[12], [12, 12, 12], [20, 6, 9, 1, 14], [3, 3, 40, 40, 7, 2]])
def test_vcast_keeps_exactly_keep_with_one_per_pair(sizes):
    """Exactly `keep` tokens, at least one per pair, each in its pair's size, pairs of any sizes."""
    n = sum(sizes)
    feats = torch.randn(n, 6, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for keep in sorted({len(sizes), len(sizes) + 1, n // 3, n // 2, n - 1, n}):
        compression, _, sizes_out, _ = ours(feats, sizes, keep)
        kept = compression.kept
        assert len(kept) == keep and sizes_out.tolist() == [1] * keep
        per_pair = [int(((kept >= s) & (kept < s + m)).sum()) for s, m in zip(starts, sizes)]
        assert min(per_pair) >= 1 and sum(per_pair) == keep
        assert set(compression.assignment.tolist()) <= set(kept.tolist()) | {DROPPED}


def test_vcast_at_r_1_keeps_everything_unchanged():
    feats = video(6, 10, 8, seed=2)
    compression, destinations, sizes, (merged,) = ours(feats, [10] * 6, 60)
    assert compression.assignment.tolist() == list(range(60))
    assert torch.equal(merged, feats) and sizes.tolist() == [1] * 60


def test_vcast_one_pair_is_compressed_to_keep():
    """A one-pair video: its budget is all `keep` (the reference leaves T = 1 uncompressed)."""
    feats = video(1, 30, 8, seed=4)
    compression, *_ = ours(feats, [30], 7)
    assert len(compression.kept) == 7


def test_vcast_bfloat16_features():
    """bfloat16 input: exactly keep, on the features' device, the same choice as its float32 copy
    (ours computes in float32 either way)."""
    feats = video(8, 24, 16, seed=7, dtype=torch.bfloat16)
    compression, _, _, (merged,) = ours(feats, [24] * 8, 48)
    assert len(compression.kept) == 48 and merged.dtype == torch.bfloat16
    assert compression.assignment.device == feats.device
    assert torch.equal(compression.assignment, ours(feats.float(), [24] * 8, 48)[0].assignment)


def test_vcast_needs_no_attention():
    tokens = VisualTokens(video(3, 5, 4, seed=1), [5] * 3, [(1, 1, 5)] * 3, received_attention=None, keys=None)
    assert len(vcast.compress(tokens, 6).kept) == 6


@pytest.mark.parametrize("keep", [2, 61])
def test_vcast_impossible_keep_is_a_clear_error(keep):
    tokens = VisualTokens(video(3, 20, 4, seed=1), [20] * 3, [(1, 4, 5)] * 3)
    with pytest.raises(ValueError, match="outside"):
        vcast.compress(tokens, keep)


def test_vcast_host_syncs_are_none_whatever_the_pairs():
    counts = []
    for pairs in (4, 16):
        feats = video(pairs, 36, 64, seed=pairs, dtype=torch.float32)
        tokens = VisualTokens(feats, [36] * pairs, [(1, 6, 6)] * pairs)
        with counting_syncs() as syncs:
            vcast.compress(tokens, math.floor(0.25 * len(feats)))
        counts.append(syncs["n"])
    assert counts == [0, 0]
