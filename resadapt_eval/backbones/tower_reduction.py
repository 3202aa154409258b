"""Merging visual tokens inside the vision tower, through hooks on its blocks (no copy of its forward).

`TowerReducer` hooks a Qwen3-VL tower for one forward: after each merging block it reads the
attention the block's merge units received (recomputed eagerly from the block's input, as
`vision_attention.received_attention_and_keys` does for the last block), merges whole units of
every attention segment (a frame pair) by the method's rule (`baselines/illava.merge_units`), and
hands the later blocks the kept units' `cu_seqlens`, `max_seqlen` and rotary embeddings through a
pre-hook. The tower's merger and the DeepStack mergers after a merging block see the kept units;
features tapped before one are merged afterwards with the same weights (`follow`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .vision_attention import received_attention_and_keys


class TowerReducer:
    """One forward of `visual` (a Qwen3-VL vision tower) that merges after the blocks of `schedule`
    (block -> units each segment keeps after it, in segment order), starting from `segment_units`
    units per segment; `rotary`: the tower's rotary function; `count`: wraps the merging work
    (a `counting.CountedCall` factory: `count(fn)`), so it is counted and timed."""

    def __init__(self, visual, schedule: dict[int, list[int]], segment_units: list[int], rotary, merge, count):
        self.visual, self.schedule, self.rotary = visual, schedule, rotary
        self.unit = visual.spatial_merge_size**2
        self.segments = list(segment_units)
        self.work = count(self._merge)
        self.merge_rule = merge
        self.merges: list[tuple[int, object]] = []  # (block, UnitMerge) in order
        self.origin: torch.Tensor | None = None  # each current unit's index among the tower's input units
        self.sizes: torch.Tensor | None = None  # how many input units each current unit averages
        self.group: torch.Tensor | None = None  # each input unit's current unit (its index among them)
        self.block_units: list[int] = []  # units entering each block, then the merger
        self._captured: dict = {}
        self._state: tuple | None = None  # (cu_seqlens, position_embeddings) of the kept units

    @contextmanager
    def attached(self):
        """Hooks on the tower's blocks for the next forward."""
        hooks = []
        for index, block in enumerate(self.visual.blocks):
            hooks.append(block.register_forward_pre_hook(self._inputs, with_kwargs=True))
            if index in self.schedule:
                hooks.append(block.attn.register_forward_pre_hook(self._capture, with_kwargs=True))
                hooks.append(block.register_forward_hook(self._after(index)))
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def _inputs(self, module, args, kwargs):
        hidden = args[0]
        if self.origin is None:
            self.origin = torch.arange(hidden.shape[0] // self.unit, device=hidden.device)
            self.sizes = torch.ones_like(self.origin)
            self.group = self.origin.clone()
        self.block_units.append(hidden.shape[0] // self.unit)
        if self._state is None:
            return None
        cu_seqlens, position_embeddings = self._state
        kwargs["cu_seqlens"], kwargs["position_embeddings"] = cu_seqlens, position_embeddings
        if kwargs.get("max_seqlen") is not None:
            kwargs["max_seqlen"] = max(self.segments) * self.unit
        return args, kwargs

    def _capture(self, module, args, kwargs):
        self._captured = dict(
            module=module,
            hidden_states=args[0],
            cu_seqlens=kwargs["cu_seqlens"],
            position_embeddings=kwargs["position_embeddings"],
        )

    def _after(self, index: int):
        def hook(module, args, output):
            return self.work(index, output)

        return hook

    def _merge(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        captured = self._captured
        received, _ = received_attention_and_keys(captured, self.rotary, self.unit)
        after = self.schedule[index]
        merge = self.merge_rule(received, self.segments, after)
        self.merges.append((index, merge))
        self.origin = self.origin[merge.survivors]
        self.sizes = torch.zeros_like(merge.survivors).index_add_(0, merge.assignment, self.sizes)
        self.group = merge.assignment[self.group]
        patches = merge.survivors[:, None] * self.unit + torch.arange(self.unit, device=hidden.device)
        cos, sin = captured["position_embeddings"]
        rows = patches.flatten()
        self.segments = list(after)
        bounds = torch.tensor([0, *after], device=captured["cu_seqlens"].device).cumsum(0) * self.unit
        self._state = (bounds.to(captured["cu_seqlens"].dtype), (cos[rows], sin[rows]))
        return merge.apply(hidden.reshape(-1, self.unit, hidden.shape[-1])).reshape(-1, hidden.shape[-1])

    def follow(self, tapped: list[torch.Tensor], tap_blocks: list[int]) -> list[torch.Tensor]:
        """The DeepStack features `tapped` after `tap_blocks` (per unit), each merged by the merges of
        the blocks after its tap, so that all follow the kept units."""
        followed = []
        for feature, tap in zip(tapped, tap_blocks):
            for block, merge in self.merges:
                if block > tap:
                    feature = merge.apply(feature)
            followed.append(feature)
        return followed

    @property
    def assignment(self) -> torch.Tensor:
        """(N,) each input unit's destination: the input unit its merged unit sits at (`origin`)."""
        return self.origin[self.group]

    def seconds(self) -> float:
        """Seconds the merging took."""
        return self.work.seconds()

    @property
    def flops(self) -> int:
        """FLOPs of the merging (the recomputed attention and the averages), as counted."""
        return self.work.flops


class TowerPruner:
    """One forward of `visual` (a Qwen3-VL vision tower) that prunes patches at block K's input and
    restores them where they are read (`baselines/ipcv.py`): the patches of each attention segment
    (`segment_patches`) ranked by their change over block K - 1; blocks K .. K + restoring - 1 attend
    over every patch, the removed ones restored, and hand on the kept ones; the later blocks run on
    the kept ones; a block whose output a DeepStack merger or the merger reads hands it every patch,
    restored; each segment keeps `keeps` patches; K is `pruned` (None: the rule's own). `count` wraps
    the pruning's own work (the neighbour search), counted and timed."""

    def __init__(self, visual, pruning, segment_patches: list[int], keeps: list[int], count, pruned: int | None = None):
        self.visual, self.rule = visual, pruning
        self.pruned, restoring = pruning.settings(len(visual.blocks), pruned)
        self.restoring = range(self.pruned, self.pruned + restoring)
        self.reads_all = {*visual.deepstack_visual_indexes, len(visual.blocks) - 1}
        self.segments, self.keeps = list(segment_patches), list(keeps)
        self.work = count(self._prune)
        self.block_patches: list[int] = []  # patches entering each block (its attention and MLP), then the merger
        self._previous: torch.Tensor | None = None
        self._state: dict | None = None

    @contextmanager
    def attached(self):
        """Hooks on the tower's blocks for the next forward."""
        hooks = []
        for index, block in enumerate(self.visual.blocks):
            hooks.append(block.register_forward_pre_hook(self._inputs(index), with_kwargs=True))
            if index >= self.pruned:
                hooks.append(block.register_forward_hook(self._outputs(index)))
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def _inputs(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0]
            if index == self.pruned - 1:
                self._previous = hidden
            if index == self.pruned:
                self.work(hidden, kwargs)
            state = self._state
            if state is None:
                self.block_patches.append(hidden.shape[0])
                return None
            if index in self.restoring:  # every patch attends, the removed ones restored
                full = hidden if hidden.shape[0] == state["total"] else self.restored(hidden)
                self.block_patches.append(full.shape[0])
                return (full, *args[1:]), kwargs
            kept = hidden[state["kept"]] if hidden.shape[0] == state["total"] else hidden
            kwargs["cu_seqlens"], kwargs["position_embeddings"] = state["cu_seqlens"], state["position_embeddings"]
            if kwargs.get("max_seqlen") is not None:
                kwargs["max_seqlen"] = state["max_seqlen"]
            self.block_patches.append(kept.shape[0])
            return (kept, *args[1:]), kwargs

        return hook

    def _outputs(self, index: int):
        def hook(module, args, output):
            state = self._state
            kept = output[state["kept"]] if output.shape[0] == state["total"] else output
            return self.restored(kept) if index in self.reads_all else kept

        return hook

    def _prune(self, hidden: torch.Tensor, kwargs: dict) -> None:
        rule = self.rule
        change = torch.linalg.vector_norm((hidden - self._previous).float(), dim=-1)
        kept = rule.select(change, self.segments, self.keeps)
        removed_mask = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        removed_mask[kept] = False
        removed = torch.nonzero(removed_mask).flatten()
        kept_then, removed_then = hidden[kept], hidden[removed]
        counts = self.keeps
        cu_seqlens = kwargs["cu_seqlens"]
        cos, sin = kwargs["position_embeddings"]
        self._state = dict(
            total=hidden.shape[0],
            kept=kept,
            removed=removed,
            kept_then=kept_then,
            removed_then=removed_then,
            near=rule.neighbours(removed_then, kept_then),
            cu_seqlens=torch.tensor([0, *counts], device=cu_seqlens.device).cumsum(0).to(cu_seqlens.dtype),
            position_embeddings=(cos[kept], sin[kept]),
            max_seqlen=max(counts),
        )
        self._previous = None

    def restored(self, kept_now: torch.Tensor) -> torch.Tensor:
        """Every patch: the kept ones as they are now, the removed ones restored (`ipcv.restore`)."""
        state = self._state
        full = kept_now.new_empty(state["total"], kept_now.shape[-1])
        full[state["kept"]] = kept_now
        full[state["removed"]] = self.rule.restore(
            kept_now, state["kept_then"], state["removed_then"], state["near"]
        ).to(kept_now.dtype)
        return full

    def seconds(self) -> float:
        """Seconds the pruning's own work took."""
        return self.work.seconds()

    @property
    def flops(self) -> int:
        """FLOPs of the pruning's own work (the neighbour search), as counted."""
        return self.work.flops
