"""DyCoke (Tao et al., CVPR 2025), first stage: temporal token merging (TTM), with Qwen frame pairs as frames.

Paper: K. Tao, C. Qin, H. You, Y. Sui, H. Wang, "DyCoke: Dynamic Compression of Tokens for Fast Video Large
Language Models", CVPR 2025 (arXiv:2411.15024). Public code: github.com/KD-TAO/DyCoke, `dycole_ttm` in
llava/model/llava_arch.py (its second stage is in llava/model/language_model/modeling_qwen2.py).

What the method does: DyCoke compresses in two stages. TTM, before the LLM, removes temporal redundancy: the frames
are taken in windows of 4. Within a window the 2nd frame is compared with the 1st and the 4th with the 3rd, then
the 3rd with the 1st; each comparison is the cosine similarity of the tokens at the same spatial position, and a
compared frame loses the fraction K of its tokens most similar to its partner (K = 0.7 in the public lmms-eval
setting). The 1st frame of each window is the reference and stays whole. The second stage prunes the KV cache
during decoding, keeping the visual tokens most attended by the current token at each step.

Deviations from the reference:
- Only TTM is implemented. The second stage (dynamic KV-cache pruning by the attention at LLM layer 3, pruning
  ratio P = 0.7 in the README, 0.8 by default, redone at every decoding step) runs inside the LLM and is not part of
  this compressor.
- A "frame" is one Qwen frame pair (`pair_sizes` tokens), compared after the vision merger.
- Budget: the reference keeps int((1 - K) * T) tokens of every compared frame, so its output size follows from K.
  Here K is solved from the budget. The reference frames stay whole, and the rest of the budget,
  keep - (reference tokens), is split over the compared frames in proportion to their sizes (`per_pair_budget`:
  one pruning rate for all, largest remainder, at least one token each). Each compared frame keeps the tokens least
  similar to its partner, so the most redundant go first, as in the reference's per-frame ranking.
- Below what TTM can reach (budget < reference tokens + one token per compared frame), each compared frame keeps
  its one least similar token and TTM is applied again, with the same windows of 4, to the sequence of reference
  frames (pairs 0, 4, 8, ...; then 0, 16, 32, ...) with the rest of the budget. If the first pair is left alone and
  still above the budget, it keeps the tokens least similar to the same positions of pair 1, or least cosine-similar
  to its own mean token when the video is a single pair. The reference has no such case: its in-LLM stage does the
  further pruning.
- The reference's second comparison loops over `range(0, F - 4, 4)`, so the 3rd frame of the last window is
  never pruned (an off-by-one); here the 3rd frame of every window is compared with its 1st.
- Pruned tokens are dropped, as in the reference, which discards them despite the name "merging". Kept tokens keep
  their own M-RoPE positions and order. The reference reorders a frame's kept tokens by similarity (topk order).
- Pairs whose grids (t, h, w) differ have no same-position correspondence. A token of such a pair is compared with
  its most similar token of the partner (maximum cosine) instead.
- Ties in similarity are broken by token index (a stable sort), so the output is deterministic. `seed` is unused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, VisualTokens, check_keep, per_pair_budget

WINDOW = 4  # frames per TTM window; the first one is the reference


def window_partners(frames: list[int]) -> dict[int, int]:
    """TTM's comparisons over windows of 4 consecutive entries of `frames`: the 2nd and 4th entry of a window are
    compared with the entry before them, the 3rd with the 1st. Returns {compared frame: partner frame}."""
    partner = {}
    for w in range(0, len(frames), WINDOW):
        window = frames[w : w + WINDOW]
        for offset, frame in enumerate(window[1:], start=1):
            partner[frame] = window[offset - 1] if offset % 2 == 1 else window[0]
    return partner


def temporal_similarity(tokens: VisualTokens, feats: torch.Tensor, frame: int, partner: int) -> torch.Tensor:
    """(size of `frame`,) cosine of each token of pair `frame` with the token at the same position of pair `partner`,
    or with its most similar token there when the two pairs have different grids. feats: (N, D) unit rows."""
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    a = feats[starts[frame] : starts[frame] + sizes[frame]]
    b = feats[starts[partner] : starts[partner] + sizes[partner]]
    if tokens.grids[frame] == tokens.grids[partner]:
        return (a * b).sum(dim=-1)
    return (a @ b.T).max(dim=1).values


def least_redundant(similarity: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (into the frame) of the k tokens least similar to the partner, the ones TTM keeps."""
    return torch.argsort(similarity, stable=True)[:k].cpu()


def root_similarity(tokens: VisualTokens, feats: torch.Tensor) -> torch.Tensor:
    """(size of pair 0,) redundancy score of the first pair's tokens: cosine with pair 1 (as in TTM's first
    comparison), or with the pair's mean token when the video has a single pair."""
    if len(tokens.pair_sizes) > 1:
        return temporal_similarity(tokens, feats, 0, 1)
    first = feats[: tokens.pair_sizes[0]]
    return first @ F.normalize(first.mean(dim=0), dim=-1)


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> torch.Tensor:
    check_keep(tokens.pair_sizes, keep)
    feats = F.normalize(tokens.features.float(), dim=-1)
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    kept = torch.zeros(feats.shape[0], dtype=torch.bool)

    def keep_tokens(frame: int, local: torch.Tensor | None = None) -> None:
        index = torch.arange(starts[frame], starts[frame] + sizes[frame])
        kept[index if local is None else index[local]] = True

    level, budget = list(range(len(sizes))), keep
    while True:
        partner = window_partners(level)
        references = [f for f in level if f not in partner]
        compared = [f for f in level if f in partner]
        if not compared:  # the first pair alone
            k = min(budget, sizes[0])
            keep_tokens(0, None if k == sizes[0] else least_redundant(root_similarity(tokens, feats), k))
            break
        reference_total = sum(sizes[f] for f in references)
        reachable = budget >= reference_total + len(compared)
        # one pruning rate for all compared frames; if TTM cannot reach the budget, one token each and TTM again
        # over the reference frames
        counts = per_pair_budget([sizes[f] for f in compared], budget - reference_total) if reachable else None
        for frame, k in zip(compared, counts or [1] * len(compared)):
            keep_tokens(frame, least_redundant(temporal_similarity(tokens, feats, frame, partner[frame]), k))
        if reachable:
            for frame in references:
                keep_tokens(frame)
            break
        level, budget = references, budget - len(compared)
    return torch.where(kept, torch.arange(feats.shape[0]), torch.full_like(kept, DROPPED, dtype=torch.long))
