"""VisionZip (Yang et al. 2025) on Qwen's merged video tokens, per frame pair.

Qwen has no CLS token: a merged token's importance is the attention its 4 patches receive in the
last ViT block, recomputed eagerly (mean over heads and query patches, mean over the merge unit,
Qwen2.5-VL's window order undone); the backbone adapter supplies it as `received_attention`.
Split of a pair's budget k: `round(k * 54/64)` dominant tokens (VisionZip's 54 dominant + 10
contextual of 64), at least one; the rest are contextual: that many uniformly spaced "target"
tokens among the non-dominant ones, with every other non-dominant token merged (averaged) into
its most cosine-similar target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, VisualTokens, per_pair_budget

DOMINANT_FRACTION = 54 / 64


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> torch.Tensor:
    if tokens.received_attention is None:
        raise ValueError("visionzip needs the attention received in the last ViT block")
    assignment = torch.full((tokens.features.shape[0],), DROPPED, dtype=torch.long)
    for start, size, k in zip(tokens.pair_starts, tokens.pair_sizes, per_pair_budget(tokens.pair_sizes, keep)):
        index = torch.arange(start, start + size)
        n_dom = max(1, round(k * DOMINANT_FRACTION)) if k > 1 else 1
        n_ctx = k - n_dom
        order = torch.argsort(tokens.received_attention[index], descending=True)
        dominant, rest = index[order[:n_dom]], index[order[n_dom:]]
        assignment[dominant] = dominant
        if n_ctx > 0:
            rest = rest.sort().values
            targets = rest[torch.linspace(0, len(rest) - 1, n_ctx).round().long()]
            feats = F.normalize(tokens.features.float(), dim=-1)
            nearest = (feats[rest] @ feats[targets].T).argmax(dim=1)
            assignment[rest] = targets[nearest]
            assignment[targets] = targets
    return assignment
