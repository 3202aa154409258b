"""FlashVID against its reference rules, written out here (frames = Qwen frame pairs).

Reference: Fanziyang-v/FlashVID@1d37422.
- segmentation: `flashvid/utils.py:168-226` (`segment`, `additional_segment`), on the frames' mean
  features (`utils.py:31-37`); segment threshold 0.9, min_segment_num 4, complementary cuts
  (`scripts/qwen2_5_vl.sh:13-20`, `scripts/qwen3_vl.sh:13-20`);
- ADTS: `flashvid/token_selection.py:14-76` (`pairwise_cosine_distances`,
  `attn_div_based_token_selection`), ceil(alpha * budget) tokens (`utils.py:46-48`);
- temporal tree merging: `utils.py:283-349` (`spatiotemporal_compression`), transcribed with its
  count rule: a root's count grows by one per direct child (`utils.py:334`), so a tree deeper than
  one level is its members' sum over 1 + the root's direct children, not their mean;
- per-frame spatial merging at the segment's common ratio: `utils.py:138-165`, DPC-kNN
  `utils.py:229-280`; segments in order and output sorted by index: `utils.py:53-78`.
Documented deviations applied to the reference rule (see `flashvid.py`): per-pair budgets from
`per_pair_budget` (ADTS share ceil(0.7 b) per pair, lower bound = the segment's budget sum); the
per-frame cluster counts split the context budget exactly (largest remainder) instead of ceil, a
frame with none drops its trees; a one-frame segment clusters its unselected tokens only; DPC-kNN
without its random density noise (equal densities: the lower index is denser, centre ties to the
lower index) and with exact zero self-distances; a segment whose budget is all its tokens merges
nothing (the reference raises there, as it does on a one-token frame, which is not compared).
"""

import math
import random
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.baselines import VisualTokens, flashvid
from resadapt_eval.baselines.common import DROPPED, merge_groups, per_pair_budget

THRESHOLD, MIN_SEGMENTS, ALPHA, TEMPORAL = 0.9, 4, 0.7, 0.8


# ---------------------------------------------------------------- the reference, written out
def ref_segment_lengths(frame_means: torch.Tensor) -> list[int]:
    """utils.py:185-203 and 206-226: segment lengths (an empty segment when a cut repeats)."""
    num_frames = frame_means.shape[0]
    normed = frame_means / frame_means.norm(p=2, dim=-1, keepdim=True)  # utils.py:188
    sims = torch.sum(normed[:-1] * normed[1:], dim=-1)  # utils.py:189
    cuts = torch.where(sims < THRESHOLD)[0]  # utils.py:192
    if cuts.numel() + 1 < MIN_SEGMENTS:  # utils.py:214-219
        remaining = MIN_SEGMENTS - (cuts.numel() + 1)
        sims = sims.clone()
        sims[sims < THRESHOLD] = 1.0
        extra = torch.topk(sims, k=min(remaining, sims.shape[0]), largest=False).indices
        cuts = torch.cat([cuts, extra]).sort().values
    padded = F.pad(cuts, (1, 1), value=0)  # utils.py:221-224
    padded[0] = -1
    padded[-1] = num_frames - 1
    return torch.diff(padded).tolist()


def ref_adts(features: torch.Tensor, attention: torch.Tensor, count: int) -> torch.Tensor:
    """token_selection.py:28-76 on (bsz, n, D) features and (bsz, n) attention: sorted indices."""
    attention = attention * 1e6  # :46
    bsz, n, _ = features.shape
    normed = features / features.norm(p=2, dim=-1, keepdim=True)  # :23
    dist = 1.0 - torch.bmm(normed, normed.transpose(-1, -2))  # :24-25
    dist = dist * attention.unsqueeze(1)  # :51
    keep = torch.zeros(bsz, count, dtype=torch.long)
    keep[:, 0] = torch.argmax(torch.topk(dist, k=2, dim=1, largest=False).values[:, 1, :], dim=-1)  # :57-58
    for i in range(1, count):  # :61-71
        sub = torch.gather(dist, 1, keep[:, :i].unsqueeze(-1).expand(-1, -1, n))
        min_dist = torch.min(sub, dim=1).values
        min_dist.scatter_(1, keep[:, :i], -1)
        keep[:, i] = torch.argmax(min_dist, dim=-1)
    return keep.sort().values  # :73


def ref_dpc_knn(x: torch.Tensor, num_clusters: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """utils.py:229-280 on one (seq, D) batch, noise removed (deviation): cluster of each row
    (index into centres) and the centres in score order."""
    seq, dim = x.shape
    dists = torch.cdist(x, x) / math.sqrt(dim)  # :246
    dists.fill_diagonal_(0.0)  # deviation: exact self-distance
    nearest = torch.topk(dists, k=k, dim=-1, largest=False).values  # :251
    density = torch.mean(-(nearest**2), dim=-1).exp()  # :252
    # :255 adds rand * 1e-6; instead (deviation) equal densities: the lower index is denser
    idx = torch.arange(seq)
    mask = (density[None, :] > density[:, None]) | (
        (density[None, :] == density[:, None]) & (idx[None, :] < idx[:, None])
    )  # :262, mask[i, j]: j denser than i
    modified = torch.where(mask, dists, dists.max())  # :263-264
    delta = torch.min(modified, dim=-1).values  # :265
    score = delta * density  # :268
    centres = torch.sort(score, descending=True, stable=True).indices[:num_clusters]  # :269, ties low
    owner = torch.argmin(dists[:, centres], dim=-1)  # :272-273
    owner[centres] = torch.arange(num_clusters)  # :275-279
    return owner, centres


def ref_temporal(video: torch.Tensor, token_mask: torch.Tensor, lower_bound: int):
    """utils.py:283-349 (in place on `video`): per frame the tree features and frame indices of the
    unselected roots."""
    num_frames, n, _ = video.shape
    normed = video / video.norm(p=2, dim=-1, keepdim=True)  # :292
    sims = torch.einsum("bnd,bmd->bnm", normed[1:], normed[:-1])  # :293
    sims[~token_mask[1:].unsqueeze(-1).expand(-1, -1, n)] = -1.0  # :295
    sims[~token_mask[:-1].unsqueeze(1).expand(-1, n, -1)] = -1.0  # :296
    max_sims, max_idx = torch.max(sims, dim=-1)  # :298
    max_sims = F.pad(max_sims, (0, 0, 1, 0), value=-1)  # :300-301
    max_idx = F.pad(max_idx, (0, 0, 1, 0), value=-1)
    counts = torch.ones(num_frames, n, dtype=video.dtype)  # :303
    mask = max_sims > TEMPORAL  # :304
    if (~mask).int().sum() < lower_bound:  # :308-312
        k = num_frames * n - lower_bound
        if k <= 0:
            mask = torch.zeros_like(mask)  # deviation: the reference's top-k with k = 0 raises
        else:
            soft = max(float(max_sims.view(-1).topk(k=k).values[-1]), -1.0 + 1e-6)
            mask = max_sims > soft
    for f in range(num_frames - 1, -1, -1):  # :314-337
        frame, frame_counts = video[f], counts[f]
        stay = ~mask[f]
        if stay.any():
            video[f][stay] = frame[stay] / frame_counts[stay].unsqueeze(-1)
            counts[f][stay] = 1
        go = mask[f]
        if go.any():
            one_hot = F.one_hot(max_idx[f][go], num_classes=n).to(video.dtype)
            video[f - 1] += torch.einsum("mn,md->nd", one_hot, frame[go])
            counts[f - 1] += one_hot.sum(dim=0)  # :334-336: one per direct child
            counts[f][go] = 0
    out_feats, out_idx = [], []
    for f in range(num_frames):  # :340-347
        keep = ~mask[f] & token_mask[f]
        out_feats.append(video[f][keep])
        out_idx.append(torch.where(keep)[0])
    return out_feats, out_idx


def exact_counts(trees: list[int], clusters: int) -> list[int]:
    """Deviation: `clusters` split exactly over frames in proportion to their trees (largest
    remainder, ties to the earlier frame), instead of ceil(trees * ratio) each."""
    quotas = [Fraction(t * clusters, sum(trees)) for t in trees]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(trees)), key=lambda f: (-(quotas[f] - counts[f]), f))
    for f in by_remainder[: clusters - sum(counts)]:
        counts[f] += 1
    return counts


def ref_segment_compression(video, index, attention, adts_counts, context_counts, stats):
    """utils.py:81-165 on one segment (frames, n, D): kept features and global indices."""
    num_frames, n, dim = video.shape
    selected_feats, selected_idx = [], []
    token_mask = torch.ones(num_frames, n, dtype=torch.bool)
    for f in range(num_frames):  # :101-116, one batch per frame (per-pair budgets)
        chosen = ref_adts(video[f : f + 1], attention[f : f + 1], adts_counts[f])[0]
        selected_feats.append(video[f][chosen])
        selected_idx.append(index[f][chosen])
        token_mask[f, chosen] = False
    out_feats, out_idx = selected_feats, selected_idx
    num_other = sum(context_counts)  # :118
    if num_other == 0:  # :133-136, 141
        return out_feats, out_idx
    if num_frames > 1:  # :121-128
        lower_bound = sum(a + s for a, s in zip(adts_counts, context_counts))  # :291 per pair
        trees, local = ref_temporal(video.clone(), token_mask, lower_bound)
        tree_idx = [index[f][local[f]] for f in range(num_frames)]
    else:  # :129-132; deviation: the unselected tokens only
        trees, tree_idx = [video[0][token_mask[0]]], [index[0][token_mask[0]]]
    current = sum(len(t) for t in trees)  # :143
    ratio = num_other / current  # :144
    counts = [len(t) for t in trees]
    if ratio < 1.0:
        counts = exact_counts(counts, num_other)  # deviation: :149 is ceil(len * ratio)
        ceil_counts = [math.ceil(len(t) * ratio) for t in trees]
        stats["ceil_excess"] = stats.get("ceil_excess", 0) + sum(ceil_counts) - num_other
    for feats, idx, clusters in zip(trees, tree_idx, counts):  # :145-162
        if ratio < 1.0 and clusters == 0:
            continue  # deviation: no cluster for this frame, its trees are dropped
        if ratio < 1.0:
            owner, centres = ref_dpc_knn(feats, clusters, k=min(clusters, 7))
            one_hot = F.one_hot(owner, num_classes=clusters).to(feats.dtype)
            merged = torch.einsum("nc,nd->cd", one_hot, feats) / one_hot.sum(dim=0).unsqueeze(-1)
            out_feats.append(merged)
            out_idx.append(idx[centres])
        else:
            out_feats.append(feats)
            out_idx.append(idx)
    return out_feats, out_idx


def ref_compress(features: torch.Tensor, attention: torch.Tensor, pair_sizes: list[int], keep: int):
    """utils.py:23-78 with the per-pair budgets of `per_pair_budget`: sorted indices, features."""
    num_frames, n = len(pair_sizes), pair_sizes[0]
    video = features.view(num_frames, n, -1)
    att = attention.view(num_frames, n)
    index = torch.arange(num_frames * n).view(num_frames, n)
    budgets = per_pair_budget(pair_sizes, keep)
    adts_counts = [math.ceil(b * ALPHA) for b in budgets]  # utils.py:47
    context_counts = [b - a for b, a in zip(budgets, adts_counts)]  # utils.py:48
    stats, feats, idx, offset = {}, [], [], 0
    for length in ref_segment_lengths(video.mean(1)):
        if length > 0:  # an empty segment yields nothing
            seg = slice(offset, offset + length)
            f, i = ref_segment_compression(
                video[seg], index[seg], att[seg], adts_counts[seg], context_counts[seg], stats
            )
            feats += f
            idx += i
        offset += length
    feats, idx = torch.cat(feats), torch.cat(idx)
    order = idx.argsort()
    return idx[order], feats[order], stats


# ---------------------------------------------------------------- data
def smooth_video(num_pairs: int, n: int, dim: int, gen: torch.Generator, cut_every: int = 0):
    """Pairs drifting around one scene (a new scene every `cut_every` pairs when > 0)."""
    feats, scene = [], None
    for p in range(num_pairs):
        if scene is None or (cut_every and p % cut_every == 0):
            scene = torch.randn(n, dim, generator=gen, dtype=torch.float64) + 1.5
        noise = 0.05 + 0.6 * torch.rand(1, generator=gen, dtype=torch.float64)
        feats.append(scene + noise * torch.randn(n, dim, generator=gen, dtype=torch.float64))
    return torch.cat(feats)


def tokens_of(feats: torch.Tensor, pair_sizes: list[int], gen: torch.Generator) -> VisualTokens:
    attention = torch.rand(feats.shape[0], generator=gen, dtype=torch.float64) / max(pair_sizes)
    return VisualTokens(feats, pair_sizes, [(1, 1, s) for s in pair_sizes], attention)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("n,count", [(196, 35), (49, 7), (63, 1), (100, 99), (2, 1), (2, 2), (37, 36)])
def test_fidelity_adts_equals_the_reference_rule(n, count):
    gen = torch.Generator().manual_seed(n * 1000 + count)
    frames, dim = 10, 12
    features = torch.randn(frames, n, dim, generator=gen, dtype=torch.float64)
    attention = torch.rand(frames, n, generator=gen, dtype=torch.float64) / n
    reference = ref_adts(features, attention, count)
    normed = features / features.norm(dim=-1, keepdim=True)
    same = sum(torch.equal(flashvid.adts(normed[f], attention[f], count), reference[f]) for f in range(frames))
    assert same == frames
    if count < n - 1 and count > 1:  # attention matters: the plain max-min rule picks other sets
        plain = ref_adts(features, torch.ones(frames, n, dtype=torch.float64), count)
        assert any(not torch.equal(plain[f], reference[f]) for f in range(frames))


def test_fidelity_adts_share_is_the_reference_ceil():
    # utils.py:47: ceil(alpha * budget); round(0.7 b) would give 1, 1, 2, 3, 7, 24
    assert [flashvid.adts_count(b) for b in [1, 2, 3, 4, 10, 35]] == [1, 2, 3, 3, 7, 25]


@pytest.mark.parametrize("kind", ["smooth", "cuts", "random", "few_pairs"])
def test_fidelity_segments_equal_the_reference_rule(kind):
    gen = torch.Generator().manual_seed(["smooth", "cuts", "random", "few_pairs"].index(kind))
    multi_segments = 0
    for case in range(20):
        num_pairs = {"few_pairs": 2 + case % 3}.get(kind, 3 + case % 14)
        if kind == "random":
            means = torch.randn(num_pairs, 8, generator=gen, dtype=torch.float64)
        else:
            feats = smooth_video(num_pairs, 5, 8, gen, cut_every=0 if kind == "smooth" else 1 + case % 4)
            means = feats.view(num_pairs, 5, 8).mean(1)
        lengths = [x for x in ref_segment_lengths(means) if x > 0]
        ours = flashvid.segments(means)
        assert [len(s) for s in ours] == lengths
        assert [p for s in ours for p in s] == list(range(num_pairs))
        multi_segments += len(ours) >= min(MIN_SEGMENTS, num_pairs)
    assert multi_segments == 20  # at least min_segment_num segments (or one per pair)


SETTINGS = [(6, 9), (8, 16), (3, 25), (5, 12), (2, 7), (12, 4)]  # (pairs, tokens per pair)


@pytest.mark.parametrize("num_pairs,n", SETTINGS)
def test_fidelity_compress_equals_the_reference(num_pairs, n):
    rng = random.Random(num_pairs * 100 + n)
    gen = torch.Generator().manual_seed(num_pairs * 100 + n)
    total = num_pairs * n
    keeps = [num_pairs, num_pairs + 1, total - 1] + [rng.randint(num_pairs, total - 1) for _ in range(21)]
    merged_trees = clustered = deep = 0
    stats_all = {}
    for case, keep in enumerate(keeps):
        feats = smooth_video(num_pairs, n, 6, gen, cut_every=[0, 2, 3][case % 3])
        tokens = tokens_of(feats, [n] * num_pairs, gen)
        ours = flashvid.compress(tokens, keep)
        kept, sizes, (merged,) = merge_groups(ours, feats)
        ref_idx, ref_feats, stats = ref_compress(feats, tokens.received_attention, [n] * num_pairs, keep)
        assert len(kept) == keep
        assert torch.equal(kept, ref_idx)
        torch.testing.assert_close(merged, ref_feats, atol=1e-6, rtol=0)
        stats_all["ceil_excess"] = stats_all.get("ceil_excess", 0) + stats.get("ceil_excess", 0)
        merged_trees += int((sizes > 1).sum())
        clustered += int(((ours.weights > 0) & (ours.weights < 1)).sum())
        # a group's weights sum above 1 only with a tree deeper than one level (utils.py:334)
        members = ours.assignment != DROPPED
        _, inverse = torch.unique(ours.assignment[members], return_inverse=True)
        totals = torch.zeros(keep, dtype=torch.float64).index_add_(0, inverse, ours.weights[members])
        deep += int((totals > 1 + 1e-9).sum())
    assert merged_trees > 0 and clustered > 0  # the cases exercise merging
    if num_pairs > MIN_SEGMENTS:  # some segment has several pairs
        assert stats_all["ceil_excess"] > 0  # the reference's ceil counts overshoot the budget
    if num_pairs > MIN_SEGMENTS + 1:  # some segment can have three pairs
        assert deep > 0  # trees deeper than one level: the count rule matters


@pytest.mark.parametrize("sizes", [[7, 9, 8], [16, 15, 16, 15, 1], [25], [3, 3]])
def test_exact_budget_on_unequal_pairs(sizes):
    gen = torch.Generator().manual_seed(sum(sizes))
    feats = torch.randn(sum(sizes), 6, generator=gen, dtype=torch.float64)
    tokens = tokens_of(feats, sizes, gen)
    for keep in range(len(sizes), sum(sizes) + 1):
        out = flashvid.compress(tokens, keep)
        assert len(out.kept) == keep
        members = out.assignment != DROPPED
        pair = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        assert (pair[out.assignment[members]] <= pair[members]).all()  # trees root in earlier pairs
        assert (out.weights[members] > 0).all()
    assert torch.equal(flashvid.compress(tokens, sum(sizes)).assignment, torch.arange(sum(sizes)))
