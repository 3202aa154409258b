"""PruMerge+ (Shang et al., "LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large Multimodal
Models", ICCV 2025; the "+" variant) on Qwen's merged video tokens, per frame pair.

Reference: 42Shawn/LLaVA-PruMerge@097c041, `llava/model/multimodal_encoder/clip_encoder.py`,
`token_prune_merge_advanced_plus` (lines 174-281), which `forward` calls with `if_adaptive=True`
(line 300; README step 2 switches between PruMerge and PruMerge+ there). Per image (CLIP ViT-L/14-336,
N = 576 patches):
- attention: the [CLS] row of one single-head attention over the whole width, built from the last
  layer's (`layers[23]`, lines 182-183) q_proj and k_proj outputs, softmax(q k^T / sqrt(C)), without
  the [CLS] column (lines 198-201);
- IQR outliers (`outlier_dectection`, lines 34-47): the values above Q3 + 1.5 IQR (numpy's linear
  percentiles, in float32); ratio = outliers / N; the `int(N * ratio)` highest-attention patches are
  kept (line 205; that float product is one less than the count for some counts);
- spatial samples (lines 208-214): stride = int(int(1 / ratio) / 3), the flat indices
  `arange(0, 575, stride)` that are not already kept are appended (about three samples per outlier);
- merging (lines 229-276): for each kept patch, its 32 most cosine-similar patches among all the
  others (kept or not), on L2-normalised keys (the k_proj output, all heads concatenated); the kept
  feature becomes x_i + sum_j a_j x_j over those 32, with a_j their [CLS] attention (unnormalised:
  the division is commented out at line 274); every centre is updated from the original features;
- one extra token, sum_j a_j x_j over all patches that were not kept, is appended (lines 278-280);
- the kept tokens go to the projector in the order [outliers by attention, samples by index, extra].

Here, per frame pair (a pair plays the image) of n tokens with budget k:
- attention a: the pair's `received_attention` divided by its sum over the pair (so it sums to 1
  over the pair's tokens, as the [CLS] row does over the patches up to [CLS]'s own share);
- o = int(n * ratio) IQR outliers and the stride exactly as above, with n - 1 for 575; the
  reference's own count is K_ref = o + the samples (`reference_count`);
- matched budget: the top o_k = min(o, max(1, round(k o / K_ref))) tokens by attention (the
  reference's outlier share; all o when k >= K_ref; 0 without outliers), and m = k - o_k samples: the
  grid tokens `arange(0, n - 1, stride)` that are not kept outliers, thinned evenly to m when the grid
  holds more (the j-th of m is the floor(j c / m)-th of its c tokens); when it holds fewer, the same
  thinning over every token that is not a kept outlier. At k = K_ref this is the reference's
  selection exactly (`tests/test_fidelity_prumerge_plus.py`);
- merging: a token that is not kept joins the kept token that has it among its 32 most similar
  (cosine of `keys`, ties to the lower index) and is the most similar to it of those (ties to the
  lower kept index), with weight a_j; the kept token has weight 1. So a group's feature is
  x_i + sum_j a_j x_j, the reference's formula over its members (deepstack features likewise).
Exactly `keep` groups: `per_pair_budget` splits floor(R N) over pairs (at least one each) and each
pair keeps exactly o_k + m = k tokens. Defaults (the reference's constants): 1.5 IQR, stride divisor
3, 32 neighbours. `seed` is unused (PruMerge+ is deterministic).

Deviations, each for a reason:
- Qwen has no [CLS] token: a token's importance is the attention its patches receive in the last
  ViT block (`received_attention`: mean over heads and query patches, then over the merge unit's 4
  patches), normalised over the pair to be a distribution as the [CLS] row is. The reference's
  attention is also the last layer's, and so are our keys (head mean of the key projection before
  rotary, then the merge unit's mean, where the reference concatenates the heads of k_proj):
  `VisualTokens.keys` is what the tower exposes.
- Budget: the reference's count is adaptive (K_ref per image); here every method keeps floor(R N),
  split over pairs, so K_ref is replaced by k and the outliers keep their share o / K_ref of it (at
  least one where there are outliers, at most the o outliers); samples are thinned or, beyond the
  grid, spread over all the other tokens. Where the reference fails we continue: no outlier (1 / 0,
  e.g. uniform attention) gives k even samples; fewer than 33 tokens (`topk(32)`) use n - 1
  neighbours; the stride is clamped to at least 1 (an `arange` step of 0 needs o > n / 3, which
  values above Q3 + 1.5 IQR never reach).
- Merge: a `Compression` is a partition, so each token is in one group. The reference adds a
  neighbour to every kept token whose 32 it is among, adds kept neighbours (a_j x_j) too, and
  appends the extra token (sum of a_j x_j over the unkept tokens, without an M-RoPE position and
  outside the budget). Here a kept token is never added to another, an unkept token is added once
  (to its most similar claiming kept token), an unkept token no kept token claims is dropped, and
  there is no extra token. The test checks exactly this difference against the reference's centres.
- Features: the merger's output (the LLM's input), where the reference merges layer -2 CLIP features
  before its projector: every compressor here acts after Qwen's merger.
- Training: the authors evaluate LLaVA-1.5 LoRA checkpoints finetuned with PruMerge+ (README step
  1; the non-adaptive branch, lines 216-227, is for that training); the Qwen backbones here are not
  finetuned, as for every baseline.
- Order: kept tokens stay in place with their own M-RoPE positions (the reference orders them
  outliers first, then samples, on 1-D positions). Ties go to the lower index (stable sorts; the
  reference's `topk` leaves them open).

Cost (reference on one image of N tokens, K kept, D feature width, d key width; ours on P pairs):
- Reference: one Python iteration per kept token (about 12 kernels each), each concatenating the
  N - 1 other features (N D copies) and keys, one (1, N) similarity and a topk: O(K N (D + d)) time,
  O(N D) transient memory; host syncs per image: 1 (the `.cpu().numpy()` of the attention, line 35)
  plus one per grid index (`x not in original_tensor_1d` reads a bool, line 212) plus one per
  appended sample (`torch.tensor` of a list of 0-dim device tensors, line 212): about 1 + 6 o.
- Ours: per pair one sort of n attentions, a (k, n) key similarity in row blocks of 256 (O(k n d)
  time, O(min(k, 256) n) memory, about 11 bytes an entry: below the reference's per-iteration n D
  bfloat16 copy for D >= 1280), no feature copies (the weighted sum is `merge_groups`' O(N D));
  about 40 kernels per pair plus about 10 per row block; 0 host syncs (every count stays a device
  scalar; `tests/test_fidelity_prumerge_plus.py` counts them). Measured (CPU, one thread, 8 pairs of
  576, D = 3584, d = 80, keep = the reference's 1359): the test's transcription of the reference's
  loop (it gathers the 32 members instead of concatenating all N - 1 features, so it is faster than
  the literal code) 0.61 s, ours 0.05 s plus 0.09 s in `merge_groups`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, F32, Compression, TokenCompressor, VisualTokens, by_mask, per_pair_budget, top

IQR_FACTOR = 1.5  # clip_encoder.py:42, upper_bound = Q3 + 1.5 * IQR
STRIDE_DIVISOR = 3  # clip_encoder.py:210, int(step_length / 3)
NEIGHBOURS = 32  # clip_encoder.py:268, topk(cos_sim_matrix, k=int(32))
ROWS = 256  # kept tokens per similarity block (memory only; the result does not depend on it)


def percentile(ascending: torch.Tensor, q: float) -> torch.Tensor:
    """numpy's default (linear) percentile of sorted values, without reading them on the host."""
    at = q * (len(ascending) - 1)
    low = int(at)
    return torch.lerp(ascending[low], ascending[min(low + 1, len(ascending) - 1)], at - low)


def iqr_outliers(attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, ratio) as device scalars: ratio = share of values above Q3 + 1.5 IQR (float32, as
    `outlier_dectection`), o = int(n * ratio), the reference's top-k count (lines 204-205)."""
    n = len(attention)
    values = attention.float()
    ascending = torch.sort(values).values
    q1, q3 = percentile(ascending, 0.25), percentile(ascending, 0.75)
    ratio = (values > q3 + IQR_FACTOR * (q3 - q1)).sum().double() / n
    return torch.floor(n * ratio).long(), ratio


def sampling_stride(ratio: torch.Tensor, n: int) -> torch.Tensor:
    """int(int(1 / ratio) / 3) (lines 209-210), clamped to [1, n] (no outlier: 1 / 0 = inf, so
    the grid is token 0 alone)."""
    return torch.floor(torch.floor(1 / ratio) / STRIDE_DIVISOR).clamp(1, n).long()


def ceil_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.div(a + b - 1, b, rounding_mode="floor")


def evenly(candidates: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mask of `count` of the c candidates spread evenly: the floor(j c / count)-th for j < count
    (all of them when count = c); r is one iff some j lands on it: ceil((r+1) m/c) > ceil(r m/c)."""
    c = candidates.sum().clamp(min=1)
    r = torch.cumsum(candidates, 0) - 1
    return candidates & (ceil_div((r + 1) * count, c) > ceil_div(r * count, c))


def select(attention: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the k tokens a pair keeps: its top o_k IQR outliers and m = k - o_k grid samples."""
    n, device = len(attention), attention.device
    rank = torch.empty(n, dtype=torch.long, device=device)
    rank[top(attention, n)] = torch.arange(n, device=device)  # 0 = most attended, ties to the lower index
    outliers, ratio = iqr_outliers(attention)
    index = torch.arange(n, device=device)
    grid = (index % sampling_stride(ratio, n) == 0) & (index < n - 1)  # arange(0, 575, stride)
    reference_count = outliers + (grid & (rank >= outliers)).sum()  # lines 211-213: samples not in idx
    share = torch.round(k * outliers.double() / reference_count.clamp(min=1)).clamp(min=1).long()
    is_outlier = rank < torch.minimum(outliers, share)
    samples = k - is_outlier.sum()
    candidates = grid & ~is_outlier
    candidates = torch.where(candidates.sum() >= samples, candidates, ~is_outlier)
    return is_outlier | evenly(candidates, samples)


def most_similar(similarity: torch.Tensor, count: int) -> torch.Tensor:
    """Mask of each row's `count` highest entries, ties to the lower column (no full sort)."""
    bar = similarity.topk(count, dim=1).values[:, -1:]
    above, at = similarity > bar, similarity == bar
    room = count - above.sum(dim=1, keepdim=True)
    return above | (at & (torch.cumsum(at, dim=1, dtype=torch.int32) <= room))


def claiming_kept(keys: torch.Tensor, kept: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """For each token in `others`, the position in `kept` of the kept token that has it among its
    32 most similar keys (all tokens but itself, as lines 253-268) and is most similar to it
    (ties to the lower kept token); -1 where no kept token claims it."""
    n = len(keys)
    unit = F.normalize(keys.to(torch.promote_types(keys.dtype, torch.float32)), dim=-1)
    best = torch.full((len(others),), -torch.inf, dtype=unit.dtype, device=keys.device)
    owner = torch.full((len(others),), -1, dtype=torch.long, device=keys.device)
    for lo in range(0, len(kept), ROWS):
        rows = kept[lo : lo + ROWS]
        similarity = unit[rows] @ unit.T
        similarity[torch.arange(len(rows), device=keys.device), rows] = -torch.inf  # not its own neighbour
        claims = most_similar(similarity, min(NEIGHBOURS, n - 1))[:, others]
        value, row = torch.where(claims, similarity[:, others], -torch.inf).max(dim=0)
        better = value > best  # strict: an earlier block (lower kept token) keeps a tie
        owner = torch.where(better, row + lo, owner)
        best = torch.maximum(value, best)
    return owner


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    if tokens.received_attention is None or tokens.keys is None:
        raise ValueError("prumerge_plus needs the last ViT block's received attention and keys")
    budget = per_pair_budget(tokens.pair_sizes, keep)
    n, device = tokens.features.shape[0], tokens.features.device
    assignment = torch.full((n,), DROPPED, dtype=torch.long, device=device)
    weights = torch.ones(n, dtype=torch.float64, device=device)
    attention = tokens.received_attention.detach().to(device)
    keys = tokens.keys.detach().to(device)
    for start, size, k in zip(tokens.pair_starts, tokens.pair_sizes, budget):
        span = slice(start, start + size)
        a = attention[span].double() / attention[span].double().sum()  # the pair's "[CLS] row"
        others, kept = by_mask(select(a, k), k)
        assignment[start + kept] = start + kept
        if k == size:
            continue
        owner = claiming_kept(keys[span], kept, others)
        assignment[start + others] = torch.where(owner >= 0, start + kept[owner.clamp(min=0)], DROPPED)
        weights[start + others] = a[others]
    return Compression(assignment, weights)


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """Per pair: a block of at most 256 kept tokens' float32 key similarities to the pair's tokens."""
    return max(min(256, n) * n * F32 for n in sizes)


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=0, reads_attention=True)
