"""What every token compressor sees and returns.

A compressor acts on the merged visual tokens (after the vision merger, before the LLM) of one
video and returns a `Compression`: an *assignment* (for each of the N tokens, the index of the
token it is kept as or merged into; kept tokens point at themselves, a dropped token has -1) and,
optionally, a *weight* per token. A group sits at its destination's M-RoPE position and its
feature is the weighted sum of its members' features (weights None: the plain mean of the
members, so repeated size-weighted merging stays exact). Weights let a method state its own merge
rule without the shared code knowing it: VisionZip's target + mean of the merged tokens,
FlashVID's tree features, FastVID's and HoliTom's beta-weighted centres. Deepstack features
(Qwen3-VL) are merged with the same weights.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..budget.plan import InfeasibleBudget

DROPPED = -1  # assignment value of a token that is removed outright
F32 = 4  # bytes of a float32


def promoted(n: int, width: int, b: int) -> int:
    """Bytes of a float32 copy of n x width features of `b` bytes each (none when they are float32)."""
    return n * width * F32 if b != F32 else 0


def pair_matrices(sizes: list[int], factor: int = 1) -> int:
    """Bytes of `factor` float32 matrices over the largest pair's tokens."""
    return factor * max(sizes) ** 2 * F32


def unit_rows_and(factor: int, copies: int = 1) -> Callable[[list[int], int, int], int]:
    """A `TokenCompressor.working_bytes` rule: float32 copies of the tokens (`copies` unit rows
    besides the promoted one) and `factor` float32 matrices over the largest pair (density peaks:
    distances, the denser mask, the masked distances)."""

    def count(sizes: list[int], width: int, b: int) -> int:
        n = sum(sizes)
        return promoted(n, width, b) + copies * n * width * F32 + pair_matrices(sizes, factor)

    return count


def no_matmul(pair_sizes: list[int], keep: int, vision) -> int:
    """A `TokenCompressor.config_flops` rule for a method that draws, averages or ranks scores: no
    matmul counted."""
    return 0


def holds_nothing(sizes: list[int], width: int, b: int) -> int:
    """A `TokenCompressor.working_bytes` rule for index arithmetic on (N,) scores: no working copy."""
    return 0


@dataclass
class VisualTokens:
    """features: (N, D) merged tokens in LLM order; pair_sizes: tokens per frame pair (sum N);
    grids: (t, h, w) merged grid per pair; received_attention: (N,) attention each token's
    4 patches received in the last ViT block (mean over heads and queries), when computed;
    keys: (N, head_dim) the last ViT block's attention keys before rotary (mean over heads and the
    4 patches), computed with received_attention; query: (M, D) the LLM's input embeddings of the
    M text tokens of the request's question (M = 0: no question text), in the features' dtype and on
    their device, given to a compressor that reads the question (`TokenCompressor.reads_query`)."""

    features: torch.Tensor
    pair_sizes: list[int]
    grids: list[tuple[int, int, int]]
    received_attention: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    query: torch.Tensor | None = None

    @property
    def pair_starts(self) -> list[int]:
        return pair_starts(self.pair_sizes)


def pair_starts(sizes: list[int]) -> list[int]:
    """Where each of consecutive pairs of `sizes` tokens starts."""
    return list(itertools.accumulate(sizes[:-1], initial=0))


@dataclass(frozen=True)
class TokenCompressor:
    """A compressor's declaration, the one place every surface reads it from (the registry, the
    engine, the FLOPs and memory counts, the host-sync check).

    compress: `(VisualTokens, keep, seed) -> Compression`, keeping exactly `keep` tokens;
    working_bytes: `(pair_sizes, width, b) -> bytes` it holds beyond its inputs on N = sum(pair_sizes)
    tokens of `width` features of `b` bytes each (`flops --memory`);
    host_syncs: the most host-device syncs one call makes, whatever the number of pairs
    (`tests/test_host_syncs.py` counts them);
    reads_attention: it reads the attention received in the last ViT block and its keys;
    reads_query: it reads the question's embeddings (`VisualTokens.query`);
    config_flops: `(pair_sizes, keep, vision) -> FLOPs` of its work from configs alone (`vision`:
    the tower's `VisionDims`), or None when the work depends on the features and is counted in a run;
    fewest_per_pair: `(t, h, w) grid -> tokens`, the fewest a frame pair of that grid can keep (None: one);
    requires: `() -> None`, raising ImportError that names what to install where code it runs is missing
    (vLLM's own VidCom2), checked when an engine is started for it (None: nothing beyond this package)."""

    compress: Callable
    working_bytes: Callable[[list[int], int, int], int]
    host_syncs: int
    reads_attention: bool = False
    reads_query: bool = False
    config_flops: Callable | None = None
    fewest_per_pair: Callable | None = None
    requires: Callable[[], None] | None = None

    @property
    def location(self) -> str:
        """ "module:attribute" where it is declared (its module's `COMPRESSOR`), for a process that loads it by
        name (vLLM's engine, `backbones/vllm_compression.py`)."""
        return f"{self.compress.__module__}:COMPRESSOR"

    def fewest(self, grids) -> int:
        """The fewest tokens it can keep of a video of these (t, h, w) pair grids."""
        return sum(self.fewest_per_pair(tuple(g)) for g in grids) if self.fewest_per_pair else len(grids)


@dataclass(frozen=True)
class Compression:
    """assignment: (N,) long, a token's group destination or DROPPED; weights: (N,) float, each
    token's weight in its group's feature (ignored for dropped tokens), or None for the mean;
    protected: (N,) bool, destinations a stage inside the LLM after the compressor must keep
    (MustDrop's key set), or None."""

    assignment: torch.Tensor
    weights: torch.Tensor | None = None
    protected: torch.Tensor | None = None

    @property
    def kept(self) -> torch.Tensor:
        """Sorted indices of the tokens that stay (the group destinations)."""
        return torch.unique(self.assignment[self.assignment != DROPPED])


def kept_count(retention: float, num_tokens: int, num_pairs: int) -> int:
    """Tokens to keep: floor(R * N), at most N, so the achieved R never exceeds the target (as
    fixed_scale and resadapt plan the largest R not above it). Every compressor keeps at least one
    token per frame pair, so R below num_pairs / N raises `InfeasibleBudget`."""
    if not 0 < retention:
        raise ValueError(f"retention must be positive, got {retention}")
    floor = num_pairs / num_tokens
    if retention < floor:
        raise InfeasibleBudget(
            retention, floor, f"token compression, one token per frame pair ({num_pairs} of {num_tokens} tokens)"
        )
    return min(num_tokens, math.floor(retention * num_tokens + 1e-9))  # 1e-9: R = k / N exactly keeps k


def check_keep(pair_sizes: list[int], keep: int) -> None:
    """Raises unless `keep` lies in [one token per pair, all tokens]."""
    if not len(pair_sizes) <= keep <= sum(pair_sizes):
        raise ValueError(f"keep={keep} tokens is outside [{len(pair_sizes)} pairs, {sum(pair_sizes)} tokens]")


def per_pair_budget(pair_sizes: list[int], keep: int) -> list[int]:
    """Split `keep` over pairs in proportion to their sizes (largest remainder), each in [1, size]."""
    check_keep(pair_sizes, keep)
    total = sum(pair_sizes)
    quota = [keep * s / total for s in pair_sizes]
    budget = [max(1, min(s, int(q))) for s, q in zip(pair_sizes, quota)]
    order = sorted(range(len(pair_sizes)), key=lambda i: quota[i] - int(quota[i]), reverse=True)
    while sum(budget) < keep:
        for i in order:
            if budget[i] < pair_sizes[i] and sum(budget) < keep:
                budget[i] += 1
    while sum(budget) > keep:
        for i in reversed(order):
            if budget[i] > 1 and sum(budget) > keep:
                budget[i] -= 1
    return budget


def merge_groups(
    compression: Compression, *features: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Destinations (sorted kept token indices), group sizes, and each feature tensor (N, D)
    reduced to its groups' features (K, D): the weighted sum of the members, or their mean when
    `compression.weights` is None. Sums run in float32 (float64 inputs stay float64)."""
    assignment = compression.assignment.to(features[0].device)
    members = assignment != DROPPED
    destinations, inverse, sizes = torch.unique(assignment[members], return_inverse=True, return_counts=True)
    merged = []
    for f in features:
        dtype = torch.promote_types(f.dtype, torch.float32)
        sums = torch.zeros(destinations.shape[0], f.shape[1], dtype=dtype, device=f.device)
        if compression.weights is None:
            sums.index_add_(0, inverse, f[members].to(dtype))
            sums /= sizes[:, None]
        else:
            weights = compression.weights.to(device=f.device, dtype=dtype)[members]
            sums.index_add_(0, inverse, f[members].to(dtype) * weights[:, None])
        merged.append(sums.to(f.dtype))
    return destinations, sizes, merged


def top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` highest scores, ties to the lower index."""
    return torch.sort(scores, descending=True, stable=True).indices[:count]


def density_peaks(feats: torch.Tensor, count: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DPC-kNN centres over feats (n, D): distances d = cdist / sqrt(D); density rho = exp(-mean d^2
    over the k nearest rows, itself included); delta = distance to the nearest denser row (equal
    densities: the lower index is denser; the densest row takes the largest distance). Returns the
    `count` rows of highest rho * delta (ties to the lower index) and the (n, n) distances."""
    n, dim = feats.shape
    dist = torch.cdist(feats, feats) / math.sqrt(dim)
    nearest = dist.topk(min(k, n), dim=1, largest=False).values
    density = torch.exp(-(nearest**2).mean(dim=1))
    index = torch.arange(n, device=feats.device)
    # denser[i, j]: row j is denser than row i
    denser = (density[None, :] > density[:, None]) | (
        (density[None, :] == density[:, None]) & (index[None, :] < index[:, None])
    )
    to_denser = torch.where(denser, dist, dist.max()).min(dim=1).values
    return top(to_denser * density, count), dist


def by_mask(mask: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions where `mask` is False, then those where it is True (`count` of them), each in
    ascending order: a stable sort, so the host reads nothing."""
    order = torch.sort(mask.to(torch.uint8), stable=True).indices
    return order[: len(mask) - count], order[len(mask) - count :]


def pair_table(pair_sizes: list[int], budgets: list[int], device: torch.device):
    """Per token its pair and its place in the pair (N,), per pair its budget (P,), on `device`."""
    table = torch.tensor([pair_sizes, budgets], dtype=torch.long)  # cpu: host lists, moved once below
    sizes, budget = table.to(device, non_blocking=True)
    return *pair_places(sizes, sum(pair_sizes)), budget


def pair_places(sizes: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of `n` its pair and its place in the pair (N,), from the pairs' sizes (P,) on the
    device they are on (no host sync)."""
    pair_of = torch.repeat_interleave(torch.arange(len(sizes), device=sizes.device), sizes, output_size=n)
    place = torch.arange(n, device=sizes.device) - (torch.cumsum(sizes, 0) - sizes)[pair_of]
    return pair_of, place


def rank_in_pair(scores: torch.Tensor, pair_of: torch.Tensor, place: torch.Tensor, shape: tuple[int, int]):
    """Each token's rank (0 = highest score) among its pair's tokens, ties to the lower index: the
    scores as a (pairs, longest pair) table, -inf after each pair's end, each row sorted stably
    (the padding comes after any real -inf of its row)."""
    table = scores.new_full(shape, -math.inf).index_put_((pair_of, place), scores)
    order = torch.sort(table, dim=1, descending=True, stable=True).indices
    columns = torch.arange(shape[1], device=scores.device).expand(shape)
    return torch.empty_like(order).scatter_(1, order, columns)[pair_of, place]
