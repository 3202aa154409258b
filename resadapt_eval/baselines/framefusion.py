"""FrameFusion (Fu et al., ICCV 2025, "FrameFusion: Combining Similarity and Importance for Video
Token Reduction on Large Vision Language Models"; code: thu-nics/FrameFusion@fbec1d2,
`framefusion/main.py`, run on Qwen2-VL by `framefusion/models/qwen2/modeling_qwen2_vl.py` and
`framefusion/interface.py`): in the first layers, merge each visual token into the token at the
same position of the frame before while they are similar; then prune the rest by importance, so
that the layer-averaged share of visual tokens is the `cost` asked for.

The reference (lines of `main.py`), at each call while merging (`forward`, :103-138): the cosine
similarity of every visual token to the token of the same patch in the previous frame (the tokens
sorted by patch, then by position: `compute_similarity_and_token_index_by_patch`, :180-241); the
sparsity the remaining layers need to meet the cost (`_compute_pruning_ratio`, :321-343); if the
share of tokens at or above `similarity_lower_bound` = 0.6 is below it, all of them merge, and
merging ends once that share is below `ratio_lower_bound` = 0.1; otherwise the top int(needed n)
merge and nothing more is reduced. A merged token is averaged into the first token of its run of
similar neighbours (`merge_tokens_and_get_mask`, :243-319): (start + members) / (m + 1), in place;
the members leave the sequence, the start keeps its position. Calls: at layer 0 before attention,
and after each layer's attention (`modeling_qwen2_vl.py:176-201`). After merging ends, the next
attention also returns the attention of the last 4 queries over every key (`utils.py:27-57`, in the
model's dtype), and right after it the visual tokens are pruned to round(n (1 - ratio)), the top
by that attention averaged over heads and the 4 queries (`forward`, :60-101).

Here: `backbones/layer_pruning.FusionPruner` runs it through the same hooks as every in-LLM method;
this module holds the rule: `neighbour_similarity`, `merge_decision`, `merge_groups`, `average_into`,
`prune_keep`.

Deviations from the reference:
- a merge after layer l's attention happens here at layer l + 1's input, after layer l's MLP (a
  decoder layer's residual stream cannot be cut between its attention and its MLP through hooks);
  the similarity is read there, and the MLP of layer l runs on the unmerged tokens. The first merge
  is, as in the reference, at the first layer's input; the pruning, ranked by the attention of the
  layer whose input merged last (the reference's: the attention after its last merge; its last 4
  queries, from that layer's own q/k projections and rotary), is at the input of the layer after it
  (the reference: between that layer's attention and MLP);
- exact layer-averaged budgets: the reference's cost bookkeeping (`_compute_pruning_ratio`) counts a
  merge as a layer, assumes 28 layers and rounds the kept count; here the visual tokens allowed over
  all layers are floor(R L N), each merge layer's count is what entered it, and a layer's allowance
  is the budget left over the layers left, floored: the needed merge is n - floor(budget / layers),
  the pruning keeps floor(budget / layers), so R is the largest layer average within the target. A
  merge of only the similar tokens that would leave the later layers less than they must hold (a
  token each after a pruning; a pair's tokens at a further merging layer) takes the needed count
  instead, as the reference's upper-bound branch does (the reference goes on, and raises "The cost
  is too small" once its cost is spent, or keeps round(n (1 - ratio)) tokens, possibly none);
- that needed count is taken among the tokens with a same-patch token before them: the first token
  of a patch never merges (the reference's top-k can pick one, whose similarity is -2, and average it
  into the previous patch, or, at the first position, into the last token, which it then drops); where
  fewer than needed have one, all of them merge and the next layer prunes to its allowance. So a
  layer that merges keeps a frame pair's tokens at least, and a video's floor is every token up to
  the first merging layer, a pair there, then one token a layer (`kinds.AdaptiveInLLMPruner`; a
  video that cannot meet it fails with `InfeasibleBudget`);
- on Qwen3-VL merging starts after the deepstack layers (`first_layer`), which add features to
  every visual token by position;
- the pruning's attention is softmaxed in float32 (the reference: the model's dtype); ties go to
  the earlier token;
- the patches are the tokens' positions within their frame pair; every visual token of the request
  is one pool (Qwen3-VL's timestamps between frames are text).
"""

from __future__ import annotations

import math

import torch

from ..budget.plan import InfeasibleBudget
from .inside_llm import BLOCK_ROWS, AdaptiveSchedule

SIMILARITY_LOWER_BOUND = 0.6  # similarity_lower_bound: a token merges into its neighbour at or above it
RATIO_LOWER_BOUND = 0.1  # ratio_lower_bound: merging ends when a layer merges a smaller share
QUERY_ROWS = 4  # the last queries whose attention ranks the visual tokens (utils.py's num=4)
IGNORE = -2.0  # the similarity of a token with no same-patch token before it


def neighbour_similarity(
    states: torch.Tensor, rows: torch.Tensor, patches: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, similarity), each (n,): the n visual tokens ordered by patch, then by position
    (`order`: indices into the n), and each one's cosine similarity to the one before it in that
    order when it is the same patch (the same position in the previous frame pair), else `IGNORE`.
    states: (L, H) hidden states; rows: (n,) the visual tokens' rows in it, in prompt order; patches:
    (n,) each one's position within its frame pair. Formed `BLOCK_ROWS` pairs of rows at a time."""
    order = torch.argsort(patches, stable=True)
    ordered = rows[order]
    cosine = torch.cat(
        [
            _cosine(states[ordered[block]], states[ordered[block + 1]])
            for block in torch.arange(len(order) - 1, device=rows.device).split(BLOCK_ROWS)
        ]
        or [states.new_empty(0)]
    )
    same = patches[order][:-1] == patches[order][1:]
    similarity = torch.cat([cosine.new_full((1,), IGNORE), cosine.masked_fill(~same, IGNORE)])
    return order, similarity


def _cosine(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity, as the reference computes it (main.py:345-349), in the rows' dtype."""
    return (previous * current).sum(dim=-1) / (previous.norm(dim=-1) * current.norm(dim=-1))


def merge_groups(order: torch.Tensor, merged: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(members, targets), each (count,) indices into the n visual tokens: the `count` `merged` tokens
    (in `order`'s order) and, for each, the token before its run of merged tokens, which it is
    averaged into: (start + members) / (m + 1) (main.py:285-316). merged: (n,) bool in `order`'s
    order (never the first of a patch). No host sync."""
    positions = torch.arange(len(order), device=order.device)
    start = torch.cummax(torch.where(merged, -1, positions), dim=0).values  # the last unmerged at or before
    picked = torch.argsort((~merged).to(torch.int8), stable=True)[:count]  # the merged, in order
    return order[picked], order[start[picked]]


def average_into(out: torch.Tensor, source: torch.Tensor, members, targets, heads: torch.Tensor) -> torch.Tensor:
    """`out` (L', H) with each member row of `source` (L, H) added into its target row of `out`, then
    each of the `heads` rows of `out` (every staying visual token's) divided by 1 + its members,
    `BLOCK_ROWS` members at a time; in place. members: (m,) rows of `source`; targets: (m,) rows of
    `out`; heads: (k,) rows of `out`."""
    sizes = torch.ones_like(out[:, 0]).index_add_(0, targets, torch.ones_like(targets, dtype=out.dtype))
    for block in torch.arange(len(members), device=members.device).split(BLOCK_ROWS):
        out.index_add_(0, targets[block], source[members[block]])
    for block in heads.split(BLOCK_ROWS):
        out[block] /= sizes[block, None]
    return out


def layer_allowance(budget: int, layers: int) -> int:
    """The most visual tokens each of `layers` layers may hold with `budget` token-layers left."""
    return budget // layers


def merge_decision(
    similarity: torch.Tensor, budget: int, layers: int, patches: int
) -> tuple[torch.Tensor, int, bool, bool]:
    """(merged, how many, done merging, done pruning) at a merging layer with `budget` token-layers
    left over its `layers` layers (this one included), its n tokens in `patches` patches: the tokens
    at or above `SIMILARITY_LOWER_BOUND`, unless they are at least the n - allowance the budget
    needs (or would leave the later layers less than they must hold): then the most similar
    n - allowance of the tokens that have a same-patch token before them (the first token of a
    patch never merges), and no more reduction follows; if fewer than that have one, all of them,
    and the next layer prunes. merged: (n,) bool in `similarity`'s order; reads one count on the host."""
    n = len(similarity)
    needed = n - layer_allowance(budget, layers)  # the reference's int(sparsity_upper_bound * n)
    similar = similarity >= SIMILARITY_LOWER_BOUND
    count = int(similar.sum())  # the host decides the new sequence length (one sync)
    done_merging = count < RATIO_LOWER_BOUND * n
    # what the later layers need at least: a token each after the pruning at the next layer, or, if
    # the next one merges again, a pair's tokens there
    later = layers - 1 if done_merging or layers == 1 else patches + layers - 2
    if count < needed and budget - (n - count) >= later:
        return similar, count, done_merging, False
    take = min(max(needed, 0), n - patches)
    merged = torch.zeros(n, dtype=torch.bool, device=similarity.device)
    merged[similarity.argsort(descending=True, stable=True)[:take]] = True  # IGNORE sorts last
    return merged, take, True, take == max(needed, 0)


def prune_keep(visual: int, budget: int, layers: int) -> int:
    """Visual tokens kept from the pruning layer on: its allowance, at most the `visual` there."""
    return min(visual, layer_allowance(budget, layers))


def total_budget(retention: float, num_layers: int, reference: int) -> int:
    """floor(R L N): the visual token-layers a prefill may hold for a layer-averaged R."""
    return math.floor(retention * num_layers * reference + 1e-9)


def typical_layers(num_layers: int, visual: int, retention: float, first_layer: int, patches: int) -> list[int]:
    """Visual tokens in each layer on a video of `visual` tokens in pairs of `patches` with no similar
    neighbours, decided as `FusionPruner` decides (the config-only rows): every token up to the first
    merging layer; there nothing is similar, so merging ends and the next layer keeps its allowance,
    unless the budget allows every token, or needs the most similar tokens merged at once (then that
    layer's allowance from it on, or, where fewer tokens have a same-patch token before them, all of
    those, and the next layer's allowance). `InfeasibleBudget` where a layer would keep none."""
    left = total_budget(retention, num_layers, visual) - first_layer * visual
    layers = num_layers - first_layer
    counts = [visual] * first_layer
    needed = visual - layer_allowance(left, layers)
    if needed <= 0:  # every token fits: nothing merges, nothing is pruned
        return counts + [visual] * layers
    held = visual if left - visual >= layers - 1 else visual - min(needed, visual - patches)
    if held <= layer_allowance(left, layers):  # the most similar merged at once, nothing more
        return counts + [held] * layers
    keep = prune_keep(held, left - held, layers - 1) if layers > 1 else 0
    if keep < 1:
        raise InfeasibleBudget(
            retention,
            (first_layer * visual + held + layers - 1) / (num_layers * visual),
            f"FrameFusion merging from layer {first_layer} of {num_layers} (one token a patch at least)",
        )
    return counts + [held] + [keep] * (layers - 1)


def working_bytes(x, tokens: int, visual: int, b: int) -> int:
    """A merging layer's (per block of `BLOCK_ROWS` neighbours two gathered rows and their product, or
    a block of gathered members; the similarity and index vectors) or the ranking's (keys of every
    token a block at a time, float32 rows of the last queries), whichever is larger, and the kept copy."""
    block = min(tokens, BLOCK_ROWS)
    merging = 3 * min(visual, BLOCK_ROWS) * x.hidden * b + 8 * visual * 8
    ranking = (tokens + 2 * block) * x.kv_heads * x.head_dim * b + 3 * x.heads * QUERY_ROWS * tokens * 4
    return max(merging, ranking) + tokens * x.hidden * b


SCHEDULE = AdaptiveSchedule(typical_layers, working_bytes)
