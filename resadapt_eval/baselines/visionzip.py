"""VisionZip (Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language
Models", CVPR 2025) on Qwen's merged video tokens, per frame pair.

Reference: dvlab-research/VisionZip@3151f6d, `visionzip/clip_encoder.py:43-83` (the selection and
merging), `visionzip/utils.py:10-89` (the patched CLIP attention returns its keys, mean over heads)
and `utils.py:122-124,191` (layer -2 stores them), `main.py:5-7` (`dominant - 1` patches plus
[CLS]). On LLaVA's CLIP tower, per image, everything is read at layer -2, the layer whose output
LLaVA hands to its projector:
- dominant: the [CLS] query's attention to the patches, summed over heads; the `dominant - 1`
  highest patches, plus [CLS] itself (the README's 64 tokens: dominant=54, contextual=10);
- the remaining patches, in their original order, are compared on their keys (the key projection
  with its bias, mean over heads), L2-normalised;
- targets: `arange(0, n, max(1, n // c))[:c]` of those n remaining tokens, c = contextual; every
  other remaining token goes to the target of highest cosine similarity (argmax, the first on
  ties);
- a contextual token is the target's hidden state plus the mean of the tokens assigned to it
  (counts clamped to 1: a target without members is itself);
- the output is [CLS and dominant tokens in original order, contextual tokens in target order],
  then the projector.

Here, per frame pair with budget k: `round(k * 54/64)` dominant tokens (Python's round, half to
even; at least 1 for every k >= 1), the other k - that contextual. Returned as a `Compression`:
dominant tokens are groups of one; a target has weight 1 and each of its m members 1/m, so its
group's feature is target + mean(members) (deepstack features, Qwen3-VL, likewise).

Deviations, each for a reason:
- Qwen has no [CLS] token. A token's importance is the attention its patches receive in the last
  ViT block (`received_attention`: mean over heads and query patches, then over the merge unit's 4
  patches, Qwen2.5-VL's window order undone). All dominant tokens are visual tokens (the
  reference's count includes [CLS]). Ties go to the lower index (`torch.topk` leaves them open).
- The last ViT block instead of layer -2, for the attention and the keys alike: the reference
  reads the layer that produces the features LLaVA projects, and on Qwen that is the last block
  (the merger projects its output). On Qwen2.5-VL the last block attends over each whole temporal
  patch while the block before it attends within windows only (`fullatt_block_indexes`), so its
  attention would not rank tokens across the frame; attention and keys come from one block, as in
  the reference.
- The keys are taken before rotary: CLIP has no rotary (its positions are added to the input), and
  rotary would make two tokens' similarity depend on where they are. They are averaged over heads
  (as the reference) and then over the merge unit's 4 patches (one key per merged token).
- Merging acts on the merger's output (the LLM's input embeddings), where the reference merges
  layer -2 hidden states and projects the result: Qwen's merger fuses 4 patches and projects in one
  step, and every compressor here acts after it.
- Budgets: floor(R * N) tokens split over frame pairs (`per_pair_budget`); each pair is
  compressed on its own, as the reference compresses each image. The 54 : 10 split is generalised
  as above (k = 64 gives 54 + 10, k = 128 gives 108 + 20).
- Order: every kept token (dominant or target) stays in its original place with its own M-RoPE
  position (Qwen's positions are per token); the reference puts contextual tokens after the
  dominant ones.
`seed` is unused (VisionZip is deterministic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, Compression, TokenCompressor, VisualTokens, by_mask, holds_nothing, per_pair_budget, top

DOMINANT_FRACTION = 54 / 64


def split(k: int) -> tuple[int, int]:
    """(dominant, contextual) tokens of a pair budget k >= 1."""
    dominant = round(k * DOMINANT_FRACTION)
    return dominant, k - dominant


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    if tokens.received_attention is None or tokens.keys is None:
        raise ValueError("visionzip needs the last ViT block's received attention and keys")
    n, device = tokens.features.shape[0], tokens.features.device
    assignment = torch.full((n,), DROPPED, dtype=torch.long, device=device)
    weights = torch.ones(n, dtype=torch.float64, device=device)
    attention = tokens.received_attention.detach().to(device)
    keys = tokens.keys.detach().to(device)
    keys = keys.to(torch.promote_types(keys.dtype, torch.float32))
    for start, size, k in zip(tokens.pair_starts, tokens.pair_sizes, per_pair_budget(tokens.pair_sizes, keep)):
        n_dom, n_ctx = split(k)
        is_dominant = torch.zeros(size, dtype=torch.bool, device=device)
        is_dominant[top(attention[start : start + size], n_dom)] = True
        rest, dominant = by_mask(is_dominant, n_dom)  # rest: original order
        assignment[start + dominant] = start + dominant
        if n_ctx == 0:
            continue
        at = torch.arange(0, size - n_dom, max(1, (size - n_dom) // n_ctx), device=device)[:n_ctx]
        is_target = torch.zeros(size - n_dom, dtype=torch.bool, device=device)
        is_target[at] = True
        members, targets = (start + rest[i] for i in by_mask(is_target, len(at)))
        metric = F.normalize(keys[members], dim=-1) @ F.normalize(keys[targets], dim=-1).T
        nearest = metric.argmax(dim=1)
        group_size = torch.zeros(len(targets), dtype=torch.long, device=device).scatter_add_(
            0, nearest, torch.ones_like(nearest)
        )
        assignment[targets] = targets
        assignment[members] = targets[nearest]
        weights[members] = 1.0 / group_size[nearest].double()
    return Compression(assignment, weights)


def similarity_flops(pair_sizes: list[int], keep: int, vision) -> int:
    """Contextual merging: per pair with budget k split into n_dom dominant and c contextual
    (`split`), the size - n_dom - c non-target tokens against the c targets, cosines of the keys
    (the vision head size, `vision.hidden // vision.heads`, wide)."""
    width = vision.hidden // vision.heads
    total = 0
    for size, k in zip(pair_sizes, per_pair_budget(pair_sizes, keep)):
        n_dom, c = split(k)
        total += 2 * (size - n_dom - c) * c * width
    return total


# it selects on (n,) attentions and (n, d_k) keys: no working copy of the features
COMPRESSOR = TokenCompressor(
    compress, working_bytes=holds_nothing, host_syncs=0, reads_attention=True, config_flops=similarity_flops
)
