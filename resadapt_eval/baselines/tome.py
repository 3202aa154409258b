"""ToMe (Bolya et al., ICLR 2023): bipartite soft matching with size-weighted merging, applied to
the merged visual tokens of each frame pair until the pair's share of the budget is reached.

Reference: facebookresearch/ToMe@af95e4b, `tome/merge.py` (`bipartite_soft_matching`, lines
18-97; `merge_wavg`, lines 210-224) as `tome/patch/timm.py` (`ToMeBlock.forward`, lines 34-56)
runs them. One round on a sequence of t tokens, exactly as the reference:

- r = min(tokens still over the pair's budget, t // 2) (the reference's `r = min(r, (t -
  protected) // 2)`; Qwen has no [CLS] or distillation token, so nothing is protected);
- cosine scores between A = the tokens at even places and B = those at odd places; each A token's
  best B (`max`, ties to the first B); A tokens ordered by that best score, descending; the first r
  merge into their best B, the others stay;
- the features: size-weighted average (`merge_wavg`: sums of feature * size over sizes);
- the next sequence is [A tokens that stay, in that score order; all B tokens, in order], and the
  next round splits it into A and B again.

Deviations, and why:

- Where: once, after the merger, on each frame pair's tokens (a pair plays the role of an image;
  pairs never merge with each other), not between the attention and the MLP of every ViT block.
  Each pair keeps its share of floor(R N) (`per_pair_budget`: largest remainder), so rounds are
  repeated on the same tokens, each merging as many as allowed (r above), instead of a fixed r per
  layer.
- Metric: the current tokens' size-weighted mean features (exactly the reference's merged `x`),
  for the reference's keys (mean of k over heads) of the next block: Qwen exposes no keys after the
  merger. A zero feature has similarity 0 (`F.normalize`) where the reference divides by zero.
- Ties between best scores go to the earlier A token (stable sort); the reference's
  `argsort(descending=True)` leaves their order unspecified.

Output: a group's feature is the plain mean of its original members (sizes start at 1, so the
repeated size-weighted averages are exactly that mean: `Compression.weights` None). Its
destination, hence its M-RoPE position, is the original index of the member that was never merged
away (the reference keeps the B token's slot). The LLM sequence is the destinations in original
order: the reorder only shapes the next round's A/B split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import F32, Compression, TokenCompressor, VisualTokens, per_pair_budget


def merge_pair(features: torch.Tensor, target: int) -> torch.Tensor:
    """Group destination (an index into 0..n-1) for each of a pair's n tokens, `target` groups."""
    n = features.shape[0]
    dtype = torch.promote_types(features.dtype, torch.float32)
    sums = features.to(dtype)  # per current token: sum of its members' features (= x * size)
    sizes = torch.ones(n, dtype=dtype, device=features.device)
    slot = torch.arange(n, device=features.device)  # per current token: its original index
    owner = torch.arange(n, device=features.device)  # per original token: its group's slot
    while len(slot) > target:
        t = len(slot)
        r = min(t - target, t // 2)
        metric = F.normalize(sums / sizes[:, None], dim=-1)
        scores = metric[0::2] @ metric[1::2].T
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = torch.sort(node_max, descending=True, stable=True).indices
        unm_idx, src_idx = edge_idx[r:], edge_idx[:r]
        dst_idx = node_idx[src_idx]
        sums_a, sums_b = sums[0::2], sums[1::2].clone()
        sizes_a, sizes_b = sizes[0::2], sizes[1::2].clone()
        slot_a, slot_b = slot[0::2], slot[1::2]
        sums_b.index_add_(0, dst_idx, sums_a[src_idx])
        sizes_b.index_add_(0, dst_idx, sizes_a[src_idx])
        remap = torch.arange(n, device=features.device)
        remap[slot_a[src_idx]] = slot_b[dst_idx]
        owner = remap[owner]
        sums = torch.cat([sums_a[unm_idx], sums_b])
        sizes = torch.cat([sizes_a[unm_idx], sizes_b])
        slot = torch.cat([slot_a[unm_idx], slot_b])
    return owner


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    budget = per_pair_budget(tokens.pair_sizes, keep)
    parts = []
    for start, size, target in zip(tokens.pair_starts, tokens.pair_sizes, budget):
        parts.append(merge_pair(tokens.features[start : start + size], target) + start)
    return Compression(torch.cat(parts))


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """Per pair: its float32 sums, metric and copy, and the |A| x |B| scores."""
    return max(3 * n * width * F32 + ((n + 1) // 2) * (n // 2) * F32 for n in sizes)


def similarity_flops(pair_sizes: list[int], keep: int, vision) -> int:
    """Bipartite similarities: per round |A| x |B| cosines of the merged features (`vision.out_hidden`
    wide), rounds repeated until each pair reaches its share of `keep` (as `merge_pair` runs them)."""
    total = 0
    for size, target in zip(pair_sizes, per_pair_budget(pair_sizes, keep)):
        alive = size
        while alive > target:
            a, b = (alive + 1) // 2, alive // 2
            total += 2 * a * b * vision.out_hidden
            alive -= min(b, alive - target)  # r = min(over budget, t // 2)
    return total


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=0, config_flops=similarity_flops)
