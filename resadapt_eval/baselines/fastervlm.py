"""FasterVLM (Zhang et al., "[CLS] Attention is All You Need for Training-Free Visual Token
Pruning: Make VLM Inference Faster", arXiv:2412.01818, 2024) on Qwen's merged video tokens, per
frame pair.

Reference: Theia-4869/FasterVLM, its video code (Video-LLaVA) on branch `video`, commit eca4cd5:
- `videollava/model/multimodal_encoder/languagebind/__init__.py:204-232`: the video tower's
  attention map of layer `mm_vision_select_layer` (-2 in the training scripts,
  `scripts/finetune.sh:19`; at inference the checkpoint's config), the [CLS] query's row over the
  patches, `attentions[:, :, :, 0, 1:]`, per frame and head
  (`video/modeling_video.py:666-669` gives it the (batch, frame, head, query, key) layout);
- `videollava/model/llava_arch.py:140-158` (`encode_videos`): mean over heads (`:145`); per
  frame, the `visual_token_num` patches of highest score (`torch.topk` over each frame's
  patches, `:151`), put back in their original order (`torch.sort` of the indices, `:152`), their
  features gathered (`:154-155`), then projected (`:157`). Every frame keeps the same number,
  given as the script's argument (`scripts/eval/run_qa_msvd.sh:5, 32`; README: 256 * (1 - 0.75)
  = 64 of a frame's 256).
The image code (main branch, Theia-4869/FasterVLM@f5d5f12, `llava/model/llava_arch.py:140-157`,
`llava/model/multimodal_encoder/clip_encoder.py:35-64`) is the same rule per image (and per
LLaVA-NeXT crop): [CLS] row of layer -2, mean over heads, top-k, the kept tokens in original order
(a boolean mask, `:151-153, 245`). Nothing is merged: the other tokens are dropped.

Here, per frame pair with budget k: the k tokens of highest `received_attention`, in original
order, each a group of one (its own feature and M-RoPE position); every other token is dropped.
Defaults: none beyond R (the reference's one setting is the number of tokens kept per frame).
`keep` is met exactly: floor(R N) tokens split over pairs by `per_pair_budget` (largest remainder
in proportion to the pair sizes, at least one per pair); a pair keeps exactly its share.

Deviations, each for a reason:
- Qwen has no [CLS] token. A token's score is the attention its patches receive in the last ViT
  block (`received_attention`: mean over heads and over all query patches, then over the merge
  unit's 4 patches, Qwen2.5-VL's window order undone), the stand-in VisionZip uses here. The
  reference reads one query's row ([CLS]); this reads every patch's row.
- The last ViT block instead of layer -2: the reference reads the attention of the block whose
  output LLaVA projects (`hidden_states[-2]` is the output of block -2, whose attention is
  `attentions[-2]`); on Qwen the merger projects the last block's output. On Qwen2.5-VL the last
  block attends over each whole temporal patch while the block before it attends within windows.
- Pruning acts on the merger's output (the LLM's input embeddings): the reference's video code
  gathers the kept CLIP features and projects only those (`llava_arch.py:155-157`); Qwen's merger
  fuses 4 patches and projects in one step inside the vision tower, and every compressor here acts
  after it.
- Budgets: floor(R N) split over pairs (`per_pair_budget`) where the reference gives every frame
  the same count; with equal pairs and `keep` a multiple of the pairs, each pair keeps keep / P,
  the reference's setting; otherwise the shares follow the pair sizes (equal pairs' shares differ
  by at most one token).
- Ties go to the lower index (stable sorts); the reference's `torch.topk` leaves their order open.
`seed` is unused (FasterVLM is deterministic).

Cost. Reference (per video of T frames of n patches, width C; K = T L kept): one batched top-k of
(T, n) scores, a sort of the T L indices, a gather of K C features (then the projector on K tokens
only); memory O(T n) scores and O(K C) gathered features; host syncs 0 in the video path
(`llava_arch.py:151-155`; the image path's boolean mask, main `llava_arch.py:245`, is one per
image). Ours (N tokens in P pairs, the longest n_max): a (P, n_max) table of scores, one stable
sort along its rows (O(N log n_max) for equal pairs) and a few O(N) integer kernels, a constant
number of kernels whatever P (no loop over pairs); memory O(P n_max) scores and integers (O(N)
for equal pairs); one host-to-device copy of the (2, P) pair sizes and budgets, `non_blocking`
(PyTorch then does not synchronise the stream after it); host syncs 0. The kept features are
gathered by the shared `merge_groups` (O(K D)). Measured on one CPU thread, 64 pairs x 768 tokens,
K = N / 4 (a shared 2-core machine): 3.4-7.5 ms against 1.2-1.3 ms for the reference's top-k and
index sort (a full stable sort where top-k needs only the first L); both are 1-3% of the feature
gather that follows (0.22-0.34 s either way).
"""

from __future__ import annotations

import torch

from .common import (
    DROPPED,
    Compression,
    TokenCompressor,
    VisualTokens,
    no_matmul,
    pair_table,
    per_pair_budget,
    rank_in_pair,
)


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    if tokens.received_attention is None:
        raise ValueError("fastervlm needs the last ViT block's received attention (its [CLS] attention stand-in)")
    budgets = per_pair_budget(tokens.pair_sizes, keep)  # raises unless pairs <= keep <= N
    device = tokens.features.device
    scores = tokens.received_attention.detach().to(device)
    pair_of, place, budget = pair_table(tokens.pair_sizes, budgets, device)
    shape = (len(tokens.pair_sizes), max(tokens.pair_sizes))
    kept = rank_in_pair(scores, pair_of, place, shape) < budget[pair_of]  # each pair's top k, original order
    index = torch.arange(len(scores), device=device)
    return Compression(torch.where(kept, index, torch.full_like(index, DROPPED)))


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """Its (pairs, longest pair) table of scores and places (24 bytes a cell)."""
    return len(sizes) * max(sizes) * 24


COMPRESSOR = TokenCompressor(
    compress, working_bytes=working_bytes, host_syncs=0, reads_attention=True, config_flops=no_matmul
)
