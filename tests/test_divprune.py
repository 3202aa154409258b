"""DivPrune: greedy max-min cosine diversity, checked against a plain loop of the public code's rule."""

import torch

from resadapt_eval.baselines.common import DROPPED, VisualTokens
from resadapt_eval.baselines.divprune import compress


def on_circle(degrees: list[float]) -> torch.Tensor:
    """Unit vectors at the given angles: cosine distance grows with the angle between tokens."""
    angles = torch.deg2rad(torch.tensor(degrees, dtype=torch.float64))
    return torch.stack([angles.cos(), angles.sin()], dim=1).float()


def reference_greedy(features: torch.Tensor, keep: int) -> list[int]:
    """The public code's rule, written out: D = 1 - cos on the full matrix; the first pick is the column
    whose second smallest entry (nearest other token) is largest, then the column whose minimum over the
    picked rows is largest; the first maximum wins a tie."""
    unit = features / features.norm(dim=1, keepdim=True)
    dist = (1 - unit @ unit.T).tolist()
    n = len(dist)
    chosen = []
    for step in range(keep):
        best, best_score = None, None
        for j in range(n):
            if j in chosen:
                continue
            if step == 0:
                score = sorted(dist[i][j] for i in range(n))[1]
            else:
                score = min(dist[i][j] for i in chosen)
            if best_score is None or score > best_score:
                best, best_score = j, score
        chosen.append(best)
    return chosen


def kept(assignment: torch.Tensor) -> list[int]:
    return sorted(set(assignment.tolist()) - {DROPPED})


# Three pairs of four tokens on the unit circle (degrees): pair 0 = t0-t3, pair 1 = t4-t7, pair 2 = t8-t11.
DEGREES = [0, 10, 21, 90, 4, 15, 183, 99, 1, 12, 7, 18]
TOKENS = VisualTokens(features=on_circle(DEGREES), pair_sizes=[4, 4, 4], grids=[(1, 2, 2)] * 3)


def test_hand_worked_selection_with_the_one_per_pair_rule():
    # keep = 4, worked by hand in angles (cosine distance is monotone in the angle):
    # 1st: t6 (183 deg): its nearest token t7 is 84 deg away, every other token has one within 9 deg.
    # 2nd: farthest from t6: t4 (4 deg, 179 deg away).
    # 3rd: largest min angle to {t6, t4}: t3 (90 deg: 86 to t4) beats t7 (99 deg: 84 to t6).
    # 4th: plain greedy would take t2 (21 deg, 17 from t4), but pair 2 has no token and one pick is
    #      left, so the pick is pair 2's best: t8 3, t9 8, t10 3, t11 14 deg from {t6, t4, t3} -> t11.
    assert reference_greedy(TOKENS.features, 4) == [6, 4, 3, 2]
    assert kept(compress(TOKENS, 4).assignment) == [3, 4, 6, 11]


def test_matches_the_reference_rule_when_every_pair_is_covered():
    # keep = 6: t6, t4, t3, t2, then t7 (99 deg, 9 from t3) and t9 (12 deg, 8 from t4 / t2): all pairs covered.
    assert reference_greedy(TOKENS.features, 6) == [6, 4, 3, 2, 7, 9]
    assert kept(compress(TOKENS, 6).assignment) == [2, 3, 4, 6, 7, 9]
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(18, 8, generator=generator)
    tokens = VisualTokens(features=features, pair_sizes=[6, 6, 6], grids=[(1, 2, 3)] * 3)
    for keep in (6, 9, 12):
        expected = reference_greedy(features, keep)
        assert {i // 6 for i in expected} == {0, 1, 2}  # the plain rule covers every pair here
        assert kept(compress(tokens, keep).assignment) == sorted(expected)


def test_budget_pairs_and_identity():
    generator = torch.Generator().manual_seed(1)
    for sizes in ([4, 4, 4], [3, 6, 5], [1, 7]):
        n = sum(sizes)
        tokens = VisualTokens(
            features=torch.randn(n, 5, generator=generator), pair_sizes=sizes, grids=[(1, 1, 1)] * len(sizes)
        )
        for keep in range(len(sizes), n + 1):
            assignment = compress(tokens, keep).assignment
            chosen = kept(assignment)
            assert len(chosen) == keep
            assert all(assignment[i] == i for i in chosen)  # pruning only: kept tokens point at themselves
            assert ((assignment == DROPPED) | (assignment == torch.arange(n))).all()
            starts = [sum(sizes[:p]) for p in range(len(sizes))]
            assert all(any(s <= i < s + size for i in chosen) for s, size in zip(starts, sizes))
            assert torch.equal(assignment, compress(tokens, keep).assignment)  # deterministic
        assert torch.equal(compress(tokens, n).assignment, torch.arange(n))


def test_the_greedy_picks_the_same_tokens_with_or_without_the_distance_matrix(monkeypatch):
    """Above `DISTANCE_MATRIX_BYTES` each pick's row is computed from the features instead of read from the
    held N x N matrix: the same picks, in the same order."""
    from resadapt_eval.baselines import divprune

    g = torch.Generator().manual_seed(5)
    feats = torch.nn.functional.normalize(torch.randn(90, 24, generator=g), dim=-1)
    pair_of = torch.arange(6).repeat_interleave(15)
    assert divprune.holds_distance_matrix(90)
    held = divprune.max_min_greedy(feats, pair_of, 6, 30)
    monkeypatch.setattr(divprune, "DISTANCE_MATRIX_BYTES", 90 * 90 * 4 - 1)
    monkeypatch.setattr(divprune, "ROW_CHUNK", 7)  # the first pick's nearest neighbours in blocks
    assert not divprune.holds_distance_matrix(90)
    assert divprune.max_min_greedy(feats, pair_of, 6, 30).tolist() == held.tolist()
    assert len(set(held.tolist())) == 30 and set(pair_of[held].tolist()) == set(range(6))
