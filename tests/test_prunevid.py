"""PruneVid's vision side: DPC-KNN, segment refinement, static merging on a hand-made video, budgets, identity."""

import math

import torch

from resadapt_eval.baselines.common import DROPPED, VisualTokens
from resadapt_eval.baselines.prunevid import compress, dpc_knn, refine_clusters, temporal_segments

GRID = (1, 2, 2)


def unit(i: int, scale: float = 1.0, dim: int = 9) -> list[float]:
    v = [0.0] * dim
    v[i] = scale
    return v


def add(*vectors: list[float]) -> list[float]:
    return [sum(x) for x in zip(*vectors)]


def hand_made_video() -> list[list[list[float]]]:
    """Eight pairs of four tokens, two scenes (pairs 0-3 and 4-7). In each scene, positions 0 and 1 are a large
    static vector (scene A: axes 0, 1; scene B: axes 2, 3) with a drift along axis 4 of j * (0.5, 1.0) for scene A,
    j * (1.5, 2.0) for scene B (j = pair index in the scene), so static similarities are distinct and decrease in
    that order; positions 2 and 3 are dynamic: orthogonal axes 5-8 changing every pair (cosine 0 across pairs)."""
    frames = []
    for p in range(8):
        scene, j = divmod(p, 4)
        a, b = (0, 1) if scene == 0 else (2, 3)
        drift0, drift1 = (0.5, 1.0) if scene == 0 else (1.5, 2.0)
        frames.append(
            [
                add(unit(a, 10), unit(4, drift0 * j)),
                add(unit(b, 10), unit(4, drift1 * j)),
                unit(5 + j, 3),
                unit(5 + (j + 1) % 4, 3),
            ]
        )
    return frames


def as_tokens(frames, grids=None) -> VisualTokens:
    return VisualTokens(
        features=torch.tensor([t for f in frames for t in f]),
        pair_sizes=[len(f) for f in frames],
        grids=grids or [GRID] * len(frames),
    )


def cosine(u, v) -> float:
    return sum(a * b for a, b in zip(u, v)) / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))


def paper_static_merging(frames, segments, keep: int) -> list[int]:
    """The paper's static token merging written plainly, with the budget rule: a position is static when the mean
    cosine of its tokens over all ordered pairs of distinct frames of the segment exceeds 0.8; static positions merge
    (all their tokens into the segment's first frame) most similar first, skipping merges that would go below
    `keep` tokens or leave a segment without a dynamic position, or make the groups outnumber `keep`."""
    starts = [4 * p for p in range(len(frames))]
    candidates = []
    for s, seg in enumerate(segments):
        for pos in range(4):
            pairs = [(w, t) for w in seg for t in seg if w != t]
            sim = sum(cosine(frames[w][pos], frames[t][pos]) for w, t in pairs) / len(pairs)
            if sim > 0.8:
                candidates.append((sim, s, pos))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    assignment = list(range(4 * len(frames)))
    count, groups, static = 4 * len(frames), len(frames), {s: 0 for s in range(len(segments))}
    for _, s, pos in candidates:
        new_group = 1 if static[s] == 0 else 0
        if static[s] + 1 < 4 and count - (len(segments[s]) - 1) >= keep and groups + new_group <= keep:
            for p in segments[s]:
                assignment[starts[p] + pos] = starts[segments[s][0]] + pos
            static[s] += 1
            count -= len(segments[s]) - 1
            groups += new_group
    return assignment


def paper_dpc_knn(points, num_clusters: int, k: int) -> list[int]:
    """DPC-KNN as the paper and its code define it, with loops: d = euclidean / sqrt(C); density = exp(-mean d^2
    over the k nearest, itself included); delta = distance to the nearest denser point (ties: lower index is
    denser), the largest distance for the densest; centres = largest density * delta; nearest-centre assignment."""
    n, c = len(points), len(points[0])
    d = [[math.dist(p, q) / math.sqrt(c) for q in points] for p in points]
    rho = [math.exp(-sum(x * x for x in sorted(row)[:k]) / k) for row in d]
    largest = max(max(row) for row in d)
    delta = []
    for i in range(n):
        denser = [j for j in range(n) if rho[j] > rho[i] or (rho[j] == rho[i] and j < i)]
        delta.append(min((d[i][j] for j in denser), default=largest))
    centres = sorted(range(n), key=lambda i: (-rho[i] * delta[i], i))[:num_clusters]
    owner = [min(centres, key=lambda ctr: (d[i][ctr], centres.index(ctr))) for i in range(n)]
    for ctr in centres:
        owner[ctr] = ctr
    return owner


def check_budget(tokens: VisualTokens, assignment: torch.Tensor, keep: int) -> None:
    n = tokens.features.shape[0]
    assert assignment.shape == (n,) and assignment.dtype == torch.long
    assert not bool((assignment == DROPPED).any())  # PruneVid's vision side only merges
    destinations = set(assignment.tolist())
    assert len(destinations) == keep
    assert all(int(assignment[d]) == d for d in destinations)
    kept = assignment == torch.arange(n)
    for start, size in zip(tokens.pair_starts, tokens.pair_sizes):
        assert bool(kept[start : start + size].any())


def test_dpc_knn_matches_the_written_out_rule():
    g = torch.Generator().manual_seed(0)
    for n, clusters, k in [(12, 3, 7), (9, 4, 5), (5, 1, 7), (20, 6, 7)]:
        x = torch.randn(n, 6, generator=g, dtype=torch.float64)
        assert dpc_knn(x, clusters, k).tolist() == paper_dpc_knn(x.float().tolist(), clusters, min(k, n))


def test_refine_clusters_makes_contiguous_segments():
    # cluster 0 keeps its longest run (3-5); its run 0-1 and the lone 1 go to the right neighbour (run of 3)
    assert refine_clusters([0, 0, 1, 0, 0, 0, 2, 2]) == [0, 0, 0, 0, 0, 0, 2, 2]
    # cluster 3 keeps 0-1, cluster 5 keeps 4-6; frames 2-3 join the longer neighbour, 5 (3 frames against 2)
    assert refine_clusters([3, 3, 5, 3, 5, 5, 5]) == [3, 3, 5, 5, 5, 5, 5]
    # equal neighbours: the left one
    assert refine_clusters([4, 4, 7, 9, 9]) == [4, 4, 4, 9, 9]
    # only single-frame runs: no cluster survives, one segment
    assert refine_clusters([1, 2, 1, 2]) == [0, 0, 0, 0]


def test_hand_made_video_matches_the_paper_rule():
    frames = hand_made_video()
    tokens = as_tokens(frames)
    # Pair means: the two scenes are far apart (static axes 0, 1 vs 2, 3), pairs of a scene are close, so DPC-KNN's
    # two centres are the densest pair of each scene and every pair joins its scene's centre: two segments.
    segments = temporal_segments(tokens)
    assert segments == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Static candidates, most similar first: (A, 0), (A, 1), (B, 0), (B, 1); each merge of 4 tokens removes 3.
    # 29, 26, 20: stop after 1, 2 or 4 merges; 23: 3 merges, the last one skipped; no clustering is left to do.
    for keep in (32, 29, 26, 23, 20):
        assignment = compress(tokens, keep).assignment
        check_budget(tokens, assignment, keep)
        assert assignment.tolist() == paper_static_merging(frames, segments, keep)
    # keep 18: all 4 merges (20 tokens), then DPC-KNN: 10 groups of 2 tokens (static A, pairs 0-3, static B, pairs
    # 4-7) share 18 clusters; the largest-remainder split gives the last two groups (pairs 6, 7) one cluster each.
    # Two tokens have equal density and score, so the lower index is the centre: 27 -> 26, 31 -> 30.
    expected = paper_static_merging(frames, segments, 20)
    expected[27], expected[31] = 26, 30
    assert compress(tokens, 18).assignment.tolist() == expected
    # keep 8: no static group fits (the 8 pair groups already use the budget); each pair is one cluster
    assignment = compress(tokens, 8).assignment
    check_budget(tokens, assignment, 8)
    assert [len(set(assignment[4 * p : 4 * p + 4].tolist())) for p in range(8)] == [1] * 8


def test_different_grids_split_segments():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 8, generator=g)
    sizes = [4, 4, 4, 6, 6, 6]
    grids = [GRID] * 3 + [(1, 2, 3)] * 3
    feats = torch.cat([base[:s] + 0.01 * torch.randn(s, 8, generator=g) for s in sizes])
    tokens = VisualTokens(features=feats, pair_sizes=sizes, grids=grids)
    assert temporal_segments(tokens) == [[0, 1, 2], [3, 4, 5]]  # one DPC-KNN cluster, split at the grid change
    # nearly identical pairs: every position is static, but one position per segment stays dynamic
    assignment = compress(tokens, 30 - 2 * 3 - 2 * 5).assignment
    check_budget(tokens, assignment, 14)
    kept = assignment == torch.arange(30)
    assert [int(kept[s : s + n].sum()) for s, n in zip(tokens.pair_starts, sizes)] == [4, 1, 1, 6, 1, 1]


def test_budgets_identity_and_determinism():
    g = torch.Generator().manual_seed(0)
    for sizes in ([6] * 9, [4, 4, 6, 6, 4, 6, 6], [5]):
        grids = [(1, 2, 2) if s == 4 else (1, 2, 3) if s == 6 else (1, 1, 5) for s in sizes]
        n = sum(sizes)
        base = torch.randn(max(sizes), 16, generator=g)
        # a static background with noise growing over time, so some positions merge and segments form
        feats = torch.cat([base[:s] + 0.1 * (1 + p) * torch.randn(s, 16, generator=g) for p, s in enumerate(sizes)])
        tokens = VisualTokens(features=feats, pair_sizes=sizes, grids=grids)
        for keep in sorted({len(sizes), len(sizes) + 1, n - 1, n} | set(range(len(sizes), n, 3))):
            assignment = compress(tokens, keep).assignment
            check_budget(tokens, assignment, keep)
            assert torch.equal(assignment, compress(tokens, keep, seed=1).assignment)
        assert torch.equal(compress(tokens, n).assignment, torch.arange(n))
