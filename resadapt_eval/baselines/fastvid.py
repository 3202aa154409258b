"""FastVID (Shen et al., NeurIPS 2025), vision side, on Qwen's merged tokens with pairs as frames.

As the paper states it, FastVID prunes video tokens before the LLM in two steps:

1. Dynamic Temporal Segmentation (DySeg): with t_i the cosine similarity of the global features of
   frames i and i+1, the video is cut after frame i for each of the c - 1 lowest t_i and for every
   t_i < tau, so segments are temporally ordered runs of similar frames.
2. Density Spatiotemporal Pruning (STPrune), per segment: of a frame's retained tokens a fraction
   1 - d are salient and d contextual.
   - Attention-based Token Selection (ATS): each frame keeps its salient tokens, those that
     received the most attention in the vision encoder.
   - Density-based Token Merging (DTM): anchor frames, every p-th frame counted back from the
     segment's last, share the segment's contextual budget. An anchor frame's anchor tokens are the
     density peaks (DPC-kNN: score = local density x distance to the nearest denser token) of its
     non-salient tokens; every non-salient token of the segment is merged into its most
     cosine-similar anchor token. Kept tokens keep their positions.

The merged feature of an anchor a with n tokens matched to it (a itself among them, as it is among
the non-salient tokens it is matched with) is w a + (1 - w) mean(those n tokens), w = max(beta,
1 / (n + 1)) = beta = 0.6 for n >= 1 (LLaVA-OneVision code, modeling_qwen2.py:1003-1008 for
single-frame segments, :1051-1056 for multi-frame ones, the same rule): the anchor weighs
beta + (1 - beta) / n, each other member (1 - beta) / n (`Compression.weights`); a lone anchor
is itself, as is a salient token. (The authors' Qwen2.5-VL and LLaVA-Video ports leave an anchor
frame's own anchors out of the tokens matched, so there n counts the other members only and the
anchor weighs beta; this port follows the LLaVA-OneVision code, as for the other steps.)

Paper: L. Shen, G. Gong, T. He, Y. Zhang, P. Liu, S. Zhao, G. Ding, "FastVID: Dynamic Density
Pruning for Fast Video Large Language Models", NeurIPS 2025, arXiv:2503.11187.
Code: github.com/LunarShen/FastVID, read at commit a40a109: the FastVID block of `Qwen2Model.forward`
in fastvid_llavaonevision/LLaVA-NeXT/llava/model/language_model/modeling_qwen2.py (the paper's
method), fastvid_qwen25vl/lmms-eval/lmms_eval/models/qwenvlutils/modeling_qwen2_5_vl.py (the
authors' Qwen2.5-VL port) and the hyperparameters of fastvid_qwen25vl/scripts/eval.sh:
c = 8, tau = 0.84 (0.9 for LLaVA-OneVision), d = 0.4, p = 4, beta = 0.6, density over the 4 nearest
neighbours (the token itself included).
As in that port, a frame is one Qwen temporal pair (one step of the merged grid).

Deviations from the reference:

- Budget: the pipeline asks for exactly `keep` tokens. `keep` is split over pairs in proportion to
  their sizes (`per_pair_budget`, at least one per pair); a pair with budget k has floor(d k)
  contextual and k - floor(d k) >= 1 salient tokens (the reference: k = int(n R) for every frame).
  A segment's contextual tokens are dealt evenly over its anchor frames (the remainder to the
  earliest; the reference floors and drops it), at most the anchor frame's non-salient tokens each;
  what does not fit becomes extra salient tokens of the segment's other frames, dealt in turn. So
  exactly `keep` tokens are kept, every pair keeps at least one, and keep == N keeps all.
- Salience: `received_attention` (attention each merged token received in the last ViT block, mean
  over heads and queries). The LLaVA-OneVision code uses its SigLIP pooling head's attention, the
  Qwen2.5-VL port the last ViT block's attention from one mean query (softmax of the mean query
  instead of the mean of the queries' softmaxes).
- Frame global feature: the mean of the pair's merged tokens, as in the Qwen2.5-VL port (the
  LLaVA-OneVision code uses the SigLIP pooling head's output).
- The Qwen2.5-VL port's second-level split (runs of frames with similarity >= 0.95 keep tokens only
  in their last frame) is not used: it leaves pairs without any token and its count is not exact.
  This follows the paper and its LLaVA code, where every frame keeps its salient tokens.
- DTM merging in segments of more than p pairs (two or more anchor frames): a non-salient token
  joins one anchor, its most similar over all anchor frames of its segment; the reference matches
  every segment token to one anchor in each anchor frame (a token feeds several anchors, another
  anchor frame's anchors included), which one assignment cannot state. The beta rule above is
  applied to the groups this assignment forms, so n counts a group's members over all the
  segment's anchor frames (the reference: the tokens matched to the anchor within its own anchor
  frame's matching). Segments with one anchor frame (at most p pairs) merge as the reference does.
- Determinism: equal densities are ordered by token index (the reference adds 1e-6 random noise);
  top-k ties go to the lower index. With fewer than c - 1 transitions, every transition is a cut.
  A frame with fewer than 4 non-salient tokens reads its density over all of them (the reference's
  frames always have more). An anchor always heads its own group (the reference, when two anchors
  point the same way, matches the later one to the earlier, whose n counts it).
- A segment without anchors (no contextual budget, or no room for it in its anchor frames) drops
  its non-salient tokens. No code of the authors does that (a40a109). The LLaVA-OneVision code
  raises IndexError where int(k d) = 0: an argmax over zero anchors at
  fastvid_llavaonevision/LLaVA-NeXT/llava/model/language_model/modeling_qwen2.py:1001.
  The LLaVA-Video copy gives a segment of L frames int(k L d) contextual tokens
  (fastvid_llavavideo/LLaVA-NeXT/llava/model/language_model/modeling_qwen2.py:941-943) and raises
  where that is 0: a torch.cat of no anchors at :1052. The Qwen2.5-VL port gives every segment at
  least one contextual token (modeling_qwen2_5_vl.py:1930).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import (
    DROPPED,
    Compression,
    TokenCompressor,
    VisualTokens,
    by_mask,
    density_peaks,
    per_pair_budget,
    top,
    unit_rows_and,
)

DYSEG_C = 8  # at least c segments (the c - 1 lowest transitions are cuts)
DYSEG_TAU = 0.84  # and a cut wherever adjacent frames' cosine is below tau (Qwen2.5-VL setting)
STPRUNE_D = 0.4  # contextual (DTM) share of a frame's retained tokens
DTM_P = 4  # anchor frame interval
DENSITY_K = 4  # neighbours in the kNN density, the token itself included
DTM_BETA = 0.6  # the least weight of an anchor in its merged feature


def frame_similarities(tokens: VisualTokens) -> list[float]:
    """(P - 1) cosine similarities of consecutive pairs' global features (mean merged token)."""
    means = torch.stack(
        [tokens.features[s : s + n].float().mean(0) for s, n in zip(tokens.pair_starts, tokens.pair_sizes)]
    )
    return F.cosine_similarity(means[:-1], means[1:], dim=-1).tolist()


def dynamic_segments(similarity: list[float]) -> list[list[int]]:
    """DySeg: pair indices per segment, cut after pair i for the c - 1 lowest similarities and all below tau."""
    lowest = sorted(range(len(similarity)), key=lambda i: (similarity[i], i))[: DYSEG_C - 1]
    cuts = set(lowest) | {i for i, s in enumerate(similarity) if s < DYSEG_TAU}
    segments = [[0]]
    for p in range(1, len(similarity) + 1):
        if p - 1 in cuts:
            segments.append([p])
        else:
            segments[-1].append(p)
    return segments


def anchor_frames(length: int) -> list[int]:
    """Positions in a segment of `length` pairs of its anchor frames: every p-th, counted back from the last."""
    return [j for j in range(length) if (length - 1 - j) % DTM_P == 0]


def deal(total: int, room: list[int]) -> list[int]:
    """`total` tokens dealt one at a time, in order, to the slots with room left; (len(room),) counts.
    Whole rounds are dealt at once: as many as every open slot can take and `total` covers."""
    given = [0] * len(room)
    while total > 0:
        open_slots = [i for i, r in enumerate(room) if given[i] < r]
        if not open_slots:
            break
        rounds = min(total // len(open_slots), min(room[i] - given[i] for i in open_slots))
        if rounds == 0:  # a last, partial round: the first open slots take one each
            for i in open_slots[:total]:
                given[i] += 1
            break
        for i in open_slots:
            given[i] += rounds
        total -= rounds * len(open_slots)
    return given


def stprune_budget(sizes: list[int], budget: list[int]) -> tuple[list[int], list[int]]:
    """Salient and anchor counts per pair of one segment (sizes, budgets per pair); they sum to sum(budget)."""
    contextual = [math.floor(STPRUNE_D * k) for k in budget]
    salient = [k - c for k, c in zip(budget, contextual)]
    anchors_at = anchor_frames(len(sizes))
    dealt = deal(sum(contextual), [sizes[j] - salient[j] for j in anchors_at])
    anchors = [0] * len(sizes)
    for j, count in zip(anchors_at, dealt):
        anchors[j] = count
    extra = deal(sum(contextual) - sum(dealt), [n - s - a for n, s, a in zip(sizes, salient, anchors)])
    return [s + e for s, e in zip(salient, extra)], anchors


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    if tokens.received_attention is None:
        raise ValueError("fastvid needs the attention received in the last ViT block")
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    budget = per_pair_budget(sizes, keep)
    features = tokens.features
    device = features.device
    attention = tokens.received_attention.to(device).float()
    assignment = torch.full((features.shape[0],), DROPPED, dtype=torch.long, device=device)
    for segment in dynamic_segments(frame_similarities(tokens)):
        salient, anchor = stprune_budget([sizes[p] for p in segment], [budget[p] for p in segment])
        rest, anchors = [], []
        for p, n_salient, n_anchor in zip(segment, salient, anchor):
            is_salient = torch.zeros(sizes[p], dtype=torch.bool, device=device)
            is_salient[top(attention[starts[p] : starts[p] + sizes[p]], n_salient)] = True
            others, kept = (starts[p] + i for i in by_mask(is_salient, n_salient))
            assignment[kept] = kept
            if n_anchor > 0:
                anchors.append(others[density_peaks(features[others].float(), n_anchor, DENSITY_K)[0]])
            rest.append(others)
        if anchors:
            rest, anchors = torch.cat(rest), torch.cat(anchors)
            unit = F.normalize(features[rest].float(), dim=-1)
            assignment[rest] = anchors[(unit @ F.normalize(features[anchors].float(), dim=-1).T).argmax(dim=1)]
            assignment[anchors] = anchors
    return Compression(assignment, dtm_weights(assignment))


def dtm_weights(assignment: torch.Tensor) -> torch.Tensor:
    """(N,) float64 weights of the DTM merge: in a group of n tokens (its destination among them), the
    destination weighs w + (1 - w) / n and each other member (1 - w) / n, w = max(beta, 1 / (n + 1)); a
    group of one (a salient token, a lone anchor) is its token. Dropped tokens weigh 0."""
    members = assignment != DROPPED
    destination = assignment.clamp(min=0)
    n = torch.zeros(len(assignment), dtype=torch.long, device=assignment.device)
    n = n.scatter_add_(0, destination, members.long())[destination].double()
    n = torch.where(members, n, torch.ones_like(n))
    w = (1 / (n + 1)).clamp(min=DTM_BETA)
    weights = (1 - w) / n
    weights = torch.where(assignment == torch.arange(len(assignment), device=assignment.device), weights + w, weights)
    return torch.where(members, weights, torch.zeros_like(weights))


COMPRESSOR = TokenCompressor(compress, working_bytes=unit_rows_and(3), host_syncs=1, reads_attention=True)
