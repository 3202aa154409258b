"""DyCoke (Tao et al., CVPR 2025): temporal token merging (TTM), pairs as frames, then KV pruning while decoding.

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
- The second stage, dynamic KV-cache pruning during decoding (`decode_stage`, `decode_pruning.DecodePruner`;
  `PrunableDynamicCache.dycoke_pruning` in the reference's modeling_qwen2.py): at each decoding step the current
  token's attention in layer K - 1 (mean over heads) ranks the visual tokens, and layers K and later attend to the top
  int((1 - P) n) of them (at least one; int(R n) where R is larger, so that R = 1 keeps every token), re-selected when
  the visual attention's cosine to the previous step's is below 0.9 (otherwise, as the reference's reset selection
  does, to all of them). K = 3 of LLaVA-OneVision-7B's 28 layers (`dycoke_l`), P = 0.7 (the README's lmms-eval
  setting; the code's default is 0.8). Here K sits at the same relative depth, round(3 L / 28), after Qwen3-VL's
  deepstack layers. The ranked tokens are exactly the visual tokens (the reference's `image_token_length` is one
  short, llava_arch.py:390, so its last visual token is never ranked and always attended). It changes only decoding,
  so the R recorded is TTM's (every prefill layer sees the tokens TTM kept); its saving is in the decoding FLOPs. The
  reference keeps the previous step's attention in a config object shared across requests; here it starts afresh with
  each request.
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
  never pruned (an off-by-one); here the 3rd frame of every window is compared with its 1st. Its pair loop
  (`range(0, F - 1, 2)`) never appends the last of an odd number of frames, which is lost; here it is kept as the
  window rule says (a window's 1st frame, or its 3rd). With fewer than 5 frames the reference fails (torch.stack
  of an empty list); here any number of pairs works.
- Pruned tokens are dropped, as in the reference, which discards them despite the name "merging". Kept tokens keep
  their own M-RoPE positions and order. The reference reorders a frame's kept tokens by similarity (topk order).
- Pairs whose grids (t, h, w) differ have no same-position correspondence. A token of such a pair is compared with
  its most similar token of the partner (maximum cosine) instead.
- Ties in similarity are broken by token index (a stable sort), so the output is deterministic. `seed` is unused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, Compression, TokenCompressor, VisualTokens, check_keep, per_pair_budget, unit_rows_and
from .inside_llm import DecodeStage, scaled_layer

WINDOW = 4  # frames per TTM window; the first one is the reference
DECODE_LAYER, DECODE_LAYERS = 3, 28  # dycoke_l of LLaVA-OneVision-7B's 28 layers
DECODE_PRUNING = 0.7  # dycoke_p: the share of the visual tokens a decoding step does not attend to
SIMILARITY_THRESHOLD = 0.9  # a step re-selects below this cosine to the previous step's visual attention


def window_partners(frames: list[int]) -> dict[int, int]:
    """TTM's comparisons over windows of 4 consecutive entries of `frames`: the 2nd and 4th entry of a window are
    compared with the entry before them, the 3rd with the 1st. Returns {compared frame: partner frame}."""
    partner = {}
    for w in range(0, len(frames), WINDOW):
        window = frames[w : w + WINDOW]
        for offset, frame in enumerate(window[1:], start=1):
            partner[frame] = window[offset - 1] if offset % 2 == 1 else window[0]
    return partner


def unit_pair(tokens: VisualTokens, frame: int) -> torch.Tensor:
    """(size of `frame`, D) the tokens of pair `frame` in float32, L2-normalised (one pair at a time, as the
    reference: the memory stays O(pair tokens x D))."""
    start, size = tokens.pair_starts[frame], tokens.pair_sizes[frame]
    return F.normalize(tokens.features[start : start + size].float(), dim=-1)


def temporal_similarity(tokens: VisualTokens, frame: int, partner: int) -> torch.Tensor:
    """(size of `frame`,) cosine of each token of pair `frame` with the token at the same position of pair `partner`,
    or with its most similar token there when the two pairs have different grids."""
    a, b = unit_pair(tokens, frame), unit_pair(tokens, partner)
    if tokens.grids[frame] == tokens.grids[partner]:
        return (a * b).sum(dim=-1)
    return (a @ b.T).max(dim=1).values


def least_redundant(similarity: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (into the frame) of the k tokens least similar to the partner, the ones TTM keeps."""
    return torch.argsort(similarity, stable=True)[:k]


def root_similarity(tokens: VisualTokens) -> torch.Tensor:
    """(size of pair 0,) redundancy score of the first pair's tokens: cosine with pair 1 (as in TTM's first
    comparison), or with the pair's mean token when the video has a single pair."""
    if len(tokens.pair_sizes) > 1:
        return temporal_similarity(tokens, 0, 1)
    first = unit_pair(tokens, 0)
    return first @ F.normalize(first.mean(dim=0), dim=-1)


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    check_keep(tokens.pair_sizes, keep)
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    device = tokens.features.device
    kept = torch.zeros(tokens.features.shape[0], dtype=torch.bool, device=device)

    def keep_tokens(frame: int, local: torch.Tensor | None = None) -> None:
        if local is None:
            kept[starts[frame] : starts[frame] + sizes[frame]] = True
        else:
            kept[starts[frame] + local] = True

    level, budget = list(range(len(sizes))), keep
    while True:
        partner = window_partners(level)
        references = [f for f in level if f not in partner]
        compared = [f for f in level if f in partner]
        if not compared:  # the first pair alone
            k = min(budget, sizes[0])
            keep_tokens(0, None if k == sizes[0] else least_redundant(root_similarity(tokens), k))
            break
        reference_total = sum(sizes[f] for f in references)
        reachable = budget >= reference_total + len(compared)
        # one pruning rate for all compared frames; if TTM cannot reach the budget, one token each and TTM again
        # over the reference frames
        counts = per_pair_budget([sizes[f] for f in compared], budget - reference_total) if reachable else None
        for frame, k in zip(compared, counts or [1] * len(compared)):
            keep_tokens(frame, least_redundant(temporal_similarity(tokens, frame, partner[frame]), k))
        if reachable:
            for frame in references:
                keep_tokens(frame)
            break
        level, budget = references, budget - len(compared)
    return Compression(torch.where(kept, torch.arange(len(kept), device=device), DROPPED))


def decode_stage(num_layers: int, visual: int, retention: float, first_layer: int = 0) -> DecodeStage:
    """The decoding stage for `visual` tokens in the prompt of a `num_layers`-layer LLM: from layer
    round(3 L / 28) on, int(max(0.3, R) n) visual tokens per re-selecting step (the paper's share; R
    where larger, so that R = 1 keeps every token), re-selected below cosine 0.9."""
    keep = min(visual, max(1, int(visual * max(1 - DECODE_PRUNING, retention) + 1e-9)))
    return DecodeStage(scaled_layer(DECODE_LAYER, DECODE_LAYERS, num_layers, first_layer), keep, SIMILARITY_THRESHOLD)


COMPRESSOR = TokenCompressor(compress, working_bytes=unit_rows_and(1), host_syncs=0)
