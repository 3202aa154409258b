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
  float32.
- Ties go to the lowest token index (torch.argmax's first maximum, as in the reference).

Cost, as the reference's (llava_arch.py:147-171): one N x N distance matrix (N^2 D multiply-adds, N^2
floats held; the reference's in the features' dtype, ours float32), then `keep` greedy steps of O(N)
each on the device (the reference's step i reads i rows: O(K^2 N) in all), with no host sync (the reference
none either: the kept indices stay on the device). Where
N^2 float32 distances exceed `DISTANCE_MATRIX_BYTES` (N > 16,384: more than 21 pairs of 768 tokens)
the matrix is not held: each step computes its picked token's row from the features (N D
multiply-adds, memory-bound), the first pick's nearest neighbours in blocks of `ROW_CHUNK` rows, so
the memory stays O(N D) while the reference's N^2 (4.8 GB in float16 at 128 frames of Qwen2.5-VL-7B)
would not fit that budget.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, Compression, VisualTokens, check_keep

ROW_CHUNK = 1024  # rows of the distance matrix computed at once for the first pick, when it is not held
DISTANCE_MATRIX_BYTES = 1 << 30  # the N x N float32 distances are held when they fit in 1 GiB (N <= 16,384)


def holds_distance_matrix(n: int) -> bool:
    """Whether the N x N float32 distance matrix of `n` tokens fits `DISTANCE_MATRIX_BYTES`."""
    return n * n * 4 <= DISTANCE_MATRIX_BYTES


def cosine_distance_to(feats: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """1 - cos(x_j, x_i) for every row j of the unit-norm `feats` (N, D), `i` a one-element index
    tensor (no host sync); (N,)."""
    return 1 - feats @ feats.index_select(0, i)[0]


def nearest_neighbour_distance(feats: torch.Tensor) -> torch.Tensor:
    """min over j != i of 1 - cos(x_i, x_j) for every row i of the unit-norm `feats` (N, D), in
    blocks of ROW_CHUNK rows; (N,)."""
    n = feats.shape[0]
    out = torch.empty(n, device=feats.device)
    for start in range(0, n, ROW_CHUNK):
        rows = torch.arange(start, min(n, start + ROW_CHUNK), device=feats.device)
        dist = (feats[rows] @ feats.T).neg_().add_(1)  # 1 - cos, in place: one ROW_CHUNK x N block held
        dist[torch.arange(len(rows), device=feats.device), rows] = torch.inf
        out[rows] = dist.min(dim=1).values
    return out


def distance_matrix(feats: torch.Tensor) -> torch.Tensor:
    """1 - cos between every two rows of the unit-norm `feats` (N, D), a token's distance to itself
    set to inf (so a column's minimum is its nearest other token); (N, N) float32."""
    distances = feats @ feats.T
    distances.neg_().add_(1).fill_diagonal_(torch.inf)
    return distances


def max_min_greedy(feats: torch.Tensor, pair_of: torch.Tensor, num_pairs: int, keep: int) -> torch.Tensor:
    """`keep` row indices of the unit-norm `feats` (N, D), in pick order, on their device: first the
    token farthest from its nearest neighbour, then the one farthest from its nearest picked token;
    `pair_of` (N,) restricts the last picks to pairs with none yet, so every pair gets at least one.
    No host sync: every step's choice stays a device tensor."""
    device = feats.device
    distances = distance_matrix(feats) if holds_distance_matrix(feats.shape[0]) else None

    def distances_to(i: torch.Tensor) -> torch.Tensor:  # the picked token's row: (N,)
        return distances.index_select(0, i)[0] if distances is not None else cosine_distance_to(feats, i)

    score = distances.min(dim=0).values if distances is not None else nearest_neighbour_distance(feats)
    picked = torch.zeros(feats.shape[0], dtype=torch.bool, device=device)
    covered = torch.zeros(num_pairs, dtype=torch.bool, device=device)
    chosen = torch.empty(keep, dtype=torch.long, device=device)
    for step in range(keep):
        # once the picks left equal the pairs without a kept token, only those pairs' tokens compete
        only_uncovered = (num_pairs - covered.sum()) == keep - step
        candidates = score.masked_fill(picked | (covered[pair_of] & only_uncovered), -torch.inf)
        i = candidates.argmax().view(1)
        chosen[step : step + 1] = i
        picked.index_fill_(0, i, True)
        covered.index_fill_(0, pair_of.index_select(0, i), True)
        row = distances_to(i)
        score = row if step == 0 else torch.minimum(score, row)
    return chosen


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """Assignment (N,): the greedy max-min diversity subset keeps itself, every other token is dropped."""
    check_keep(tokens.pair_sizes, keep)
    n = tokens.features.shape[0]
    if keep == n:
        return Compression(torch.arange(n))  # cpu: a CPU Compression; merge_groups moves it to the features
    feats = F.normalize(tokens.features.float(), dim=-1)
    pairs = torch.arange(len(tokens.pair_sizes), device=feats.device)
    sizes = torch.tensor(tokens.pair_sizes, device=feats.device)
    pair_of = torch.repeat_interleave(pairs, sizes, output_size=n)
    chosen = max_min_greedy(feats, pair_of, len(tokens.pair_sizes), keep)
    assignment = torch.full((n,), DROPPED, dtype=torch.long, device=feats.device)
    assignment[chosen] = chosen
    return Compression(assignment)
