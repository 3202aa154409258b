"""VidCom2 (Liu et al., EMNLP 2025) on Qwen's merged video tokens, with frame pairs as frames.

VidCom2 ("Video Compression Commander") prunes video tokens in two stages. Frame Compression
Adjustment: a frame's uniqueness is minus the mean similarity of its tokens to the video's mean
token; a low-temperature softmax over the frames turns it into per-frame retention ratios
r_f = R (1 + sigma_f - mean(sigma)), so distinctive frames keep more tokens. Adaptive Token
Compression: inside each frame, keep the r_f share of tokens least similar to both the frame's mean
token and the video's mean token (the most unique ones); drop the rest.
In the public code the similarity is a multi-scale Gaussian kernel, sum over a in {1/8, 1/4, 1/2, 1, 2}
of exp(-|x - c|^2 / 2a), on the L2-normalised features restricted to the half of the channels with the
lowest variance over the video, c being the mean of those vectors over the frame or the whole video;
the softmax temperature is 0.01 and a frame keeps max(1, round(min(r_f, 1) * its tokens)).

Paper: "Video Compression Commander: Plug-and-Play Inference Acceleration for Video Large Language
Models", arXiv 2505.14454. Public code: github.com/xuyang-liu16/VidCom2,
token_compressor/vidcom2/vidcom2.py (its Qwen2.5-VL / Qwen3-VL hooks: token_compressor/vidcom2/models/).

Deviations from the reference:
- Frames are Qwen frame pairs (the reference's Qwen port also scores per temporally merged frame).
- Budgets sum to exactly keep = floor(R * N): pair f's quota is keep * s_f w_f / sum_g s_g w_g, with
  w_f = 1 + sigma_f - mean(sigma) and s_f its tokens (for equal pairs exactly the reference's
  R w_f s_f with R = keep / N); a quota above s_f is capped and the excess shared over the other pairs
  in proportion to their quotas (the reference clips it away); quotas become integers by floor plus
  largest remainder (ties, remainders equal to 9 decimals, to the earlier pair) instead of rounding
  each; a pair left with 0 gets 1, taken from the largest budget (the reference's max(1, .) adds it to
  the total instead).
- Pairs may differ in size (per-frame resolutions); the video mean is over all tokens.
- Scores in float64 (T = 0.01 magnifies float32 rounding of the frame uniqueness into the budgets);
  ties in channel variance or token score go to the lower index (the reference's topk leaves them
  unspecified).

Cost (N tokens, D wide, P pairs of at most n tokens): O(N D) time, as the reference's, in four passes
over the pairs (the channel means, their variance, the unit rows for the video's mean token, the
similarities); memory one pair at a time, never an N x D copy: a pair's float64 rows and their
deviations (2 n D x 8 bytes) and four N-vectors (`working_bytes`: 41 MiB at 64 pairs of 720 tokens,
D = 3,584). The reference batches all frames as (F, n, D/2) in the features' dtype: the gathered
channels, their unit rows, a difference to a centre and its square, up to 4 x N D/2 values at once
(630 MiB in bfloat16 at that size). Host syncs: 1 (the frame weights, read once), the reference 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, Compression, TokenCompressor, VisualTokens, check_keep

CHANNEL_FRACTION = 0.5  # share of channels kept for scoring: those of lowest variance
KERNEL_WIDTHS = (1 / 8, 1 / 4, 1 / 2, 1.0, 2.0)  # Gaussian kernel scales a
TEMPERATURE = 0.01  # softmax temperature of the frame uniqueness


def channel_variance(features: torch.Tensor, starts: list[int], sizes: list[int]) -> torch.Tensor:
    """Biased variance of each channel of features (N, D) over the video, (D,) float64: the mean, then
    the mean squared deviation from it, each summed one pair at a time (at most a pair's float64 rows
    and their deviations are held, never all N)."""
    pairs = [features[s : s + n] for s, n in zip(starts, sizes)]
    mean = sum(pair.double().sum(dim=0) for pair in pairs) / len(features)
    return sum((pair.double() - mean).square_().sum(dim=0) for pair in pairs) / len(features)


def scoring_channels(features: torch.Tensor, starts: list[int], sizes: list[int]) -> torch.Tensor:
    """Indices (D',) of the CHANNEL_FRACTION of channels of features (N, D) with the lowest variance
    over the video, ties to the lower index."""
    count = max(1, int(features.shape[1] * CHANNEL_FRACTION))
    return torch.sort(channel_variance(features, starts, sizes), stable=True).indices[:count]


def gaussian_similarity(x: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """Multi-scale Gaussian kernel between each row of x (n, D) and centre (D,), (n,)."""
    squared = (x - centre).square_().sum(dim=-1)
    return sum(torch.exp(-squared / (2 * a)) for a in KERNEL_WIDTHS)


def unit_rows(features: torch.Tensor, channels: torch.Tensor | slice) -> torch.Tensor:
    """Rows of features (n, D) on `channels`, in float64, L2-normalised, (n, D')."""
    return F.normalize(features[:, channels].double(), dim=-1)


def similarities(
    features: torch.Tensor, starts: list[int], sizes: list[int], channels: torch.Tensor | slice = slice(None)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's similarity to the video's mean token and to its frame's mean token, (N,) each, in
    float64, on the unit rows of features (N, D) over `channels` (`unit_rows`). The unit rows are made
    one pair at a time, twice (for the video's mean, then for the similarities to it): at most one
    pair's float64 rows and their differences to a mean are held, never all N."""
    pairs = [(s, s + n) for s, n in zip(starts, sizes)]
    video = sum(unit_rows(features[s:e], channels).sum(dim=0) for s, e in pairs) / features.shape[0]
    to_video, to_frame = [], []
    for s, e in pairs:
        unit = unit_rows(features[s:e], channels)
        to_video.append(gaussian_similarity(unit, video))
        to_frame.append(gaussian_similarity(unit, unit.mean(dim=0)))
    return torch.cat(to_video), torch.cat(to_frame)


def frame_weights(to_video: torch.Tensor, starts: list[int], sizes: list[int]) -> torch.Tensor:
    """Frame Compression Adjustment: w_f = 1 + sigma_f - mean(sigma), sigma = softmax(u / T) of the
    frame uniqueness u_f = -mean over the frame of the similarity to the video, (F,), in float64: with
    T = 0.01 the less unique frames' sigma is often below float32's resolution of 1 + sigma, and the
    budgets' largest remainders would then be decided by rounding instead of by sigma."""
    uniqueness = torch.stack([-to_video[s : s + n].mean() for s, n in zip(starts, sizes)]).double()
    sigma = F.softmax((uniqueness - uniqueness.max()) / TEMPERATURE, dim=0)
    return 1 + sigma - sigma.mean()


def frame_budgets(weights: torch.Tensor, sizes: list[int], keep: int) -> list[int]:
    """Tokens kept per frame, summing to keep: quotas keep * s_f w_f / sum(s w), capped at s_f with
    the excess shared over the uncapped frames, floor + largest remainder, then at least 1 each.
    The weights are read once (one host sync); the rest is host arithmetic in float64."""
    check_keep(sizes, keep)
    share = [w * n for w, n in zip(weights.double().tolist(), sizes)]
    capped = [False] * len(sizes)
    while True:
        free = keep - sum(n for n, c in zip(sizes, capped) if c)
        total = sum(x for x, c in zip(share, capped) if not c)
        quota = [n if c else free * x / total for n, x, c in zip(sizes, share, capped)]
        over = [not c and q > n for n, q, c in zip(sizes, quota, capped)]
        if not any(over):
            break
        capped = [c or o for c, o in zip(capped, over)]
    budget = [min(n, int(q)) for n, q in zip(sizes, quota)]
    # remainders equal in exact arithmetic (e.g. 1/3 of 4/3 and of 10/3 when sigma is one-hot) differ by
    # rounding: compare them to 9 decimals, so that such ties go to the earlier frame
    remainder = [round(q - b, 9) for q, b in zip(quota, budget)]
    for f in sorted(range(len(sizes)), key=lambda f: -remainder[f]):  # stable: earlier frame first
        if sum(budget) == keep:
            break
        if budget[f] < sizes[f]:
            budget[f] += 1
    for f in range(len(sizes)):
        if budget[f] == 0:
            budget[f] = 1
            budget[max(range(len(sizes)), key=lambda g: budget[g])] -= 1
    return budget


def unique_tokens(score: torch.Tensor, k: int) -> torch.Tensor:
    """Adaptive Token Compression: indices of the k lowest scores (most unique), ties to the lower index."""
    return torch.sort(score, stable=True).indices[:k]


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """Assignment (N,): each pair's most unique tokens keep themselves, the rest are dropped."""
    check_keep(tokens.pair_sizes, keep)
    n = tokens.features.shape[0]
    if keep == n:
        return Compression(torch.arange(n))  # cpu: a CPU Compression, moved by merge_groups
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    # float64: the frame weights' softmax at T = 0.01 turns score rounding into budget changes
    channels = scoring_channels(tokens.features, starts, sizes)
    to_video, to_frame = similarities(tokens.features, starts, sizes, channels)
    budget = frame_budgets(frame_weights(to_video, starts, sizes), sizes, keep)
    score = to_video + to_frame
    assignment = torch.full((n,), DROPPED, dtype=torch.long, device=score.device)
    for s, size, k in zip(starts, sizes, budget):
        kept = s + unique_tokens(score[s : s + size], k)
        assignment[kept] = kept
    return Compression(assignment)


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """One pair at a time: its float64 rows and their deviations from the video's mean (the channel
    variance; its unit rows on half the channels and their differences to a mean are no larger), and
    four 8-byte vectors over the N tokens (the two similarities, their sum, the assignment)."""
    return 2 * max(sizes) * width * 8 + 4 * sum(sizes) * 8


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=1)
