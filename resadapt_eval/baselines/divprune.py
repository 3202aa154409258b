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
  the second smallest entry of each distance-matrix column: the same up to rounding).
- Precision: as in the reference, the dot products are in the features' own dtype (it normalises and
  multiplies in that dtype); the norms, the division by them and the distances are in float32 (float64
  features: float64). Each pair's distance is computed once, so the distances are exactly symmetric as
  the reference's matrix (the two halves of one matrix product can differ in rounding).
- Ties go to the lowest token index (torch.argmax's first maximum, as in the reference).

Cost, as the reference's (llava_arch.py:147-171): one N x N distance matrix (the reference's N^2 D
multiply-adds and N^2 values in the features' dtype; ours its upper half, N^2 D / 2, held in float32),
then `keep` greedy steps of O(N) each on the device (the reference's step i reads i rows: O(K^2 N) in
all), with no host sync (the reference none either: the kept indices stay on the device). No copy of
the features: the distances come from their dot products, `ROW_CHUNK` rows at a time, and the rows'
norms (N,). Where N^2 float32 distances exceed `DISTANCE_MATRIX_BYTES` (N > 16,384: more than 22 pairs
of 720 tokens) the matrix is not held: the first pick's nearest neighbours take the same upper half a
ROW_CHUNK x N block at a time, and each step computes its pick's row from the features (one N x D
matrix-vector product, memory-bound). The extra memory is then that block and its divisor (90 MiB at
N = 46,080, 128 frames of Qwen2.5-VL-7B) and O(N) vectors, where the reference holds N^2 values (4.2 GB
in bfloat16 at that N).
"""

from __future__ import annotations

import torch

from .common import DROPPED, F32, Compression, TokenCompressor, VisualTokens, check_keep

ROW_CHUNK = 256  # rows of distances computed at once: the held matrix, or the first pick's nearest neighbours
DISTANCE_MATRIX_BYTES = 1 << 30  # the N x N float32 distances are held when they fit in 1 GiB (N <= 16,384)


def holds_distance_matrix(n: int) -> bool:
    """Whether the N x N float32 distance matrix of `n` tokens fits `DISTANCE_MATRIX_BYTES`."""
    return n * n * 4 <= DISTANCE_MATRIX_BYTES


def distance_dtype(feats: torch.Tensor) -> torch.dtype:
    """The distances' dtype: the features' own, at least float32."""
    return torch.promote_types(feats.dtype, torch.float32)


def row_norms(feats: torch.Tensor) -> torch.Tensor:
    """||x_i|| of every row of `feats` (N, D) in the distances' dtype, at least 1e-12 (as F.normalize); (N,).
    ROW_CHUNK rows at a time: half-precision features are never promoted whole."""
    dtype = distance_dtype(feats)
    return torch.cat([block.to(dtype).norm(dim=-1) for block in feats.split(ROW_CHUNK)]).clamp_min_(1e-12)


def upper_block(feats: torch.Tensor, norms: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """1 - cos(x_i, x_j) for the rows i in [start, stop) of `feats` (N, D) and the columns j >= start: the
    dot products in the features' dtype (as the reference), divided by ||x_i|| ||x_j|| (`norms` (N,)) in the
    distances' dtype; (stop - start, N - start). A pair i < j is computed once, in the block of i's rows, so
    it has one distance either way round, as the reference's matrix is symmetric (the two halves of a
    matrix product can differ in rounding: the first pick's tie of two mutual nearest neighbours would not
    go to the lower index)."""
    dots = (feats[start:stop] @ feats[start:].T).to(norms.dtype)
    return dots.div_(norms[start:stop, None] * norms[start:]).neg_().add_(1)


def cosine_distance_to(feats: torch.Tensor, i: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """1 - cos(x_j, x_i) for every row j of `feats` (N, D), as `upper_block` computes it, `i` a one-element
    index tensor (no host sync), `norms` the rows' (`row_norms`): one N x D
    matrix-vector product, no copy of the features; (N,)."""
    dots = (feats @ feats.index_select(0, i)[0]).to(norms.dtype)
    return dots.div_(norms * norms.index_select(0, i)).neg_().add_(1)


def nearest_neighbour_distance(feats: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """min over j != i of 1 - cos(x_i, x_j) for every row i of `feats` (N, D) (`norms`: the rows',
    `row_norms`): the pairs i < j once each, ROW_CHUNK rows of i at a time (one ROW_CHUNK x N
    block of distances and its divisor held); (N,)."""
    n = feats.shape[0]
    out = torch.full((n,), torch.inf, dtype=norms.dtype, device=feats.device)
    chunk = min(ROW_CHUNK, n)
    not_later = torch.ones(chunk, chunk, dtype=torch.bool, device=feats.device).tril_()  # j <= i in a block
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        dist = upper_block(feats, norms, start, stop)
        dist[:, : stop - start].masked_fill_(not_later[: stop - start, : stop - start], torch.inf)
        out[start:stop] = torch.minimum(out[start:stop], dist.amin(dim=1))  # i's nearest later token
        out[start:] = torch.minimum(out[start:], dist.amin(dim=0))  # j's nearest token among these earlier ones
    return out


def distance_matrix(feats: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """1 - cos between every two rows of `feats` (N, D) (`norms`: the rows', `row_norms`),
    symmetric (the pairs i < j computed once each, ROW_CHUNK rows at a time), a token's distance to
    itself set to inf (so a column's minimum is its nearest other token); (N, N) in the distances' dtype."""
    n = feats.shape[0]
    distances = torch.empty(n, n, dtype=norms.dtype, device=feats.device)
    chunk = min(ROW_CHUNK, n)
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=feats.device).triu_(1)  # j > i in a block
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        dist = upper_block(feats, norms, start, stop)
        square = dist[:, : stop - start]  # the block's own pairs: the half below its diagonal mirrors the other
        square.copy_(torch.where(later[: stop - start, : stop - start], square, square.T))
        distances[start:stop, start:] = dist
        distances[start:, start:stop] = dist.T
    return distances.fill_diagonal_(torch.inf)


def max_min_greedy(feats: torch.Tensor, pair_of: torch.Tensor, num_pairs: int, keep: int) -> torch.Tensor:
    """`keep` row indices of `feats` (N, D, any norm), in pick order, on their device: first the
    token farthest from its nearest neighbour, then the one farthest from its nearest picked token;
    `pair_of` (N,) restricts the last picks to pairs with none yet, so every pair gets at least one.
    No host sync: every step's choice stays a device tensor."""
    device = feats.device
    norms = row_norms(feats)
    distances = distance_matrix(feats, norms) if holds_distance_matrix(feats.shape[0]) else None

    def distances_to(i: torch.Tensor) -> torch.Tensor:  # the picked token's row: (N,)
        return distances.index_select(0, i)[0] if distances is not None else cosine_distance_to(feats, i, norms)

    score = distances.amin(dim=0) if distances is not None else nearest_neighbour_distance(feats, norms)
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
    feats = tokens.features  # no copy: the distances are computed from the features as they are
    pairs = torch.arange(len(tokens.pair_sizes), device=feats.device)
    sizes = torch.tensor(tokens.pair_sizes, device=feats.device)
    pair_of = torch.repeat_interleave(pairs, sizes, output_size=n)
    chosen = max_min_greedy(feats, pair_of, len(tokens.pair_sizes), keep)
    assignment = torch.full((n,), DROPPED, dtype=torch.long, device=feats.device)
    assignment[chosen] = chosen
    return Compression(assignment)


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """No copy of the features: the N x N float32 distances where they fit `DISTANCE_MATRIX_BYTES`, and
    one ROW_CHUNK x N float32 block of distances with its divisor while they are computed (the dot
    products in the features' dtype, cast as they come); the greedy steps hold (N,) vectors."""
    n = sum(sizes)
    matrix = n * n * F32 if holds_distance_matrix(n) else 0
    return matrix + 2 * min(ROW_CHUNK, n) * n * F32


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=0)
