"""G-Prune against its reference rule, written out here from the authors' code.

Reference: jytmelon/G-Prune@762c637, `LLaVA-NeXT/llava/model/llava_arch.py:259-287` (one view of
an image, on the projected features): normalise (`:259`), cosine graph (`:261`), `A[A < 0.5] = 0`
(`:263`), `A / 0.03` (`:265`), `A[abs(A) < 1e-6] = -5000` (`:267`), row softmax (`:269`), degree
`sum(A > 0)` (`:271`), `matrix_power(A, 5)` (`:273`), W = feature norms (`:275`), `W @ A^5 / degree`
(`:277-279`), `topk(int(0.5 n))` (`:281`), sorted (`:287`). UniPruneBench's port,
TianfanPeng/VLMUniPruneBench@f93768f `methods/GPrune_PreLLM.py:6-20`, is the same sequence of
operations (keep `max(1, int(keep_ratio n))`, `:18`).

Documented deviations applied to the reference: one graph per frame pair, each keeping its
`per_pair_budget` share of `keep` (the reference: int(keep_ratio n) per view); ours computes the
flow as five vector-matrix products (the same product; scores compared to 1e-9 in float64); ties
to the lower index (the random float64 scores here have none).
"""

import random

import pytest
import torch

from resadapt_eval.baselines import gprune
from resadapt_eval.baselines.common import DROPPED, VisualTokens, merge_groups, per_pair_budget
from resadapt_eval.measure.syncs import counting_syncs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def reference_view(image_feature, keep_num: int, similarity=0.5, temperature=0.03, iterate_num=5, upcast=None):
    """jytmelon/G-Prune@762c637 `llava_arch.py:259-287` on one view of n tokens (n, C), without
    row-end tokens; also VLMUniPruneBench@f93768f `GPrune_PreLLM.py:7-19`. Returns the sorted kept
    indices and the scores. `upcast`: the documented deviation, the steps after the cosines in
    that dtype (the reference: all in the features' dtype)."""
    normalized = torch.nn.functional.normalize(image_feature, p=2, dim=1)  # :259
    A = normalized @ normalized.t()  # :261
    if upcast is not None:
        A = A.to(upcast)
    A[A < similarity] = 0  # :263
    A = A / temperature  # :265
    A[abs(A) < 1e-6] = -5000  # :267
    A = torch.nn.functional.softmax(A, dim=1)  # :269
    degree = torch.sum(A > 0, dim=1)  # :271
    A = torch.matrix_power(A, iterate_num)  # :273
    W = torch.norm(image_feature, dim=-1).view(1, -1).to(dtype=A.dtype)  # :275
    result = W @ A  # :277
    result = result / degree  # :279
    keep_indices = result.topk(keep_num).indices.flatten()  # :281-283
    return torch.sort(keep_indices)[0], result[0]  # :287


def clustered(n: int, dim: int, gen: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """Tokens around a few directions with varying norms, so links and degrees vary."""
    centres = torch.randn(max(1, n // 10), dim, generator=gen, dtype=dtype)
    pick = torch.randint(len(centres), (n,), generator=gen)
    scale = torch.rand(n, 1, generator=gen, dtype=dtype) * 2 + 0.2
    return (centres[pick] + 0.7 * torch.randn(n, dim, generator=gen, dtype=dtype)) * scale


def ours(pair_sizes, feats, keep):
    tokens = VisualTokens(feats, pair_sizes, [(1, 1, s) for s in pair_sizes])
    compression = gprune.compress(tokens, keep)
    destinations, sizes, (merged,) = merge_groups(compression, feats)
    return compression, destinations, sizes, merged


def check(pair_sizes: list[int], keep: int, feats: torch.Tensor) -> None:
    """Our kept tokens and scores against the reference per pair on its budget share."""
    compression, destinations, sizes, merged = ours(pair_sizes, feats, keep)
    expected = []
    start = 0
    for size, k in zip(pair_sizes, per_pair_budget(pair_sizes, keep)):
        kept, scores = reference_view(feats[start : start + size], k)
        torch.testing.assert_close(gprune.importance(feats[None, start : start + size])[0], scores, rtol=1e-9, atol=0)
        expected.append(kept + start)
        start += size
    expected = torch.cat(expected)
    assert torch.equal(destinations, expected)
    assert torch.equal(merged, feats[expected]) and sizes.tolist() == [1] * keep  # pruned, not merged
    dropped = torch.ones(len(feats), dtype=torch.bool)
    dropped[expected] = False
    assert (compression.assignment[dropped] == DROPPED).all()
    assert torch.equal(compression.assignment[expected], expected)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 37, 64])
def test_fidelity_gprune_single_pair_every_budget(n):
    gen = torch.Generator().manual_seed(n)
    feats = clustered(n, 8, gen)
    for keep in range(1, n + 1):
        check([n], keep, feats)


def test_fidelity_gprune_reference_setting_keeps_half_of_each_pair():
    """Equal pairs, keep = P int(0.5 n): each pair keeps the reference's int(keep_ratio n)."""
    gen = torch.Generator().manual_seed(7)
    sizes = [49] * 4
    feats = clustered(sum(sizes), 16, gen)
    _, destinations, _, _ = ours(sizes, feats, 4 * 24)
    expected = torch.cat([reference_view(feats[i * 49 : (i + 1) * 49], int(0.5 * 49))[0] + i * 49 for i in range(4)])
    assert torch.equal(destinations, expected)


def test_fidelity_gprune_random_pairs_and_batches(monkeypatch):
    """Unequal and equal pairs, gaussian and clustered tokens; a small CHUNK so that equal
    consecutive pairs form several batches (and pairs larger than it run alone)."""
    rng = random.Random(0)
    for case in range(30):
        monkeypatch.setattr(gprune, "CHUNK", rng.choice([1, 500, 4000, 2**23]))
        pairs = rng.randint(1, 5)
        size = rng.randint(1, 40)
        sizes = [size if rng.random() < 0.5 else rng.randint(1, 40) for _ in range(pairs)]
        gen = torch.Generator().manual_seed(case)
        dim = rng.choice([3, 6, 12])
        n = sum(sizes)
        feats = clustered(n, dim, gen) if case % 2 else torch.randn(n, dim, generator=gen, dtype=torch.float64)
        check(sizes, rng.randint(pairs, n), feats)


def test_fidelity_gprune_batches_cover_equal_runs(monkeypatch):
    monkeypatch.setattr(gprune, "CHUNK", 100)
    assert gprune.batches([4, 4, 4, 4, 3, 3, 5], 5) == [(0, 4), (4, 2), (6, 1)]
    assert gprune.batches([4] * 6, 6) == [(0, 4), (4, 2)]  # 100 // (4 * 6) = 4 pairs a batch
    assert gprune.batches([20, 20], 2) == [(0, 1), (1, 1)]  # one pair alone is above CHUNK


def test_fidelity_gprune_zero_feature_and_duplicates():
    """A zero vector: its row is all -5000, so uniform (degree n), and nothing links to it; exact
    duplicates: equal scores, the lower index first."""
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(12, 4, generator=gen, dtype=torch.float64)
    feats[5] = 0
    check([12], 6, feats)
    normalized = torch.nn.functional.normalize(feats, dim=-1)
    _, degree = gprune.similarity_graph(normalized @ normalized.T)
    assert degree[5] == 12
    twins = torch.cat([feats[:4], feats[:4]])
    scores = gprune.importance(twins[None])[0]
    assert torch.equal(scores[:4], scores[4:])
    best, second = torch.sort(scores[:4], descending=True).indices[:2].tolist()
    for keep, expected in ((1, [best]), (2, [best, best + 4]), (3, sorted([best, best + 4, second]))):
        assert ours([8], twins, keep)[1].tolist() == sorted(expected)


def test_gprune_keeps_exactly_keep_and_every_pair():
    sizes = [5, 1, 8, 3, 12]
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(sum(sizes), 6, generator=gen)
    pair = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    for keep in range(len(sizes), sum(sizes) + 1):
        compression, destinations, sizes_out, _ = ours(sizes, feats, keep)
        assert len(destinations) == keep and sizes_out.sum() == keep
        assert torch.bincount(pair[destinations], minlength=len(sizes)).tolist() == per_pair_budget(sizes, keep)


def test_gprune_r1_keeps_everything_unchanged():
    feats = torch.randn(17, 4)
    compression, _, _, merged = ours([6, 6, 5], feats, 17)
    assert torch.equal(compression.assignment, torch.arange(17))
    assert torch.equal(merged, feats)


def test_gprune_bfloat16():
    """bfloat16 tokens: norms and cosines in bfloat16 as the reference, the rest in float32 (the
    same kept tokens as the reference upcast after its cosines); kept features unchanged."""
    gen = torch.Generator().manual_seed(2)
    feats = clustered(3 * 36, 32, gen, torch.float32).to(torch.bfloat16)
    compression, destinations, _, merged = ours([36] * 3, feats, 27)
    assert compression.assignment.device == feats.device and len(destinations) == 27
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, feats[destinations])
    expected = [reference_view(feats[i : i + 36], 9, upcast=torch.float32)[0] + i for i in (0, 36, 72)]
    assert torch.equal(destinations, torch.cat(expected))


def test_gprune_host_syncs_are_zero_whatever_the_pairs():
    counts = []
    for pairs in (4, 16):
        gen = torch.Generator().manual_seed(pairs)
        n = pairs * 36
        tokens = VisualTokens(torch.randn(n, 16, generator=gen), [36] * pairs, [(1, 6, 6)] * pairs)
        with counting_syncs() as syncs:
            gprune.compress(tokens, n // 4)
        counts.append(syncs["n"])
    assert counts == [0, 0]
    # the reference: its two boolean-mask assignments (:263, :267) are a sync each, per graph
    with counting_syncs() as syncs:
        reference_view(torch.randn(36, 16), 9)
    assert syncs["n"] == 2


def test_gprune_errors():
    tokens = VisualTokens(torch.zeros(8, 2), [4, 4], [(1, 2, 2)] * 2)
    for keep in (0, 1, 9):
        with pytest.raises(ValueError, match=f"keep={keep} tokens is outside"):
            gprune.compress(tokens, keep)
