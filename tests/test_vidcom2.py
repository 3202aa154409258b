"""VidCom2: frame-uniqueness budgets and token uniqueness, checked against a plain loop of the public code."""

import torch

from resadapt_eval.baselines.common import DROPPED, VisualTokens
from resadapt_eval.baselines.vidcom2 import compress, frame_budgets


def reference_vidcom2(features: torch.Tensor, per_frame: int, retention: float) -> list[int]:
    """The public code's rule, written out for equal frames of `per_frame` tokens: half the channels
    (lowest biased variance), L2-normalised; similarity = sum over a in 1/8..2 of exp(-|x - c|^2 / 2a)
    to the video mean c and to the frame mean; frame uniqueness = -mean similarity to the video;
    sigma = softmax(uniqueness / 0.01); k_f = max(1, round(min(1, R (1 + sigma_f - mean sigma)) * per_frame));
    each frame keeps its k_f tokens of lowest summed similarity."""
    n, d = features.shape
    frames = n // per_frame
    variance = [((features[:, c] - features[:, c].mean()) ** 2).mean().item() for c in range(d)]
    channels = sorted(range(d), key=lambda c: variance[c])[: d // 2]
    x = features[:, channels].double()
    x = x / x.norm(dim=1, keepdim=True)

    def kernel(v, centre):
        squared = ((v - centre) ** 2).sum()
        return sum(torch.exp(-squared / (2 * a)).item() for a in (1 / 8, 1 / 4, 1 / 2, 1, 2))

    video_centre = x.mean(dim=0)
    to_video = [kernel(x[i], video_centre) for i in range(n)]
    to_frame = []
    for f in range(frames):
        centre = x[f * per_frame : (f + 1) * per_frame].mean(dim=0)
        to_frame += [kernel(x[i], centre) for i in range(f * per_frame, (f + 1) * per_frame)]
    uniqueness = [-sum(to_video[f * per_frame : (f + 1) * per_frame]) / per_frame for f in range(frames)]
    top = max(uniqueness)
    weights = [torch.exp(torch.tensor((u - top) / 0.01, dtype=torch.float64)).item() for u in uniqueness]
    sigma = [w / sum(weights) for w in weights]
    mean_sigma = sum(sigma) / frames
    kept = []
    for f in range(frames):
        k = max(1, round(min(1.0, retention * (1 + sigma[f] - mean_sigma)) * per_frame))
        frame = range(f * per_frame, (f + 1) * per_frame)
        kept += sorted(frame, key=lambda i: to_video[i] + to_frame[i])[:k]
    return sorted(kept)


def fixture() -> torch.Tensor:
    """3 pairs of 6 tokens, 4 channels: channels 0-1 carry a small 2D direction (low variance, the ones
    VidCom2 scores), channels 2-3 large values (high variance, ignored). Pair 0 points around 95-160 deg,
    pairs 1-2 around 0 deg, so pair 0 is by far the most unique frame."""
    degrees = [100, 130, 115, 160, 95, 140, 0, 20, -15, 35, 5, -40, 10, -5, 60, 25, -20, 3]
    noise = [5, -3, 4, -6, 2, -5, 7, -2, 3, -4, 6, -7, 1, -3, 5, -1, 4, -5]
    angles = torch.deg2rad(torch.tensor(degrees, dtype=torch.float64))
    big = torch.tensor(noise, dtype=torch.float64)
    third = torch.arange(18, dtype=torch.float64) % 3
    return torch.stack([0.1 * angles.cos(), 0.1 * angles.sin(), big, -2 * big + third], dim=1).float()


def kept(assignment: torch.Tensor) -> list[int]:
    return sorted(set(assignment.tolist()) - {DROPPED})


def test_matches_the_reference_rule_on_a_fixed_input():
    features = fixture()
    tokens = VisualTokens(features=features, pair_sizes=[6, 6, 6], grids=[(1, 2, 3)] * 3)
    # R = 1/2: sigma is one-hot on pair 0, so its ratio is R (1 + 1 - 1/3) -> 5 of 6 tokens and the
    # others' R (1 - 1/3) -> 2 of 6: 5 + 2 + 2 = 9 = keep, the reference's rounding gives the same total.
    expected = reference_vidcom2(features, 6, 0.5)
    assert [sum(1 for i in expected if i // 6 == p) for p in range(3)] == [5, 2, 2]
    assert kept(compress(tokens, 9).assignment) == expected
    # The same ranking read off the scored tokens (summed similarity, lowest kept): pair 0 drops t2
    # (115 deg, the highest); pair 1 keeps t11 (-40 deg) and t8 (-15 deg); pair 2 t16 (-20) and t14 (60).
    assert expected == [0, 1, 3, 4, 5, 8, 11, 14, 16]


def test_frame_budgets():
    weights = torch.tensor([5 / 3, 2 / 3, 2 / 3])
    # quotas 10 * (20/3, 8/3, 8/3) / 12 = 5.56, 2.22, 2.22: pair 0 capped at 4, the other 6 split 3 + 3
    assert frame_budgets(weights, [4, 4, 4], 10) == [4, 3, 3]
    # one token per pair at the floor of the budget
    assert frame_budgets(weights, [4, 4, 4], 3) == [1, 1, 1]
    # quotas 3 * (15, 1) / 16 = 2.81, 0.19 -> 3, 0 -> pair 1 gets 1, taken from pair 0
    assert frame_budgets(torch.tensor([1.5, 0.5]), [10, 2], 3) == [2, 1]
    # equal weights: in proportion to the pair sizes
    assert frame_budgets(torch.tensor([1.0, 1.0]), [6, 2], 4) == [3, 1]
    assert frame_budgets(weights, [4, 4, 4], 12) == [4, 4, 4]
    # the reference's per-pair rounding misses the budget: keep 6 of (6, 6, 6) gives round(3.33) +
    # 2 round(1.33) = 5; floor + largest remainder gives 3 + 1 + 1 and one more, to exactly 6
    budget = frame_budgets(weights, [6, 6, 6], 6)
    assert sum(budget) == 6 and budget[0] >= 3 and min(budget) == 1


def test_budget_pairs_and_identity():
    generator = torch.Generator().manual_seed(0)
    for sizes in ([4, 4, 4], [3, 6, 5], [1, 7]):
        n = sum(sizes)
        tokens = VisualTokens(
            features=torch.randn(n, 6, generator=generator), pair_sizes=sizes, grids=[(1, 1, 1)] * len(sizes)
        )
        for keep in range(len(sizes), n + 1):
            assignment = compress(tokens, keep).assignment
            chosen = kept(assignment)
            assert len(chosen) == keep
            assert ((assignment == DROPPED) | (assignment == torch.arange(n))).all()
            starts = [sum(sizes[:p]) for p in range(len(sizes))]
            assert all(any(s <= i < s + size for i in chosen) for s, size in zip(starts, sizes))
            assert torch.equal(assignment, compress(tokens, keep).assignment)  # deterministic
        assert torch.equal(compress(tokens, n).assignment, torch.arange(n))
