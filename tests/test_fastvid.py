"""FastVID on a fixed hand-made video: DySeg cuts, STPrune budgets, salient / anchor / merged tokens,
checked against the paper's rules written out as plain loops here."""

import math

import pytest
import torch

from resadapt_eval.baselines import fastvid
from resadapt_eval.baselines.common import DROPPED, VisualTokens, merge_groups, per_pair_budget

# 14 pairs of 6 tokens (grid 1 x 2 x 3), 4-d features: a scene vector plus an irregular pattern.
A, B, C, D = (4.0, 0, 0, 0), (0, 4.0, 0, 0), (0, 0, 4.0, 0), (0, 0, 0, 4.0)
MIX = (0, 0, 2.4, 3.2)  # 0.6 C + 0.8 D: like C, but not enough (cosine of the pair means 0.71)
SCENES = [A, A, A, A, A, B, C, D, A, B, B, C, MIX, A]
TOKENS = 6


def video() -> VisualTokens:
    feats = [
        [SCENES[p][d] + 1.5 * ((11 * p + 7 * j + 5 * d + p * j * d) % 17) / 17 for d in range(4)]
        for p in range(len(SCENES))
        for j in range(TOKENS)
    ]
    attention = [((7 * p + 5 * j) % 11) / 10 for p in range(len(SCENES)) for j in range(TOKENS)]
    return VisualTokens(
        torch.tensor(feats),
        [TOKENS] * len(SCENES),
        [(1, 2, 3)] * len(SCENES),
        torch.tensor(attention),
    )


# ---- the paper's rules as plain loops (float64), independent of the module ----


def cosine(u, v):
    return sum(a * b for a, b in zip(u, v)) / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))


def segments_by_hand(feats, sizes):
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    means = [[sum(feats[s + j][d] for j in range(n)) / n for d in range(len(feats[0]))] for s, n in zip(starts, sizes)]
    sims = [cosine(means[i], means[i + 1]) for i in range(len(sizes) - 1)]
    by_similarity = sorted(range(len(sims)), key=lambda i: sims[i])
    cuts = set(by_similarity[:7]) | {i for i in range(len(sims)) if sims[i] < 0.84}  # c - 1 = 7, tau = 0.84
    segments, current = [], [0]
    for p in range(1, len(sizes)):
        if p - 1 in cuts:
            segments.append(current)
            current = [p]
        else:
            current.append(p)
    segments.append(current)
    return segments


def density_peaks_by_hand(points, count):
    """DPC-kNN: density over the 4 nearest (self included), distance to the nearest denser point, top score."""
    n, dim = len(points), len(points[0])
    dist = [[math.dist(points[i], points[j]) / math.sqrt(dim) for j in range(n)] for i in range(n)]
    density = [math.exp(-sum(x * x for x in sorted(dist[i])[: min(4, n)]) / min(4, n)) for i in range(n)]
    largest = max(max(row) for row in dist)
    score = []
    for i in range(n):
        denser = [dist[i][j] for j in range(n) if density[j] > density[i] or (density[j] == density[i] and j < i)]
        score.append(density[i] * (min(denser) if denser else largest))
    order = sorted(range(n), key=lambda i: (-score[i], i))
    if count < n:  # the choice is not a float tie
        assert score[order[count - 1]] - score[order[count]] > 1e-5
    return order[:count]


def deal_by_hand(total, room):
    given = [0] * len(room)
    while total > 0 and any(given[i] < room[i] for i in range(len(room))):
        for i in range(len(room)):
            if total > 0 and given[i] < room[i]:
                given[i] += 1
                total -= 1
    return given


def fastvid_by_hand(feats, attention, sizes, keep):
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    budget = per_pair_budget(sizes, keep)
    assignment = [DROPPED] * sum(sizes)
    for segment in segments_by_hand(feats, sizes):
        length = len(segment)
        contextual = [int(0.4 * budget[p]) for p in segment]  # d = 0.4
        salient = [budget[p] - c for p, c in zip(segment, contextual)]
        anchor_at = [j for j in range(length) if (length - 1 - j) % 4 == 0]  # p = 4, counted back from the last
        dealt = deal_by_hand(sum(contextual), [sizes[segment[j]] - salient[j] for j in anchor_at])
        anchors = [0] * length
        for j, a in zip(anchor_at, dealt):
            anchors[j] = a
        room = [sizes[p] - salient[j] - anchors[j] for j, p in enumerate(segment)]
        salient = [s + e for s, e in zip(salient, deal_by_hand(sum(contextual) - sum(dealt), room))]
        rest, targets = [], []
        for j, p in enumerate(segment):
            index = list(range(starts[p], starts[p] + sizes[p]))
            ranked = sorted(index, key=lambda i: (-attention[i], i))
            for i in ranked[: salient[j]]:
                assignment[i] = i
            others = [i for i in index if i not in ranked[: salient[j]]]
            if anchors[j]:
                targets += [others[k] for k in density_peaks_by_hand([feats[i] for i in others], anchors[j])]
            rest += others
        for i in rest:
            if targets:
                sims = sorted(((cosine(feats[i], feats[t]), t) for t in targets), key=lambda x: -x[0])
                assert len(sims) == 1 or sims[0][0] - sims[1][0] > 1e-5 or sims[0][1] == i
                assignment[i] = sims[0][1]
        for t in targets:
            assignment[t] = t
    return assignment


# ---- tests ----


def test_dyseg_rule_on_hand_similarities():
    # 9 transitions: the 7 lowest (0.1 .. 0.7) are cuts whatever their value, 0.8 < tau = 0.84 is a cut
    # too; only transition 1 (0.95) is not, so pairs 1 and 2 share a segment.
    sims = [0.1, 0.95, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    assert fastvid.dynamic_segments(sims) == [[0], [1, 2], [3], [4], [5], [6], [7], [8], [9]]
    # with only 4 transitions all are among the c - 1 = 7 lowest, even the similar ones
    assert fastvid.dynamic_segments([0.99, 0.99, 0.99, 0.99]) == [[0], [1], [2], [3], [4]]


def test_fixed_video_segments():
    tokens = video()
    # Transitions 0-3 and 9 (A A A A A, B B) are similar (> 0.99). The other 7 but one (4-8, 10, 12: 0.29 to
    # 0.40) are the c - 1 = 7 lowest, so cuts; 11 (C -> MIX, 0.71) is not among them but below tau = 0.84, a cut too.
    expected = [[0, 1, 2, 3, 4], [5], [6], [7], [8], [9, 10], [11], [12], [13]]
    assert segments_by_hand(tokens.features.tolist(), tokens.pair_sizes) == expected
    assert fastvid.dynamic_segments(fastvid.frame_similarities(tokens)) == expected


@pytest.mark.parametrize(
    "keep, kept_per_pair",
    [
        # 3 per pair: 1 contextual + 2 salient. Segment 0-4: anchor frames 0 and 4 share 5 anchors (3 + 2);
        # segment 9-10: anchor frame 10 gets both; a one-pair segment is its own anchor frame.
        (42, [5, 2, 2, 2, 4, 3, 3, 3, 3, 2, 4, 3, 3, 3]),
        # 5 per pair: 2 contextual + 3 salient. Segment 0-4: anchor frames 0 and 4 hold at most 3 anchors
        # each (6 - 3 salient), so 4 of the 10 become salient in pairs 1, 2, 3, 1; in segment 9-10 one of
        # the 4 anchors spills to pair 9.
        (70, [6, 5, 4, 4, 6, 5, 5, 5, 5, 4, 6, 5, 5, 5]),
    ],
)
def test_fixed_video_matches_rule(keep, kept_per_pair):
    tokens = video()
    out = fastvid.compress(tokens, keep).assignment
    expected = fastvid_by_hand(tokens.features.tolist(), tokens.received_attention.tolist(), tokens.pair_sizes, keep)
    assert out.tolist() == expected
    kept = out[out == torch.arange(len(out))]
    assert [int(((kept >= 6 * p) & (kept < 6 * p + 6)).sum()) for p in range(14)] == kept_per_pair
    assert len(kept) == keep
    assert any(d not in (DROPPED, i) for i, d in enumerate(expected))  # some tokens were merged


@pytest.mark.parametrize("keep", [42, 70])
def test_merged_features_weigh_the_anchor_by_beta(keep):
    # DTM merge: an anchor a gathering n tokens (itself included) becomes w a + (1 - w) x their mean,
    # w = max(beta, 1 / (n + 1)) = 0.6; a salient token (or a lone anchor) stays as it is.
    tokens = video()
    feats = tokens.features.double()
    groups = {}
    for i, d in enumerate(fastvid_by_hand(feats.tolist(), tokens.received_attention.tolist(), tokens.pair_sizes, keep)):
        if d != DROPPED:
            groups.setdefault(d, []).append(i)
    assert max(len(m) for m in groups.values()) >= 3
    expected = []
    for d in sorted(groups):
        n = len(groups[d])
        w = max(0.6, 1 / (n + 1))
        mean = [sum(feats[i][c].item() for i in groups[d]) / n for c in range(4)]
        expected.append([w * feats[d][c].item() + (1 - w) * mean[c] for c in range(4)])
    destinations, _, (merged,) = merge_groups(fastvid.compress(tokens, keep), feats)
    assert destinations.tolist() == sorted(groups)
    torch.testing.assert_close(merged, torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=0)
    # a group of two: the anchor weighs 0.6 + 0.4 / 2 = 0.8, its member 0.2
    pair = next(d for d in sorted(groups) if len(groups[d]) == 2)
    other = next(i for i in groups[pair] if i != pair)
    row = destinations.tolist().index(pair)
    torch.testing.assert_close(merged[row], 0.8 * feats[pair] + 0.2 * feats[other], atol=1e-9, rtol=0)


@pytest.mark.parametrize("keep", [14, 15, 30, 42, 57, 70, 83, 84])
def test_budget_exact_one_per_pair_identity(keep):
    tokens = video()
    out = fastvid.compress(tokens, keep).assignment
    destinations = out[out != DROPPED].unique()
    assert len(destinations) == keep
    assert torch.equal(out[destinations], destinations)  # every destination is kept as itself
    for p in range(14):
        assert ((destinations >= 6 * p) & (destinations < 6 * p + 6)).any()
    assert torch.equal(out, fastvid.compress(tokens, keep).assignment)
    if keep == 84:
        assert torch.equal(out, torch.arange(84))


def test_unequal_grids_and_missing_attention():
    # pairs of different sizes need no position correspondence: budgets stay exact
    g = torch.Generator().manual_seed(1)
    sizes = [6, 12, 12, 4, 9, 9, 9, 9, 9, 9]
    grids = [(1, 2, 3), (1, 3, 4), (1, 4, 3), (1, 2, 2)] + [(1, 3, 3)] * 6
    tokens = VisualTokens(torch.randn(sum(sizes), 8, generator=g), sizes, grids, torch.rand(sum(sizes), generator=g))
    for keep in (10, 25, 60, sum(sizes)):
        out = fastvid.compress(tokens, keep).assignment
        assert len(out[out != DROPPED].unique()) == keep
    assert torch.equal(fastvid.compress(tokens, sum(sizes)).assignment, torch.arange(sum(sizes)))
    with pytest.raises(ValueError):
        fastvid.compress(VisualTokens(tokens.features, sizes, grids), 20).assignment
