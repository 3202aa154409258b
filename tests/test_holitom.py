"""HoliTom's outer-LLM stage on fixed hand-made videos: the dynamic-programming segmentation, static
chains, attention selection and DPC-kNN merging, with the expected outputs worked out by hand."""

import math

import pytest
import torch

from resadapt_eval.baselines import holitom
from resadapt_eval.baselines.common import DROPPED, VisualTokens, merge_groups

# 4 pairs of 6 tokens (grid 1 x 2 x 3); token = unit 2-d vector at an angle (degrees), so the cosine of
# two tokens is the cosine of their angle difference.
ANGLES = [  # ANGLES[pair][position]
    # pos0  pos1      pos2      pos3  pos4  pos5
    [0, 90, 45, 180, 0, 30],
    [0, 90, 45 + 25.84, 270, 90, 120],
    [0, 90 + 18.19, 45 + 25.84, 0, 180, 210],
    [0, 90 + 18.19 + 90, 45 + 25.84 + 180, 0, 270, 300],
]
# Step similarities (pair p -> p + 1), per position:
#   step 0: 1, 1,    0.90, 0, 0, 0     static (> tau = 0.8): pos 0, 1, 2
#   step 1: 1, 0.95, 1,    0, 0, 0     static: pos 0, 1, 2
#   step 2: 1, 0,    -1,   1, 0, 0     static: pos 0, 3
ATTENTION = [
    [0.1, 0.2, 0.3, 0.6, 0.5, 0.4],
    [0.1, 0.2, 0.3, 0.4, 0.6, 0.5],
    [0.3, 0.2, 0.1, 0.5, 0.4, 0.6],
    [0.6, 0.5, 0.4, 0.3, 0.2, 0.1],
]


def video() -> VisualTokens:
    feats = [[math.cos(math.radians(a)), math.sin(math.radians(a))] for row in ANGLES for a in row]
    return VisualTokens(
        torch.tensor(feats), [6] * 4, [(1, 2, 3)] * 4, torch.tensor([a for row in ATTENTION for a in row])
    )


def segments_by_loops(sims, tau=0.8):
    """The reference's rule: saved[s][e] = (e - s) x positions static over all steps s..e-1; the dynamic
    programme takes a window only when it saves strictly more, shortest window first."""
    num = len(sims) + 1
    saved = [[0] * num for _ in range(num)]
    for s in range(num):
        for e in range(s + 1, num):
            static = sum(all(sims[t][i] > tau for t in range(s, e)) for i in range(len(sims[0])))
            saved[s][e] = (e - s) * static
    best, start = [0] * num, [0] * num
    for i in range(num):
        best[i], start[i] = (best[i - 1] if i else 0), i
        for size in range(2, i + 2):
            j = i - size + 1
            if (best[j - 1] if j else 0) + saved[j][i] > best[i]:
                best[i], start[i] = (best[j - 1] if j else 0) + saved[j][i], j
    windows, i = [], num - 1
    while i >= 0:
        windows.append((start[i], i))
        i = start[i] - 1
    return windows[::-1]


def test_segmentation_by_dynamic_programming():
    # Saved tokens per window (by hand from the step table):
    #   [0,1] 1 x 3 = 3   [1,2] 1 x 3 = 3   [2,3] 1 x 2 = 2
    #   [0,2] 2 x 3 = 6   [1,3] 2 x 1 = 2   [0,3] 3 x 1 = 3
    # best[1] = 3 ([0,1]); best[2] = 6 ([0,2]); best[3]: alone 6, [2,3] 3 + 2 = 5, [1,3] 0 + 2, [0,3] 3,
    # so pair 3 stands alone (a tie would also keep it alone): windows [0, 2] and [3, 3], 6 tokens saved.
    sims = [[math.cos(math.radians(b - a)) for a, b in zip(ANGLES[p], ANGLES[p + 1])] for p in range(3)]
    assert segments_by_loops(sims) == [(0, 2), (3, 3)]
    tokens = video()
    steps = holitom.step_matches(tokens, torch.nn.functional.normalize(tokens.features, dim=-1))
    gains = holitom.redundancy_gains(steps, tokens.pair_sizes, 0.8)
    assert [gains[0][1], gains[0][2], gains[0][3], gains[1][2], gains[1][3], gains[2][3]] == [3, 6, 3, 3, 2, 2]
    assert holitom.temporal_segments(gains) == [(0, 2), (3, 3)]


def test_fixed_video_keep_8():
    # Window [0, 2]: static chains pos 0, 1, 2 (tokens 0/6/12, 1/7/13, 2/8/14); 24 - 2 x 3 = 18 tokens left.
    # Units: dynamic pos 3-5 of pairs 0, 1, 2 (3 each), pair 3 (6), static chains of window 0 (3):
    # quotas 8 x [3, 3, 3, 6, 3] / 18 = [1.33, 1.33, 1.33, 2.67, 1.33] -> [1, 1, 1, 2, 1], the two left
    # to the largest remainders (pair 3, then pair 0): [2, 1, 1, 3, 1].
    # Dynamic by attention: pair 0 pos 3, 4 (0.6, 0.5); pair 1 pos 4 (0.6); pair 2 pos 5 (0.6); pair 3 pos 0-2.
    # Static, one centre: with k = 1 every density is exp(0), so chain 0 (lowest index) is the densest and
    # its distance-to-denser is the largest distance: all three chains merge into token 0.
    expected = [0, 0, 0, 3, 4, DROPPED]
    expected += [0, 0, 0, DROPPED, 10, DROPPED]
    expected += [0, 0, 0, DROPPED, DROPPED, 17]
    expected += [18, 19, 20, DROPPED, DROPPED, DROPPED]
    assert holitom.compress(video(), 8).assignment.tolist() == expected


def unit(angle):
    return [math.cos(math.radians(angle)), math.sin(math.radians(angle))]


def mean(vectors):
    return [sum(v[d] for v in vectors) / len(vectors) for d in range(len(vectors[0]))]


def test_fixed_video_keep_8_weighs_the_centre_by_beta():
    # The cluster of token 0: centre chain pos 0 (temporal mean c), merged chains pos 1 and 2 (temporal means
    # m1, m2): 0.6 c + 0.4 (m1 + m2) / 2. Every other group is one dynamic token, as it is.
    tokens = video()
    chain = {pos: mean([unit(ANGLES[p][pos]) for p in range(3)]) for pos in range(3)}
    cluster = [0.6 * chain[0][d] + 0.4 * (chain[1][d] + chain[2][d]) / 2 for d in range(2)]
    destinations, _, (merged,) = merge_groups(holitom.compress(tokens, 8), tokens.features.double())
    assert destinations.tolist() == [0, 3, 4, 10, 17, 18, 19, 20]
    expected = [cluster] + [unit(ANGLES[i // 6][i % 6]) for i in destinations.tolist()[1:]]
    torch.testing.assert_close(merged, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


def test_fixed_video_keep_8_weights_hold_beta_exactly():
    # The same cluster's weights, float64: each of the centre chain's 3 tokens (0, 6, 12) 0.6 / 3, each token
    # of the 2 merged chains (1, 7, 13 and 2, 8, 14) 0.4 / 2 / 3; beta is not rounded to float32 on the way.
    weights = holitom.compress(video(), 8).weights
    assert weights.dtype == torch.float64
    assert weights[[0, 6, 12]].tolist() == [holitom.BETA / 3] * 3
    assert weights[[1, 7, 13, 2, 8, 14]].tolist() == [(1 - holitom.BETA) / 2 / 3] * 6


def test_fixed_video_keep_20_releases_the_weakest_chain():
    # Temporal merging alone leaves 18 < 20 tokens: the weakest chain, pos 2 (lowest similarity 0.90;
    # pos 1: 0.95, pos 0: 1), returns to the dynamic set, leaving 20. Every set is then kept whole; the
    # two remaining chains are both centres: tokens 6, 12 merge into 0 and 7, 13 into 1.
    expected = list(range(24))
    expected[6] = expected[12] = 0
    expected[7] = expected[13] = 1
    out = holitom.compress(video(), 20)
    assert out.assignment.tolist() == expected
    # a centre that gathers no other chain is its temporal mean
    _, _, (merged,) = merge_groups(out, video().features.double())
    for row, pos in ((0, 0), (1, 1)):
        torch.testing.assert_close(
            merged[row], torch.tensor(mean([unit(ANGLES[p][pos]) for p in range(3)]), dtype=torch.float64)
        )


def test_tau_follows_the_retention_entering_the_llm():
    # 2 pairs of 9 (N = 18). Position 0 turns by 45.57 degrees (cosine 0.70, static at tau 0.65, not at 0.8), the
    # others by 90; position 0 has the most attention in both pairs, then position 8.
    # keep = 2 < N / 8: tau 0.65, position 0 is a static chain (tokens 0, 9); keep 2 over the dynamic sets (8, 8)
    # and the chain (1): quotas 0.94, 0.94, 0.12 -> 1, 1, 0, so the chain goes and each pair keeps position 8.
    # keep = 3 >= N / 8: tau 0.8, no chain; quotas 1.5, 1.5 -> 2, 1: pair 0 keeps positions 0 and 8, pair 1 position 0.
    assert holitom.static_threshold(2, 18) == 0.65 and holitom.static_threshold(3, 18) == 0.8
    assert holitom.static_threshold(10, 80) == 0.8 and holitom.static_threshold(9, 80) == 0.65  # N / 8 exactly: 0.8
    angles = [40 * j for j in range(9)]
    feats = [unit(a) for a in angles] + [unit(angles[0] + 45.57)] + [unit(a + 90) for a in angles[1:]]
    attention = [0.9] + [j / 100 for j in range(1, 9)]
    tokens = VisualTokens(torch.tensor(feats), [9, 9], [(1, 3, 3)] * 2, torch.tensor(attention * 2))
    low = [DROPPED] * 18
    low[8], low[17] = 8, 17
    assert holitom.compress(tokens, 2).assignment.tolist() == low
    high = [DROPPED] * 18
    high[0], high[8], high[9] = 0, 8, 9
    assert holitom.compress(tokens, 3).assignment.tolist() == high


def test_fully_static_window_keeps_a_token_per_pair():
    # Two identical pairs of 2 tokens: window [0, 1] with chains 0/2 and 1/3 would leave pair 1 empty, so
    # the weaker chain (a tie at 1.0: the lower index, 0/2) returns to the dynamic set. keep = 2: dynamic
    # sets {0}, {2} and the static chain 1/3 get quotas 2/3 each -> floors 1, 1, 0: the chain is dropped.
    tokens = VisualTokens(torch.tensor([[1.0, 0], [0, 1.0]] * 2), [2, 2], [(1, 1, 2)] * 2, torch.tensor([0.5] * 4))
    assert holitom.compress(tokens, 2).assignment.tolist() == [0, DROPPED, 2, DROPPED]
    assert holitom.compress(tokens, 3).assignment.tolist() == [0, 1, 2, 1]


def test_unequal_grids_follow_the_most_similar_token():
    # Pair 0 (grid 1x1x3): e1, u = (0, 1, 0), v = (0, 0.9, 0.436); pair 1 (grid 1x3x1): w = (0, 0.95, 0.312),
    # e1, e3. Followers: e1 -> e1 (1.0); u -> w (0.95) and v -> w (0.991): w keeps its most similar, v,
    # and u has none. Static chains: e1 (0 -> 4) and v (2 -> 3); 6 - 2 = 4 tokens left. keep = 3: dynamic
    # {u = 1}, {e3 = 5} and the 2 chains get quotas 0.75, 0.75, 1.5 -> 1, 1, 1; one centre, chain 0 (e1),
    # takes both chains: 0, 2, 3, 4 -> 0.
    feats = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0.9, 0.436], [0, 0.95, 0.312], [1.0, 0, 0], [0, 0, 1.0]])
    tokens = VisualTokens(feats, [3, 3], [(1, 1, 3), (1, 3, 1)], torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))
    assert holitom.compress(tokens, 3).assignment.tolist() == [0, 1, 0, 0, 0, 5]


def random_video(sizes, grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    scene = torch.randn(max(sizes), 16, generator=g)
    feats = torch.cat([scene[:n] + 0.3 * torch.randn(n, 16, generator=g) for n in sizes])
    return VisualTokens(feats, sizes, grids, torch.rand(sum(sizes), generator=g))


@pytest.mark.parametrize(
    "sizes, grids",
    [
        ([6] * 4, [(1, 2, 3)] * 4),
        ([12] * 8, [(1, 3, 4)] * 8),
        ([12, 12, 9, 9, 12, 6, 6, 6], [(1, 3, 4), (1, 4, 3), (1, 3, 3), (1, 3, 3), (1, 3, 4)] + [(1, 2, 3)] * 3),
    ],
)
def test_budget_exact_one_per_pair_identity(sizes, grids):
    tokens = video() if sizes == [6] * 4 else random_video(sizes, grids)
    total = sum(sizes)
    for keep in sorted({len(sizes), len(sizes) + 1, total // 4, total // 2, total - 1, total}):
        out = holitom.compress(tokens, keep).assignment
        destinations = out[out != DROPPED].unique()
        assert len(destinations) == keep
        assert torch.equal(out[destinations], destinations)
        starts = tokens.pair_starts
        for s, n in zip(starts, sizes, strict=True):
            assert ((destinations >= s) & (destinations < s + n)).any()
        assert torch.equal(out, holitom.compress(tokens, keep).assignment)
    assert torch.equal(holitom.compress(tokens, total).assignment, torch.arange(total))
    with pytest.raises(ValueError):
        holitom.compress(VisualTokens(tokens.features, sizes, grids), len(sizes)).assignment
