"""VisPruner (Zhang et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective
Token Pruning in VLMs", ICCV 2025, arXiv:2412.01818) on Qwen's merged video tokens, per frame pair.

Reference: Theia-4869/VisPruner@aefa01a, `llava/model/llava_arch.py:140-186` (`encode_images`:
the selection), `llava/model/multimodal_encoder/clip_encoder.py:35-52` (the [CLS] row of the
attention and the hidden states of `mm_vision_select_layer`, -2 in `scripts/finetune.sh:25`),
`llava/eval/model_vqa_loader.py:151-152` (defaults: 576 tokens, `important_ratio` 0.5; the
README's examples use 0.5 and 0.75), `llava_arch.py:209-212, 265, 272` (the kept tokens are taken
by a boolean mask: original order). On LLaVA, per image (each anyres crop is its own image, with
its own T tokens), with T = `visual_token_num` and r = `important_ratio`:

- important tokens (`llava_arch.py:150-157`): T_imp = int(T r) tokens of highest [CLS] attention
  (mean over heads); the others, the residual, stay in that descending-attention order;
- diverse tokens (`llava_arch.py:159-176`), T_div = T - T_imp: the residual features are
  L2-normalised (`:160`); each round, with R residual tokens, r = min(8, R - T_div) (`:162-165`;
  none left to remove: stop); A = the residual tokens at even places, B = those at odd places
  (`:168`); each A token's score is its highest cosine similarity to a B token (`:169-170`); the r
  A tokens of highest score are removed, and the next residual is [the other A tokens in
  descending score order, then all B tokens in order] (`:172-176`);
- the image keeps the important tokens and the T_div residual tokens (`:178-183`), in original
  order, unmerged: it is pure pruning.

Here, per frame pair with budget k (`per_pair_budget`): int(k * 0.5) important tokens by
`received_attention`, k - int(k * 0.5) diverse tokens by the rounds above on the merged features,
so exactly k tokens per pair and floor(R N) in all. Returned as a `Compression`: kept tokens are
groups of one, the others DROPPED, no weights (a kept token's feature is its own).

Deviations, each for a reason:
- Qwen has no [CLS] token. A token's importance is the attention its patches receive in the last
  ViT block (`received_attention`: mean over heads and query patches, then over the merge unit's 4
  patches, Qwen2.5-VL's window order undone), from the last block instead of layer -2: it is the
  block whose output Qwen's merger projects (on Qwen2.5-VL the block before it attends within
  windows only). All T_imp important tokens are visual tokens.
- The similarity is on the merger's output (the LLM's input embeddings), where the reference
  compares layer -2 hidden states before its projector: Qwen's merger fuses 4 patches and projects
  in one step, and every compressor here acts after it.
- Budgets: floor(R N) split over frame pairs (`per_pair_budget`), each pair pruned on its own as
  the reference prunes each image (it has no video code: a pair plays the role of an image). The
  reference's T is fixed per image.
- Where the reference's code fails, the rule its slices state is followed: the A half is all
  ceil(R / 2) even places, and a round removes min(r, ceil(R / 2)) A tokens (`[:, r:]` at `:172`).
  The reference's batch index has `R // 2 - r` columns (`:174`) against ceil(R / 2) - r kept A
  tokens; when R is odd or r > R // 2 in some round, it raises (shapes that do not broadcast, or
  a negative size), keeps fewer than T tokens, or drops one A token too many in a round (a width-0
  index broadcast against width 1). That happens on Qwen's pair sizes (R = n - int(k / 2) is odd
  for half of all budgets) and for small budgets (r > R // 2 needs fewer than 16 residual tokens
  and T_div < R / 2). Wherever the index fits (R even and r <= R // 2 in every round, as on
  LLaVA's 576 tokens at T = 64, 128, 192) the kept tokens are the reference's (tested).
- A zero feature vector has similarity 0 (`F.normalize`); the reference divides by zero (NaN).
- Ties go to the lower index (attention) and to the earlier A token (scores): stable sorts, where
  the reference's `argsort` leaves them unspecified.
- Similarities in float32 at least (float64 stays float64); the reference computes them in the
  model's dtype (float16 on LLaVA). Where one Gram matrix is cheaper than the per-round products
  (below), its dot products are summed in another order, so a float32 near tie can fall the
  other way (one pair of 8 at 720 tokens x 3,584, R = 0.1); in float64 the kept tokens are equal.

Cost, against the reference's (`llava_arch.py:154-183`, one batch of B images of n tokens, D wide,
m = n - T_imp residual tokens, s rounds of R_i residual tokens):
- Time: the reference computes every round's ceil(R_i / 2) x floor(R_i / 2) x D products. Ours
  batches the pairs of equal (size, budget) as one group (uniform frames: at most two groups), as
  the reference batches images, and takes whichever of two ways needs fewer multiply-adds
  (`products`): the same per-round products, or one m x m x D Gram matrix per pair from which each
  round gathers its scores (the Gram matrix from about 5 rounds on, i.e. more than 32 tokens removed
  per pair; 6.7x fewer at 720-token pairs and R = 0.25). Plus a stable sort of the n attentions and
  of each round's A scores, as the reference's argsorts. Measured on one CPU thread, 8 pairs x 720
  tokens x 3,584, float32: 0.81 s against 4.05 s for the reference's loop (R = 0.25), 0.63 s
  against 6.15 s (R = 0.1).
- Memory: the Gram way holds one pair's normalised residual features (m D, float32) at a time and
  the B m^2 float32 Gram matrices (22 MB at 8 x 720 x 3,584, R = 0.25); the reference holds all
  B n D features normalised plus each round's B R_i D gather, in the model's dtype (77 MB in
  float16). The per-round way (at most about 4 rounds: R close to 1) gathers and normalises each
  round's A and B features, B R_i D in float32, about the reference's bytes.
- Host syncs: 0 (the rounds' sizes are computed on the host from the pair sizes and budgets, and
  the kept tokens are written by index). The reference: none in its loop, then one boolean-mask
  selection of the kept features per image entry (`llava_arch.py:212, 265, 272`).
`seed` is unused (VisPruner is deterministic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import DROPPED, F32, Compression, TokenCompressor, VisualTokens, per_pair_budget

IMPORTANT_RATIO = 0.5  # `important_ratio`, llava/eval/model_vqa_loader.py:152
MAX_REMOVED = 8  # duplicates removed per round at most, llava_arch.py:163


def split(k: int, ratio: float = IMPORTANT_RATIO) -> tuple[int, int]:
    """(important, diverse) tokens of a pair budget k (`llava_arch.py:150-151`)."""
    important = int(k * ratio)
    return important, k - important


def rounds(residual: int, diverse: int) -> list[int]:
    """The r of every duplicate-removal round, from `residual` tokens down to `diverse`
    (`llava_arch.py:161-165`); a round removes min(r, ceil(R / 2)) A tokens."""
    out = []
    while diverse > 0 and min(MAX_REMOVED, residual - diverse) > 0:
        r = min(MAX_REMOVED, residual - diverse)
        out.append(r)
        residual -= min(r, (residual + 1) // 2)
    return out


def by_importance(attention: torch.Tensor) -> torch.Tensor:
    """Each row's token indices by attention, highest first, ties to the lower index (`:154-155`)."""
    return torch.sort(attention, dim=-1, descending=True, stable=True).indices


def products(residual: int, schedule: list[int]) -> tuple[int, int]:
    """Multiply-adds per feature channel of the reference's per-round A x B products, and of one
    Gram matrix of the `residual` tokens."""
    per_round, size = 0, residual
    for r in schedule:
        per_round += ((size + 1) // 2) * (size // 2)
        size -= min(r, (size + 1) // 2)
    return per_round, residual * residual


def unit(features: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The L2-normalised features (`llava_arch.py:160`) of the tokens `index` (B, m): (B, m, D),
    float32 at least."""
    return F.normalize(features[index].to(torch.promote_types(features.dtype, torch.float32)), dim=-1)


def cosine_gram(features: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, m, m) cosine similarities among each row's tokens `index` (B, m), one row at a time so
    that a single row's normalised copy exists at once."""
    dtype = torch.promote_types(features.dtype, torch.float32)
    gram = torch.empty(index.shape[0], index.shape[1], index.shape[1], dtype=dtype, device=features.device)
    for row in range(index.shape[0]):
        x = unit(features, index[row])
        torch.matmul(x, x.T, out=gram[row])
    return gram


def remove_duplicates(
    features: torch.Tensor, residual: torch.Tensor, schedule: list[int], use_gram: bool
) -> torch.Tensor:
    """The rounds of `llava_arch.py:161-176` on the residual tokens (B, m) of each row, in the
    reference's order; returns the (B, m - removed) tokens that stay, in the order the reference
    leaves them. Scores from one Gram matrix per row (`use_gram`) or, as the reference, from each
    round's A x B products."""
    batch, m = residual.shape
    rows = torch.arange(batch, device=residual.device)[:, None, None]
    gram = cosine_gram(features, residual) if use_gram else None
    place = torch.arange(m, device=residual.device).expand(batch, m)  # positions in `residual`
    for r in schedule:
        a, b = place[:, 0::2], place[:, 1::2]  # :168
        if gram is not None:
            similarity = gram[rows, a[:, :, None], b[:, None, :]]
        else:  # :167-169
            similarity = unit(features, residual.gather(1, a)) @ unit(features, residual.gather(1, b)).transpose(1, 2)
        scores = similarity.amax(dim=-1)  # :170
        distinct = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, r:]  # :172
        place = torch.cat([a.gather(1, distinct), b], dim=1)  # :173-176
    return residual.gather(1, place)


def select(features: torch.Tensor, attention: torch.Tensor, at: torch.Tensor, k: int) -> torch.Tensor:
    """VisPruner on a batch of equal images, the tokens `at` (B, n) of features (N, D) and
    attention (N,): the k kept token indices of each (B, k), important first, then diverse (the
    reference's order, `:178-179`)."""
    important, diverse = split(k)
    order = at.gather(1, by_importance(attention[at]))
    keep_important, residual = order[:, :important], order[:, important:]  # :156-157
    schedule = rounds(residual.shape[1], diverse)
    if not schedule:  # keep everything (or, with no diverse token, the important ones)
        return order[:, :k]
    per_round, gram = products(residual.shape[1], schedule)
    return torch.cat([keep_important, remove_duplicates(features, residual, schedule, gram < per_round)], dim=1)


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """Exactly `keep` tokens: each pair's `per_pair_budget` share by `select`, the rest DROPPED."""
    if tokens.received_attention is None:
        raise ValueError("vispruner needs the last ViT block's received attention")
    features = tokens.features.detach()
    n, device = features.shape[0], features.device
    attention = tokens.received_attention.detach().to(device)
    groups: dict[tuple[int, int], list[int]] = {}  # pairs of equal (size, budget) run as one batch
    for start, size, k in zip(tokens.pair_starts, tokens.pair_sizes, per_pair_budget(tokens.pair_sizes, keep)):
        groups.setdefault((size, k), []).append(start)
    assignment = torch.full((n,), DROPPED, dtype=torch.long, device=device)
    for (size, k), starts in groups.items():
        at = torch.tensor(starts, device=device)[:, None] + torch.arange(size, device=device)  # (B, size)
        kept = select(features, attention, at, k).flatten()
        assignment[kept] = kept
    return Compression(assignment)


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """Per pair: its float32 unit rows and their Gram matrix."""
    return max(n * width * F32 + n * n * F32 for n in sizes)


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=0, reads_attention=True)
