"""IPCV's pruning inside the vision tower against its reference rule, written out here.

Reference: Perkzi/IPCV@29726f044f0f9c0c2be4eb0005888ddeb5fa188e,
`Qwen2-VL/Qwen2VL_IPCV/modeling_qwen2_vl_IPCV.py`:
- :1166-1172 and :1299-1320: at block K's input, diff = h_K - h_{K-1}, its L2 norm per patch, the top
  int(n (1 - vit_reduction_ratio)) by `topk`, sorted (:1179);
- :1183-1215: removed = the rest; `torch.cdist(removed.float(), kept.float())`, the 10 smallest per row;
- :393-416 (a restoring block) and :1267-1294 (after the last block): a removed patch is its state at
  K plus the mean over its neighbours of (kept now - kept at K), via `torch.unique` and `inv_idx`;
- :418-432: a restoring block attends over every patch, then keeps the kept ones for its MLP;
  :1252-1260: blocks K .. K + AS_layer - 1 restore, the later ones run on the kept patches with their
  own `cu_seqlens` (:1185-1196) and rotary rows.
Documented deviations applied to the reference here: the top-k is taken within each attention segment
(frame pair), a segment keeping the count it is given; R kept per pair (the tower's share).
"""

import random

import pytest
import torch

from resadapt_eval.backbones.tower_reduction import TowerPruner
from resadapt_eval.baselines import ipcv


def reference_keep(cur: torch.Tensor, prev: torch.Tensor, segments: list[int], keeps: list[int]) -> torch.Tensor:
    """:1299-1320 and :1179 in each segment."""
    diff_norm = torch.norm(cur - prev, dim=-1)
    kept, start = [], 0
    for n, k in zip(segments, keeps):
        kept.append(diff_norm[start : start + n].topk(k).indices + start)
        start += n
    return torch.cat(kept).sort().values


def reference_neighbours(removed: torch.Tensor, kept: torch.Tensor, top_k: int = 10):
    """:1198-1212: cdist, the smallest `top_k`, and the unique/inverse bookkeeping."""
    dists = torch.cdist(removed.float(), kept.float(), p=2.0)
    _, rem_to_kept_idx = dists.topk(min(top_k, kept.shape[0]), largest=False, dim=1)
    unique_idx, inv_idx = torch.unique(rem_to_kept_idx.view(-1), return_inverse=True)
    return rem_to_kept_idx, unique_idx, inv_idx


def reference_restore(new_kept, orig_kept, removed_states, rem_to_kept_idx, unique_idx, inv_idx):
    """:1275-1291: the removed patches' restored states."""
    delta_unique = new_kept[unique_idx] - orig_kept[unique_idx]
    return removed_states + delta_unique[inv_idx.view(rem_to_kept_idx.shape)].mean(dim=1)


def cases():
    rng = random.Random(0)
    for n in (1, 2, 5, 8, 13, 32):
        for _ in range(20):
            segments = [n + rng.randrange(0, 3) for _ in range(rng.randrange(1, 4))]
            keeps = [rng.randrange(1, s + 1) for s in segments]
            yield segments, keeps, rng.randrange(10**6)


@pytest.mark.parametrize("segments,keeps,seed", list(cases()))
def test_kept_patches_neighbours_and_restored_states_are_the_references(segments, keeps, seed):
    g = torch.Generator().manual_seed(seed)
    total, width = sum(segments), 8
    prev, cur = (torch.randn(total, width, generator=g, dtype=torch.float64) for _ in range(2))
    change = torch.linalg.vector_norm((cur - prev).float(), dim=-1)
    kept = ipcv.select(change, segments, keeps)
    assert kept.tolist() == reference_keep(cur.float(), prev.float(), segments, keeps).tolist()

    removed = torch.tensor(sorted(set(range(total)) - set(kept.tolist())), dtype=torch.long)
    kept_then, removed_then = cur[kept], cur[removed]
    near = ipcv.neighbours(removed_then, kept_then)
    rem_to_kept_idx, unique_idx, inv_idx = reference_neighbours(removed_then, kept_then)
    assert near.tolist() == rem_to_kept_idx.tolist()

    kept_now = kept_then + torch.randn(kept_then.shape, generator=g, dtype=torch.float64)
    ours = ipcv.restore(kept_now, kept_then, removed_then, near)
    theirs = reference_restore(kept_now, kept_then, removed_then, rem_to_kept_idx, unique_idx, inv_idx)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_the_neighbour_search_in_blocks_of_rows_is_the_whole_matrix_s(monkeypatch):
    g = torch.Generator().manual_seed(3)
    removed, kept = torch.randn(50, 6, generator=g), torch.randn(20, 6, generator=g)
    whole = ipcv.neighbours(removed, kept)
    monkeypatch.setattr(ipcv, "NEIGHBOUR_ROWS", 7)
    assert torch.equal(ipcv.neighbours(removed, kept), whole)
    assert whole.shape == (50, 10)


def test_the_blocks_are_the_references_at_the_same_relative_depth():
    assert ipcv.settings(32) == (3, 7)  # demo.py:17, :26
    assert ipcv.settings(27) == (2, 5)  # Qwen3-VL-8B
    assert ipcv.settings(4) == (1, 0) and ipcv.settings(2) == (1, 0)
    assert ipcv.kept_patches(100, 0.25) == 25 and ipcv.kept_patches(3, 0.1) == 1


def reference_tower(visual, pixels, grid, pruned: int, restoring: int, keeps: list[int]):
    """:1139-1297 on the tiny Qwen3-VL tower (its patch embedding, position and rotary embeddings and
    blocks; its DeepStack mergers and merger reading every patch, restored, as the VidCom2 port does),
    the blocks called directly with the tower's own `cu_seqlens` and rotary embeddings (captured)."""
    captured = {}

    def capture(module, args, kwargs):
        captured.setdefault("input", args[0])
        captured.setdefault("kwargs", dict(kwargs))

    hook = visual.blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
    visual(pixels, grid_thw=grid)
    hook.remove()
    hidden, kwargs = captured["input"], captured["kwargs"]
    cu_seqlens, (cos, sin) = kwargs["cu_seqlens"], kwargs["position_embeddings"]
    segments = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    saved, prev, taps = None, None, []
    for i, blk in enumerate(visual.blocks):
        if i == pruned - 1:
            prev = hidden
        if i == pruned:
            kept = reference_keep(hidden, prev, segments, keeps)
            removed = torch.tensor(sorted(set(range(hidden.shape[0])) - set(kept.tolist())), dtype=torch.long)
            near, unique_idx, inv_idx = reference_neighbours(hidden[removed], hidden[kept])
            saved = (kept, removed, hidden[kept], hidden[removed], near, unique_idx, inv_idx)
            hidden = hidden[kept]
            pruned_cu = torch.tensor([0, *keeps]).cumsum(0).to(cu_seqlens.dtype)

        def full_of(kept_now):
            kept, removed, orig_kept, removed_states, near, unique_idx, inv_idx = saved
            full = torch.zeros(sum(segments), kept_now.shape[-1], dtype=kept_now.dtype)
            full[kept] = kept_now
            full[removed] = reference_restore(kept_now, orig_kept, removed_states, near, unique_idx, inv_idx)
            return full

        if saved is not None and i < pruned + restoring:  # attention over every patch, then the kept ones
            attended = full_of(hidden)
            attended = attended + blk.attn(blk.norm1(attended), cu_seqlens=cu_seqlens, position_embeddings=(cos, sin))
            hidden = attended[saved[0]]
            hidden = hidden + blk.mlp(blk.norm2(hidden))
        elif saved is not None:
            hidden = blk(hidden, cu_seqlens=pruned_cu, position_embeddings=(cos[saved[0]], sin[saved[0]]))
        else:
            hidden = blk(hidden, cu_seqlens=cu_seqlens, position_embeddings=(cos, sin))
        if i in visual.deepstack_visual_indexes:
            tap = full_of(hidden) if saved is not None else hidden
            taps.append(visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(i)](tap))
    return visual.merger(full_of(hidden)), taps


@pytest.mark.parametrize("restoring", [0, 1])
def test_the_hooked_tower_runs_the_references_loop(adapters, restoring, monkeypatch):
    """The tiny Qwen3-VL tower (2 blocks, a DeepStack tap after block 0), K = 1, with and without a
    restoring block: the merger's and the DeepStack merger's outputs equal the reference loop's."""
    monkeypatch.setattr(ipcv, "RESTORING_LAYERS", 32 * restoring)  # settings(2) -> (1, restoring)
    visual = adapters["qwen3vl"].model.model.visual
    config = adapters["qwen3vl"].model.config.vision_config
    grid = torch.tensor([[2, 4, 6]])  # two frame pairs of 24 patches
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(48, config.in_channels * config.temporal_patch_size * config.patch_size**2, generator=g)
    keeps = [7, 10]
    with torch.no_grad():
        pruner = TowerPruner(visual, ipcv.PRUNING, [24, 24], keeps, lambda fn: fn)
        with pruner.attached():
            ours = visual(pixels, grid_thw=grid, return_dict=True)
        merged, taps = reference_tower(visual, pixels, grid, 1, restoring, keeps)
    torch.testing.assert_close(ours.pooler_output, merged, rtol=0, atol=1e-5)
    for tapped, theirs in zip(ours.deepstack_features, taps, strict=True):
        torch.testing.assert_close(tapped, theirs, rtol=0, atol=1e-5)
    assert pruner.block_patches == [48, 48 if restoring else 17]
