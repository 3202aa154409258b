"""G-Prune (Jiang et al., "What Kind of Visual Tokens Do We Need? Training-free Visual Token
Pruning for Multi-modal Large Language Models from the Perspective of Graph", AAAI 2025,
arXiv:2501.02268) on Qwen's merged video tokens, per frame pair.

Reference: the authors' code, jytmelon/G-Prune@762c637, `LLaVA-NeXT/llava/model/llava_arch.py:
239-287` (LLaVA-NeXT, one image; `encode_images`, `:159-163`, has already projected the features,
so the graph is built on the LLM's input embeddings). For each view of the image (the 576-token
base view; the high-res crops together, without their row-end tokens, `:246-257`):
- nodes and links: the features L2-normalised, A = their cosine similarities (`:259-262`);
  A < similarity (0.5) set to 0 (`:263`), A / temperature (0.03) (`:265`), entries with
  |A| < 1e-6 set to -5000 (`:267`), softmax over each row (`:269`): a row-stochastic graph whose
  links are the pairs with cosine >= 0.5;
- degree: the positive entries of each row (`:271`);
- information flow: each token starts with the L2 norm of its feature (`:275`) and the flow
  W A^iterate_num (iterate_num 5, `torch.matrix_power`, `:273, 277`) is divided by the degree
  (`:279`);
- selection: the `int(keep_ratio * n)` tokens of highest score (`topk`, `:281`; keep_ratio 0.5 at
  `:241`), in original order (`:287`); the row-end tokens are always kept. Nothing is merged: the
  other tokens are dropped.
UniPruneBench runs the same rule (TianfanPeng/VLMUniPruneBench@f93768f,
`methods/GPrune_PreLLM.py:6-20`, keep `max(1, int(keep_ratio n))`, defaults at `:27-30`); on
Qwen2.5-VL one graph over an image's merged tokens (`custom_qwenvl.py:68-73`); it prunes no videos.

Here, per frame pair with budget k: the same graph over the pair's merged tokens, the same flow and
degree, and the pair's k tokens of highest score kept in original order, each a group of one (its
own feature and M-RoPE position); every other token is dropped. Defaults: the reference's
(similarity 0.5, temperature 0.03, 5 iterations); no other setting (the reference's keep_ratio is
R). `keep` is met exactly: floor(R N) tokens split over pairs by `per_pair_budget` (largest
remainder in proportion to the pair sizes, at least one per pair); a pair keeps exactly its share.
It reads only the features (no attention, no keys).

Deviations, each for a reason:
- One graph per frame pair. The reference builds one graph per view of an image (UniPruneBench:
  per image) and has no video code; a frame pair plays the image, as for every per-image method
  here, and one graph over a whole video (up to 49,152 tokens) would hold N^2 entries, 9.7 GB in
  float32, where a pair's holds 0.6 M.
- Budgets: floor(R N) split over pairs (`per_pair_budget`) where the reference keeps
  int(keep_ratio n) of each view; with equal pairs and `keep` a multiple of the pairs that is the
  reference's count. Qwen has no row-end tokens to keep.
- The flow is W A A A A A, five vector-matrix products, instead of W A^5 by `matrix_power`: the same
  product (associativity), summed in another order; equal scores up to rounding (float64: 1e-9 tested).
- Precision: the norms W, the normalised features and their cosines are computed in the features'
  dtype, as the reference (so the threshold sees the same rounded cosines); the threshold, softmax,
  degree and flow then run in float32 (float64 inputs stay float64), where the reference stays in the
  model's dtype (float16 in LLaVA-NeXT, bfloat16 in UniPruneBench's Qwen runs) and rounds each of
  `matrix_power`'s 3 products to it. With bfloat16 tokens the kept tokens are those of the reference
  upcast after its cosines (tested); against the all-bfloat16 reference, 99.8% of them are the same
  (8 pairs x 768 clustered random tokens, width 3,584, R = 0.25). In float16 the reference's degree
  also loses links whose softmax weight underflows (below 6e-8; the smallest linked weight is about
  exp(-0.5 / 0.03) / n); in float32 none does.
- Ties go to the lower index (a stable sort); the reference's `topk` leaves their order open.
`seed` is unused (G-Prune is deterministic).

Cost. Reference (one view of n tokens, width D): the normalised copy (n D) and the n x n Gram
matrix (n^2 D), a few elementwise passes, `matrix_power(A, 5)`: 3 n x n matmuls (A^2, A^4, A^4 A:
3 n^3), then W A^5 (n^2) and a top-k; memory about eight n^2 buffers in the model's dtype (A, the
two boolean masks, A / T, |A|, the softmax, the powers); host syncs 2 per graph, the boolean-mask
assignments `A[A < similarity] = 0` and `A[abs(A) < 1e-6] = -5000` (`llava_arch.py:263, 267`;
`GPrune_PreLLM.py:9, 11`), plus 2 per image in the authors' code (`torch.where(mask)`, `:254, 256`);
applied per frame that is 2 per frame. Ours (N tokens in P pairs of n, width D): per pair the same
normalised copy and Gram matrix in the features' dtype (n D, n^2 D), then 5 n^2 for the flow
instead of 3 n^3 (at n = 768, D = 3,584: 4.2 GFLOP + 6 MFLOP against 4.2 + 2.7 GFLOP); memory per
batch the normalised copy (B n D) and four (B, n, n) buffers (the cosines, their float32 copy, the
unlinked mask, the softmax). Consecutive pairs of equal size run as one batch of B pairs, at most
`CHUNK` = 2^22 entries in its (B, n, max(n, D)) buffers (one pair where a pair alone is larger):
at 768 tokens and D = 3,584 one pair a batch, about 12 MB with bfloat16 tokens; at 256 tokens 4
pairs. Host syncs 0: masks are applied with `masked_fill` and the kept tokens written by a
scatter, the budgets copied to the device once (tests/test_fidelity_gprune.py counts them at 4 and
16 pairs). Measured (one CPU thread, shared 2-core machine, 8 pairs x 768 x 3,584, R = 0.25, best
of 5, the test's transcription of the reference per pair): 0.51 s against 0.76 s in float32,
0.18 s against 0.29 s in bfloat16.
"""

from __future__ import annotations

import torch

from .common import DROPPED, F32, Compression, TokenCompressor, VisualTokens, per_pair_budget

SIMILARITY = 0.5  # llava_arch.py:240, cosine below which two tokens are not linked
TEMPERATURE = 0.03  # :242, softmax temperature of the links
ITERATIONS = 5  # :243, steps of information flow
UNLINKED = -5000.0  # :267, the logit of a pair that is not linked
CHUNK = 2**22  # entries in a batch's (pairs, n, max(n, D)) buffers


def similarity_graph(cosine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-stochastic links (B, n, n) from each batch's cosine similarities (B, n, n), overwritten,
    and each token's degree (B, n): llava_arch.py:263-271. A cosine below SIMILARITY is set to 0
    and, after the division by TEMPERATURE, every |logit| < 1e-6 to UNLINKED (:263-267); a linked
    logit is at least SIMILARITY / TEMPERATURE, so exactly the unlinked pairs get UNLINKED."""
    unlinked = cosine < SIMILARITY
    links = torch.softmax(cosine.div_(TEMPERATURE).masked_fill_(unlinked, UNLINKED), dim=-1)
    return links, (links > 0).sum(dim=-1)


def information_flow(norms: torch.Tensor, links: torch.Tensor) -> torch.Tensor:
    """W A^ITERATIONS (B, n), W the tokens' feature norms (B, n): llava_arch.py:273-277, as
    ITERATIONS vector-matrix products."""
    flow = norms[:, None, :]
    for _ in range(ITERATIONS):
        flow = flow @ links
    return flow[:, 0]


def importance(features: torch.Tensor) -> torch.Tensor:
    """G-Prune's score (B, n) of each token of a batch of graphs (B, n, D): the information flow
    divided by the degree (llava_arch.py:279). The norms, the normalised features and their cosines
    in the features' dtype, as the reference (:259-261, 275); the rest in float32 (float64 stays)."""
    norms = features.norm(dim=-1, keepdim=True)  # :275, W
    normalized = features / norms.clamp_min(1e-12)  # :259, F.normalize
    work = torch.promote_types(features.dtype, torch.float32)
    links, degree = similarity_graph((normalized @ normalized.transpose(1, 2)).to(work))  # :261
    return information_flow(norms[..., 0].to(work), links) / degree


def keep_top(scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """(B, n) mask of each row's budgets[b] highest scores, ties to the lower index."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    place = torch.arange(scores.shape[1], device=scores.device)
    return torch.zeros_like(order, dtype=torch.bool).scatter_(1, order, place < budgets[:, None])


def batches(pair_sizes: list[int], width: int):
    """(first pair, pairs) of runs of consecutive equal-size pairs, at most CHUNK entries in each
    batch's (pairs, n, max(n, width)) buffers, at least one pair."""
    runs, first = [], 0
    while first < len(pair_sizes):
        n = pair_sizes[first]
        most = max(1, CHUNK // (n * max(n, width)))
        count = 1
        while first + count < len(pair_sizes) and pair_sizes[first + count] == n and count < most:
            count += 1
        runs.append((first, count))
        first += count
    return runs


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    budgets = per_pair_budget(tokens.pair_sizes, keep)  # raises unless pairs <= keep <= N
    features = tokens.features.detach()
    device, width = features.device, features.shape[1]
    budget_of = torch.tensor(budgets, dtype=torch.long).to(device, non_blocking=True)  # cpu: a host list, moved
    index = torch.arange(features.shape[0], device=device)
    assignment = torch.full_like(index, DROPPED)
    starts = tokens.pair_starts
    for first, count in batches(tokens.pair_sizes, width):
        n = tokens.pair_sizes[first]
        span = slice(starts[first], starts[first] + count * n)
        scores = importance(features[span].reshape(count, n, width))
        kept = keep_top(scores, budget_of[first : first + count]).flatten()
        assignment[span] = torch.where(kept, index[span], DROPPED)
    return Compression(assignment)


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """A pair's float32 graph and its two buffers."""
    return 3 * max(sizes) ** 2 * F32


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=0)
