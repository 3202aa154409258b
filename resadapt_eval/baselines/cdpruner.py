"""CDPruner (Zhang et al., "Beyond Attention or Similarity: Maximizing Conditional Diversity for
Token Pruning in MLLMs", NeurIPS 2025, arXiv:2506.10967) on Qwen's merged video tokens, per frame pair.

Reference: Theia-4869/CDPruner@9541616, `llava/model/llava_arch.py:140-187` (`encode_images`: the
selection), `llava/model/multimodal_encoder/clip_encoder.py:60-98` (the CLIP image and text
embeddings), `llava/eval/model_vqa_loader.py:108-120` (the instruction it embeds). On LLaVA, for a
batch of B images (anyres crops) of N tokens, T = `visual_token_num` kept per image:

- similarity (`llava_arch.py:150-153`): cosine of the projector's outputs, in float32;
- relevance (`:155-160`): r = -mean over the M text embeddings of cos(CLIP image embedding, CLIP
  text embedding) (M: the instruction's 77-token CLIP segments, `clip_encoder.py:81-89`), then
  r = (r - min + 1e-6) / (max - min), min and max over the whole batch;
- kernel (`:167`): L = diag(r) S diag(r);
- selection (`:170-181`): the greedy MAP inference of the DPP (Chen et al., NeurIPS 2018), T steps
  per image: j = argmax d^2 (the first maximum), e = (L_j - sum_t c_t[j] c_t) / sqrt(d^2_j),
  d^2 -= e^2, d^2_j = -inf; the kept tokens are read by a mask (original order, `:183-185`).

Here each frame pair is one of the reference's images: features are the merged tokens (the LLM's
input space, as the reference's projector outputs), `per_pair_budget` gives each pair its k of
floor(R N) (at least 1), pairs of equal (size, k) run as one batch, and the relevance is read
against `VisualTokens.query`, the LLM's input embeddings of the question's M tokens. Kept tokens
are groups of one, the others DROPPED, no weights.

Deviations from the reference:
- Relevance space: Qwen has no CLIP text tower. The merged tokens are compared with the
  question's LLM input embeddings (the same space), each of the M rows playing a CLIP text
  embedding; openvinotoolkit/openvino.genai@da1db86 does the same for Qwen2/2.5/3-VL
  (`src/cpp/src/visual_language/vision_token_pruning_processor.cpp:161-221`; it averages every
  non-visual prompt token, chat template included, into one row).
- Sign: relevance is +mean cosine; the reference negates it (`llava_arch.py:159`) for CLIP, whose
  patch embeddings rank inversely to the text; openvino.genai's Qwen path keeps the sign
  (`cdpruner/cdpruner_config.hpp:38-40`, `use_negative_relevance = false`). Ours on the query -q
  keeps exactly the reference's tokens on q (tested).
- The mean over M of x . q_m / |q_m| is computed as x . (mean of the unit rows q_m / |q_m|): the same
  number summed in another order (N D multiply-adds instead of N M D).
- Scope: per frame pair, the budget split by `per_pair_budget` (the reference keeps a fixed T per
  image; openvino.genai prunes each frame to round(n (1 - ratio)),
  `cdpruner/cdpruner.cpp:259-273`). The min-max of the relevance spans the whole video, as the
  reference's spans its whole batch (openvino.genai's spans one frame).
- Constant relevance (max = min, and M = 0: no question text) gives every token relevance 1 (the
  kernel is the similarity, a plain DPP), where the reference divides by zero (a NaN kernel). The
  reference embeds an empty instruction with CLIP ("" is [SOS, EOS], a question-independent
  embedding); an empty question has no LLM input embedding, and uniform relevance is the
  question-independent choice.
- Past the kernel's numerical rank (a pair's largest d^2 <= 0, e.g. duplicate tokens), the
  reference's sqrt gives NaN, after which its argmax returns NaN places: it re-picks kept tokens and
  keeps fewer than T. Here that pair's remaining picks go by relevance (highest first, ties to the
  lower index). Wherever the pivot is positive the picks are the reference's.
- Zero feature vectors have similarity and relevance 0 (`F.normalize`); the reference divides by
  zero. Features are cast to float32 before they are normalised (the reference normalises in the
  model's dtype, then casts); float64 stays float64.

Cost, against the reference's (`llava_arch.py:150-181`, B images of n tokens, D wide, T kept):
both compute B n^2 D multiply-adds of similarity, the relevance (the reference B n M C, ours N D),
and T greedy steps whose step i reads i rows of c: B n T (T - 1) / 2 multiply-adds in all. The
reference holds the similarity and the kernel (2 B n^2 float32) and c (T B n float32); ours builds
the kernel in place of the similarity (B n^2) next to c (k B n per group of equal pairs), normalising
one pair's features at a time (n D float32). Host syncs: 0 (every pick stays a device tensor; the
reference's loop has none either, then its caller selects the kept features by a boolean mask, one
sync per image). `seed` is unused (CDPruner is deterministic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, F32, Compression, TokenCompressor, VisualTokens, check_keep, per_pair_budget

EPSILON = 1e-6  # added to the min-max normalised relevance, llava_arch.py:160


def unit_query(query: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mean of the question's unit rows (M, D) -> (D,); zeros when M = 0."""
    rows = F.normalize(query.to(dtype), dim=-1)
    return rows.sum(dim=0) / max(1, rows.shape[0])


def similarities(
    features: torch.Tensor, at: torch.Tensor, direction: torch.Tensor, relevance: torch.Tensor
) -> torch.Tensor:
    """Cosine similarities (B, n, n) among each row's tokens `at` (B, n), one row's unit features
    at a time; writes each token's cosine to `direction` (D,) into `relevance` (N,)."""
    batch, n = at.shape
    gram = torch.empty(batch, n, n, dtype=direction.dtype, device=features.device)
    for row in range(batch):
        unit = F.normalize(features[at[row]].to(direction.dtype), dim=-1)
        torch.matmul(unit, unit.T, out=gram[row])
        relevance[at[row]] = unit @ direction
    return gram


def min_max(raw: torch.Tensor) -> torch.Tensor:
    """(raw - min + 1e-6) / (max - min) over all tokens (`llava_arch.py:160`); 1 everywhere when
    max = min."""
    low, high = raw.min(), raw.max()
    span = high - low
    return torch.where(span > 0, (raw - low + EPSILON) / span, torch.ones_like(raw))


def greedy_map(kernel: torch.Tensor, relevance: torch.Tensor, k: int) -> torch.Tensor:
    """The fast greedy MAP inference of `llava_arch.py:170-181` on each row's kernel (B, n, n):
    the (k, B) picks in order. A row whose largest d^2 is not positive picks by `relevance` (B, n)
    from then on. No host sync."""
    batch, n, _ = kernel.shape
    rows = torch.arange(batch, device=kernel.device)
    di2s = torch.diagonal(kernel, dim1=1, dim2=2).clone()
    fallback = relevance.clone()
    cis = kernel.new_zeros(batch, k, n)  # the reference's (k, B, n) c rows, batch first
    chosen = torch.empty(k, batch, dtype=torch.long, device=kernel.device)
    exhausted = torch.zeros(batch, dtype=torch.bool, device=kernel.device)
    for i in range(k):
        j = di2s.argmax(dim=-1)
        pivot = di2s[rows, j]
        exhausted |= ~(pivot > 0)
        j = torch.where(exhausted, fallback.argmax(dim=-1), j)
        chosen[i] = j
        projection = torch.matmul(cis[rows, :i, j][:, None, :], cis[:, :i])[:, 0]  # sum_t c_t[j] c_t: (B, n)
        eis = (kernel[rows, j] - projection) / torch.sqrt(pivot)[:, None]
        eis = eis.masked_fill(exhausted[:, None], 0)
        cis[:, i] = eis
        di2s -= torch.square(eis)
        di2s[rows, j] = -torch.inf
        fallback[rows, j] = -torch.inf
    return chosen


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """Exactly `keep` tokens: each pair's `per_pair_budget` share by the conditional DPP's greedy
    MAP inference, the rest DROPPED."""
    if tokens.query is None:
        raise ValueError("cdpruner needs the question's input embeddings (VisualTokens.query), got None")
    check_keep(tokens.pair_sizes, keep)
    features = tokens.features.detach()
    n, device = features.shape[0], features.device
    if keep == n:
        return Compression(torch.arange(n, device=device))
    dtype = torch.promote_types(features.dtype, torch.float32)
    direction = unit_query(tokens.query.detach().to(device), dtype)
    groups: dict[tuple[int, int], list[int]] = {}  # pairs of equal (size, budget) run as one batch
    for start, size, k in zip(tokens.pair_starts, tokens.pair_sizes, per_pair_budget(tokens.pair_sizes, keep)):
        groups.setdefault((size, k), []).append(start)
    relevance = torch.empty(n, dtype=dtype, device=device)
    batches = []
    for (size, k), starts in groups.items():
        at = torch.tensor(starts, device=device)[:, None] + torch.arange(size, device=device)  # (B, size)
        batches.append((at, k, similarities(features, at, direction, relevance)))
    relevance = min_max(relevance)
    assignment = torch.full((n,), DROPPED, dtype=torch.long, device=device)
    for at, k, kernel in batches:
        r = relevance[at]
        kernel.mul_(r[:, :, None]).mul_(r[:, None, :])  # llava_arch.py:167, in place of the similarity
        kept = at.gather(1, greedy_map(kernel, r, k).T).flatten()
        assignment[kept] = kept
    return Compression(assignment)


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """Every pair's float32 kernel (n^2), the greedy's c rows (at most n^2 per pair: k < n), one
    pair's float32 unit rows (n width) and four float32 vectors per token."""
    return sum(2 * n * n * F32 for n in sizes) + max(sizes) * width * F32 + 4 * sum(sizes) * F32


def dpp_flops(pair_sizes: list[int], keep: int, vision) -> int:
    """2 FLOPs per multiply-add: every token's cosine to the question (2 N D), each pair's Gram
    matrix (2 n^2 D) and its greedy's projections (step i: 2 i n, so n k (k - 1)); D =
    `vision.out_hidden`; 0 at keep = N (nothing is computed)."""
    if keep == sum(pair_sizes):
        return 0
    width = vision.out_hidden
    total = 2 * sum(pair_sizes) * width
    for n, k in zip(pair_sizes, per_pair_budget(pair_sizes, keep)):
        total += 2 * n * n * width + n * k * (k - 1)
    return total


COMPRESSOR = TokenCompressor(
    compress, working_bytes=working_bytes, host_syncs=0, reads_query=True, config_flops=dpp_flops
)
