"""ToMe against its reference rule, written out here on one sequence (no batch dimension).

Reference: facebookresearch/ToMe@af95e4b. `tome/merge.py:18-97` (bipartite_soft_matching: r
clamped to t // 2, alternate A/B split, cosine scores, node_max/node_idx, edges by descending
score, merged output [unmerged A, B]), `tome/merge.py:210-224` (merge_wavg), `tome/merge.py:227-239`
(merge_source: which original tokens each merged token holds), driven as `tome/patch/timm.py:40-53`
does (bipartite_soft_matching on the metric, merge_source, merge_wavg). Documented deviations
applied to the reference: no class or distillation token (Qwen has none); the metric of each round
is the current merged features (Qwen exposes no keys after the merger); the rounds run on one pair
until it reaches its share of the budget (r = the tokens still over it, clamped by the reference);
each pair gets its `per_pair_budget` share and is merged on its own.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from resadapt_eval.baselines import VisualTokens, tome
from resadapt_eval.baselines.common import merge_groups, per_pair_budget


def reference_matching(metric: torch.Tensor, r: int):
    """bipartite_soft_matching (tome/merge.py:18-97) on a (t, c) sequence, class_token and
    distill_token False. Returns merge(x, mode) or None when r <= 0 (do_nothing)."""
    t = metric.shape[0]
    r = min(r, t // 2)  # merge.py:43-44, protected = 0
    if r <= 0:  # merge.py:46-47
        return None, 0
    metric = metric / metric.norm(dim=-1, keepdim=True)  # merge.py:50
    a, b = metric[::2], metric[1::2]  # merge.py:51
    scores = a @ b.T  # merge.py:52
    node_max, node_idx = scores.max(dim=-1)  # merge.py:59
    edge_idx = node_max.argsort(dim=-1, descending=True)[:, None]  # merge.py:60
    unm_idx = edge_idx[r:]  # merge.py:62
    src_idx = edge_idx[:r]  # merge.py:63
    dst_idx = node_idx[:, None].gather(dim=0, index=src_idx)  # merge.py:64

    def merge(x: torch.Tensor, mode: str) -> torch.Tensor:  # merge.py:70-80
        src, dst = x[::2], x[1::2]
        t1, c = src.shape
        unm = src.gather(dim=0, index=unm_idx.expand(t1 - r, c))
        src = src.gather(dim=0, index=src_idx.expand(r, c))
        if mode != "keep":  # "keep" (not the reference's): which token holds each output slot
            dst = dst.scatter_reduce(0, dst_idx.expand(r, c), src, reduce=mode)
        return torch.cat([unm, dst], dim=0)

    return merge, a.shape[0] * b.shape[0]


def reference_merge_wavg(merge, x: torch.Tensor, size: torch.Tensor | None):
    """merge_wavg (tome/merge.py:210-224)."""
    if size is None:
        size = torch.ones_like(x[..., 0, None])
    x = merge(x * size, mode="sum")
    size = merge(size, mode="sum")
    return x / size, size


def reference_pair(x: torch.Tensor, target: int):
    """The timm block loop (patch/timm.py:40-53) with x as its own metric, until `target` tokens.
    Returns groups (set of original indices) by slot, the slot's own token, merged x, sizes, and
    the number of scores computed and rounds run."""
    n = x.shape[0]
    source = torch.eye(n, dtype=x.dtype)  # merge_source (merge.py:234-236), no batch
    holder = torch.arange(n, dtype=x.dtype)[:, None]
    size, scores, rounds = None, 0, 0
    while x.shape[0] > target:
        merge, count = reference_matching(x, x.shape[0] - target)
        assert merge is not None
        source = merge(source, mode="amax")  # merge.py:238
        holder = merge(holder, mode="keep")
        x, size = reference_merge_wavg(merge, x, size)
        scores, rounds = scores + count, rounds + 1
    if size is None:  # nothing to merge (a one-token pair)
        size = torch.ones_like(x[..., 0, None])
    groups = [frozenset(torch.nonzero(row).flatten().tolist()) for row in source]
    return groups, holder.flatten().long().tolist(), x, size.flatten(), scores, rounds


def our_groups(assignment: torch.Tensor) -> dict[int, frozenset]:
    out: dict[int, set] = {}
    for i, d in enumerate(assignment.tolist()):
        out.setdefault(d, set()).add(i)
    return {d: frozenset(m) for d, m in out.items()}


def check(pair_sizes: list[int], keep: int, seed: int, dim: int = 6) -> int:
    """Our compress against the reference run per pair on its budget share; returns max rounds."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(sum(pair_sizes), dim, generator=gen, dtype=torch.float64)
    tokens = VisualTokens(features=feats, pair_sizes=pair_sizes, grids=[(1, 1, s) for s in pair_sizes])
    ours = tome.compress(tokens, keep)
    assert ours.weights is None
    groups = our_groups(ours.assignment)

    ref_groups, ref_holders, ref_x, ref_size, scores, max_rounds = {}, [], [], [], 0, 0
    for start, size, target in zip(tokens.pair_starts, pair_sizes, per_pair_budget(pair_sizes, keep)):
        g, holder, x, s, count, rounds = reference_pair(feats[start : start + size], target)
        assert len(g) == target
        for members, h in zip(g, holder):
            ref_groups[start + h] = frozenset(start + m for m in members)
        ref_holders += [start + h for h in holder]
        ref_x.append(x)
        ref_size.append(s)
        scores, max_rounds = scores + count, max(max_rounds, rounds)

    # same groups, each at the original index of the token the reference keeps the slot of
    assert groups == ref_groups
    # same merged features (the reference's repeated weighted averages) and sizes, by destination
    destinations, sizes, (merged,) = merge_groups(ours, feats)
    order = torch.tensor(ref_holders).argsort()
    assert destinations.tolist() == sorted(ref_holders)
    torch.testing.assert_close(merged, torch.cat(ref_x)[order], atol=1e-6, rtol=0)
    assert sizes.tolist() == torch.cat(ref_size)[order].long().tolist()
    # the similarity count from configs (`tome.similarity_flops`) is the reference's |A| x |B| cosines per round
    assert tome.similarity_flops(pair_sizes, keep, SimpleNamespace(out_hidden=dim)) == 2 * scores * dim
    return max_rounds


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 15, 16, 33])
def test_fidelity_tome_single_pair_every_budget(n):
    """One pair, odd and even sizes, every budget from 1 token to all but one."""
    rounds = [check([n], keep, seed=100 * n + keep) for keep in range(1, n)]
    if n >= 7:
        assert max(rounds) >= 3  # several rounds, each re-splitting the reordered sequence


def test_fidelity_tome_random_single_pairs():
    rng = random.Random(0)
    for case in range(40):
        n = rng.randint(2, 60)
        check([n], rng.randint(1, n - 1), seed=case, dim=rng.choice([3, 8, 16]))


@pytest.mark.parametrize("num_pairs", [2, 3, 5])
def test_fidelity_tome_several_pairs_budget_split(num_pairs):
    """Several pairs (odd and even sizes), keep from one token per pair to all but one."""
    rng = random.Random(num_pairs)
    checked = 0
    for case in range(25):
        sizes = [rng.randint(1, 30) for _ in range(num_pairs)]
        total = sum(sizes)
        if total <= num_pairs:
            continue
        keep = num_pairs if case == 0 else total - 1 if case == 1 else rng.randint(num_pairs, total - 1)
        check(sizes, keep, seed=1000 * num_pairs + case)
        checked += 1
    assert checked >= 20  # a case is skipped only when every pair has one token


def test_fidelity_tome_round_merges_at_most_half_and_reorders():
    """Three tokens to one: the reference merges floor(3 / 2) = 1 per round (two rounds), and the
    second round's A/B split is of the reordered [unmerged A, B] sequence."""
    feats = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]], dtype=torch.float64)
    tokens = VisualTokens(features=feats, pair_sizes=[3], grids=[(1, 1, 3)])
    # round 1: A = {0, 2}, B = {1}; 0 -> 1 (closer). Sequence [2, {0, 1}]: A = {2}, B = {0, 1}.
    assert tome.compress(tokens, 2).assignment.tolist() == [1, 1, 2]
    # round 2 merges 2 into the group held by token 1, which stays its destination
    assert tome.compress(tokens, 1).assignment.tolist() == [1, 1, 1]
    assert tome.similarity_flops([3], 1, SimpleNamespace(out_hidden=2)) == 2 * (2 * 1 + 1 * 1) * 2
