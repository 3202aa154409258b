"""V-CAST (Lin et al., "V-CAST: Video Curvature-Aware Spatio-Temporal Pruning for Efficient Video
Large Language Models", arXiv:2603.27650, 2026) on Qwen's merged video tokens, with frame pairs as
frames.

Reference: xinyouu/V-CAST@c235ef3 (its Qwen3-VL code), `compressor/v_cast/modeling_qwen3_vl_v_cast.py`:
- `:14-16` defaults: retain ratio 0.25, at least `min_k` = 1 token a frame, budget temperature 0.7
  (`compressor/v_cast/main.py:13` prints them: "budget=curvature/softmax@0.7 score=hybrid");
- `:131` a frame's representation: the mean of its tokens, L2-normalised (eps 1e-6);
- `:33-45` curvature of the trajectory of those representations: 1 - cos(v_in, v_out) with
  v_in = r_t - r_{t-1}, v_out = r_{t+1} - r_t (eps 1e-6); the first and last frames get 1;
- `:133` budget weights: softmax(curvature / 0.7) over the frames, in float32;
- `:135-139` the video's budget: round(R T n), within [1, T n], at least T min_k;
- `:48-111` per-frame budgets summing to it: min_k each, then floor(w_t * rest) more (w renormalised,
  capped at n - min_k); the tokens still left go, one at a time, to the frame of largest fractional
  part `raw - floor(raw)` (argmax, the first on ties) that is below its cap. That fractional part is
  not lowered when a frame receives a token (`:94-100`), so the frame with the largest one receives
  the whole remainder up to its cap, then the next (not largest-remainder rounding, which gives one
  to each). Where float32 rounding makes the floors exceed the budget, one token is taken back from
  each frame above min_k in ascending weight order until the sum is right (`:101-109`);
- `:156-164` within a frame: score = (1 - cos(token, frame representation)) + the token's L2 norm
  min-max normalised over the frame ((norm - min) / (max - min + 1e-6)), both in float32; the k
  highest, in original order (`topk` then `sort`); the others are dropped;
- `:166-171, 240-265` the kept tokens' features (and deepstack features) are gathered, nothing is
  merged; `:268-320` this runs on the vision tower's output, after the merger, for videos only
  (`grid_thw` t > 1); `:424-455` the dropped placeholders are removed from the ids, and the kept
  tokens keep their positions from the full sequence's `get_rope_index`.
The text query is not read.

Here: the same rule on the merged tokens of one video, a frame pair as a frame: per-pair
representations and curvature, softmax(curvature / 0.7) weights, the allocation above with total
`keep` and each pair's cap its own size, then each pair's top k by the hybrid score, in original
order, each a group of one (its own feature and M-RoPE position). `keep` is met exactly: the
reference's allocation always sums to its total (its floor-and-remainder step tops every pair up
to its cap in turn, and `keep` <= N), so its total is simply `keep` = floor(R N) instead of
round(0.25 T n); `keep` >= the number of pairs, so min_k = 1 always applies (one token a pair at
least). The reference's take-back step (`:101-109`) runs only where float32 rounding puts the
floors over the total, which needs (keep - P)(P + 2) >= 2^24 or so (P pairs); it takes at most one
token from each frame, so it could miss the total only when the floors are more than P tokens over,
which needs keep - P >= 2^24 or so: never at Qwen's sizes.
Defaults: temperature 0.7, min_k 1, the score's weights 1 and 1 (no setting beyond R).

Deviations, each for a reason:
- Budget: floor(R N) (`kept_count`) instead of round(R N) with R fixed at 0.25: every method here
  keeps floor(R N) so that the achieved R never exceeds the target.
- A one-pair video is compressed to `keep` (its budget all in that pair); the reference leaves a
  video with T = 1 uncompressed (`:230-238`), which would not meet the budget.
- Pairs may differ in size (the reference reshapes a video to (T, n, D)): each pair's cap is its
  own size and its representation the mean of its own tokens.
- Frame means, their normalisation, the cosines and the curvature are computed in float32 for
  bfloat16 or float16 features (float64 stays float64), where the reference computes them in the
  model's dtype: bfloat16 resolves 1 - cos only in steps of 2^-8 near a cosine of 1, and the
  differences of nearly equal frame representations lose most of their bits, which turns the
  curvature of slowly changing videos, and so the budgets, into rounding noise. The reference's own
  float32 steps (softmax, allocation, norms, score) are float32 here too. On bfloat16 features the
  kept tokens therefore differ slightly from the reference's (about 1% of them on random-walk test
  videos, 16 pairs x 360 tokens x 1,024 at R = 0.25); on float64 features they are equal (tested),
  on float32 features equal up to float32 near-ties (equal at every size measured).
- The cosine to the frame representation is one matrix-vector product divided by the token norms
  (`cosine_to`), where `F.cosine_similarity` first makes normalised (n, D) copies: equal up to
  rounding, without those copies. Each pair's mean is taken on its own (the reference: one mean
  over the (T, n, D) view), also equal up to rounding and, on CPU, several times faster.
- Ties go to the lower index: in the scores (the reference's `topk(sorted=False)` leaves them
  open), in the take-back order (the reference's unstable `argsort`; the first and last frames
  always have equal weights) and in the leftover order (`argmax` returns the first maximum, as here).
- Also on Qwen2.5-VL (no deepstack), whose merged tokens are in the same LLM order here; the
  reference patches Qwen3-VL only.
`seed` is unused (V-CAST is deterministic).

Cost. Reference, one video of T frames of n tokens (N = T n, width D, K kept): per frame a mean, a
cosine and a norm over its n D features (O(N D) in all), a top-k of n and a sort of k; memory O(n D)
at a time (a float32 copy of the frame for its norms, `F.cosine_similarity`'s two normalised (n, D)
copies in the model's dtype); host syncs per video: 3 reading the grid row (`:24-26`, `grid_thw`
is on the device) and 1 for `torch.any(...).item()` (`:307`), 3 in the allocation (`:73, 78, 90`),
6 per leftover token (`:96-99`: the 0-d tensor `idx` read as an index four times, which torch does
with `.item()` on any device, one `.item()` and the tensor `if`; fewer than T leftover tokens unless
caps bind), 2 to 4 per frame the take-back pass visits (`:107-108`, where it fires at all), and 1 per
frame reading its budget (`:152`): T + 7 to 7 T + 1 without caps (counted on its rule as
transcribed in the test, without the 4 grid syncs: 19, 73 and 131 at 4, 16 and 32 pairs of 36
tokens, R = 0.25). Ours (P pairs, the longest n_max): per pair, one float32 copy (bfloat16
features; the reference's `.float()` copy), its mean, its token norms, one matrix-vector product and
the min-max (a loop over pairs on the host, as the reference's); an allocation of a few kernels on (P,)
tensors (two stable sorts of P); and one stable sort of a (P, n_max) score table
(`common.rank_in_pair`, O(N log n_max)) instead of the top-k; memory O(n D) at a time (that copy)
plus O(N) scores and integers: no more than the reference's. Host syncs 0 (one non-blocking copy of
the P pair sizes to the device). The kept features are gathered by the shared `merge_groups` (O(K D)).
Measured on one CPU thread (a shared 2-core machine), R = 0.25, D = 3,584: 8 pairs x 720 tokens,
17 ms against the reference's 76 ms (bfloat16) and 17 ms against 43 ms (float32); 32 pairs x 720
tokens (bfloat16), 85 ms against 368 ms; the reference's time is mostly its (T, n, D) mean and its
bfloat16 cosines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, F32, Compression, TokenCompressor, VisualTokens, check_keep, pair_places, rank_in_pair

BUDGET_TEMPERATURE = 0.7  # DEFAULT_BUDGET_TEMP, :16
MIN_K = 1  # DEFAULT_MIN_K, :15: tokens every frame keeps at least
EPS = 1e-6  # the eps of every normalisation and cosine, :43, :131, :158, :161


def curvature(reps: torch.Tensor) -> torch.Tensor:
    """1 - cos of the turn at each inner frame of the trajectory reps (P, D); 1 at both ends (:33-45)."""
    if reps.shape[0] <= 1:
        return torch.ones(reps.shape[0], device=reps.device, dtype=torch.float32)
    v_in = reps[1:-1] - reps[:-2]
    v_out = reps[2:] - reps[1:-1]
    inner = 1.0 - F.cosine_similarity(v_in, v_out, dim=-1, eps=EPS)
    ends = torch.ones(1, device=reps.device, dtype=inner.dtype)
    return torch.cat([ends, inner, ends])


def budget_weights(curv: torch.Tensor) -> torch.Tensor:
    """softmax(curvature / 0.7) over the pairs, float32 (:133)."""
    return torch.softmax(curv.float() / BUDGET_TEMPERATURE, dim=0)


def fill(alloc: torch.Tensor, frac: torch.Tensor, room: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """:91-100: `left` (>= 0) tokens one at a time to the argmax of `frac` (the first on ties), which
    stays the argmax until its `room` is used up: in stable descending `frac` order, each pair is
    topped up to its room until none is left."""
    order = torch.sort(frac, descending=True, stable=True).indices
    room = room[order]
    give = torch.minimum((left - (torch.cumsum(room, 0) - room)).clamp(min=0), room)
    return alloc.index_add(0, order, give)


def take_back(alloc: torch.Tensor, weights: torch.Tensor, over: torch.Tensor, floor: int) -> torch.Tensor:
    """:101-109: one pass over the pairs in ascending weight (stable), taking one token from each pair
    above `floor` until `over` (>= 0) are taken."""
    order = torch.sort(weights, stable=True).indices
    above = (alloc[order] > floor).long()
    taken = above * (torch.cumsum(above, 0) <= over).long()
    return alloc.index_add(0, order, -taken)


def allocate(weights: torch.Tensor, total: int, sizes: torch.Tensor) -> torch.Tensor:
    """Per-pair budgets (P,) long summing to `total` (P <= total <= sum(sizes)), each in
    [MIN_K, size]: `_allocate_budget_per_frame` (:48-111) with max_k a pair's own size."""
    base = torch.full_like(sizes, MIN_K)  # :67-72, total >= P MIN_K: min_k_eff = MIN_K
    remaining = total - MIN_K * len(sizes)  # :73
    if remaining <= 0:
        return base
    w = weights.float().clamp_min(0.0)  # :77
    w = torch.where(w.sum() > 0, w, torch.ones_like(w))  # :78-79
    w = w / w.sum().clamp_min(1e-6)  # :80
    raw = w * float(remaining)  # :82
    extra = torch.minimum(torch.floor(raw).long(), sizes - MIN_K)  # :83-87
    alloc = base + extra  # :88
    left = total - alloc.sum()  # :90
    frac = (raw - torch.floor(raw)).masked_fill(alloc >= sizes, -1.0)  # :92-93
    room = torch.where(frac >= 0, sizes - alloc, 0)  # a capped pair (frac -1) ends the loop, :96-97
    alloc = fill(alloc, frac, room, left.clamp(min=0))
    return take_back(alloc, w, (-left).clamp(min=0), MIN_K)


def cosine_to(x: torch.Tensor, rep: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """`F.cosine_similarity(x, rep[None], dim=-1, eps=EPS)` (:158) for rows x (n, D) of L2 norms
    `length`: torch divides both by their norms clamped at eps, then sums the products; here one
    matrix-vector product, without the (n, D) normalised copies (equal up to rounding)."""
    return (x @ (rep / torch.linalg.vector_norm(rep).clamp_min(EPS))) / length.clamp_min(EPS)


def frame_scores(features: torch.Tensor, sizes: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair, in `dtype`: its representation, the mean token L2-normalised (:131), (P, D); and
    each token's hybrid score, float32 (N,) (:156-162): (1 - cos to the representation) + its L2
    norm min-max normalised over the pair."""
    reps, scores = [], []
    for chunk in features.split(sizes):
        frame_tokens = chunk.to(dtype)  # float32 for bfloat16 features: the reference's `.float()` copy (:160)
        rep = F.normalize(frame_tokens.mean(dim=0), dim=-1, eps=EPS)
        length = torch.linalg.vector_norm(frame_tokens, dim=-1)
        outlier = (1.0 - cosine_to(frame_tokens, rep, length)).float()
        norm = length if dtype == torch.float32 else frame_tokens.float().norm(dim=-1)  # :160, float32
        norm = (norm - norm.min()) / (norm.max() - norm.min() + EPS)
        reps.append(rep)
        scores.append(outlier + norm)
    return torch.stack(reps), torch.cat(scores)


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """Assignment (N,): each pair's curvature-allocated top tokens keep themselves, the rest are dropped."""
    sizes = tokens.pair_sizes
    check_keep(sizes, keep)
    features = tokens.features.detach()
    device, n = features.device, features.shape[0]
    dtype = torch.promote_types(features.dtype, torch.float32)
    reps, scores = frame_scores(features, sizes, dtype)
    size = torch.tensor(sizes, dtype=torch.long).to(device, non_blocking=True)  # cpu: a host list, moved once
    budget = allocate(budget_weights(curvature(reps)), keep, size)
    pair_of, place = pair_places(size, n)
    kept = rank_in_pair(scores, pair_of, place, (len(sizes), max(sizes))) < budget[pair_of]
    index = torch.arange(n, device=device)
    return Compression(torch.where(kept, index, torch.full_like(index, DROPPED)))


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """One pair's float32 copy at a time."""
    return max(sizes) * width * F32


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=0)
