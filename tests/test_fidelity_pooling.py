"""Pooling against its references' rule, written out here on one frame pair at a time.

References:
- xuyang-liu16/VidCom2@98dad55 (pull request #9), `token_compressor/pooling/pooling.py:99-156`
  (`adaptive_pooling`: th = int(sqrt(T)), tw = ceil(T / th) at :126-127; the input grid guessed from the
  token count at :130-136; `F.adaptive_avg_pool2d` at :144; row-major flatten at :149-150; cut to T at
  :153-154), `:19-61` (`spatial_average_pooling`: `F.avg_pool2d`, kernel = stride = s), `:200`
  (T = max(1, int(L R))); applied per frame pair (`models/qwen3_vl.py:142-166`).
- TianfanPeng/VLMUniPruneBench@f93768f, `methods/Pool_PreLLM.py:34-41` (the grid guess), `:44-46, 52-69`
  (`F.adaptive_avg_pool2d` to s x s, row-major), `:84-88` (s*s in {4, 16, 25}).
Documented deviations applied to the references: the pair's real grid (the tests use square grids,
where the guess is right, except one test showing the guess); per-pair budgets from `per_pair_budget`;
a window shares no row or column with the next (where `adaptive_avg_pool2d`'s windows overlap, the
shared row or column goes to the later window only); where th tw > T the reference drops windows and
ours re-cut the bands to cover every token; a pooled token sits at its window's top-left token.
"""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.baselines import VisualTokens, merge_groups, pooling
from resadapt_eval.baselines.common import per_pair_budget
from resadapt_eval.measure.syncs import counting_syncs


def guessed_grid(length: int) -> tuple[int, int]:
    """VidCom2 pooling.py:130-136 (= UniPruneBench Pool_PreLLM.py:34-41): rows = the square root, or the
    largest divisor of the length below it."""
    h = w = int(math.sqrt(length))
    if h * w != length:
        for i in range(int(math.sqrt(length)), 0, -1):
            if length % i == 0:
                h, w = i, length // i
                break
    return h, w


def vidcom2_shape(target: int) -> tuple[int, int]:
    """pooling.py:126-127: th = int(sqrt(T)) rows, tw = ceil(T / th) columns."""
    th = int(math.sqrt(target))
    return th, (target + th - 1) // th


def vidcom2_pool(x: torch.Tensor, target: int) -> torch.Tensor:
    """pooling.py:115-156 on one segment x (L, D): adaptive average pooling to (th, tw), row-major, first T."""
    length, dim = x.shape
    if target >= length:  # :117-118
        return x
    th, tw = vidcom2_shape(target)
    h, w = guessed_grid(length)
    maps = x.view(1, h, w, dim).permute(0, 3, 1, 2)  # :139-140
    pooled = F.adaptive_avg_pool2d(maps, (th, tw))  # :144
    pooled = pooled.permute(0, 2, 3, 1).reshape(1, -1, dim)  # :149-150
    return pooled[0, :target]  # :153-154


def uniprune_pool(x: torch.Tensor, side: int) -> torch.Tensor:
    """Pool_PreLLM.py:52-69 on one tile x (L, D): adaptive average pooling to side x side, row-major."""
    length, dim = x.shape
    h, w = guessed_grid(length)  # :62
    maps = x[None].permute(0, 2, 1).reshape(1, dim, h, w)  # :63
    pooled = F.adaptive_avg_pool2d(maps, (side, side))  # :64
    return pooled.reshape(1, dim, side * side).permute(0, 2, 1)[0]  # :65


def adaptive_window(i: int, n: int, m: int) -> tuple[int, int]:
    """The input range [start, end) of `adaptive_avg_pool2d`'s output i of m over n inputs (PyTorch's
    start_index / end_index: floor(i n / m), ceil((i + 1) n / m))."""
    return (i * n) // m, -(-((i + 1) * n) // m)


def groups_of(assignment: list[int], start: int, h: int, w: int) -> dict[int, list[tuple[int, int]]]:
    """(row, col) members of each destination of one pair."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for local in range(h * w):
        groups.setdefault(assignment[start + local], []).append(divmod(local, w))
    return groups


def as_rectangle(members: list[tuple[int, int]]) -> tuple[int, int, int, int]:
    """(row0, row1, col0, col1) of a group, asserting it is exactly that rectangle."""
    rows, cols = [r for r, _ in members], [c for _, c in members]
    r0, r1, c0, c1 = min(rows), max(rows) + 1, min(cols), max(cols) + 1
    assert sorted(members) == [(r, c) for r in range(r0, r1) for c in range(c0, c1)]
    return r0, r1, c0, c1


def run(grids: list[tuple[int, int]], keep: int, seed: int = 0, dim: int = 5):
    """Random float64 tokens on `grids`, our compression, its groups' features and destinations."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [h * w for h, w in grids]
    feats = torch.randn(sum(sizes), dim, generator=gen, dtype=torch.float64)
    tokens = VisualTokens(feats, sizes, [(1, h, w) for h, w in grids])
    ours = pooling.compress(tokens, keep)
    destinations, group_sizes, (merged,) = merge_groups(ours, feats)
    return tokens, ours, destinations, merged


def check_equals_reference(side: int, target: int, pairs: int = 3, seed: int = 0) -> None:
    """Square side x side pairs, each with T = target windows that tile it without overlap: the same
    windows, features and row-major order as the reference, each at its top-left token."""
    tokens, ours, destinations, merged = run([(side, side)] * pairs, pairs * target, seed)
    assert per_pair_budget(tokens.pair_sizes, pairs * target) == [target] * pairs
    th, tw = vidcom2_shape(target)
    assignment = ours.assignment.tolist()
    for p, start in enumerate(tokens.pair_starts):
        x = tokens.features[start : start + side * side]
        reference = vidcom2_pool(x, target)
        ours_pair = merged[p * target : (p + 1) * target]  # destinations ascend: the pooled row-major order
        torch.testing.assert_close(ours_pair, reference, atol=1e-12, rtol=0)
        groups = groups_of(assignment, start, side, side)
        assert len(groups) == target
        for index, (dest, members) in enumerate(sorted(groups.items())):
            i, j = divmod(index, tw)
            r0, r1, c0, c1 = as_rectangle(members)
            assert (r0, r1) == adaptive_window(i, side, th) and (c0, c1) == adaptive_window(j, side, tw)
            assert dest == start + r0 * side + c0  # the top-left token
        if th == tw and th in (2, 4, 5):  # UniPruneBench's fixed outputs (Pool_PreLLM.py:9)
            torch.testing.assert_close(ours_pair, uniprune_pool(x, th), atol=1e-12, rtol=0)
    assert destinations.tolist() == ours.kept.tolist()


@pytest.mark.parametrize("side", [1, 2, 4, 6, 8, 10, 12, 16])
def test_fidelity_pooling_whole_factors_equal_the_references(side):
    """Every whole factor s of a square grid (R = 1 / s^2): s x s windows, = F.avg_pool2d (pooling.py:55)."""
    for s in range(1, side + 1):
        if side % s == 0:
            check_equals_reference(side, (side // s) ** 2, seed=side * 100 + s)
            tokens, _, _, merged = run([(side, side)], (side // s) ** 2, seed=s)
            maps = tokens.features.T.reshape(1, -1, side, side)
            avg = F.avg_pool2d(maps, kernel_size=s, stride=s).reshape(tokens.features.shape[1], -1).T  # :55
            torch.testing.assert_close(merged, avg, atol=1e-12, rtol=0)


def test_fidelity_pooling_rectangular_outputs_that_tile_equal_the_reference():
    """T = th x tw with th | side and tw | side, th != tw (VidCom2's near-square outputs), e.g. 2 x 3 on 6 x 6."""
    checked = 0
    for side in range(1, 13):
        for target in range(1, side * side):
            th, tw = vidcom2_shape(target)
            if th * tw == target and th != tw and side % th == 0 and side % tw == 0:
                check_equals_reference(side, target, pairs=2, seed=target)
                checked += 1
    assert checked >= 10


@pytest.mark.parametrize("side", [3, 5, 6, 7, 9, 11])
def test_fidelity_pooling_overlapping_windows_go_to_the_later_window(side):
    """Every T = th x tw that fits a square grid: the same th x tw windows as the reference, each being the
    reference's window less the row or column it shares with the next window (the documented difference);
    where no window shares anything, the features are the reference's."""
    for target in range(1, side * side):
        th, tw = vidcom2_shape(target)
        if th * tw != target or tw > side:
            continue
        tokens, ours, _, merged = run([(side, side)], target, seed=target)
        x = tokens.features.view(side, side, -1)
        groups = sorted(groups_of(ours.assignment.tolist(), 0, side, side).items())
        assert len(groups) == target
        for index, (dest, members) in enumerate(groups):
            i, j = divmod(index, tw)
            r0, r1, c0, c1 = as_rectangle(members)
            (a0, a1), (b0, b1) = adaptive_window(i, side, th), adaptive_window(j, side, tw)
            next_row = adaptive_window(i + 1, side, th)[0] if i + 1 < th else side
            next_col = adaptive_window(j + 1, side, tw)[0] if j + 1 < tw else side
            assert (r0, r1, c0, c1) == (a0, min(a1, next_row), b0, min(b1, next_col))
            assert dest == r0 * side + c0
            torch.testing.assert_close(merged[index], x[r0:r1, c0:c1].reshape(-1, x.shape[2]).mean(0))
        if side % th == 0 and side % tw == 0:
            torch.testing.assert_close(merged, vidcom2_pool(tokens.features, target), atol=1e-12, rtol=0)


def test_fidelity_pooling_covers_what_the_reference_truncates():
    """Where th x tw > T the reference pools th x tw windows and keeps the first T (pooling.py:153-154),
    so the tokens only under its dropped windows are lost; ours keep th bands, k windows covering all."""
    lost_somewhere = False
    for side in range(2, 10):
        for target in range(2, side * side):
            th, tw = vidcom2_shape(target)
            if th * tw == target or tw > side or math.ceil(target / side) > th:
                continue
            assert vidcom2_pool(torch.zeros(side * side, 1), target).shape[0] == target
            covered = set()  # tokens under the reference's kept windows
            for index in range(target):
                (a0, a1), (b0, b1) = adaptive_window(index // tw, side, th), adaptive_window(index % tw, side, tw)
                covered |= {(r, c) for r in range(a0, a1) for c in range(b0, b1)}
            lost_somewhere |= len(covered) < side * side
            tokens, ours, _, _ = run([(side, side)], target)
            groups = groups_of(ours.assignment.tolist(), 0, side, side)
            assert len(groups) == target and sum(map(len, groups.values())) == side * side
            bands = sorted({as_rectangle(m)[:2] for m in groups.values()})
            assert [b[0] for b in bands] == [adaptive_window(i, side, th)[0] for i in range(th)]  # th bands
    assert lost_somewhere


def test_fidelity_pooling_uses_the_real_grid_and_its_aspect():
    """A 9 x 16 pair (a 16:9 frame): the references would read 144 tokens as 12 x 12 (pooling.py:130-136);
    ours pool the real grid, and at R = 1/4 with an even grid (8 x 16) the windows are exactly 2 x 2."""
    assert guessed_grid(9 * 16) == (12, 12)
    tokens, _, _, merged = run([(8, 16), (8, 16)], 2 * 32)
    maps = tokens.features.T.reshape(-1, 2, 8, 16).transpose(0, 1)  # (pairs, D, h, w)
    avg = F.avg_pool2d(maps, kernel_size=2, stride=2).flatten(2).transpose(1, 2).reshape(-1, maps.shape[1])
    torch.testing.assert_close(merged, avg, atol=1e-12, rtol=0)
    assert pooling.output_rows(9, 16, 36) == 4  # floor(sqrt(36 * 9 / 16)): 4 bands of 9 windows


def test_fidelity_pooling_random_grids_are_exact_partitions():
    """Random grids and budgets: exactly `keep` groups, each pair's share, every group a rectangle of near-equal
    bands and columns at its top-left token, its feature the mean of its tokens."""
    rng = random.Random(0)
    for case in range(40):
        grids = [(rng.randint(1, 12), rng.randint(1, 12)) for _ in range(rng.randint(1, 4))]
        total = sum(h * w for h, w in grids)
        keep = rng.randint(len(grids), total)
        tokens, ours, destinations, merged = run(grids, keep, seed=case)
        assert len(destinations) == keep
        assignment = ours.assignment.tolist()
        budget = per_pair_budget(tokens.pair_sizes, keep)
        for (h, w), start, k in zip(grids, tokens.pair_starts, budget):
            groups = groups_of(assignment, start, h, w)
            assert len(groups) == k >= 1
            rows = pooling.output_rows(h, w, k)
            rects = sorted(as_rectangle(m) for m in groups.values())
            bands = sorted({(r0, r1) for r0, r1, _, _ in rects})
            assert len(bands) == rows and {r1 - r0 for r0, r1 in bands} <= {h // rows, -(-h // rows)}
            for r0, r1 in bands:
                widths = [c1 - c0 for b0, b1, c0, c1 in rects if (b0, b1) == (r0, r1)]
                assert sum(widths) == w and max(widths) - min(widths) <= 1
            for dest, members in groups.items():
                r0, _, c0, _ = as_rectangle(members)
                assert dest == start + r0 * w + c0
        members: dict[int, list[int]] = {}
        for i, a in enumerate(assignment):
            members.setdefault(a, []).append(i)
        expected = torch.stack([tokens.features[members[d]].mean(0) for d in destinations.tolist()])
        torch.testing.assert_close(merged, expected)


def test_fidelity_pooling_r1_keeps_everything_unchanged():
    tokens, ours, destinations, merged = run([(3, 5), (4, 4), (1, 7)], 15 + 16 + 7)
    assert ours.assignment.tolist() == list(range(38))
    assert torch.equal(merged, tokens.features)


def test_fidelity_pooling_one_token_per_pair():
    tokens, ours, destinations, merged = run([(3, 5), (4, 4)], 2)
    assert destinations.tolist() == [0, 15]
    torch.testing.assert_close(merged, torch.stack([tokens.features[:15].mean(0), tokens.features[15:].mean(0)]))


def test_fidelity_pooling_bfloat16():
    feats = torch.randn(2 * 64, 8).to(torch.bfloat16)
    tokens = VisualTokens(feats, [64, 64], [(1, 8, 8)] * 2)
    ours = pooling.compress(tokens, 32)
    assert ours.assignment.device == feats.device and ours.weights is None
    _, _, (merged,) = merge_groups(ours, feats)
    assert merged.dtype == torch.bfloat16 and merged.shape == (32, 8)
    maps = feats.double().T.reshape(8, 2, 8, 8).transpose(0, 1)
    avg = F.avg_pool2d(maps, 2).flatten(2).transpose(1, 2).reshape(32, 8)
    torch.testing.assert_close(merged.double(), avg, atol=2e-2, rtol=2e-2)


def test_fidelity_pooling_host_syncs_do_not_grow_with_the_pairs():
    counts = []
    for pairs in (4, 16):
        feats = torch.randn(pairs * 36, 16)
        tokens = VisualTokens(feats, [36] * pairs, [(1, 6, 6)] * pairs)
        with counting_syncs() as syncs:
            pooling.compress(tokens, len(feats) // 4 + 1, 0)
        counts.append(syncs["n"])
    assert counts == [0, 0]


def test_fidelity_pooling_rejects_an_impossible_keep_or_grid():
    tokens = VisualTokens(torch.zeros(20, 2), [8, 12], [(1, 2, 4), (1, 3, 4)])
    for keep in (0, 1, 21):
        with pytest.raises(ValueError, match="outside"):
            pooling.compress(tokens, keep)
    with pytest.raises(ValueError, match="grid"):
        pooling.compress(VisualTokens(torch.zeros(20, 2), [8, 12], [(1, 2, 4), (1, 3, 3)]), 4)
