"""HoliTom (Shao et al., NeurIPS 2025): outer-LLM merging on Qwen's merged tokens, pairs as frames; inner-LLM merging.

As the paper states it, HoliTom merges video tokens before the LLM in three steps:

1. Global redundancy-aware temporal segmentation: a token position is static over a window of
   frames [s, e] when each step's cosine similarity of the position's tokens exceeds tau; merging
   the window saves (e - s) tokens per static position. Dynamic programming over all frames picks
   the windows that save the most tokens in total (a frame may stand alone).
2. Spatio-temporal merging: in each window, a static position's tokens are merged over time into
   one token; the other (dynamic) tokens stay per frame.
3. Spatial merging to the budget, at the retention that remains after step 2: each frame's dynamic
   tokens keep those that received the most attention in the vision encoder (VisionZip's dominant
   tokens; the released setting has no contextual share, D = 0); a window's static tokens are
   clustered by DPC-kNN (centres: highest local density x distance to a denser token, over the
   k = min(7, centres) nearest neighbours), each merged into its nearest centre.

A static position's feature is the temporal mean of its tokens over the window (llava_arch.py:303).
A cluster's feature is beta c + (1 - beta) mean(m), beta = 0.6, with c the centre's temporal mean and
mean(m) the mean of the temporal means of the m >= 1 positions merged into it; a centre that gathers
none stays as it is (`merge_tokens_by_clustering`, llava_arch.py:127-146, its default branch, the
released scripts not setting NO_BETA). In `Compression.weights`: each of a centre's L window tokens
weighs beta / L (1 / L alone), each token of a merged position (1 - beta) / (m L); a dynamic token
is kept as it is (D = 0: no contextual merge).
Tau follows the released scripts, which set it by RETAIN_RATIO, the share of the video tokens that
enter the LLM (keep / N here; with the inner stage, above the layer-averaged R): 0.65 at 0.10, 0.8 at
0.15, 0.20 and 0.25 (scripts/eval_ov-7b_holitom.sh:2-74; 0.8 at 0.15 in eval_ov-72b_holitom.sh and
eval_vid-7b_holitom.sh). Between and beyond those the nearest setting's tau is used: 0.65 where
keep < N / 8, else 0.8.

Paper: K. Shao, K. Tao, C. Qin, H. You, Y. Sui, H. Wang, "HoliTom: Holistic Token Merging for Fast
Video Large Language Models", NeurIPS 2025, arXiv:2505.21334.
Code: github.com/cokeshao/HoliTom, read at commit e9b2972: holitom/llava_arch.py
(`select_static_windows`, `get_static_dynamic_features`, `holitom`, `merge_tokens_by_attention_density`,
`merge_tokens_by_density`, `cluster_dpc_knn`, `merge_tokens_by_clustering`), the attention of
LLaVA-NeXT/llava/model/multimodal_encoder/siglip_encoder.py (last layer, mean over heads and
queries), scripts/eval_ov-7b_holitom.sh (T by RETAIN_RATIO) and the defaults of llava_arch.py:350-355
(beta = 0.6, D = 0, K = 7, MAX_WINDOW_SIZE 1024).

Cost: the reference normalises every token of the video at once for its frame similarities (a copy of
all N x D features in their dtype, llava_arch.py:377-380) and gathers each window's static and dynamic
features (:298-301). Here no copy of all N tokens is made: each pair's rows are promoted to float32 and
normalised as the step similarities read them (two pairs' unit rows held at a time), and a window's
static chains are averaged `CHAIN_TOKENS` tokens at a time (the same float32 means), so the extra
memory is a few pairs' float32 rows and the DPC-kNN matrices over a window's m <= n static positions
(m^2): about 72 MiB at most at 128 frames of Qwen2.5-VL-7B (N = 46,080 tokens of 3,584 in float32,
where one float32 copy of them is 630 MiB). Host syncs: 2 (see `redundancy_gains`, `compress`).

Deviations from the reference:

- Inner-LLM merging (`stages`, holitom/modeling_qwen2.py of the code, HOLITOM_k = 18 of
  LLaVA-OneVision-7B's 28 layers, HOLITOM_r = 0.5): before layer K the visual tokens are ranked by
  the last token's attention in layer K - 1 (mean over heads), the top round((1 - r) n) stay, and
  each other one is averaged into its most cosine-similar kept token, (kept + dropped) / 2 in token
  order, as the reference loops. Here K is at the same relative depth, round(18 L / 28) (8 of the
  tiny 12), after Qwen3-VL's deepstack layers, or at `prune_layers`; kept tokens keep their
  original M-RoPE positions (the reference's positions are the kept indices too).
- Budget: the retention R is layer-averaged over both stages (docs/budget.md). The inner stage
  keeps its paper share (or R of the tokens where R is larger, so that R = 1 keeps every token), and
  the outer stage keeps the most tokens that leave the layer average within R
  (`inside_llm.entering_tokens`).
- Budget: the reference keeps ceil(r' n) of each frame's dynamic tokens and round(r' m) of a
  window's m static tokens, r' = R N / (N - saved). Here `keep` is apportioned over these sets in
  proportion to their sizes (largest remainder), at least one token to each pair's dynamic set, so
  exactly `keep` tokens are kept.
- When step 2 alone leaves fewer than `keep` tokens (the reference then caps r' at 1 and keeps
  fewer), the least redundant static positions (lowest similarity along the window) return to the
  dynamic set until at least `keep` remain; so keep == N keeps every token.
- At least one token per pair: a window whose static positions cover some pair returns its least
  redundant static position to the dynamic set (in the reference such frames keep no token).
- Pairs of different grids (a plan resized them) have no common positions: each token of the
  earlier pair is followed to its most cosine-similar token of the later pair, a token of the later
  pair taking only its most similar follower (ties to the lower index); equal grids compare
  positions as in the reference.
- A static cluster sits at its centre's token in the window's first pair (the reference puts
  static tokens with the window's first frame).
- Salience: `received_attention`, the same quantity as the reference (last ViT block, mean over
  heads and queries), per merged token (mean over its 4 patches) instead of 2x2-pooled.
- Windows unbounded (the reference's default MAX_WINDOW_SIZE 1024).
- Determinism: equal densities are ordered by token index (the reference adds uniform [0, 1e-6)
  noise, llava_arch.py:38-40); top-k ties go to the lower index.
- The reference is random where a window has one or two static centres: its DPC-kNN reads a density
  over k = min(K, centres) nearest positions, the position itself included (llava_arch.py:203,
  :36-37). With k = 1 every density is exp(-d^2) of a position's distance to itself, 0 up to
  cdist's rounding, so the noise (with that rounding) picks the densest position; it takes the
  largest distance (:44-45), so the top score, and is the centre (:48-49). With k = 2 a density
  depends only on the distance to the nearest other position, so two positions nearest to each
  other tie, and the noise decides which is a centre where only one of them is. Here such ties go
  to the lower index: with one centre and up to 25 positions (cdist's self-distances are then
  exactly 0) the first position is the centre.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .common import (
    DROPPED,
    F32,
    Compression,
    TokenCompressor,
    VisualTokens,
    check_keep,
    density_peaks,
    pair_matrices,
    promoted,
    top,
)
from .inside_llm import Stage, check_layers, scaled_layer

TAU = 0.8  # a position is static across a step when its tokens' cosine exceeds tau (scripts: RETAIN_RATIO >= 0.15)
TAU_LOW = 0.65  # the scripts' tau at RETAIN_RATIO = 0.10, used where keep < N / 8
BETA = 0.6  # a cluster centre's weight in its merged feature (llava_arch.py:352)
DENSITY_K = 7  # DPC-kNN neighbours, at most the number of centres (the token itself included)
INNER_LAYER, INNER_LAYERS = 18, 28  # HOLITOM_k of LLaVA-OneVision-7B's 28 layers
INNER_MERGE = 0.5  # HOLITOM_r: the share of the visual tokens merged away at the inner stage
CHAIN_TOKENS = 4096  # static-chain tokens gathered at once for their temporal means (56 MiB of float32 at D = 3,584)


@dataclass
class Window:
    """Pairs first..last merged together; chains (c, L): global indices of each static position's tokens, one per
    pair (rows in the first pair's token order)."""

    first: int
    last: int
    chains: torch.Tensor


def step_matches(tokens: VisualTokens, feats: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each step p -> p + 1: (n_p,) index of each token's follower in pair p + 1 and (n_p,) their cosine,
    -inf where a token has no follower. Each pair's rows of `feats` (N, D) are promoted to float32 and
    normalised as they are read: two pairs' unit rows are held at a time, never all N."""
    starts, sizes, steps, device = tokens.pair_starts, tokens.pair_sizes, [], feats.device

    def unit(p: int) -> torch.Tensor:  # pair p's float32 unit rows, (n_p, D)
        return F.normalize(feats[starts[p] : starts[p] + sizes[p]].float(), dim=-1)

    # the steps are views of two (N,) tensors made first: nothing kept is allocated between a step's large
    # temporaries (on the CPU, small results kept between them left glibc's heap holding the freed pairs'
    # pages: about 1 GB resident at 128 frames)
    followers = torch.empty(feats.shape[0], dtype=torch.long, device=device)
    cosines = torch.empty(feats.shape[0], device=device)
    b = unit(0)
    for p in range(len(sizes) - 1):
        a, b = b, unit(p + 1)
        follower, similarity = followers[starts[p] : starts[p] + sizes[p]], cosines[starts[p] : starts[p] + sizes[p]]
        if tokens.grids[p] == tokens.grids[p + 1]:
            torch.arange(sizes[p], out=follower, device=device)
            torch.sum(a * b, dim=-1, out=similarity)
        else:
            torch.max(a @ b.T, dim=1, out=(similarity, follower))
            # most similar first (ties: lower index), a follower goes to the first token that reaches it
            rank = torch.empty_like(follower)
            rank[torch.sort(similarity, descending=True, stable=True).indices] = torch.arange(sizes[p], device=device)
            first = torch.full((sizes[p + 1],), sizes[p], device=device).scatter_reduce_(0, follower, rank, "amin")
            similarity.masked_fill_(rank != first[follower], -math.inf)
        steps.append((follower, similarity))
    return steps


def static_threshold(keep: int, num_tokens: int) -> float:
    """tau of the released setting whose RETAIN_RATIO is nearest keep / N: 0.65 (at 0.10) below 1 / 8, else 0.8."""
    return TAU_LOW if 8 * keep < num_tokens else TAU


def redundancy_gains(steps, sizes: list[int], tau: float) -> list[list[int]]:
    """gain[s][e]: tokens saved by merging window [s, e] over time, (e - s) x its static positions (cosine > tau).
    The chains from every pair are followed together, one step at a time; one host sync reads the gains."""
    num_pairs = len(sizes)
    if num_pairs == 1:
        return [[0]]
    device = steps[0][1].device
    static = torch.zeros(num_pairs, num_pairs, dtype=torch.long, device=device)  # static[s, e]: static positions
    position = torch.zeros(0, dtype=torch.long, device=device)  # each chain's token in the current pair
    strength = torch.zeros(0, device=device)  # each chain's lowest similarity so far
    origin = torch.zeros(0, dtype=torch.long, device=device)  # the pair each chain starts from
    for e in range(1, num_pairs):
        new = sizes[e - 1]  # the chains starting at pair e - 1
        position = torch.cat([position, torch.arange(new, device=device)])
        strength = torch.cat([strength, torch.full((new,), math.inf, device=device)])
        origin = torch.cat([origin, torch.full((new,), e - 1, device=device)])
        follower, similarity = steps[e - 1]
        strength = torch.minimum(strength, similarity[position])
        position = follower[position]
        static[:, e].index_add_(0, origin, (strength > tau).long())
    pairs = torch.arange(num_pairs, device=device)
    return (static * (pairs[None, :] - pairs[:, None]).clamp(min=0)).tolist()


def temporal_segments(gain: list[list[int]]) -> list[tuple[int, int]]:
    """Windows (first, last) that save the most tokens in total, by dynamic programming over the pairs."""
    num_pairs = len(gain)
    best, start = [0] * num_pairs, [0] * num_pairs
    for i in range(num_pairs):
        best[i], start[i] = (best[i - 1] if i > 0 else 0), i
        for j in range(i - 1, -1, -1):  # window [j, i], shortest first; a longer one must save strictly more
            value = (best[j - 1] if j > 0 else 0) + gain[j][i]
            if value > best[i]:
                best[i], start[i] = value, j
    windows, i = [], num_pairs - 1
    while i >= 0:
        windows.append((start[i], i))
        i = start[i] - 1
    return windows[::-1]


def follow(tokens: VisualTokens, steps, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chains from each token of pair `first` to pair `last` > first: (n, L) global indices, (n,) strength (the
    lowest similarity along the chain)."""
    starts, size = tokens.pair_starts, tokens.pair_sizes[first]
    device = steps[first][1].device
    position = torch.arange(size, device=device)
    path, strength = [position + starts[first]], torch.full((size,), math.inf, device=device)
    for p in range(first, last):
        follower, similarity = steps[p]
        strength = torch.minimum(strength, similarity[position])
        position = follower[position]
        path.append(position + starts[p + 1])
    return torch.stack(path, dim=1), strength


def released_counts(strengths: list[list[float]], spans: list[int], smallest: list[int], num_tokens: int, keep: int):
    """How many of each window's static chains (their strengths; -inf: not static) return to the dynamic set, the
    weakest first (ties: the lower row): until each of the window's pairs has a token outside the chains (at most
    its `smallest` pair's size - 1 chains), then the globally weakest (ties: earlier window, lower row) until
    temporal merging leaves at least `keep` tokens (a window's chain had saved `spans` tokens)."""
    weakest = [sorted((s, row) for row, s in enumerate(w) if s != -math.inf) for w in strengths]
    released = [max(0, len(w) - (n - 1)) for w, n in zip(weakest, smallest)]
    left = num_tokens - sum(span * (len(w) - r) for w, span, r in zip(weakest, spans, released))
    remaining = sorted((s, k, row) for k, (w, r) in enumerate(zip(weakest, released)) for s, row in w[r:])
    for _, k, _ in remaining:
        if left >= keep:
            break
        released[k] += 1
        left += spans[k]  # a chain of L tokens had become one
    return [len(w) for w in weakest], released


def apportion(total: int, sizes: list[int], floors: list[int]) -> list[int]:
    """Split `total` in proportion to sizes (largest remainder), each share within [floor, size]."""
    whole = sum(sizes)
    quota = [total * s / whole for s in sizes]
    share = [min(s, max(f, int(q))) for s, f, q in zip(sizes, floors, quota)]
    order = sorted(range(len(sizes)), key=lambda i: quota[i] - int(quota[i]), reverse=True)
    given = sum(share)
    while given < total:
        for i in order:
            if share[i] < sizes[i] and given < total:
                share[i], given = share[i] + 1, given + 1
    while given > total:
        for i in reversed(order):
            if share[i] > floors[i] and given > total:
                share[i], given = share[i] - 1, given - 1
    return share


def chain_means(feats: torch.Tensor, chains: torch.Tensor) -> torch.Tensor:
    """The float32 temporal mean of each chain's tokens: `chains` (c, L) indices into `feats` (N, D), the
    tokens gathered and promoted CHAIN_TOKENS at a time (a window's chains can span most of the video); (c, D)."""
    rows = max(1, CHAIN_TOKENS // chains.shape[1])
    return torch.cat([feats[block].float().mean(dim=1) for block in chains.split(rows)])


def merge_static(
    window: Window, feats: torch.Tensor, count: int, assignment: torch.Tensor, weights: torch.Tensor
) -> None:
    """Cluster the window's static chains (features: their temporal mean) to `count` centres; every chain
    joins its nearest centre (ties: the lower index), whose first-pair token is the destination, and the
    weights give the cluster beta c + (1 - beta) x the mean of the merged chains' means (c alone if none).
    count == 0 leaves them all dropped."""
    if count == 0:
        return
    means = chain_means(feats, window.chains)
    centres, dist = density_peaks(means, count, min(DENSITY_K, count))
    centres = centres.sort().values  # the reference sorts the centres before matching to them
    nearest = centres[dist[:, centres].argmin(dim=1)]
    nearest[centres] = centres
    assignment[window.chains] = window.chains[nearest, :1]
    rows = torch.arange(len(nearest), device=nearest.device)
    # chains merged into each centre, float64 as the weights
    merged = torch.zeros(len(nearest), dtype=weights.dtype, device=weights.device)
    merged = merged.index_add_(0, nearest, torch.ones_like(merged)) - 1
    # beta in the weights' own dtype (float64): torch.where(mask, BETA, 1.0) would make a float32 tensor, and
    # its 0.6000000238 would enter every centre's weight
    beta = torch.tensor(BETA, dtype=weights.dtype, device=weights.device)
    chain_weight = torch.where(
        nearest == rows,
        torch.where(merged > 0, beta, torch.ones_like(beta)),
        (1 - beta) / merged[nearest].clamp(min=1),
    )
    length = window.chains.shape[1]
    weights[window.chains] = (chain_weight / length)[:, None].expand(-1, length)


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    if tokens.received_attention is None:
        raise ValueError("holitom needs the attention received in the last ViT block")
    check_keep(tokens.pair_sizes, keep)
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    feats = tokens.features  # no float32 copy: each pair's rows, each block of static chains promoted as read
    device = feats.device
    attention = tokens.received_attention.to(device).float()
    steps = step_matches(tokens, feats)
    tau = static_threshold(keep, feats.shape[0])

    # 1. global redundancy-aware temporal segmentation (one host sync)
    segments = [(s, e) for s, e in temporal_segments(redundancy_gains(steps, sizes, tau)) if e > s]
    # 2. static chains of each window: all chains' strengths read at once (one host sync), -inf where not static;
    # the chains released to the dynamic set follow on the host, the weakest of each window
    paths, marked = [], []
    for s, e in segments:
        path, strength = follow(tokens, steps, s, e)
        paths.append(path)
        marked.append(strength.masked_fill(~(strength > tau), -math.inf))
    flat = torch.cat(marked).tolist() if marked else []
    bounds = [0]
    for path in paths:
        bounds.append(bounds[-1] + len(path))
    static_counts, released = released_counts(
        [flat[a:b] for a, b in zip(bounds, bounds[1:])],
        [e - s for s, e in segments],
        [min(sizes[s : e + 1]) for s, e in segments],
        feats.shape[0],
        keep,
    )
    windows, is_static = [], torch.zeros(feats.shape[0], dtype=torch.bool, device=device)
    for (s, e), path, strength, count, gone in zip(segments, paths, marked, static_counts, released):
        weakest_first = torch.sort(strength.masked_fill(strength == -math.inf, math.inf), stable=True).indices
        window = Window(s, e, path[weakest_first[gone:count].sort().values])
        is_static[window.chains.flatten()] = True
        windows.append(window)

    # 3. spatial merging: keep apportioned over each pair's dynamic tokens and each window's static chains
    chain_count = {p: len(w.chains) for w in windows for p in range(w.first, w.last + 1)}
    dynamic = [sizes[p] - chain_count.get(p, 0) for p in range(len(sizes))]
    share = apportion(keep, dynamic + [len(w.chains) for w in windows], [1] * len(dynamic) + [0] * len(windows))

    assignment = torch.full((feats.shape[0],), DROPPED, dtype=torch.long, device=device)
    weights = torch.ones(feats.shape[0], dtype=torch.float64, device=device)  # a dynamic token is kept as it is
    salience = attention.masked_fill(is_static, -math.inf)  # a pair's static tokens rank after its dynamic ones
    for start, size, count in zip(starts, sizes, share):
        chosen = start + top(salience[start : start + size], count)
        assignment[chosen] = chosen
    for w, count in zip(windows, share[len(dynamic) :]):
        if len(w.chains):
            merge_static(w, feats, count, assignment, weights)
    return Compression(assignment, weights)


def stages(
    num_layers: int, visual: int, retention: float, layers: list[int] | None = None, first_layer: int = 0
) -> list[Stage]:
    """The inner-LLM merging: from layer round(18 L / 28) (or `layers`) on, round(max(0.5, R) n) of
    the `visual` tokens, the others merged into them (the paper's share; R where larger, so that
    R = 1 keeps every token). The outer stage is sized for the layer-averaged R
    (`inside_llm.entering_tokens`)."""
    (layer,) = layers or [scaled_layer(INNER_LAYER, INNER_LAYERS, num_layers, first_layer)]
    check_layers([layer], num_layers, first_layer)
    keep = min(visual, max(1, round(visual * max(1 - INNER_MERGE, retention))))
    return [Stage(layer, keep, merge=True)]


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """Float32 working copies of a few pairs' tokens, never all N: the step similarities hold two pairs'
    unit rows and their product (and a pair's promoted rows for half-precision features); a window's
    static chains are averaged CHAIN_TOKENS tokens at a time (gathered, then promoted), then clustered:
    their means (at most a pair's positions) and three float32 matrices over them (density peaks)."""
    pair = max(sizes) * width * F32
    steps = 3 * pair + promoted(max(sizes), width, b)
    block = min(CHAIN_TOKENS, sum(sizes)) * width * (F32 + (b if b != F32 else 0))
    return max(steps, block + pair + pair_matrices(sizes, 3))


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=2, reads_attention=True)
