"""ToMe (Bolya et al. 2023): bipartite soft matching, here on the merged visual tokens of each
frame pair, repeated until the pair's share of the budget is reached.

Similarity: cosine between the current (size-weighted mean) features of the tokens; Qwen exposes
no attention keys after the merger, so the features play the role of ToMe's keys. One round:
alternate tokens form sets A and B; every A token finds its most similar B token; the r most
similar edges merge A into B (r = min(|A|, tokens over budget)). A merged token takes its B
destination's position and the size-weighted mean of its members.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import VisualTokens, per_pair_budget


def merge_pair(features: torch.Tensor, target: int) -> torch.Tensor:
    """Group index (into 0..n-1, a destination's own index) for each of a pair's n tokens."""
    n = features.shape[0]
    owner = torch.arange(n)  # owner[i]: the token i is currently merged into
    alive = list(range(n))
    sums, sizes = features.float().clone(), torch.ones(n)
    while len(alive) > target:
        a_set, b_set = alive[0::2], alive[1::2]
        if not b_set:
            break
        means = sums / sizes[:, None]
        sim = F.normalize(means[a_set], dim=-1) @ F.normalize(means[b_set], dim=-1).T
        best, best_b = sim.max(dim=1)
        r = min(len(a_set), len(alive) - target)
        merged_a = torch.argsort(best, descending=True)[:r]
        for ai in merged_a.tolist():
            a, b = a_set[ai], b_set[int(best_b[ai])]
            sums[b] += sums[a]
            sizes[b] += sizes[a]
            owner[owner == a] = b
        gone = {a_set[i] for i in merged_a.tolist()}
        alive = [t for t in alive if t not in gone]
    return owner


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> torch.Tensor:
    budget = per_pair_budget(tokens.pair_sizes, keep)
    parts = []
    for start, size, target in zip(tokens.pair_starts, tokens.pair_sizes, budget):
        parts.append(merge_pair(tokens.features[start : start + size], target) + start)
    return torch.cat(parts)
