"""PruneVid (Huang et al., 2024): spatio-temporal token merging, then question-attention pruning inside the LLM.

Paper: X. Huang, H. Zhou, K. Han, "PruneVid: Visual Token Pruning for Efficient Video Large Language Models",
arXiv:2412.16117 (ACL 2025). Public code: github.com/Visual-AI/PruneVid, `merge_frames_dynamic`,
`cluster_dpc_knn` and `refine_clusters` in models/pllava/modeling_pllava.py, defaults in scripts/eval.sh.

What the method does (with Qwen frame pairs as frames):
1. Temporal segmentation: the frames' mean tokens are clustered with DPC-KNN into int(0.25 * frames) clusters
   (k = 7). The clusters are made contiguous: each keeps its longest run of consecutive frames, or none if all its
   runs are single frames, and every other run joins the longer of its neighbouring runs (the left one on ties).
   The runs of equal cluster are the segments (scenes).
2. Static token merging: within a segment of W frames, a spatial position whose tokens have a mean pairwise cosine
   over the W frames above tau = 0.8 is static. Its W tokens are averaged into one token. The other positions are
   dynamic and stay per frame.
3. Spatial merging: the static tokens of a segment, and the dynamic tokens of each frame, are clustered with DPC-KNN
   (k = 7) into int(0.5 * count) clusters, each replaced by the mean of its tokens. DPC-KNN: distances
   d = ||x_i - x_j|| / sqrt(C); density rho_i = exp(-mean of d^2 to the k nearest tokens, itself included);
   delta_i = distance to the nearest denser token (the largest distance for the densest); the tokens with the
   largest rho * delta are the centres, and every token joins its nearest centre.
4. Inside the LLM (`stages`): after layer 10 of PLLaVA-7B's 32, the visual tokens are ranked by the attention
   the text tokens after the video (the question and the answer prompt) pay them in that layer, max over heads
   and over those tokens, and the top alpha = 0.4 stay for the later layers (`VTPWindowCache` in
   models/pllava/elastic_cache.py :120-202, `selected_layer` and `alpha` in scripts/eval.sh). That attention is
   the layer's `attn_weights_wo_pos` (models/pllava/llama.py :445-449, returned at :514; the SDPA text model,
   modeling_pllava.py :586, falls back to this eager forward at llama.py :645-660 since the layer asks for
   attentions, :1417-1418): q k^T / sqrt(head_dim) of its q/k projections WITHOUT rotary (applied only after,
   :451-452) and WITHOUT the causal mask (:478-480), softmax over all keys in float32 cast back to the model's
   dtype (:448); the max over heads and text tokens runs in that dtype (elastic_cache.py :125). Ours is the
   same (`layer_pruning.text_attention`), on only the text query rows, from the layer's own projections (so
   also under SDPA / FlashAttention).

Deviations from the reference:
- Budget: the retention R is layer-averaged over both stages (docs/budget.md). The LLM stage keeps its paper
  share alpha = 0.4 at its paper depth (or R of them where R is larger, so that R = 1 keeps every token); the
  vision side keeps the most tokens that leave the layer average within R (`inside_llm.entering_tokens`).
- The LLM stage sits at the same relative depth: layer round(11 L / 32) of an L-layer LLM (the first layer
  without the pruned tokens is 11 of 32; 10 of Qwen2.5-VL-7B's 28, 4 of the tiny 12), after Qwen3-VL's deepstack
  layers, or at `prune_layers`. It keeps floor(max(alpha, R) n) of the n tokens that entered, ranked over all of them;
  the reference keeps int(alpha size) within each static group and each frame's dynamic tokens, which the
  merged tokens entering the LLM no longer carry.
- The LLM stage's ranking: Qwen3-VL's per-head q/k norms are part of its projections, key heads are repeated
  for GQA (PLLaVA-7B's LLaMA has one per query head), and ties go to the earlier token (the reference's
  `torch.topk` leaves their order unspecified).
- The reference also drops the pruned tokens from the KV cache of the layers before the stage, which changes
  only the decoding steps; here those layers keep them (as FastV does).
- A "frame" is one Qwen frame pair (`pair_sizes` tokens), compared after the vision merger.
- Budget: the reference's output size follows from tau and the cluster ratio 0.5. Here the output has exactly
  `keep` tokens. Positions above tau are the static candidates. They are merged in decreasing order of similarity,
  most redundant first, skipping a merge that would take the token count below `keep` (a merge of W tokens removes
  W - 1). If tokens are still above `keep`, spatial DPC-KNN clustering finishes the job. `keep` is split over the
  clustering groups (the static tokens of each segment, the dynamic tokens of each frame) in proportion to their
  sizes (`per_pair_budget`, at least one cluster each), in place of the uniform 0.5 ratio.
- The reference clusters a group only if it has more than 14 tokens. That exemption is dropped, since it cannot
  hold a budget.
- At least one position of every segment stays dynamic (a merge that would make the last one static is skipped),
  and a merge that starts a segment's static group is skipped if the groups would outnumber `keep`. So every pair
  keeps a token, and every group gets a cluster.
- A static token, and a cluster of static tokens, sits at its position in the segment's first pair (M-RoPE needs a
  real token's position). The reference puts a segment's static tokens before its dynamic ones in the sequence.
  A cluster sits at its centre token. Features are means of all members, as in the reference (each static token
  averages W frames).
- Pairs with different grids (t, h, w) have no same-position correspondence, so a segment is further split into
  runs of consecutive pairs with the same grid.
- DPC-KNN's random density jitter (rand * 1e-6) is replaced by a tie-break on token index (the lower index counts
  as denser, and wins ties in score), and k is min(7, count). The output is deterministic, and `seed` is unused.
- Fewer than 4 pairs still form one temporal cluster (the reference's int(0.25 * frames) would be 0; it always
  has 16 frames).

Cost of `compress` (N tokens, D wide, P pairs of at most n tokens, segments of W pairs, groups of m <= n items):
the reference's work (DPC-KNN on the P pair means, W n D per segment, m^2 D per group). Memory: never a copy of
a segment or of the video; one block of positions at a time (at most n tokens: max(1, n // W) positions of all W
pairs) is normalised for the static similarity or averaged into a group's features, and one group's float32
features (m x D) and its 3 m x m float32 matrices are held while it is clustered (`working_bytes`: 26 MiB at
64 pairs of 720 tokens, D = 3,584, float32). The reference holds per segment its normalised copy and its static
and dynamic `masked_select` copies, about 2 W n D values in the features' dtype, and m x m per group. Host syncs:
2 (the temporal labels, every segment's position similarities), the reference at least 3 P.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import (
    F32,
    Compression,
    TokenCompressor,
    VisualTokens,
    check_keep,
    density_peaks,
    pair_matrices,
    per_pair_budget,
    promoted,
    top,
)
from .inside_llm import TEXT_AFTER_VISUAL, Stage, check_layers, scaled_layer

TAU = 0.8  # static threshold on a position's mean pairwise cosine across a segment's frames
SEGMENT_RATIO = 0.25  # temporal_segment_ratio: DPC-KNN clusters per frame in the temporal segmentation
KNN = 7  # k nearest neighbours of the DPC-KNN density, temporal and spatial
ALPHA = 0.4  # share of the visual tokens the LLM stage keeps
LLM_LAYER, LLM_LAYERS = 11, 32  # the first layer without the pruned tokens, of PLLaVA-7B's 32


def dpc_knn(x: torch.Tensor, num_clusters: int, k: int = KNN) -> torch.Tensor:
    """Centre (row index) of each of the n rows of x (n, C): DPC-KNN clustering into num_clusters clusters."""
    centres, dist = density_peaks(x.float(), num_clusters, k)
    owner = centres[dist[:, centres].argmin(dim=1)]
    owner[centres] = centres
    return owner


def runs(labels: list) -> list[tuple[object, int, int]]:
    """Maximal runs of equal labels, as (label, start, end) with end exclusive."""
    out, start = [], 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            out.append((labels[start], start, i))
            start = i
    return out


def refine_clusters(labels: list[int]) -> list[int]:
    """PruneVid's refinement of frame clusters into contiguous segments: each cluster keeps its longest run(s) of
    frames (none if they are single frames); every other run joins the longer neighbouring run (left on ties)."""
    longest: dict[int, int] = {}
    for label, start, end in runs(labels):
        longest[label] = max(longest.get(label, 0), end - start)
    refined: list = list(labels)
    for label, start, end in runs(labels):
        if longest[label] == 1 or end - start < longest[label]:
            refined[start:end] = [None] * (end - start)
    i = 0
    while i < len(refined):
        if refined[i] is not None:
            i += 1
            continue
        start = i
        while i < len(refined) and refined[i] is None:
            i += 1
        left = right = 0
        if start > 0:
            while start - left - 1 >= 0 and refined[start - left - 1] == refined[start - 1]:
                left += 1
        if i < len(refined):
            while i + right < len(refined) and refined[i + right] == refined[i]:
                right += 1
        if left == right == 0:  # no neighbours: the whole video is one segment
            label = 0
        else:
            label = refined[start - 1] if left >= right else refined[i]
        refined[start:i] = [label] * (i - start)
    return refined


def temporal_segments(tokens: VisualTokens) -> list[list[int]]:
    """Pair indices of each segment: DPC-KNN over the pairs' mean tokens, refined into contiguous runs, then split
    where the grid changes."""
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    means = torch.stack([tokens.features[s : s + n].float().mean(dim=0) for s, n in zip(starts, sizes)])
    labels = dpc_knn(means, max(1, int(len(sizes) * SEGMENT_RATIO))).tolist()
    segments = []
    for _, start, end in runs(refine_clusters(labels)):
        grids = [tokens.grids[p] for p in range(start, end)]
        segments += [list(range(start + a, start + b)) for _, a, b in runs(grids)]
    return segments


def position_block(frames: torch.Tensor) -> int:
    """Positions of frames (W, L, D) worked on at once, max(1, L // W): a block holds at most L tokens of the
    W frames (W tokens where W > L)."""
    return max(1, frames.shape[1] // frames.shape[0])


def static_similarity(frames: torch.Tensor) -> torch.Tensor:
    """(L,) mean cosine between the tokens at each position over all pairs of distinct frames; frames: (W, L, D),
    normalised in float32 one block of positions at a time (`position_block`)."""
    w, b = frames.shape[0], position_block(frames)
    sims = []
    for p in range(0, frames.shape[1], b):
        total = F.normalize(frames[:, p : p + b].float(), dim=-1).sum(dim=0)
        sims.append(((total * total).sum(dim=-1) - w) / (w * (w - 1)))
    return torch.cat(sims)


def position_means(frames: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(n, D) float32 means over the W frames of frames (W, L, D) of the tokens at each of `positions` (n,),
    one block of positions at a time (`position_block`)."""
    b = position_block(frames)
    return torch.cat([frames[:, positions[p : p + b]].float().mean(dim=0) for p in range(0, len(positions), b)])


def segment_frames(tokens: VisualTokens, segment: list[int]) -> torch.Tensor:
    """(W, L, D) tokens of the W consecutive pairs of a segment (same grid): a view of the features."""
    start, length = tokens.pair_starts[segment[0]], tokens.pair_sizes[segment[0]]
    frames = tokens.features[start : start + len(segment) * length]
    return frames.view(len(segment), length, -1)


def static_counts(tokens: VisualTokens, segments: list[list[int]], keep: int) -> tuple[list[int], list]:
    """How many positions of each segment are static, and each segment's (L,) position similarities (None for a
    single pair): positions above TAU, merged most similar first while the token count stays at least `keep`, at
    least one position per segment stays dynamic, and groups do not outnumber `keep`. Each rule, once it refuses
    a segment's position, refuses its later ones, so a segment's static positions are its most similar ones (ties:
    the lower position). One host sync reads every segment's similarities."""
    sizes = tokens.pair_sizes
    sims = [static_similarity(segment_frames(tokens, seg)) if len(seg) > 1 else None for seg in segments]
    read = [sim for sim in sims if sim is not None]
    values, offset, candidates = torch.cat(read).tolist() if read else [], 0, []
    for s, sim in enumerate(sims):
        if sim is not None:
            segment = values[offset : offset + len(sim)]
            candidates += [(v, s, pos) for pos, v in enumerate(segment) if v > TAU]
            offset += len(sim)
    counts = [0] * len(segments)
    count, groups = sum(sizes), len(sizes)  # tokens, and clustering groups (one per pair, one per static group)
    for _, s, _ in sorted(candidates, key=lambda c: (-c[0], c[1], c[2])):
        saved, new_group = len(segments[s]) - 1, int(not counts[s])
        if counts[s] + 1 < sizes[segments[s][0]] and count - saved >= keep and groups + new_group <= keep:
            counts[s] += 1
            count, groups = count - saved, groups + new_group
    return counts, sims


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    check_keep(tokens.pair_sizes, keep)
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    device = tokens.features.device
    segments = temporal_segments(tokens)
    # clustering groups: (frames (W, L, D), positions (n,) of its items in them, member tokens (n, W) of each item,
    # the first its destination); an item's features, the float32 mean of its position over the W frames (a static
    # token: W pairs of the segment; a dynamic one: its own pair), are made when the group is clustered, so that one
    # group's are held at a time
    groups = []
    for seg, count, sim in zip(segments, *static_counts(tokens, segments, keep)):
        first, length = starts[seg[0]], sizes[seg[0]]
        is_static = torch.zeros(length, dtype=torch.bool, device=device)
        if count:
            # in position order (as the reference's masked_select), for the index tie-break
            positions = top(sim, count).sort().values
            is_static[positions] = True
            members = first + positions[:, None] + length * torch.arange(len(seg), device=device)
            groups.append((segment_frames(tokens, seg), positions, members))
        dynamic = torch.sort(is_static, stable=True).indices[: length - count]  # the other positions, in order
        for p in seg:
            groups.append((segment_frames(tokens, [p]), dynamic, starts[p] + dynamic[:, None]))
    assignment = torch.arange(tokens.features.shape[0], device=device)
    for (frames, positions, members), k in zip(groups, per_pair_budget([len(m) for *_, m in groups], keep)):
        if k == len(members):
            owner = torch.arange(len(members), device=device)
        else:
            owner = dpc_knn(position_means(frames, positions), k)
        assignment[members] = members[owner, :1].expand_as(members)
    return Compression(assignment)


def stages(
    num_layers: int, visual: int, retention: float, layers: list[int] | None = None, first_layer: int = 0
) -> list[Stage]:
    """The LLM stage: from layer round(11 L / 32) (or `layers`) on, the floor(max(0.4, R) n) of the
    `visual` tokens most attended by the text after the video (the paper's share; R where larger, so
    that R = 1 keeps every token). The vision side is sized for the layer-averaged R
    (`inside_llm.entering_tokens`)."""
    (layer,) = layers or [scaled_layer(LLM_LAYER, LLM_LAYERS, num_layers, first_layer)]
    check_layers([layer], num_layers, first_layer)
    keep = min(visual, max(1, math.floor(max(ALPHA, retention) * visual + 1e-9)))
    return [Stage(layer, keep, rank_by=TEXT_AFTER_VISUAL)]


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """One clustering group or block of positions at a time: a block of at most one pair's tokens (a
    segment's W tokens of one position where W is larger) gathered and promoted to float32, the group's
    float32 features (at most a pair's), and 3 float32 matrices over the largest pair (density peaks)."""
    block = max(max(sizes), len(sizes))
    return block * width * b + promoted(block, width, b) + max(sizes) * width * F32 + pair_matrices(sizes, 3)


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=2)
