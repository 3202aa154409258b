"""VisPruner against its reference rule, written out here from the reference's code.

Reference: Theia-4869/VisPruner@aefa01a, `llava/model/llava_arch.py:140-183` (`encode_images`), on
a batch of B images (B, N, C) with their attention scores (B, N):
- `:148-151`: T_imp = int(T * important_ratio), T_div = T - T_imp (`important_ratio` 0.5 by
  default, `llava/eval/model_vqa_loader.py:152`);
- `:154-157`: scores mean over heads (here already one score per token), `argsort` descending,
  the first T_imp important, the rest residual in that order;
- `:160`: features divided by their L2 norms;
- `:161-176`: while T_div > 0: R residual tokens, r = min(8, R - T_div), stop when r <= 0; A, B =
  the residual tokens at even and odd places; each A token's score is its max cosine to B; the
  next residual is A[argsort(scores, descending)[r:]] then B;
- `:178-183`: kept = important + residual (a mask: original order, `:212, 265, 272`).
Documented deviations applied to the reference: the scores are our `received_attention` (no
[CLS]); each pair is one image with its `per_pair_budget` share as T. Where the reference's batch
index (`:174`, `R // 2 - r` columns) does not fit the A half (some round with R odd or r > R // 2),
the literal code raises, keeps fewer than T tokens, or drops one A token too many in a round (an
index of width 0 broadcast against 1); there ours equals the rule with that index's width fixed to
the A half's (`literal=False`). Everywhere the index fits, the literal code runs and ours is its
result.
"""

import random

import pytest
import torch

from resadapt_eval.baselines import VisualTokens
from resadapt_eval.baselines import vispruner as vp
from resadapt_eval.baselines.common import DROPPED, merge_groups, per_pair_budget
from resadapt_eval.measure.syncs import counting_syncs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def reference(image_features, image_attentions, visual_token_num, important_ratio=0.5, literal=True):
    """llava_arch.py:144-183 on (B, N, C) features and (B, N) scores; returns the kept indices per
    image, sorted (the boolean mask of `:182-183` read back in original order)."""
    B, N, C = image_features.shape  # :144
    important_token_num = int(visual_token_num * important_ratio)  # :150
    diverse_token_num = visual_token_num - important_token_num  # :151
    token_indices = image_attentions.argsort(dim=-1, descending=True)  # :155
    important_indices = token_indices[:, :important_token_num]  # :156
    residual_indices = token_indices[:, important_token_num:]  # :157
    image_normalized = image_features / image_features.norm(dim=-1, keepdim=True)  # :160
    while diverse_token_num > 0:  # :161
        R = residual_indices.shape[1]  # :162
        r = min(8, R - diverse_token_num)  # :163
        if r <= 0:  # :164-165
            break
        residual_tokens = image_normalized[torch.arange(B).unsqueeze(-1).expand(-1, R), residual_indices]  # :167
        a, b = residual_tokens[..., ::2, :], residual_tokens[..., 1::2, :]  # :168
        scores = a @ b.transpose(-1, -2)  # :169
        scores = scores.max(dim=-1).values  # :170
        distinct_indices = scores.argsort(dim=-1, descending=True)[:, r:]  # :172
        width = R // 2 - r if literal else distinct_indices.shape[1]  # :174 (literal) or the A half's
        residual_indices = torch.cat(
            [
                residual_indices[..., ::2][torch.arange(B).unsqueeze(-1).expand(-1, width), distinct_indices],  # :174
                residual_indices[..., 1::2],  # :175
            ],
            dim=-1,
        )  # :173-176
    if diverse_token_num > 0:  # :178-181
        selected_indices = torch.cat([important_indices, residual_indices], dim=-1)
    else:
        selected_indices = important_indices
    index_masks = torch.zeros(B, N, dtype=torch.bool)  # :182
    index_masks.scatter_(1, selected_indices, True)  # :183
    return [torch.arange(N)[m].tolist() for m in index_masks]


def index_misfits(n: int, k: int) -> bool:
    """Whether some round of the reference has R odd or r > R // 2 (its `:174` index then differs
    from the A half's width)."""
    important, diverse = vp.split(k)
    residual = n - important
    for r in vp.rounds(residual, diverse):
        if residual % 2 or r > residual // 2:
            return True
        residual -= r
    return False


def literal_or_none(feats, scores, k):
    """The literal reference's kept indices, or None where it raises or keeps fewer than k tokens."""
    try:
        kept = reference(feats, scores, k)
    except (RuntimeError, IndexError):
        return None
    return kept if all(len(row) == k for row in kept) else None


def check(pair_sizes: list[int], keep: int, seed: int, dim: int = 6) -> dict[str, int]:
    """Ours against the reference per pair on its budget share, kept indices and features."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(pair_sizes)
    feats = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    attention = torch.rand(n, generator=gen, dtype=torch.float64)
    tokens = VisualTokens(feats, pair_sizes, [(1, 1, s) for s in pair_sizes], attention)
    ours = vp.compress(tokens, keep)
    assert ours.weights is None
    seen = {"literal": 0, "fixed": 0}
    expected = []
    for start, size, k in zip(tokens.pair_starts, pair_sizes, per_pair_budget(pair_sizes, keep)):
        f, s = feats[start : start + size][None], attention[start : start + size][None]
        fixed = reference(f, s, k, literal=False)[0]
        assert len(fixed) == k
        # the literal code on a batch of two images (this pair and a random one)
        other_f, other_s = (
            torch.randn(1, size, dim, generator=gen, dtype=torch.float64),
            torch.rand(1, size, generator=gen),
        )
        literal = literal_or_none(torch.cat([f, other_f]), torch.cat([s, other_s.double()]), k)
        if index_misfits(size, k):
            seen["fixed"] += 1
        else:  # the index fits in every round: the literal code runs, and the fix changes nothing
            assert literal is not None and literal[0] == fixed, (size, k)
            seen["literal"] += 1
        expected += [start + i for i in fixed]
    assert ours.kept.tolist() == expected
    assignment = ours.assignment.tolist()
    assert all(assignment[i] == (i if i in set(expected) else DROPPED) for i in range(n))
    destinations, sizes, (merged,) = merge_groups(ours, feats)
    assert destinations.tolist() == expected and sizes.eq(1).all()
    torch.testing.assert_close(merged, feats[expected], atol=0, rtol=0)  # pure pruning: features unchanged
    return seen


def test_fidelity_vispruner_defaults():
    assert vp.IMPORTANT_RATIO == 0.5 and vp.MAX_REMOVED == 8
    assert vp.split(64) == (32, 32)  # README: 64 tokens at ratio 0.5
    assert vp.split(64, 0.75) == (48, 16)  # README: "48 important tokens and 16 diverse tokens"
    assert vp.split(1) == (0, 1)
    # LLaVA's 576 patches at T = 128: 512 residual tokens, 8 removed a round down to 64
    assert vp.rounds(576 - 64, 64) == [8] * 56


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16, 17, 33, 40])
def test_fidelity_vispruner_single_pair_every_budget(n):
    """One pair, odd and even sizes, every budget from 1 token to all of them."""
    seen = {"literal": 0, "fixed": 0}
    for keep in range(1, n + 1):
        for key, count in check([n], keep, seed=100 * n + keep).items():
            seen[key] += count
    assert seen["literal"] > 0


def test_fidelity_vispruner_llava_sizes():
    """LLaVA-1.5's 576 tokens at the budgets the reference's scripts use (`README.md`: 64, 128,
    192) and their neighbours: the literal code runs at T = 64, 128, 192 and is our result."""
    for keep in (64, 128, 192, 63, 66, 100):
        seen = check([576], keep, seed=keep, dim=8)
        if keep % 64 == 0:
            assert seen["literal"] == 1


def test_fidelity_vispruner_random_single_pairs():
    rng = random.Random(0)
    for case in range(30):
        n = rng.randint(2, 300)
        check([n], rng.randint(1, n), seed=case, dim=rng.choice([3, 8, 16]))


@pytest.mark.parametrize("num_pairs", [2, 3, 5])
def test_fidelity_vispruner_several_pairs_budget_split(num_pairs):
    """Several pairs (odd and even sizes, some equal), keep from one token per pair to all."""
    rng = random.Random(num_pairs)
    for case in range(20):
        sizes = [rng.choice([rng.randint(1, 80), 48]) for _ in range(num_pairs)]
        total = sum(sizes)
        keep = num_pairs if case == 0 else total if case == 1 else rng.randint(num_pairs, total)
        check(sizes, keep, seed=1000 * num_pairs + case)


def test_fidelity_vispruner_batched_pairs_are_the_reference_batch():
    """Equal pairs with equal budgets run as one batch, as the reference runs a batch of images:
    the literal reference on all of them at once gives every pair's kept tokens."""
    gen = torch.Generator().manual_seed(7)
    pairs, size, keep = 6, 144, 6 * 36
    feats = torch.randn(pairs * size, 10, generator=gen, dtype=torch.float64)
    attention = torch.rand(pairs * size, generator=gen, dtype=torch.float64)
    ours = vp.compress(VisualTokens(feats, [size] * pairs, [(1, 12, 12)] * pairs, attention), keep)
    literal = reference(feats.view(pairs, size, -1), attention.view(pairs, size), keep // pairs)
    assert ours.kept.tolist() == [p * size + i for p, row in enumerate(literal) for i in row]


def test_fidelity_vispruner_gram_and_per_round_scores_agree(monkeypatch):
    """Both ways of scoring (one Gram matrix, or the reference's per-round products) keep the same
    tokens; `select` takes the one with fewer multiply-adds, and the fidelity checks see both."""
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(3 * 101, 7, generator=gen, dtype=torch.float64)
    residual = torch.stack([torch.randperm(101, generator=gen) + 101 * row for row in range(3)])
    schedule = vp.rounds(101, 20)
    assert len(schedule) == 11 and schedule[-1] == 1
    gram_way = vp.remove_duplicates(features, residual, schedule, True)
    assert gram_way.shape == (3, 20)
    assert torch.equal(gram_way, vp.remove_duplicates(features, residual, schedule, False))
    per_round, gram = vp.products(101, schedule)
    assert gram < per_round  # many rounds: the Gram matrix is cheaper
    per_round, gram = vp.products(101, vp.rounds(101, 90))  # two rounds (8, 3)
    assert per_round < gram
    used = []
    original = vp.remove_duplicates

    def spy(features, residual, schedule, use_gram):
        used.append(use_gram)
        return original(features, residual, schedule, use_gram)

    monkeypatch.setattr(vp, "remove_duplicates", spy)
    for keep in (10, 60, 100):
        check([120], keep, seed=keep)
    assert used == [True, True, False]


def test_vispruner_keeps_exactly_keep_and_every_pair():
    rng = random.Random(11)
    for case in range(20):
        sizes = [rng.randint(1, 60) for _ in range(rng.randint(1, 6))]
        keep = rng.randint(len(sizes), sum(sizes))
        gen = torch.Generator().manual_seed(case)
        tokens = VisualTokens(
            torch.randn(sum(sizes), 5, generator=gen),
            sizes,
            [(1, 1, s) for s in sizes],
            torch.rand(sum(sizes), generator=gen),
        )
        kept = vp.compress(tokens, keep).kept
        assert len(kept) == keep
        owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        assert set(owner[kept].tolist()) == set(range(len(sizes)))


def test_vispruner_keeping_everything_changes_nothing():
    gen = torch.Generator().manual_seed(1)
    sizes = [30, 31, 29]
    feats = torch.randn(90, 4, generator=gen)
    ours = vp.compress(VisualTokens(feats, sizes, [(1, 1, s) for s in sizes], torch.rand(90, generator=gen)), 90)
    assert ours.assignment.tolist() == list(range(90))
    _, _, (merged,) = merge_groups(ours, feats)
    assert torch.equal(merged, feats)


def test_vispruner_bfloat16():
    gen = torch.Generator().manual_seed(2)
    sizes = [64] * 4
    feats = torch.randn(256, 32, generator=gen).bfloat16()
    tokens = VisualTokens(feats, sizes, [(1, 8, 8)] * 4, torch.rand(256, generator=gen).bfloat16())
    ours = vp.compress(tokens, 64)
    assert len(ours.kept) == 64 and ours.assignment.dtype == torch.long
    _, _, (merged,) = merge_groups(ours, feats)
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, feats[ours.kept])


def test_vispruner_host_syncs_do_not_grow_with_the_pairs():
    counts = []
    for pairs in (4, 16):
        gen = torch.Generator().manual_seed(pairs)
        n = pairs * 36
        tokens = VisualTokens(
            torch.randn(n, 64, generator=gen), [36] * pairs, [(1, 6, 6)] * pairs, torch.rand(n, generator=gen)
        )
        with counting_syncs() as syncs:
            vp.compress(tokens, n // 4, 0)
        counts.append(syncs["n"])
    assert counts == [0, 0]


def test_vispruner_impossible_keep_and_missing_attention():
    tokens = VisualTokens(torch.zeros(8, 2), [4, 4], [(1, 2, 2)] * 2, torch.rand(8))
    with pytest.raises(ValueError, match="outside"):
        vp.compress(tokens, 1)  # below one token per pair
    with pytest.raises(ValueError, match="outside"):
        vp.compress(tokens, 9)
    with pytest.raises(ValueError, match="received attention"):
        vp.compress(VisualTokens(torch.zeros(4, 2), [4], [(1, 2, 2)]), 2)
