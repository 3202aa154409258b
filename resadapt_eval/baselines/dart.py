"""DART (Wen et al., 2025, "Stop Looking for Important Tokens in Multimodal Language Models:
Duplication Matters More"; code: ZichenWen1/DART, read through its fork xqy1111111/DART at
38d7b9c94d15c524171ffe60db5e45819d5ed505, `Qwen2_5-VL/Qwen2_5VL_DART/modeling_qwen2_5_vl_self.py`,
class `DART`, whose upstream copy is not in this machine's mirror): before decoder layer K (default
2), keep the visual tokens that duplicate the pivots least.

The reference, per prefill (lines of that file, `DART.forward` and `DART.get_retained_image_token`):
1. the states: the hidden states leaving layer K - 1 through the LLM's final norm (`self.norm`), and
   layer K - 1's keys after rotary, heads concatenated per token;
2. the pivots: the `pivot_image_token` (4) image tokens and the `pivot_text_token` (4) tokens after
   the image block (the question and the chat template's tail) of largest key L1 norm;
3. TOKEN_TOPK = int(N (1 - reduction_ratio) / (pivots)); for each pivot in turn, the TOKEN_TOPK image
   tokens not yet kept (pivots excluded) of lowest cosine similarity to it join the kept set;
4. the text pivots leave the set; the image pivots and the chosen tokens stay, in prompt order, at
   their positions (the position ids are sliced, not renumbered), for layer K on. It reads no
   attention weights, so it runs with SDPA and FlashAttention.

Here: `Stage(K, keep, rank_by=DUPLICATION)` in `inside_llm`; `backbones/layer_pruning.LayerPruner` takes
the keys' L1 norms in layer K - 1's attention input hook (`key_l1_norms`) and calls `select` on the
hidden states entering layer K.

Deviations from the reference:
- the kept count is solved from the layer-averaged target R as FastV's (`inside_llm.one_stage`):
  k = floor((R L - K) N / (L - K)), so every in-LLM method is compared at the same R. The reference
  keeps pivots + pivots_all * int(N (1 - ratio) / pivots_all), which is not a function of a target;
  here the k - (image pivots) chosen tokens are spread over the pivots as evenly as the reference
  spreads them: each takes floor(e / P), and the first e mod P in turn one more (equal to the
  reference whenever e is a multiple of P). Below 4 tokens only the top k image pivots stay;
- the pivots are visited as the reference visits them, in the order of a Python `set` of their prompt
  indices (CPython's hash-table order, which is increasing only while every index is below the table's
  size); reading those 8 indices to the host is the stage's one host sync (the reference makes one per
  chosen token, `[valid_indices_list[i] for i in top_k_indices]`);
- the cosine similarity is one matmul of the normed rows against the normed pivots, in the model's
  dtype, over float32 norms (the reference calls `cosine_similarity` per pivot on a gathered copy of
  the remaining rows), formed `SIMILARITY_ROWS` rows at a time with the final norm applied per block:
  no (N, H) copy exists whole;
- every visual token of the request is one pool (a video's pairs, or several images), and the text
  pivots are the tokens after the last visual token (Qwen3-VL's timestamps between frames are
  neither), where the reference takes one contiguous image block;
- on Qwen3-VL the default K comes after the deepstack layers (`first_layer`), as FastV's;
- ties go to the earlier token (a stable sort; the reference's `topk` leaves their order unspecified,
  and it can differ between CPU and GPU).
"""

from __future__ import annotations

import torch

from .inside_llm import DUPLICATION, Stage, one_stage

DEFAULT_LAYER = 2  # K
PIVOT_IMAGE = 4  # pivot_image_token
PIVOT_TEXT = 4  # pivot_text_token
SIMILARITY_ROWS = 1024  # visual rows normed and compared with the pivots at a time


def stages(
    num_layers: int, visual: int, retention: float, layers: list[int] | None = None, first_layer: int = 0
) -> list[Stage]:
    """One stage at K (`layers`, default max(2, first_layer)) keeping the most tokens whose
    layer-averaged retention is not above `retention`."""
    return one_stage(num_layers, visual, retention, layers, first_layer, DEFAULT_LAYER, DUPLICATION, "DART")


def key_l1_norms(keys: torch.Tensor) -> torch.Tensor:
    """(L,) L1 norm of each token's key, heads concatenated (`keys`: (1, kv_heads, L, d), after
    rotary), in the keys' dtype as the reference's `torch.norm(p=1)`."""
    return keys[0].transpose(0, 1).reshape(keys.shape[2], -1).norm(p=1, dim=-1)


def pivot_counts(keep: int, image_pivots: int, text_pivots: int) -> tuple[int, list[int]]:
    """(image pivots kept, tokens each of the pivots chooses, in visiting order) for `keep` tokens."""
    image = min(image_pivots, keep)
    pivots, extra = image + text_pivots, keep - image
    return image, [extra // pivots + (i < extra % pivots) for i in range(pivots)] if pivots else []


def select(
    hidden: torch.Tensor,
    norm,
    key_l1: torch.Tensor,
    visual: torch.Tensor,
    after: torch.Tensor,
    keep: int,
    pivot_image: int = PIVOT_IMAGE,
    pivot_text: int = PIVOT_TEXT,
) -> torch.Tensor:
    """(N,) bool: which of the N `visual` tokens DART keeps, exactly `keep` of them.

    hidden: (1, L, H) states entering layer K; norm: the LLM's final norm; key_l1: (L,) key L1 norms
    of layer K - 1; visual: (N,) prompt positions of the visual tokens, increasing; after: (T,)
    prompt positions of the text after the last visual token. One host sync (the pivots' order)."""
    image, counts = pivot_counts(keep, pivot_image, min(pivot_text, len(after)))
    image_pivots = key_l1[visual].argsort(descending=True, stable=True)[:image]  # indices into visual
    text_pivots = after[key_l1[after].argsort(descending=True, stable=True)[: len(counts) - image]]
    taken = torch.zeros(len(visual), dtype=torch.bool, device=visual.device)
    taken[image_pivots] = True
    if not counts or max(counts) == 0:
        return taken
    pivots = visiting_order(torch.cat([visual[image_pivots], text_pivots]))
    similarity = pivot_similarity(hidden, norm, visual, pivots)  # (N, P)
    for j, count in enumerate(counts):
        if count:
            candidates = similarity[:, j].neg().masked_fill(taken, float("-inf"))
            taken[candidates.argsort(descending=True, stable=True)[:count]] = True
    return taken


def visiting_order(pivots: torch.Tensor) -> torch.Tensor:
    """(P,) the pivots' prompt indices (image pivots, then text pivots, each by decreasing key L1 norm) in
    the order the reference visits them: that of a Python set built from them in turn
    (modeling_qwen2_5_vl_self.py:1577, :1582). Reads the P indices to the host: one sync."""
    return torch.tensor(list(set(pivots.tolist())), dtype=pivots.dtype, device=pivots.device)


def pivot_similarity(hidden: torch.Tensor, norm, visual: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    """(N, P) float32 cosine similarity of each visual token's normed state to each pivot's: dot
    products in the states' dtype over float32 norms, `SIMILARITY_ROWS` visual rows at a time."""
    pivot_rows = norm(hidden[:, pivots])[0]  # (P, H)
    pivot_norms = pivot_rows.float().norm(dim=-1)
    blocks = []
    for rows in visual.tensor_split(-(-len(visual) // SIMILARITY_ROWS)):
        states = norm(hidden[:, rows])[0]  # (n, H)
        dots = (states @ pivot_rows.T).float()
        blocks.append(dots / (states.float().norm(dim=-1)[:, None] * pivot_norms).clamp_min(1e-8))
    return torch.cat(blocks)


def ranking_flops(hidden: int, kv_width: int, length: int, visual: int, keep: int, text_after: int) -> int:
    """FLOPs its matmuls run: layer K - 1's key projection over the `length` prompt tokens
    (2 L H kv_width) and the pivots' similarity to the `visual` tokens (2 N H P)."""
    image, counts = pivot_counts(keep, PIVOT_IMAGE, min(PIVOT_TEXT, text_after))
    similarity = 2 * visual * hidden * len(counts) if counts and max(counts) else 0
    return 2 * length * hidden * kv_width + similarity
