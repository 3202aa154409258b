"""IPCV's pruning inside the vision tower (Perkzi/IPCV, "Information-Preserving Compression for MLLM
Visual Encoders"; code: Perkzi/IPCV@29726f0, its Qwen2-VL tower
`Qwen2-VL/Qwen2VL_IPCV/modeling_qwen2_vl_IPCV.py`, run with DART inside the LLM, and the VidCom2
codebase's Qwen3-VL port, xuyang-liu16/VidCom2@98dad55 `token_compressor/ipcv/`).

The reference (`IPCV_ViT.forward`, :1139-1297, and `get_retained_image_token_diff`, :1299-1320): at
the input of block K (`vit_pruned_layer` = 3 of Qwen2-VL's 32), each patch's change over block K - 1,
||h_K - h_{K-1}||_2, ranks the patches; the top int(n (1 - vit_reduction_ratio)) stay (0.65 in
`Qwen2-VL/demo.py:17-18`, where DART's `reduction_ratio` inside the LLM is set the same). Each
removed patch's 10 nearest kept patches (L2 on the states at K,
`torch.cdist`, `Top_K` = 10, `eval_scripts/lmms_eval_multi.sh:39`) are noted. In the next `AS_layer`
= 7 blocks (K to K + 6) a removed patch is restored as its state at K plus the mean change of its
neighbours since K (`Qwen2VLVisionBlock.forward`, :393-416), the block attends over every patch, and
only the kept patches go on (:430-432); the later blocks run on the kept patches alone; after the
last block every removed patch is restored the same way (:1267-1294), so the merger, and the LLM,
see every token. The LLM prunes with DART (`Qwen2VLModel.forward`, :1615-1640; this package's
`baselines/dart.py`), which sets the budget R.

Here: `backbones/tower_reduction.TowerPruner` runs it through hooks on the tower's blocks; this module
holds the rule (`select`, `neighbours`, `restore`) and its settings (`settings`).

Deviations from the reference:
- the tower keeps the share R of the budget (vit_reduction_ratio = 1 - R, as the reference's demo sets
  it equal to the LLM's reduction ratio and the VidCom2 port reads it from R), so R = 1 is vanilla;
- each frame pair keeps int(n R) of its n patches (the reference: that share of the whole video's
  patches, so a pair may keep more or fewer), so the tower's per-block counts, and its FLOPs, follow
  from the plan;
- the blocks at the reference's relative depth: K = 3 d / 32 (at least 1: the reference needs
  K >= 2, `K-1>0` at :1168, which a tower of 22 blocks or more gives; Qwen3-VL-8B's 27: K = 2), and
  7 d / 32 restoring blocks (27: 5);
- a restoring block's MLP runs over every patch, and the removed patches' outputs are dropped (the
  reference runs it on the kept ones only: hooks cannot cut a block between its attention and its
  MLP); the kept patches' values are the reference's;
- the neighbours come from the distances of at most `NEIGHBOUR_ROWS` removed patches at a time
  (||a||^2 + ||b||^2 - 2 a.b, float32, as `torch.cdist` computes them for large inputs): the same
  nearest 10, without the reference's removed x kept matrix (35 GB at 128 frames of Qwen3-VL-8B);
- on Qwen3-VL, the DeepStack mergers read every patch, the removed ones restored (as the VidCom2 port
  does, `models/qwen3_vl.py:212-227`);
- Qwen3-VL only: Qwen2.5-VL's windowed blocks would need their windows re-formed (not ported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REFERENCE_DEPTH = 32
PRUNED_LAYER = 3  # vit_pruned_layer of Qwen2-VL's 32 blocks (Qwen2-VL/demo.py:17)
RESTORING_LAYERS = 7  # AS_layer (Qwen2-VL/demo.py:26)
TOP_K = 10  # neighbours of a removed patch (Qwen2-VL/eval_scripts/lmms_eval_multi.sh:39)
NEIGHBOUR_ROWS = 4096  # removed patches whose distances are formed at once


def settings(depth: int, pruned: int | None = None) -> tuple[int, int]:
    """(K, restoring blocks) of a `depth`-block tower: the reference's 3 and 7 of 32 at the same
    relative depth, K at least 1 and at most depth - 1 (27 blocks: 2 and 5; 2 blocks: 1 and 0), or
    K = `pruned` (`tower_layers=`)."""
    if pruned is None:
        pruned = min(max(1, PRUNED_LAYER * depth // REFERENCE_DEPTH), depth - 1)
    return pruned, RESTORING_LAYERS * depth // REFERENCE_DEPTH


def kept_patches(patches: int, retention: float) -> int:
    """Patches a frame pair of `patches` keeps at R: int(n (1 - vit_reduction_ratio)) with
    vit_reduction_ratio = 1 - R, at least 1."""
    return max(1, int(patches * retention + 1e-9))


def select(change: torch.Tensor, segments: list[int], keeps: list[int]) -> torch.Tensor:
    """Sorted indices of the kept patches: in each segment of `segments` patches, its `keeps` of
    largest `change` (ties to the earlier patch)."""
    device = change.device
    sizes = torch.tensor(segments, device=device)
    segment = torch.repeat_interleave(torch.arange(len(segments), device=device), sizes, output_size=sum(segments))
    starts = torch.cumsum(sizes, 0) - sizes
    by_change = torch.sort(change.float(), descending=True, stable=True).indices
    order = by_change[torch.sort(segment[by_change], stable=True).indices]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0], device=device) - starts[segment[order]]
    keep = torch.tensor(keeps, device=device)
    return torch.nonzero(rank < keep[segment]).flatten()


def neighbours(removed: torch.Tensor, kept: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """(R, min(k, K)) indices of each removed patch's nearest kept patches by L2 distance (float32),
    nearest first, `NEIGHBOUR_ROWS` removed patches at a time."""
    kept = kept.float()
    kept_norms = (kept * kept).sum(-1)
    count = min(k, kept.shape[0])
    found = []
    for start in range(0, removed.shape[0], NEIGHBOUR_ROWS):
        rows = removed[start : start + NEIGHBOUR_ROWS].float()
        squared = (rows * rows).sum(-1, keepdim=True) + kept_norms - 2 * rows @ kept.T
        found.append(squared.clamp_min(0).topk(count, dim=-1, largest=False).indices)
    return torch.cat(found) if found else torch.zeros(0, count, dtype=torch.long, device=removed.device)


def restore(kept_now: torch.Tensor, kept_then: torch.Tensor, removed_then: torch.Tensor, near: torch.Tensor):
    """The removed patches' states now: their states at K plus the mean change of their `near`
    kept neighbours since K (R, D)."""
    return removed_then + (kept_now - kept_then)[near].mean(dim=1)


def distance_flops(removed: int, kept: int, width: int) -> int:
    """The neighbour search's matmul: 2 R K D."""
    return 2 * removed * kept * width


@dataclass(frozen=True)
class TowerPruning:
    """A vision-tower pruning method whose tower restores every patch (`kinds.IN_TOWER_THEN_PRUNER`):
    its blocks (`settings`), the patches each pair keeps (`kept_patches`) and the rule."""

    settings: object
    kept_patches: object
    select: object
    neighbours: object
    restore: object
    distance_flops: object
    layer_count: int = 1  # `tower_layers=` names K

    def check_layers(self, layers: list[int], depth: int) -> None:
        """K within [1, depth - 1]: the change over block K - 1 ranks the patches entering block K."""
        if not all(1 <= b <= depth - 1 for b in layers):
            raise ValueError(
                f"model_args tower_layers {list(layers)} must lie in [1, {depth - 1}] on this vision tower of {depth} "
                "blocks (the change over the block before ranks the patches)"
            )


PRUNING = TowerPruning(settings, kept_patches, select, neighbours, restore, distance_flops)
