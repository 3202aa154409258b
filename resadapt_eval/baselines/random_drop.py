"""Random Drop: keep a seeded uniform subset of the merged tokens, in their original order.

No canonical code: the rule is the usual baseline's, a uniform random subset of the visual tokens. The one
deviation is that every frame pair keeps at least one token: one uniform token per pair is drawn first, then the
rest uniformly from the other tokens. With one pair the subset is exactly uniform; with several, a subset's
probability is proportional to the product of its per-pair counts (balanced subsets are slightly favoured over a
uniform draw among the subsets that cover every pair). tests/test_fidelity_random_drop.py checks the draw and law.
"""

from __future__ import annotations

import torch

from .common import DROPPED, Compression, TokenCompressor, VisualTokens, check_keep, holds_nothing, no_matmul


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """One random token per pair first (every pair keeps at least one), the rest uniformly."""
    check_keep(tokens.pair_sizes, keep)
    n, pairs = tokens.features.shape[0], len(tokens.pair_sizes)
    # the seeded draw runs on the CPU generator, so a seed selects the same tokens on any device
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.cat(
        [
            start + torch.randint(size, (1,), generator=generator)  # cpu: the seeded draw
            for start, size in zip(tokens.pair_starts, tokens.pair_sizes)
        ]
    )
    taken = torch.zeros(n, dtype=torch.bool)  # cpu: index bookkeeping of the draw
    taken[chosen] = True
    pool = torch.sort(taken.to(torch.uint8), stable=True).indices[: n - pairs]  # the other tokens, in order
    extra = pool[torch.randperm(n - pairs, generator=generator)[: keep - pairs]]  # cpu: the seeded draw
    assignment = torch.full((n,), DROPPED, dtype=torch.long)  # cpu: a CPU Compression, moved by merge_groups
    kept = torch.cat([chosen, extra])
    assignment[kept] = kept
    return Compression(assignment)


COMPRESSOR = TokenCompressor(compress, working_bytes=holds_nothing, host_syncs=0, config_flops=no_matmul)
