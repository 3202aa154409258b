"""Fidelity of VidCom2 (issue 30) against the public code, xuyang-liu16/VidCom2@944a17d.

The reference rule, written out below in float64 (token_compressor/vidcom2/vidcom2.py and its Qwen2.5-VL hook
token_compressor/vidcom2/models/qwen2_5_vl.py:20-33, 134, which scores per temporally merged frame, that is per
Qwen frame pair, and defaults R_RATIO to 0.25):
- scoring channels: the int(D / 2) channels of lowest biased variance over the video (vidcom2.py:38-43), each
  token L2-normalised on them (:47-48);
- similarity: sum over a in 2^-3..2^1 of exp(-|x - c|^2 / 2a) (:54, :59-62) to the video's mean token (:51) and
  to the frame's mean token (:52);
- frame retention: sigma = softmax((u - max u) / 0.01) of the frame uniqueness u_f = -mean over the frame of the
  similarity to the video (:32, :64-66), scale_f = min(1, R (1 + sigma_f - mean sigma)) (:67-68), and frame f
  keeps k_f = max(1, round(scale_f * tokens per frame)) tokens (:72);
- each frame keeps its k_f tokens of lowest summed similarity to video and frame (:33, :70-78); pruned, not merged.

Deviations the module documents, applied to the reference below: the per-frame budgets (`documented_budgets`:
quotas keep s_f w_f / sum s w, capped with the excess shared, floor + largest remainder with ties (to 9 decimals)
to the earlier pair, a pair left with 0 takes 1 from the largest budget) replace the reference's rounding so that
exactly keep = floor(R N) tokens stay; the test also checks that these quotas are the reference's R w_f s_f for
R = keep / N and that the budgets equal the reference's own k_f whenever those sum to keep (and no k_f is a
rounded .5, which torch rounds to even). Pairs of different sizes (the reference needs equal frames) use the same
formulas per pair, the video mean over all tokens. Scores are float64 on both sides.
"""

import math

import pytest
import torch

from resadapt_eval.baselines.common import VisualTokens, merge_groups
from resadapt_eval.baselines.vidcom2 import compress

SETTINGS = [[6, 6, 6], [7, 7, 7, 7], [5, 5], [4, 4, 4, 4, 4, 4], [7, 4, 6, 3]]
CASES = 20
ALPHAS = [2.0**k for k in range(-3, 2)]  # vidcom2.py:54
TEMPERATURE = 0.01  # vidcom2.py:64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def gaussian(x: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """vidcom2.py:59-62: sum over the scales of exp(-|x - c|^2 / 2a), one value per row of x."""
    squared = ((x - centre) ** 2).sum(dim=-1)
    return sum(torch.exp(-squared / (2 * a)) for a in ALPHAS)


def reference_scores(features: torch.Tensor, sizes: list[int]) -> tuple[list[float], list[float]]:
    """Each token's summed similarity (vid_score + frame_score) and each frame's weight 1 + sigma_f - mean sigma."""
    x = features.double()
    variance = ((x - x.mean(dim=0)) ** 2).mean(dim=0)  # vidcom2.py:40, biased
    channels = sorted(range(x.shape[1]), key=lambda c: variance[c].item())[: int(x.shape[1] * 0.5)]  # :41-43
    x = x[:, channels]
    x = x / x.norm(dim=1, keepdim=True)  # :48
    to_video = gaussian(x, x.mean(dim=0))  # :51, :55
    frames = list(torch.split(torch.arange(len(x)), sizes))
    to_frame = torch.cat([gaussian(x[f], x[f].mean(dim=0)) for f in frames])  # :52, :56
    uniqueness = torch.stack([-to_video[f].mean() for f in frames])  # qwen2_5_vl.py:31
    exp = [math.exp((u - uniqueness.max().item()) / TEMPERATURE) for u in uniqueness.tolist()]  # :66
    sigma = [e / sum(exp) for e in exp]
    weights = [1 + s - sum(sigma) / len(sigma) for s in sigma]  # :67
    return (to_video + to_frame).tolist(), weights


def reference_counts(weights: list[float], tokens_per_frame: int, retention: float) -> list[int]:
    """vidcom2.py:67-68, :72: max(1, round(min(1, R w_f) * tokens per frame)), torch's round (half to even)."""
    return [max(1, int(torch.tensor(min(1.0, retention * w) * tokens_per_frame).round())) for w in weights]


def documented_budgets(weights: list[float], sizes: list[int], keep: int) -> list[int]:
    """The module's documented budget rule (its docstring, "Budgets sum to exactly keep")."""
    capped: set[int] = set()
    while True:
        free = keep - sum(sizes[f] for f in capped)
        share = sum(sizes[f] * weights[f] for f in range(len(sizes)) if f not in capped)
        quota = [sizes[f] if f in capped else free * sizes[f] * weights[f] / share for f in range(len(sizes))]
        over = {f for f in range(len(sizes)) if f not in capped and quota[f] > sizes[f]}
        if not over:
            break
        capped |= over
    budget = [min(sizes[f], math.floor(quota[f])) for f in range(len(sizes))]
    # ties (remainders equal in exact arithmetic, so to 9 decimals here) go to the earlier pair
    by_remainder = sorted(range(len(sizes)), key=lambda f: (-round(quota[f] - budget[f], 9), f))
    for f in by_remainder:
        if sum(budget) < keep and budget[f] < sizes[f]:
            budget[f] += 1
    for f in range(len(sizes)):
        if budget[f] == 0:
            largest = min(range(len(sizes)), key=lambda g: (-budget[g], g))
            budget[f], budget[largest] = 1, budget[largest] - 1
    return budget


def reference_keep(scores: list[float], sizes: list[int], counts: list[int]) -> list[int]:
    """vidcom2.py:70-78 and :99-103: per frame the `count` lowest scores, mapped to video indices."""
    kept, start = [], 0
    for size, count in zip(sizes, counts):
        frame = range(start, start + size)
        kept += sorted(sorted(frame, key=lambda i: scores[i])[:count])
        start += size
    return kept


def case(sizes: list[int], index: int) -> VisualTokens:
    g = torch.Generator().manual_seed(104729 * index + 17 * sum(sizes) + len(sizes))
    # a per-pair offset (none, small or large) makes the frames differ in uniqueness, as video frames do; large
    # ones make sigma one-hot, so the budgets meet ties
    offset = 0.5 * (index % 3)
    features = torch.cat(
        [
            torch.randn(s, 16, generator=g, dtype=torch.float64)
            + offset * torch.randn(16, generator=g, dtype=torch.float64)
            for s in sizes
        ]
    )
    return VisualTokens(features=features, pair_sizes=sizes, grids=[(1, 1, s) for s in sizes])


@pytest.mark.parametrize("sizes", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_fidelity_vidcom2_matches_the_reference(sizes):
    n, pairs = sum(sizes), len(sizes)
    equal = len(set(sizes)) == 1
    same_as_reference_rounding = 0
    for index in range(CASES):
        tokens = case(sizes, index)
        scores, weights = reference_scores(tokens.features, sizes)
        for keep in range(pairs, n):  # one token per pair to all but one
            budget = documented_budgets(weights, sizes, keep)
            assert sum(budget) == keep and all(1 <= b <= s for b, s in zip(budget, sizes))
            expected = reference_keep(scores, sizes, budget)
            compression = compress(tokens, keep)
            assert compression.kept.tolist() == expected
            assert compression.weights is None
            _, group_sizes, (merged,) = merge_groups(compression, tokens.features)
            assert group_sizes.tolist() == [1] * keep
            torch.testing.assert_close(merged, tokens.features[expected], rtol=0, atol=1e-6)
            if equal:
                retention = keep / n
                own = reference_counts(weights, sizes[0], retention)
                if all(retention * w <= 1 for w in weights):  # uncapped: the quotas are the reference's R w_f s_f
                    quota = [keep * sizes[0] * w / sum(sizes[0] * v for v in weights) for w in weights]
                    assert all(abs(q - retention * w * sizes[0]) < 1e-9 for q, w in zip(quota, weights))
                scaled = [min(1.0, retention * w) * sizes[0] for w in weights]
                halves = any(abs(x - math.floor(x) - 0.5) < 1e-9 for x in scaled)  # torch rounds .5 to even
                if sum(own) == keep and not halves:  # the reference's rounding meets the budget: the same counts
                    assert budget == own
                    same_as_reference_rounding += 1
        assert torch.equal(compress(tokens, n).assignment, torch.arange(n))
    if equal:
        assert same_as_reference_rounding >= CASES  # the comparison with the reference's counts happened
