"""DivPrune (Alvar et al., CVPR 2025) on Qwen's merged video tokens.

DivPrune casts visual token pruning as a Max-Min Diversity Problem: keep the subset of `keep` tokens
whose smallest pairwise cosine distance is as large as possible and drop the others. The problem is
NP-hard, so it is solved greedily: the first kept token is the one whose nearest neighbour is farthest
away, and each next one is the token whose cosine distance to its nearest kept token is largest. All
visual tokens of the input form one pool (for a video, every frame together), with no per-frame budget.

Paper: "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models", arXiv 2503.02175.
Public code: github.com/vbdi/divprune, `DivPrune` in LLaVA/llava/model/llava_arch.py.

Deviations from the reference:
- As in the reference the pool is every token of the video; the one frame rule added is that every
  Qwen frame pair keeps at least one token: once the picks left equal the number of pairs still
  without a kept token, a greedy step only considers the tokens of those pairs (same max-min score).
  Nothing changes when the plain greedy already covers every pair.
- The budget is keep = floor(R * N) (the reference keeps round(R * N)).
- A kept token is never picked again (its score is masked); the reference's argmax can return a kept
  token when every remaining token duplicates a kept one, keeping fewer distinct tokens.
- The first pick's nearest-neighbour distance excludes the token itself explicitly (the reference takes
  the second smallest entry of each distance-matrix column: the same up to rounding); distances are in
  float32 and the N x N matrix is never held (a min-distance vector is updated after each pick).
- Ties go to the lowest token index (torch.argmax's first maximum, as in the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, Compression, VisualTokens, check_keep

ROW_CHUNK = 4096  # rows of the distance matrix held at once for the first pick


def cosine_distance_to(feats: torch.Tensor, i: int) -> torch.Tensor:
    """1 - cos(x_j, x_i) for every row j of the unit-norm `feats` (N, D); (N,)."""
    return 1 - feats @ feats[i]


def nearest_neighbour_distance(feats: torch.Tensor) -> torch.Tensor:
    """min over j != i of 1 - cos(x_i, x_j) for every row i of the unit-norm `feats` (N, D); (N,)."""
    n = feats.shape[0]
    out = torch.empty(n, device=feats.device)
    for start in range(0, n, ROW_CHUNK):
        rows = torch.arange(start, min(n, start + ROW_CHUNK), device=feats.device)
        dist = 1 - feats[rows] @ feats.T
        dist[torch.arange(len(rows), device=feats.device), rows] = torch.inf
        out[rows] = dist.min(dim=1).values
    return out


def max_min_greedy(feats: torch.Tensor, pair_of: torch.Tensor, keep: int) -> list[int]:
    """`keep` row indices of the unit-norm `feats` (N, D), in pick order: first the token farthest
    from its nearest neighbour, then the one farthest from its nearest picked token; `pair_of` (N,)
    restricts the last picks to pairs with none yet, so every pair gets at least one."""
    num_pairs = int(pair_of.max()) + 1
    score = nearest_neighbour_distance(feats)
    picked = torch.zeros(feats.shape[0], dtype=torch.bool, device=feats.device)
    covered = torch.zeros(num_pairs, dtype=torch.bool, device=feats.device)
    chosen: list[int] = []
    pairs_covered: set[int] = set()
    while len(chosen) < keep:
        candidates = score.masked_fill(picked, -torch.inf)
        if keep - len(chosen) == num_pairs - len(pairs_covered):
            candidates = candidates.masked_fill(covered[pair_of], -torch.inf)
        i = int(candidates.argmax())
        chosen.append(i)
        picked[i] = True
        covered[pair_of[i]] = True
        pairs_covered.add(int(pair_of[i]))
        distance = cosine_distance_to(feats, i)
        score = distance if len(chosen) == 1 else torch.minimum(score, distance)
    return chosen


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """Assignment (N,): the greedy max-min diversity subset keeps itself, every other token is dropped."""
    check_keep(tokens.pair_sizes, keep)
    n = tokens.features.shape[0]
    if keep == n:
        return Compression(torch.arange(n))  # cpu: a CPU Compression; merge_groups moves it to the features
    feats = F.normalize(tokens.features.float(), dim=-1)
    pairs = torch.arange(len(tokens.pair_sizes), device=feats.device)
    pair_of = torch.repeat_interleave(pairs, torch.tensor(tokens.pair_sizes, device=feats.device))
    # the picks are Python ints (one argmax per step): the assignment is index bookkeeping on the CPU
    chosen = torch.tensor(max_min_greedy(feats, pair_of, keep), dtype=torch.long)  # cpu: the picks, Python ints
    assignment = torch.full((n,), DROPPED, dtype=torch.long)  # cpu: a CPU Compression, moved by merge_groups
    assignment[chosen] = chosen
    return Compression(assignment)
