"""Fidelity of CDPruner against the public code, Theia-4869/CDPruner@9541616.

The reference rule (`llava/model/llava_arch.py:150-185`, `encode_images`), written out below with torch ops
on a batch of B images (B, N, C):
- `:151-153`: unit features (divided by their norms), similarity S = their Gram matrix;
- `:156-160`: unit image and text embeddings, relevance = -(image @ text.T).mean(-1), then
  (r - r.min() + 1e-6) / (r.max() - r.min()), min and max over the whole batch;
- `:167`: kernel L = r_i S_ij r_j;
- `:170-181`: T steps of j = argmax(d2) (torch's first maximum), e = (L[j] - einsum(c[:i, j], c[:i])) /
  sqrt(d2[j]), c[i] = e, d2 -= e^2, d2[j] = -inf;
- `:183-185`: the kept tokens as a mask (original order).
Documented deviations applied to the reference below: the image embeddings are the merged tokens and the text
embeddings the question's rows (`query`); the sign of the relevance is + (`sign=1`; the reference's -1 is run
literally on the negated query); each frame pair is one image with its `per_pair_budget` share as T, the
relevance normalised over the whole video; constant relevance (and M = 0) is 1 everywhere; once a pair's pivot
d2[j] is not positive (the reference's sqrt would give NaN), its remaining picks go by relevance, highest
first, ties to the lower index (`test_fidelity_cdpruner_past_the_rank_...` shows the reference's NaN re-picks).
Everything runs in float64 (the reference: float32, `:152, :170`).
"""

import types

import pytest
import torch

from resadapt_eval.baselines import cdpruner
from resadapt_eval.baselines.common import DROPPED, VisualTokens, merge_groups, per_pair_budget
from resadapt_eval.measure.counting import counted_flops
from resadapt_eval.measure.syncs import counting_syncs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SETTINGS = [[9], [6, 6, 6], [5, 5, 5], [7, 4, 6, 3], [3, 3, 3, 3, 3, 3, 3], [2, 8]]
CASES = 20


def reference_relevance(image_embeds: torch.Tensor, text_embeds: torch.Tensor, sign: float = -1.0) -> torch.Tensor:
    """llava_arch.py:156-160 on (B, N, C) image and (M, C) text embeddings: (B, N). `sign` -1 is the
    reference's negation (:159); our documented rule is +1."""
    image_embeds = image_embeds / image_embeds.norm(dim=-1, keepdim=True)  # :156
    text_embeds = text_embeds / text_embeds.norm(dim=-1, keepdim=True)  # :157
    relevance = torch.matmul(image_embeds, text_embeds.t())  # :158
    relevance = (sign * relevance).mean(dim=-1)  # :159
    return (relevance - relevance.min() + 1e-6) / (relevance.max() - relevance.min())  # :160


def reference_select(image_features: torch.Tensor, relevance: torch.Tensor, visual_token_num: int):
    """llava_arch.py:151-153, 167, 170-185 on (B, N, C) features and (B, N) relevance: the picks in order (T, B),
    each step's pivot d2[j] (T, B) and the kept mask (B, N)."""
    B, N, C = image_features.shape
    image_normalized = image_features / image_features.norm(dim=-1, keepdim=True)  # :151 (:152 casts to float32)
    similarity = torch.matmul(image_normalized, image_normalized.transpose(1, 2))  # :153
    kernel = relevance.unsqueeze(2) * similarity * relevance.unsqueeze(1)  # :167
    cis = torch.zeros((visual_token_num, B, N), dtype=kernel.dtype)  # :170
    di2s = torch.diagonal(kernel, dim1=1, dim2=2).clone()  # :171
    select_idx = torch.empty((visual_token_num, B), dtype=torch.long)  # :172
    pivots = torch.empty((visual_token_num, B), dtype=kernel.dtype)
    for i in range(visual_token_num):  # :173
        j = torch.argmax(di2s, dim=-1)  # :174
        select_idx[i] = j  # :175
        pivots[i] = di2s[torch.arange(B), j]
        eis = (
            kernel[torch.arange(B), j] - torch.einsum("tb,tbn->bn", cis[:i, torch.arange(B), j], cis[:i])
        ) / torch.sqrt(di2s[torch.arange(B), j]).unsqueeze(-1)  # :177-178
        cis[i, :, :] = eis  # :179
        di2s -= torch.square(eis)  # :180
        di2s[torch.arange(B), j] = -float("inf")  # :181
    index_masks = torch.zeros(B, N, dtype=torch.bool)  # :184
    index_masks.scatter_(1, torch.sort(select_idx.t()).values, True)  # :183, :185
    return select_idx, pivots, index_masks


def documented_picks(features: torch.Tensor, relevance: torch.Tensor, k: int) -> list[int]:
    """One pair's picks by the documented rule: the reference's until its first pivot that is not positive,
    then the others by relevance (highest first, ties to the lower index)."""
    picks, pivots, _ = reference_select(features[None], relevance[None], k)
    picks, pivots = picks[:, 0].tolist(), pivots[:, 0].tolist()
    stop = next((i for i, p in enumerate(pivots) if not p > 0), k)
    rest = sorted((i for i in range(len(relevance)) if i not in picks[:stop]), key=lambda i: (-relevance[i], i))
    return picks[:stop] + rest[: k - stop]


def video_relevance(features: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The documented relevance of every token of the video (one batch of all its tokens), +sign; 1 everywhere
    when the question is empty or the relevance constant."""
    if query.shape[0] == 0:
        return torch.ones(features.shape[0], dtype=features.dtype)
    raw = reference_relevance(features[None], query, sign=1.0)[0]
    return raw if torch.isfinite(raw).all() else torch.ones_like(raw)


def expected_kept(tokens: VisualTokens, keep: int) -> tuple[list[int], bool]:
    """Sorted kept indices by the documented rule, and whether some pair went past its rank."""
    relevance = video_relevance(tokens.features, tokens.query)
    kept, past = [], False
    for start, size, k in zip(tokens.pair_starts, tokens.pair_sizes, per_pair_budget(tokens.pair_sizes, keep)):
        picks = documented_picks(tokens.features[start : start + size], relevance[start : start + size], k)
        _, pivots, mask = reference_select(
            tokens.features[start : start + size][None], relevance[start : start + size][None], k
        )
        past |= not bool((pivots > 0).all())
        if (pivots > 0).all():  # the reference's own mask, read back: exactly k tokens
            assert torch.arange(size)[mask[0]].tolist() == sorted(picks)
        kept += [start + i for i in picks]
    return sorted(kept), past


def case(pair_sizes: list[int], index: int, width: int = 16, query_rows: int | None = None) -> VisualTokens:
    g = torch.Generator().manual_seed(7919 * index + 31 * sum(pair_sizes) + len(pair_sizes))
    features = torch.randn(sum(pair_sizes), width, generator=g, dtype=torch.float64)
    m = 1 + index % 5 if query_rows is None else query_rows
    query = torch.randn(m, width, generator=g, dtype=torch.float64)
    return VisualTokens(features, pair_sizes, [(1, 1, s) for s in pair_sizes], query=query)


def check(tokens: VisualTokens, keep: int) -> bool:
    """Ours against the documented rule: kept indices, assignment, features; whether a pair went past its rank."""
    expected, past = expected_kept(tokens, keep)
    ours = cdpruner.compress(tokens, keep)
    assert ours.kept.tolist() == expected
    assert ours.weights is None
    n = tokens.features.shape[0]
    assert ours.assignment.tolist() == [i if i in set(expected) else DROPPED for i in range(n)]
    _, sizes, (merged,) = merge_groups(ours, tokens.features)
    assert sizes.eq(1).all()
    torch.testing.assert_close(merged, tokens.features[expected], rtol=0, atol=0)  # pure pruning
    return past


@pytest.mark.parametrize("pair_sizes", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_fidelity_cdpruner_matches_the_reference(pair_sizes):
    """Odd and even pair counts and sizes, every budget from one token per pair to all but one."""
    n = sum(pair_sizes)
    for index in range(CASES):
        tokens = case(pair_sizes, index)
        for keep in range(len(pair_sizes), n):
            assert not check(tokens, keep)  # 16 random dimensions: every pivot is positive
        assert torch.equal(cdpruner.compress(tokens, n).assignment, torch.arange(n))


def test_fidelity_cdpruner_literal_reference_is_ours_on_the_negated_query():
    """The reference's own sign (-mean cosine, :159) and its batch-wide min-max (:160), run literally on a batch
    of equal pairs with equal budgets, keeps exactly our tokens for the query -q: cos(x, -q) = -cos(x, q)."""
    for index in range(CASES):
        pairs, size = 2 + index % 4, 5 + index % 6
        tokens = case([size] * pairs, index)
        k = 1 + index % (size - 1)
        features = tokens.features.view(pairs, size, -1)
        relevance = reference_relevance(features, tokens.query)  # the literal sign
        _, _, mask = reference_select(features, relevance, k)
        literal = torch.arange(pairs * size)[mask.flatten()].tolist()
        negated = VisualTokens(tokens.features, tokens.pair_sizes, tokens.grids, query=-tokens.query)
        assert cdpruner.compress(negated, pairs * k).kept.tolist() == literal
        assert cdpruner.compress(tokens, pairs * k).kept.tolist() == expected_kept(tokens, pairs * k)[0]


def test_fidelity_cdpruner_past_the_rank_the_reference_repicks():
    """Documented difference: where a pair's largest d2 is 0 (duplicate tokens), the reference's sqrt(0) makes
    every d2 NaN, torch.argmax then returns the first NaN (a kept token) and the mask keeps fewer than T tokens.
    Ours picks the remaining tokens by relevance (here uniform, no question: in index order). Basis vectors and
    relevance 1 make every kernel entry exactly 0 or 1, so both run without rounding."""
    features = torch.eye(3, dtype=torch.float64)[[0, 1, 2, 0, 1, 2, 0]]
    picks, pivots, mask = reference_select(features[None], torch.ones(1, 7, dtype=torch.float64), 5)
    assert picks[:, 0].tolist() == [0, 1, 2, 3, 0] and pivots[:, 0].tolist()[:4] == [1, 1, 1, 0]
    assert mask.sum() == 4  # one token short
    tokens = VisualTokens(features, [7], [(1, 1, 7)], query=features[:0])
    assert cdpruner.compress(tokens, 5).kept.tolist() == [0, 1, 2, 3, 4]


def test_fidelity_cdpruner_past_the_rank_picks_by_relevance():
    """The documented rule past the rank, on a kernel exact in float64 (basis vectors, relevance powers of two):
    the reference's picks while the pivot is positive (7, 0, 2: one per basis vector, each zeroing its
    duplicates' d2), then the highest relevance among the others, ties to the lower index (4; 1 before 3)."""
    features = torch.eye(3, dtype=torch.float64)[[0, 1, 2, 0, 1, 2, 0, 1]]
    relevance = torch.tensor([1, 0.5, 0.25, 0.5, 1, 0.125, 0.25, 2], dtype=torch.float64)
    picks, pivots, _ = reference_select(features[None], relevance[None], 6)
    assert picks[:3, 0].tolist() == [7, 0, 2] and pivots[3, 0] == 0
    assert documented_picks(features, relevance, 6) == [7, 0, 2, 4, 1, 3]
    kernel = relevance[:, None] * (features @ features.T) * relevance[None, :]
    assert cdpruner.greedy_map(kernel[None], relevance[None], 6)[:, 0].tolist() == [7, 0, 2, 4, 1, 3]


def test_fidelity_cdpruner_fewer_dimensions_than_tokens():
    """Rank 3 of pairs of up to 9 tokens (past the rank the reference's d2 are rounding noise, ours too, so
    picks there are compared by rule in the exact test above): exactly `keep` distinct tokens, at least one a
    pair, and each pair keeps the reference's first min(k, 3) picks, made while its pivots are well above
    rounding."""
    for index in range(CASES):
        tokens = case([9, 6, 8], index, width=3)
        relevance = video_relevance(tokens.features, tokens.query)
        for keep in (3, 10, 15, 22):
            kept = set(cdpruner.compress(tokens, keep).kept.tolist())
            assert len(kept) == keep
            budgets = per_pair_budget(tokens.pair_sizes, keep)
            for start, size, k in zip(tokens.pair_starts, tokens.pair_sizes, budgets):
                picks, pivots, _ = reference_select(
                    tokens.features[start : start + size][None], relevance[start : start + size][None], k
                )
                first = min(k, 3)
                assert (pivots[:first] > 1e-9).all()
                assert {start + i for i in picks[:first, 0].tolist()} <= kept
                assert len([i for i in kept if start <= i < start + size]) == k


def test_fidelity_cdpruner_empty_and_constant_relevance_is_a_plain_dpp():
    """M = 0 (no question text) and a question orthogonal to every token (relevance constant, where the
    reference's min-max divides by zero) both give relevance 1: the reference's greedy on the similarity."""
    for index in range(CASES):
        tokens = case([6, 7, 5], index, query_rows=0)
        features = torch.cat([tokens.features[:, :8], torch.zeros(18, 8, dtype=torch.float64)], dim=1)
        orthogonal = torch.cat([torch.zeros(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)], 1)
        for keep in range(3, 18):
            empty = VisualTokens(features, tokens.pair_sizes, tokens.grids, query=features[:0])
            constant = VisualTokens(features, tokens.pair_sizes, tokens.grids, query=orthogonal)
            uniform = []
            for start, size, k in zip(empty.pair_starts, empty.pair_sizes, per_pair_budget(empty.pair_sizes, keep)):
                one = torch.ones(1, size, dtype=torch.float64)
                _, _, mask = reference_select(features[start : start + size][None], one, k)
                uniform += [start + i for i in torch.arange(size)[mask[0]].tolist()]
            assert cdpruner.compress(empty, keep).kept.tolist() == uniform
            assert cdpruner.compress(constant, keep).kept.tolist() == uniform
            check(empty, keep)


def test_fidelity_cdpruner_follows_the_question():
    """The same question keeps the same tokens; another question on the same video keeps other tokens."""
    tokens = case([36, 36, 36, 36], 3, width=32, query_rows=6)
    g = torch.Generator().manual_seed(11)
    other = VisualTokens(
        tokens.features, tokens.pair_sizes, tokens.grids, query=torch.randn(6, 32, generator=g, dtype=torch.float64)
    )
    first = cdpruner.compress(tokens, 36).kept
    assert torch.equal(cdpruner.compress(tokens, 36).kept, first)
    assert not torch.equal(cdpruner.compress(other, 36).kept, first)


def test_fidelity_cdpruner_needs_the_query():
    tokens = case([4, 4], 0)
    with pytest.raises(ValueError, match="query"):
        cdpruner.compress(VisualTokens(tokens.features, tokens.pair_sizes, tokens.grids), 4)


def test_fidelity_cdpruner_float32_no_syncs_and_flops_from_configs():
    """float32 tokens (the model's working precision): no host sync whatever the number of pairs, every pair
    keeps at least one token, and the FLOPs a run counts equal the formula from the pair sizes and keep."""
    for pairs in (4, 16):
        g = torch.Generator().manual_seed(pairs)
        sizes = [36] * (pairs - 1) + [20]
        features = torch.randn(sum(sizes), 64, generator=g)
        tokens = VisualTokens(features, sizes, [(1, 6, 6)] * (pairs - 1) + [(1, 4, 5)], query=torch.randn(7, 64))
        keep = sum(sizes) // 4
        with counting_syncs() as syncs:
            ours = cdpruner.compress(tokens, keep)
        assert syncs["n"] == 0
        kept = ours.kept
        assert len(kept) == keep
        starts = torch.tensor(tokens.pair_starts)
        assert len(torch.unique(torch.searchsorted(starts, kept, right=True))) == pairs
        _, flops = counted_flops(cdpruner.compress, tokens, keep)
        assert flops == cdpruner.dpp_flops(sizes, keep, types.SimpleNamespace(out_hidden=64))
    assert cdpruner.dpp_flops(sizes, sum(sizes), None) == 0
