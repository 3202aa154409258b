"""Random Drop: keep a seeded uniform subset of the merged tokens, in their original order."""

from __future__ import annotations

import torch

from .common import DROPPED, Compression, VisualTokens, check_keep


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """One random token per pair first (every pair keeps at least one), the rest uniformly."""
    check_keep(tokens.pair_sizes, keep)
    n = tokens.features.shape[0]
    generator = torch.Generator().manual_seed(seed)
    chosen = [
        start + int(torch.randint(size, (1,), generator=generator))
        for start, size in zip(tokens.pair_starts, tokens.pair_sizes)
    ]
    remaining = torch.ones(n, dtype=torch.bool)
    remaining[chosen] = False
    pool = torch.nonzero(remaining).flatten()
    extra = pool[torch.randperm(len(pool), generator=generator)[: keep - len(chosen)]]
    assignment = torch.full((n,), DROPPED, dtype=torch.long)
    kept = torch.cat([torch.tensor(chosen, dtype=torch.long), extra])
    assignment[kept] = kept
    return Compression(assignment)
