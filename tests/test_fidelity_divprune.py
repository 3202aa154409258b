"""Fidelity of DivPrune (issue 30) against the public code, vbdi/divprune@799e2d9.

The reference rule (LLaVA/llava/model/llava_arch.py:147-171, `pairwise_cosine_similarity` and `DivPrune`),
written out below: D = 1 - cos on the full N x N matrix of the visual tokens; the first pick is the column whose
second smallest entry (its nearest other token; the smallest is its own 0) is largest; each next pick is the column
whose minimum over the rows already picked is largest; torch.argmax, so the first maximum wins a tie. The whole
video is one pool (llava_arch.py:352-376 feeds every visual token at once).

Deviations the module documents, applied to the reference below:
- budget: the reference keeps round(ratio * N) (llava_arch.py:153); ours is handed keep = floor(R N), so the
  reference is given the same count;
- one token per frame pair: once the picks left equal the pairs still without a kept token, a step considers only
  the tokens of those pairs (same score);
- a kept token is never picked again (the reference's argmax can re-pick one when every remaining token duplicates
  a kept one): `test_fidelity_divprune_repicks_only_in_the_reference` shows exactly that difference.
"""

import pytest
import torch

from resadapt_eval.baselines.common import VisualTokens, merge_groups
from resadapt_eval.baselines.divprune import compress

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


SETTINGS = [[9], [6, 6, 6], [5, 5, 5], [7, 4, 6, 3], [3, 3, 3, 3, 3, 3, 3], [2, 8]]
CASES = 20


def distances(features: torch.Tensor) -> list[list[float]]:
    """vbdi/divprune@799e2d9 LLaVA/llava/model/llava_arch.py:147-150, 154-155: D = 1 - cos, in float64. The
    matrix is symmetric; it is made so exactly here, so that an exact tie (the first pick of two tokens that are
    each other's nearest neighbour) goes to the lower index as the module documents, instead of to whichever
    rounding of the reference's (fp16) matmul is larger."""
    unit = features.double() / features.double().norm(dim=1, keepdim=True)
    d = 1.0 - unit @ unit.T
    return ((d + d.T) / 2).tolist()


def argmax(scores: list[float]) -> int:
    """torch.argmax: the first maximum (a score of -inf is never taken while a finite one is left)."""
    best = 0
    for j, score in enumerate(scores):
        if score > scores[best]:
            best = j
    return best


def reference_divprune(d: list[list[float]], keep: int, pair_sizes: list[int] | None = None) -> list[int]:
    """vbdi/divprune@799e2d9 LLaVA/llava/model/llava_arch.py:152-171 on the distances `d`, the picks in order.
    With `pair_sizes`, the module's documented one-token-per-pair rule restricts a step's candidates."""
    n = len(d)
    pair_of = [p for p, size in enumerate(pair_sizes or [n]) for _ in range(size)]
    picks: list[int] = []
    for i in range(keep):
        if i == 0:  # :161-163: the second smallest entry of each column (the smallest is its own distance)
            scores = [sorted(d[r][j] for r in range(n))[1] for j in range(n)]
        else:  # :160, :164-165: the minimum over the picked rows
            scores = [min(d[r][j] for r in picks) for j in range(n)]
        if pair_sizes is not None:
            covered = {pair_of[j] for j in picks}
            if keep - i == len(pair_sizes) - len(covered):  # documented: only pairs without a kept token
                scores = [s if pair_of[j] not in covered else -float("inf") for j, s in enumerate(scores)]
        picks.append(argmax(scores))  # :167
    return picks


def case(pair_sizes: list[int], index: int) -> VisualTokens:
    g = torch.Generator().manual_seed(7919 * index + 31 * sum(pair_sizes) + len(pair_sizes))
    features = torch.randn(sum(pair_sizes), 16, generator=g, dtype=torch.float64)
    return VisualTokens(features=features, pair_sizes=pair_sizes, grids=[(1, 1, s) for s in pair_sizes])


@pytest.mark.parametrize("pair_sizes", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_fidelity_divprune_matches_the_reference(pair_sizes):
    n, pairs = sum(pair_sizes), len(pair_sizes)
    starts = [sum(pair_sizes[:p]) for p in range(pairs)]
    constrained = 0
    for index in range(CASES):
        tokens = case(pair_sizes, index)
        d = distances(tokens.features)
        plain = reference_divprune(d, n)  # without the pair rule the picks for keep k are the first k of these
        for keep in range(pairs, n):  # one token per pair to all but one
            picks = reference_divprune(d, keep, pair_sizes)
            assert len(set(picks)) == keep
            compression = compress(tokens, keep)
            assert compression.kept.tolist() == sorted(picks)
            assert compression.weights is None
            _, sizes, (merged,) = merge_groups(compression, tokens.features)
            assert sizes.tolist() == [1] * keep
            torch.testing.assert_close(merged, tokens.features[sorted(picks)], rtol=0, atol=1e-6)
            # where the reference's own picks cover every pair, the pair rule changes nothing
            if all(any(s <= i < s + size for i in plain[:keep]) for s, size in zip(starts, pair_sizes)):
                assert picks == plain[:keep]
            else:
                constrained += 1
        assert torch.equal(compress(tokens, n).assignment, torch.arange(n))
    if pairs >= 3:
        assert constrained > 0  # the pair rule was exercised


def test_fidelity_divprune_repicks_only_in_the_reference():
    """Documented difference: when every token not yet kept duplicates a kept one, the reference's argmax
    returns an already kept token (its own distance 0 ties the duplicates' 0 and the first maximum wins), so
    it keeps fewer distinct tokens; ours masks kept tokens and keeps `keep` distinct ones. Basis vectors make
    every distance exactly 0 or 1, so both run without rounding."""
    features = torch.eye(3, dtype=torch.float64)[[0, 1, 2, 0, 1, 2, 0]]
    tokens = VisualTokens(features=features, pair_sizes=[7], grids=[(1, 1, 7)])
    # every token has a duplicate: first pick the first maximum of zeros, t0; then t1 and t2 (distance 1);
    # then every score is 0 and argmax returns t0 again
    assert reference_divprune(distances(features), 5) == [0, 1, 2, 0, 0]
    assert compress(tokens, 5).kept.tolist() == [0, 1, 2, 3, 4]
