"""DyCoke's temporal token merging: the paper's window rule on a hand-made video, budgets, identity."""

import math

import torch

from resadapt_eval.baselines.common import DROPPED, VisualTokens
from resadapt_eval.baselines.dycoke import compress, window_partners

GRID = (1, 2, 2)

# Five pairs of four tokens; each token is the 2-d unit vector at the given angle (degrees), so the cosine of two
# tokens is cos(difference of angles). Pair 0 and pair 4 are window references (1st of windows 0-3 and 4-7).
ANGLES = [
    [0, 40, 80, 120],  # pair 0
    [2, 70, 90, 170],  # pair 1, vs pair 0: differences 2, 30, 10, 50
    [15, 45, 125, 145],  # pair 2, vs pair 0: differences 15, 5, 45, 25
    [50, 48, 145, 153],  # pair 3, vs pair 2: differences 35, 3, 20, 8
    [200, 10, 90, 170],  # pair 4 (next window's reference), vs pair 0 one level up: differences 200, 30, 10, 50
]


def video(angles, grids=None) -> VisualTokens:
    feats = [[math.cos(math.radians(a)), math.sin(math.radians(a))] for frame in angles for a in frame]
    return VisualTokens(
        features=torch.tensor(feats), pair_sizes=[len(f) for f in angles], grids=grids or [GRID] * len(angles)
    )


def kept_set(assignment: torch.Tensor) -> set[int]:
    return {i for i, a in enumerate(assignment.tolist()) if a == i}


def paper_ttm(angles, kept_per_compared: int) -> set[int]:
    """The paper's TTM written plainly: windows of 4 pairs; the 2nd is compared with the 1st, the 3rd with the 1st,
    the 4th with the 3rd, token by token at the same position; a compared pair keeps its `kept_per_compared` tokens
    of lowest cosine with its partner; the window's 1st pair keeps everything."""
    starts = [sum(len(f) for f in angles[:p]) for p in range(len(angles))]
    kept = set()
    for p, frame in enumerate(angles):
        offset = p % 4
        if offset == 0:
            kept |= {starts[p] + i for i in range(len(frame))}
            continue
        partner = p - 2 if offset == 2 else p - 1
        cos = [math.cos(math.radians(frame[i] - angles[partner][i])) for i in range(len(frame))]
        order = sorted(range(len(frame)), key=lambda i: cos[i])
        kept |= {starts[p] + i for i in order[:kept_per_compared]}
    return kept


def check_budget(tokens: VisualTokens, assignment: torch.Tensor, keep: int) -> None:
    n = tokens.features.shape[0]
    assert assignment.shape == (n,) and assignment.dtype == torch.long
    kept = assignment == torch.arange(n)
    assert int(kept.sum()) == keep
    assert bool(((assignment == DROPPED) | kept).all())  # TTM prunes: every token is kept or dropped
    for start, size in zip(tokens.pair_starts, tokens.pair_sizes):
        assert bool(kept[start : start + size].any())


def test_window_partners_follow_the_paper():
    # windows 0-3, 4-7, 8-9: 2nd vs 1st, 3rd vs 1st, 4th vs 3rd; the last window's 3rd is compared too
    assert window_partners(list(range(10))) == {1: 0, 2: 0, 3: 2, 5: 4, 6: 4, 7: 6, 9: 8}
    assert window_partners([0, 4, 8, 12, 16]) == {4: 0, 8: 0, 12: 8}
    assert window_partners([0]) == {}


def test_hand_made_video_matches_the_paper_rule():
    tokens = video(ANGLES)
    for per_frame in (1, 2, 3):
        keep = 8 + 3 * per_frame  # both references whole, the same rate for the three compared pairs
        assignment = compress(tokens, keep).assignment
        check_budget(tokens, assignment, keep)
        assert kept_set(assignment) == paper_ttm(ANGLES, per_frame)
    # worked by hand for two tokens per compared pair: pair 1 keeps positions 3, 1 (differences 50, 30), pair 2
    # keeps 2, 3 (45, 25), pair 3 keeps 0, 2 (35, 20)
    assert kept_set(compress(tokens, 14).assignment) == {
        0,
        1,
        2,
        3,
        4 + 3,
        4 + 1,
        8 + 2,
        8 + 3,
        12 + 0,
        12 + 2,
        16,
        17,
        18,
        19,
    }


def test_below_ttm_reach_it_recurses_over_reference_pairs():
    tokens = video(ANGLES)
    # keep 9 < 8 reference tokens + 3: pairs 1, 2, 3 keep their least similar token (positions 3, 2, 0); TTM over
    # the references [0, 4] with 6 left: pair 4 vs pair 0 keeps 2 (positions 0 and 3: differences 200, 50)
    assert kept_set(compress(tokens, 9).assignment) == {0, 1, 2, 3, 7, 10, 12, 16, 19}
    # keep 7: pairs 1-3 and pair 4 keep one each; pair 0, alone with 3, keeps the three tokens least similar to
    # pair 1 (positions 3, 1, 2: differences 50, 30, 10)
    assert kept_set(compress(tokens, 7).assignment) == {1, 2, 3, 7, 10, 12, 16}


def test_different_grids_compare_with_the_most_similar_token():
    angles = [[0, 40, 80, 120], [0, 41, 100, 180, 121, 63], [1, 42, 82, 125]]
    grids = [GRID, (1, 2, 3), GRID]
    tokens = video(angles, grids)
    # 3 tokens for the compared pairs 1 (6 tokens) and 2 (4 tokens): 2 and 1. Pair 1 (other grid) vs pair 0 by best
    # match: differences 0, 1, 20, 60, 1, 17 -> keeps positions 3, 2; pair 2 (same grid as pair 0) by position:
    # differences 1, 2, 2, 5 -> keeps position 3
    assignment = compress(tokens, 4 + 2 + 1).assignment
    check_budget(tokens, assignment, 7)
    assert kept_set(assignment) == {0, 1, 2, 3, 4 + 3, 4 + 2, 10 + 3}


def test_budgets_identity_and_determinism():
    g = torch.Generator().manual_seed(0)
    for sizes in ([6] * 9, [4, 4, 6, 6, 4, 6, 6], [5]):
        grids = [(1, 2, 2) if s == 4 else (1, 2, 3) if s == 6 else (1, 1, 5) for s in sizes]
        n = sum(sizes)
        base = torch.randn(max(sizes), 16, generator=g)
        feats = torch.cat([base[:s] + 0.5 * torch.randn(s, 16, generator=g) for s in sizes])
        tokens = VisualTokens(features=feats, pair_sizes=sizes, grids=grids)
        for keep in sorted({len(sizes), len(sizes) + 1, n - 1, n} | set(range(len(sizes), n, 3))):
            assignment = compress(tokens, keep).assignment
            check_budget(tokens, assignment, keep)
            assert torch.equal(assignment, compress(tokens, keep, seed=1).assignment)
        assert torch.equal(compress(tokens, n).assignment, torch.arange(n))
