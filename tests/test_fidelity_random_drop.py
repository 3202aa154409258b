"""Fidelity of Random Drop (issue 30). There is no canonical repository: the rule the ResAdapt paper and the
usual token-pruning baselines state is a seeded uniform random subset of the visual tokens, kept in their
original order and positions. The port adds one documented rule, that every frame pair keeps at least one token:
one uniform token per pair is drawn first, then the rest uniformly from the remaining tokens.

The reference draw below is written out from that rule with its own torch.Generator calls; the test checks that
our `compress` makes exactly this draw, and the properties the rule promises, on odd and even token counts,
several pairs and every budget from one token per pair to all but one."""

import itertools
import math

import pytest
import torch

from resadapt_eval.baselines.common import DROPPED, VisualTokens, merge_groups
from resadapt_eval.baselines.random_drop import compress

# (pair sizes): odd and even totals, one pair, several pairs, unequal pairs
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


SETTINGS = [[9], [6, 6, 6], [5, 5, 5], [7, 4, 6, 3], [2, 3, 2, 3, 2, 3, 1]]
CASES = 20  # random cases (feature tensors and seeds) per setting


def reference_draw(pair_sizes: list[int], keep: int, seed: int) -> list[int]:
    """The rule, drawn from a fresh generator seeded with `seed`: for each pair in order one
    torch.randint(size) token; then torch.randperm over the other tokens (in index order), whose first
    keep - pairs entries are added. Returns the kept token indices in the order drawn."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    firsts, start = [], 0
    for size in pair_sizes:
        firsts.append(start + torch.randint(low=0, high=size, size=(1,), generator=generator).item())
        start += size
    others = [i for i in range(sum(pair_sizes)) if i not in firsts]
    order = torch.randperm(len(others), generator=generator).tolist()
    return firsts + [others[j] for j in order[: keep - len(pair_sizes)]]


def case(pair_sizes: list[int], index: int) -> tuple[VisualTokens, int]:
    g = torch.Generator().manual_seed(1000 * len(pair_sizes) + 37 * sum(pair_sizes) + index)
    n = sum(pair_sizes)
    features = torch.randn(n, 8, generator=g, dtype=torch.float64)
    tokens = VisualTokens(features=features, pair_sizes=pair_sizes, grids=[(1, 1, s) for s in pair_sizes])
    return tokens, int(torch.randint(0, 2**31 - 1, (1,), generator=g))


@pytest.mark.parametrize("pair_sizes", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_fidelity_random_drop_draw_and_properties(pair_sizes):
    n, pairs = sum(pair_sizes), len(pair_sizes)
    starts = [sum(pair_sizes[:p]) for p in range(pairs)]
    for index in range(CASES):
        tokens, seed = case(pair_sizes, index)
        for keep in range(pairs, n):  # from one token per pair to all but one
            compression = compress(tokens, keep, seed=seed)
            assignment = compression.assignment
            drawn = reference_draw(pair_sizes, keep, seed)
            kept = sorted(drawn)
            assert len(set(drawn)) == keep
            # the same draw, exactly
            assert compression.kept.tolist() == kept
            # pruning only: a kept token points at itself (its own position), every other token is dropped
            expected = torch.full((n,), DROPPED, dtype=torch.long)
            expected[kept] = torch.tensor(kept)
            assert torch.equal(assignment, expected)
            assert compression.weights is None
            # every pair keeps at least one token
            assert all(any(s <= i < s + size for i in kept) for s, size in zip(starts, pair_sizes))
            # the merged features are the kept rows, unchanged, in their original order
            destinations, sizes, (merged,) = merge_groups(compression, tokens.features)
            assert destinations.tolist() == kept and sizes.tolist() == [1] * keep
            assert merged.dtype == torch.float64
            torch.testing.assert_close(merged, tokens.features[kept], rtol=0, atol=1e-12)
            # reproducible by seed
            assert torch.equal(compress(tokens, keep, seed=seed).assignment, assignment)
        assert torch.equal(compress(tokens, n, seed=seed).assignment, torch.arange(n))


def test_fidelity_random_drop_seeds_change_the_draw():
    tokens, _ = case([6, 6, 6], 0)
    draws = {tuple(compress(tokens, 7, seed=seed).kept.tolist()) for seed in range(20)}
    assert len(draws) >= 15  # C(18, 7) subsets: 20 seeds give (nearly) 20 different draws


def law(pair_sizes: list[int], kept: tuple[int, ...]) -> float:
    """Probability of the kept set under the rule: each token of a pair is equally likely to be its first
    token (prod over pairs of c_p / s_p, c_p its kept tokens), the rest a uniform subset of the N - P others."""
    n, pairs, keep = sum(pair_sizes), len(pair_sizes), len(kept)
    counts = [sum(1 for i in kept if sum(pair_sizes[:p]) <= i < sum(pair_sizes[: p + 1])) for p in range(pairs)]
    return math.prod(c / s for c, s in zip(counts, pair_sizes)) / math.comb(n - pairs, keep - pairs)


def test_fidelity_random_drop_is_uniform_within_a_pair_and_favours_balanced_pairs():
    """One pair: every subset equally likely (the plain uniform rule). Several pairs: the one-per-pair rule
    makes a subset's probability proportional to prod c_p (documented), not uniform over the subsets that
    cover every pair. Checked by a chi-square over 6000 fixed seeds (deterministic)."""
    draws = 6000
    for pair_sizes, keep in (([5], 2), ([3, 3], 4)):
        n = sum(pair_sizes)
        tokens = VisualTokens(torch.zeros(n, 1), pair_sizes, [(1, 1, s) for s in pair_sizes])
        counts: dict[tuple[int, ...], int] = {}
        for seed in range(draws):
            kept = tuple(compress(tokens, keep, seed=seed).kept.tolist())
            counts[kept] = counts.get(kept, 0) + 1
        subsets = [s for s in itertools.combinations(range(n), keep) if law(pair_sizes, s) > 0]
        assert set(counts) <= set(subsets)
        assert abs(sum(law(pair_sizes, s) for s in subsets) - 1) < 1e-12
        chi2 = sum((counts.get(s, 0) - draws * law(pair_sizes, s)) ** 2 / (draws * law(pair_sizes, s)) for s in subsets)
        assert chi2 < 40  # 9 or 14 degrees of freedom: p < 1e-4 above 40
        if len(pair_sizes) > 1:  # the uniform law over covering subsets is rejected
            uniform = draws / len(subsets)
            assert sum((counts.get(s, 0) - uniform) ** 2 / uniform for s in subsets) > 60
