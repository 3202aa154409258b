"""FlashVID (Fan et al., ICLR 2026), vision side, on Qwen's merged tokens with pairs as frames.

Paper: Z. Fan, K. Chen, R. Xing, Y. Li, L. Jiang, Z. Tian, "FlashVID: Efficient Video Large Language
Models via Training-free Tree-based Spatiotemporal Token Merging", ICLR 2026, arXiv:2602.08024.
Code: github.com/Fanziyang-v/FlashVID, read at commit 1d37422: `flashvid/utils.py` (23-78
`flashvid_compression`, 81-165 `segment_compression`, 168-226 `segment` / `additional_segment`,
229-280 `dpc_knn`, 283-349 `spatiotemporal_compression`), `flashvid/token_selection.py:14-76`
(ADTS, `attn_div`), and the settings of the authors' Qwen runs, `scripts/qwen2_5_vl.sh:13-24` and
`scripts/qwen3_vl.sh:13-25`: alpha 0.7, temporal threshold 0.8, segment threshold 0.9 (the
default), at least 4 segments with complementary cuts, ADTS v1 (`attn_div`). The config defaults
(8 segments, `flashvid()`'s `attn_div_v2`) are the LLaVA settings (`scripts/llava_ov.sh`). On Qwen
the reference's frame is a temporal patch (`modeling_qwen2_5_vl.py:259-263,463-470`), i.e. a frame
pair here.

What runs, per video (the reference's rules; the deviations below say where ours differ):

1. Segments (`utils.py:168-226`): t_i = cosine of the mean features of pairs i and i+1; cut after
   pair i where t_i < SEGMENT_THRESHOLD. With fewer than MIN_SEGMENTS segments, the transitions
   already cut are set to 1 and the MIN_SEGMENTS - segments lowest t_i (at most all transitions)
   are cut as well; a transition cut twice makes an empty segment, which yields nothing.
2. ADTS in each pair (`token_selection.py:28-76`, `utils.py:100-108`), ceil(ALPHA b) tokens of a
   pair with budget b (`utils.py:47`): d_ij = (1 - cos(i, j)) * a_j * 1e6, a_j the attention token
   j received. The first pick is argmax_j of the second smallest d_ij over i (a_j times j's
   distance to its nearest neighbour); each later pick is argmax_j of a_j times j's smallest
   distance to the chosen tokens, chosen tokens excluded; argmax ties to the lower index.
3. Tree-based temporal merging of the segment's unselected tokens (`utils.py:283-349`): each token
   of a pair after the segment's first takes its most cosine-similar unselected token of the
   previous pair (the first on ties) as parent when the similarity exceeds TEMPORAL_THRESHOLD. If
   fewer tokens than the segment's budget would stay unmerged (selected tokens and the first
   pair's included), only similarities above the (tokens - budget)-th largest merge (that
   threshold floored at -1 + 1e-6). Chains of parents form trees, at their roots' positions. A
   tree's feature is the sum of its members over 1 + the number of its root's direct children:
   the reference adds one count per merged child, not the child's own count (`utils.py:334`), so
   this is the members' mean only for trees of depth <= 1 (a chain a <- b <- c gives
   (a + b + c) / 2). We follow the code.
4. Spatial merging per pair (`utils.py:138-162`): S = the segment's context budget (b -
   ceil(ALPHA b) summed over its pairs), R0 = its trees; if S / R0 < 1, each pair's trees are
   clustered by DPC-kNN (`utils.py:229-280`: d = euclidean / sqrt(D); density exp(-mean d^2) over
   the k = min(clusters, 7) nearest, itself included; delta = distance to the nearest denser tree,
   the densest taking the largest distance; centres = top density * delta; every tree joins its
   nearest centre), else every tree stays. A cluster's feature is the unweighted mean of its trees'
   features, at its centre's position. With S = 0 the unselected tokens are dropped.

As a `Compression`: selected tokens are groups of one; a token of tree T in cluster C (|C| trees)
has weight 1 / (|C| c_T), c_T = 1 + the direct children of T's root, so its group's feature is the
mean of the tree features (the adapter merges Qwen3-VL's deepstack features with the same weights;
the reference takes the kept positions' deepstack features unmerged, `modeling_qwen3_vl.py:323`).

Deviations, each for a reason:
- Budgets: the published method also prunes inside the LLM (FastV-style: it enters
  ceil(1.25 R n) tokens per frame and keeps 30% of them at layer 20 of Qwen2.5-VL, 10% at layer 28
  of Qwen3-VL) and quotes a layer-averaged retention. This port has no in-LLM stage: exactly
  floor(R N) tokens enter the LLM, and that is the R recorded. They are split over pairs by
  `per_pair_budget` (the reference: one budget for every frame); a pair's ADTS share is
  ceil(ALPHA b) as in the reference, and the segment's lower bound for temporal merging is the sum
  of its pairs' budgets.
- Cluster counts: the reference gives pair p ceil(r_p S / R0) clusters (r_p: its trees), which
  sums to S or more. Ours split S exactly: floor(r_p S / R0), plus one for the pairs with the
  largest remainders (integer arithmetic, ties to the earlier pair), so each count is the
  reference's or one less. A pair given 0 clusters this way drops its trees (the reference never
  does); k = min(clusters, 7) follows our count.
- One-pair segments: the reference clusters all the frame's tokens, its ADTS-selected ones
  included (`utils.py:129-132`), so a selected token can be kept twice (also as a cluster centre)
  and its feature enter a cluster as well; an assignment gives each token one group, so we cluster
  the unselected tokens only, as the reference does in segments of two or more pairs.
- Determinism: DPC-kNN's density has no random noise; equal densities: the lower index is denser.
  The reference adds uniform [0, 1e-6) noise to every density (`utils.py:255`). The noise orders
  equal densities and can reverse any two less than 1e-6 apart, so it decides the reference's
  clustering on ties and where densities are 1e-6 or less (a mean d^2 over the k nearest of at
  least ln(1e6), about 13.8): there it can exceed the density, which scales each score density * delta.
  A tree's distance to itself is exactly 0 (the matmul-based `cdist` leaves rounding noise there,
  which with k = 1, every density exp(0), would pick the centre); centre ties go to the lower index,
  assignment ties to the higher-scored centre. `seed` is unused.
- Edge cases where the reference raises: a one-token pair's ADTS pick is its token (the reference
  takes the top 2 of a column); a segment whose budget is all its tokens merges nothing (the
  reference takes the last of a top-0).
- Precision: similarities and distances are computed in float32 (float64 inputs stay float64); the
  reference computes the segment means and temporal similarities in the model's dtype (bf16).
- Attention: Qwen has no [CLS] token; a_j is `received_attention` (the attention token j's 4
  patches received in the last ViT block, mean over heads and queries, then over the 4 patches),
  which is what the reference's Qwen code computes (`modeling_qwen2_5_vl.py:257-263,574-584`).

Cost, as the reference's or less: per segment of F pairs of at most n tokens, ADTS on one (F, n, n)
distance block batched over the segment's pairs (the reference: one (F, n, n) batch per segment),
one batched greedy step per pick of the segment's largest ADTS share (O(F n) each; the reference's
step t gathers t rows, O(F t n)); temporal similarities n^2 D per pair; DPC-kNN r^2 D on a pair's r
trees; float32 copies of one segment's features at a time. Everything stays on the features'
device. Host syncs: one read of the segment cuts, and one per segment of two or more pairs that
merges anything (its trees per pair size the clustering); the reference has about 9 per frame of
such segments and 6 per segment (`utils.py:57-60,192,295-345`).
"""

from __future__ import annotations

import math

import torch

from .common import (
    DROPPED,
    Compression,
    TokenCompressor,
    VisualTokens,
    by_mask,
    pair_starts,
    per_pair_budget,
    top,
    unit_rows_and,
)

SEGMENT_THRESHOLD = 0.9
MIN_SEGMENTS = 4  # scripts/qwen2_5_vl.sh and qwen3_vl.sh (the config default, 8, is for LLaVA)
ALPHA = 0.7
TEMPORAL_THRESHOLD = 0.8
ATTENTION_SCALE = 1e6  # token_selection.py:46, "to avoid numerical issues"
MAX_NEIGHBOURS = 7  # utils.py:155: k = min(clusters, 7)


def adts_count(budget: int) -> int:
    """Tokens ADTS selects in a pair with `budget` tokens (`utils.py:47`)."""
    return math.ceil(budget * ALPHA)


def segments(pair_means: torch.Tensor) -> list[list[int]]:
    """Runs of consecutive pair indices: threshold cuts, then complementary cuts at the lowest
    transition similarities up to MIN_SEGMENTS segments (one read of the cuts by the host)."""
    count = pair_means.shape[0]
    if count == 1:
        return [[0]]
    normed = pair_means / pair_means.norm(dim=-1, keepdim=True)
    sim = (normed[:-1] * normed[1:]).sum(dim=-1)
    below = sim < SEGMENT_THRESHOLD
    missing = MIN_SEGMENTS - 1 - below.sum()
    order = torch.sort(torch.where(below, torch.ones_like(sim), sim), stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(count - 1, device=sim.device))
    cuts = (below | (rank < missing)).tolist()
    groups, start = [], 0
    for i, cut in enumerate(cuts):
        if cut:
            groups.append(list(range(start, i + 1)))
            start = i + 1
    groups.append(list(range(start, count)))
    return groups


def adts_distances(normed: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """(n, n) ADTS distances of a pair's unit rows: d_ij = (1 - cos(i, j)) a_j (scaled)."""
    return (1.0 - normed @ normed.T) * (attention * ATTENTION_SCALE)[None, :]


def adts_picks(dist: torch.Tensor, count: int) -> torch.Tensor:
    """(B, count) ADTS picks, in pick order, of B pairs at once from their (B, m, m) distances,
    padded with +inf rows and -inf columns: the first pick maximises the second smallest d_ij over
    i, each later one a column's smallest distance to the picks, picks excluded (argmax: the first)."""
    rows = torch.arange(dist.shape[0], device=dist.device)
    pick = dist.topk(min(2, dist.shape[1]), dim=1, largest=False).values[:, -1].argmax(dim=1)
    picks, nearest = [pick], dist[rows, pick]
    taken = torch.zeros_like(nearest, dtype=torch.bool)
    for _ in range(1, count):
        taken[rows, pick] = True
        pick = torch.where(taken, -1.0, nearest).argmax(dim=1)
        picks.append(pick)
        nearest = torch.minimum(nearest, dist[rows, pick])
    return torch.stack(picks, dim=1)


def adts_segment(normed: list[torch.Tensor], attention: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
    """Sorted ADTS picks of each of a segment's pairs (unit rows, attention, count), batched."""
    size = max(x.shape[0] for x in normed)
    dist = torch.full((len(normed), size, size), math.inf, dtype=normed[0].dtype, device=normed[0].device)
    for b, (x, a) in enumerate(zip(normed, attention)):
        dist[b, :, x.shape[0] :] = -math.inf  # padding columns are never picked
        dist[b, : x.shape[0], : x.shape[0]] = adts_distances(x, a)
    picks = adts_picks(dist, max(counts))
    return [picks[b, :count].sort().values for b, count in enumerate(counts)]


def adts(normed: torch.Tensor, attention: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted indices of `count` rows of `normed` (n, D), unit rows, chosen by ADTS (one pair)."""
    return adts_segment([normed], [attention], [count])[0]


def cluster_counts(trees: list[int], clusters: int) -> list[int]:
    """`clusters` split over pairs in proportion to their trees: floors, then one more for the
    largest remainders (ties to the earlier pair)."""
    total = sum(trees)
    counts = [t * clusters // total for t in trees]
    remainders = [t * clusters % total for t in trees]
    order = sorted(range(len(trees)), key=lambda p: -remainders[p])
    for p in order[: clusters - sum(counts)]:
        counts[p] += 1
    return counts


def dpc_knn(feats: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DPC-kNN over feats (n, D) into `count` clusters: centres (row indices, by descending score)
    and each row's cluster (an index into centres; a centre is its own)."""
    n, dim = feats.shape
    dist = torch.cdist(feats, feats) / math.sqrt(dim)
    dist.fill_diagonal_(0.0)
    nearest = dist.topk(min(count, MAX_NEIGHBOURS), dim=1, largest=False).values
    density = torch.exp(-(nearest**2).mean(dim=1))
    index = torch.arange(n, device=feats.device)
    # [i, j]: j is denser than i; ties: the lower index. The reference adds uniform [0, 1e-6) noise
    # instead (Fanziyang-v/FlashVID@1d37422 flashvid/utils.py:255): it decides the reference's ties
    # and can reverse any two densities less than 1e-6 apart (all where densities are 1e-6 or less).
    denser = (density[None, :] > density[:, None]) | (
        (density[None, :] == density[:, None]) & (index[None, :] < index[:, None])
    )
    delta = torch.where(denser, dist, dist.max()).min(dim=1).values
    centres = top(delta * density, count)
    owner = dist[:, centres].argmin(dim=1)
    owner[centres] = torch.arange(count, device=feats.device)
    return centres, owner


def temporal_trees(
    normed: torch.Tensor, sizes: list[int], selected: list[torch.Tensor], budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Root and parent (indices into the segment; parent DROPPED when unmerged) of every token of
    a segment's pairs (unit rows `normed`, pair `sizes`, sorted ADTS picks per pair)."""
    device = normed.device
    best = [torch.full((sizes[0],), -1.0, dtype=normed.dtype, device=device)]
    parent = [torch.full((sizes[0],), DROPPED, dtype=torch.long, device=device)]
    start = 0
    for j in range(1, len(sizes)):
        prev, start = start, start + sizes[j - 1]
        sim = normed[start : start + sizes[j]] @ normed[prev:start].T
        sim[selected[j], :] = -1.0
        sim[:, selected[j - 1]] = -1.0
        value, at = sim.max(dim=1)
        best.append(value)
        parent.append(at + prev)
    best, parent = torch.cat(best), torch.cat(parent)
    merged = best > TEMPORAL_THRESHOLD
    k = best.numel() - budget  # the reference's top-k: at most k - 1 tokens merge
    if k <= 0:
        merged = torch.zeros_like(merged)
    else:  # the k-th largest similarity is the (budget + 1)-th smallest
        soft = best.kthvalue(budget + 1).values.clamp(min=-1.0 + 1e-6)
        merged = torch.where((~merged).sum() < budget, best > soft, merged)
    roots, start = [torch.arange(sizes[0], device=device)], 0
    for j in range(1, len(sizes)):
        prev, start = start, start + sizes[j - 1]
        here = slice(start, start + sizes[j])
        own = torch.arange(start, start + sizes[j], device=device)
        roots.append(torch.where(merged[here], roots[-1][parent[here] - prev], own))
    return torch.cat(roots), torch.where(merged, parent, DROPPED)


def tree_counts(is_tree: torch.Tensor, sizes: list[int]) -> list[int]:
    """Trees per pair of a segment: the host reads them (one sync), as they size the clustering."""
    return torch.stack([t.sum() for t in is_tree.split(sizes)]).tolist()


def merge_segment(
    feats: torch.Tensor, normed: torch.Tensor, sizes: list[int], selected: list[torch.Tensor], budget: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-based temporal merging, then DPC-kNN per pair, of a segment's unselected tokens (its
    pairs' `sizes`, sorted ADTS picks per pair, `budget` and `context` tokens): each token's cluster
    centre (an index into the segment; DROPPED for selected and dropped tokens) and weight."""
    length, device = feats.shape[0], feats.device
    if len(sizes) == 1:  # every unselected token is a tree of its own
        root = torch.arange(length, device=device)
        parent = torch.full((length,), DROPPED, dtype=torch.long, device=device)
    else:
        root, parent = temporal_trees(normed, sizes, selected, budget)
    unselected = torch.ones(length, dtype=torch.bool, device=device)
    unselected[torch.cat([s + picks for s, picks in zip(pair_starts(sizes), selected)])] = False
    # a tree's feature: the sum of its members over 1 + its root's direct children (utils.py:303-337)
    divisor = torch.ones(length, dtype=torch.long, device=device)
    divisor.scatter_add_(0, parent.clamp(min=0), (parent != DROPPED).long())
    tree_sum = torch.zeros_like(feats).index_add_(0, root, feats)
    is_tree = unselected & (root == torch.arange(length, device=device))
    trees = [length - len(selected[0])] if len(sizes) == 1 else tree_counts(is_tree, sizes)
    counts = trees if sum(trees) <= context else cluster_counts(trees, context)
    centre = torch.full((length,), DROPPED, dtype=torch.long, device=device)  # each tree's centre root
    for start, size, t, clusters in zip(pair_starts(sizes), sizes, trees, counts):
        roots = start + by_mask(is_tree[start : start + size], t)[1]
        if clusters >= t:
            centre[roots] = roots
        elif clusters > 0:
            centres, owner = dpc_knn(tree_sum[roots] / divisor[roots].to(feats.dtype)[:, None], clusters)
            centre[roots] = roots[centres][owner]
    member_centre = torch.where(unselected, centre[root], DROPPED)
    trees_in = torch.zeros(length, dtype=torch.long, device=device)  # trees per cluster, by centre
    trees_in.scatter_add_(0, centre.clamp(min=0), (centre != DROPPED).long())
    return member_centre, 1.0 / (trees_in[member_centre.clamp(min=0)] * divisor[root]).double()


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    if tokens.received_attention is None:
        raise ValueError("flashvid needs the last ViT block's received attention")
    features = tokens.features.detach()
    dtype = torch.promote_types(features.dtype, torch.float32)
    device = features.device
    attention = tokens.received_attention.detach().to(device=device, dtype=dtype)
    n = features.shape[0]
    assignment = torch.full((n,), DROPPED, dtype=torch.long, device=device)
    weights = torch.zeros(n, dtype=torch.float64, device=device)
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    budget = per_pair_budget(sizes, keep)
    means = torch.stack([features[s : s + k].to(dtype).mean(dim=0) for s, k in zip(starts, sizes)])
    for seg in segments(means):
        first, seg_sizes = starts[seg[0]], [sizes[p] for p in seg]  # the segment's tokens are contiguous
        here = slice(first, first + sum(seg_sizes))
        feats = features[here].to(dtype)
        normed = feats / feats.norm(dim=-1, keepdim=True)
        selected = adts_segment(
            [normed[s : s + k] for s, k in zip(pair_starts(seg_sizes), seg_sizes)],
            [attention[here][s : s + k] for s, k in zip(pair_starts(seg_sizes), seg_sizes)],
            [adts_count(budget[p]) for p in seg],
        )
        chosen = first + torch.cat([s + picks for s, picks in zip(pair_starts(seg_sizes), selected)])
        assignment[chosen] = chosen
        weights[chosen] = 1.0
        context = sum(budget[p] - adts_count(budget[p]) for p in seg)
        if context == 0:
            continue  # only the ADTS tokens stay (utils.py:118-141)
        centre, share = merge_segment(feats, normed, seg_sizes, selected, sum(budget[p] for p in seg), context)
        merged = centre != DROPPED
        assignment[here] = torch.where(merged, first + centre, assignment[here])
        weights[here] = torch.where(merged, share, weights[here])
    return Compression(assignment, weights)


COMPRESSOR = TokenCompressor(compress, working_bytes=unit_rows_and(3), host_syncs=1, reads_attention=True)
