"""iLLaVA's merging inside the vision tower (Hu et al., "iLLaVA: An Image is Worth Fewer Than 1/3
Input Tokens in Large Multimodal Models", arXiv:2412.06263; code: hulianyuyy/iLLaVA@4068149, its
Qwen2-VL tower `src/transformers-4.46.0/src/transformers/models/qwen2_vl/modeling_qwen2_vl.py`).

The reference (`Qwen2VLVisionBlock.forward`, :436-504), in each of its merging blocks (12-15 of
Qwen2-VL's 32, `src/VLMEvalKit/vlmeval/config.py:339`; `VisionTransformer.forward`, :1119-1137),
for each attention segment (a frame, `cu_seqlens`): the attention every token receives, averaged
over heads and query tokens (`attn_weights.mean(0)` twice, :466-474, the eager shapes its comment
names); the r + 1 tokens that receive the least (`topk(r + 1, largest=False)`, ascending), with
r = floor(0.16 n) rounded down to a multiple of 4 (:467-472); they are averaged with weights
r + 1, r, ..., 1 (the least-attended weighs most) into the (r + 1)-th, which keeps its place and
rotary position, and the other r leave the sequence (:475-487); the block's MLP then runs on the
rest. Here: `backbones/tower_reduction.TowerReducer` runs it through hooks on the tower's blocks;
this module holds the rule (`merge_units`) and the schedule (`default_layers`, `layer_counts`).

Deviations from the reference:
- whole 2 x 2 merge units, not patches: a unit's score is the mean of its patches' received
  attention, and the r + 1 least-attended units merge patch by patch (patch j into patch j). The
  reference picks patches (r a multiple of 4, but any 4 patches), so the merger, which fuses 4
  consecutive patches, then fuses patches of different units;
- the merge happens after the block's MLP (at the next block's input), scored by the block's own
  attention recomputed from its input: a block's residual stream cannot be cut between its
  attention and its MLP through hooks; the reference merges before the MLP;
- exact budgets: a frame pair of n units keeps k of floor(R N) (`common.per_pair_budget`), reached
  geometrically over the m merging blocks, ceil(n (k / n)^(j / m)) units after the j-th (the
  reference removes a fixed 16% of what is left in each, about 50% after 4);
- the merging blocks: 4 consecutive blocks from 12/32 of the tower's depth, as many as come before
  the last block (Qwen3-VL-8B's 27 blocks: 10-13);
- on Qwen3-VL, DeepStack features tapped before a merging block are merged with the same weights,
  so every tapped feature follows the kept units;
- the attention is the eager one in float32 (the reference's flash path reads the log-sum-exp
  flash-attention returns in place of attention weights); the merged features are averaged in
  float32 and cast to the tower's dtype (the reference casts to float16); ties go to the earlier unit;
- Qwen3-VL only: on Qwen2.5-VL the blocks between full-attention blocks attend in 112-px windows,
  which a merge would have to re-form (`cu_window_seqlens`); not ported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

REFERENCE_LAYERS = (12, 13, 14, 15)  # of Qwen2-VL's 32 vision blocks (VLMEvalKit config.py:339)
REFERENCE_DEPTH = 32


def default_layers(depth: int) -> list[int]:
    """The reference's 4 merging blocks at the same relative depth of a `depth`-block tower, as many
    as come before its last block (32 blocks: 12-15; 27: 10-13; 2: 0)."""
    start = REFERENCE_LAYERS[0] * depth // REFERENCE_DEPTH
    return list(range(start, min(start + len(REFERENCE_LAYERS), depth - 1)))


def layer_counts(units: int, keep: int, merges: int) -> list[int]:
    """Units a frame pair of `units` holds after each of `merges` merging blocks, ending at `keep`:
    ceil(units (keep / units)^(j / merges)), the geometric path of the reference's fixed ratio."""
    if not 1 <= keep <= units:
        raise ValueError(f"keep={keep} units is outside [1, {units}]")
    path = [math.ceil(units * (keep / units) ** (j / merges) - 1e-9) for j in range(1, merges)]
    return [max(keep, count) for count in path] + [keep]


@dataclass(frozen=True)
class UnitMerge:
    """One merging block's reduction of U units to K: assignment (U,) the output unit each input
    unit goes into; weights (U,) its weight in that output's average; survivors (K,) the input unit
    whose place (and rotary position) each output unit takes, ascending."""

    assignment: torch.Tensor
    weights: torch.Tensor
    survivors: torch.Tensor

    def apply(self, features: torch.Tensor) -> torch.Tensor:
        """(K, ...) the weighted averages of `features` (U, ...) per output unit, in float32, cast back."""
        flat = features.reshape(features.shape[0], -1).float()
        weights = self.weights.to(flat.dtype)
        total = flat.new_zeros(self.survivors.shape[0], flat.shape[1]).index_add_(
            0, self.assignment, flat * weights[:, None]
        )
        norm = weights.new_zeros(self.survivors.shape[0]).index_add_(0, self.assignment, weights)
        return (total / norm[:, None]).to(features.dtype).reshape(-1, *features.shape[1:])


def merge_units(scores: torch.Tensor, segment_units: list[int], after: list[int]) -> UnitMerge:
    """iLLaVA's merge in every attention segment at once: `scores` (U,) the attention each unit
    received, in segments of `segment_units` units; a segment of n units keeps `after` of them: its
    r = n - after least-attended units and the (r + 1)-th average into the (r + 1)-th with weights
    r + 1, ..., 1 (ties to the earlier unit)."""
    device = scores.device
    sizes = torch.tensor(segment_units, device=device)
    segment = torch.repeat_interleave(
        torch.arange(len(segment_units), device=device), sizes, output_size=sum(segment_units)
    )
    removed = sizes - torch.tensor(after, device=device)
    starts = torch.cumsum(sizes, 0) - sizes
    # ascending by score within each segment: a stable sort by score, then a stable sort by segment
    by_score = torch.sort(scores.float(), stable=True).indices
    order = by_score[torch.sort(segment[by_score], stable=True).indices]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0], device=device) - starts[segment[order]]
    r = removed[segment]
    destination = order[starts + removed][segment]  # the (r + 1)-th least-attended unit of each segment
    merged = rank <= r
    weights = torch.where(merged, (r + 1 - rank).to(torch.float32), torch.ones_like(rank, dtype=torch.float32))
    stays = ~(rank < r)
    output_of = torch.cumsum(stays.long(), 0) - 1  # each surviving unit's output index
    target = torch.where(merged, destination, torch.arange(order.shape[0], device=device))
    return UnitMerge(output_of[target], weights, torch.nonzero(stays).flatten())


@dataclass(frozen=True)
class TowerMerging:
    """A vision-tower merging method (`kinds.IN_TOWER_REDUCER`): the blocks it merges after
    (`default_layers`), each pair's units after each of them (`layer_counts`) and the merge of one
    block (`merge_units`, given the attention the units received in it)."""

    default_layers: object
    layer_counts: object
    merge: object
    layer_count: int | None = None  # how many blocks `tower_layers=` names (None: any number)

    def check_layers(self, layers: list[int], depth: int) -> None:
        """A merge after each of `layers`, strictly increasing, each with a block after it."""
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"model_args tower_layers must be strictly increasing, got {list(layers)}")
        if not all(0 <= b <= depth - 2 for b in layers):
            raise ValueError(
                f"model_args tower_layers {list(layers)} must lie in [0, {depth - 2}] on this vision tower of {depth} "
                "blocks (a merge after a block needs a block after it)"
            )


MERGING = TowerMerging(default_layers, layer_counts, merge_units)
