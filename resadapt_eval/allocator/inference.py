"""Allocator inference: policy mean / quantile / seeded sample -> per-frame scales, projected to R.

`AllocatorPolicy` is the `method=resadapt` budget policy: it runs the Allocator on the frames the
pipeline already decoded and the query, and records its time per stage (text encode, visual
encode, scale prediction) in seconds, as the paper's latency table splits it.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from ..budget.plan import TokenGrid, project_to_retention
from ..budget.policies import BudgetSpec
from .model import INFERENCE_MODES, Allocator, AllocatorConfig

BUILTIN = "builtin"


def load_allocator(spec: str | None, device: str | torch.device = "cpu") -> Allocator:
    """`builtin` (or None): the untrained default (minilm-effnet encoders, seed 0, initial mean
    scale 1.0); otherwise a `save_pretrained` folder."""
    if spec is None or spec == BUILTIN:
        allocator = Allocator(AllocatorConfig())
    else:
        allocator = Allocator.from_pretrained(Path(spec))
    return allocator.to(device).eval()


class AllocatorPolicy:
    """Budget policy backed by an Allocator (see `budget.policies` for the policy signature)."""

    def __init__(self, allocator: Allocator, mode: str = "mean", quantile: float = 0.5, seed: int = 0):
        if mode not in INFERENCE_MODES:
            raise ValueError(f"allocator inference must be one of {INFERENCE_MODES}, got {mode!r}")
        self.allocator, self.mode, self.quantile, self.seed = allocator, mode, quantile, seed

    def raw_scales(self, frames: np.ndarray, query: str, timings: dict) -> np.ndarray:
        """The Allocator's scales s_t for uint8 frames (T, H, W, 3) and a query, before
        projection; the stage seconds go into `timings`."""
        (scales,), stage_seconds = self.raw_scales_batch([frames], [query])
        timings.update(stage_seconds)
        return scales

    @torch.no_grad()
    def raw_scales_batch(self, frames: list[np.ndarray], queries: list[str]) -> tuple[list[np.ndarray], dict]:
        """`raw_scales` for several videos in one pass: one text encode, one visual encode per
        frame size, one Allocator forward over the padded batch. Returns the scales per video and
        the stage seconds divided equally among the videos."""
        enc = self.allocator.encoders
        t0 = time.perf_counter()
        text, text_mask = enc.encode_text(list(queries))
        t1 = time.perf_counter()
        lengths = [len(f) for f in frames]
        encoded = [None] * len(frames)
        by_shape = {}  # videos of one frame size are encoded in one call
        for i, f in enumerate(frames):
            by_shape.setdefault(f.shape[1:], []).append(i)
        for group in by_shape.values():
            flat = enc.encode_frames(torch.from_numpy(np.ascontiguousarray(np.concatenate([frames[i] for i in group]))))
            for i, chunk in zip(group, flat.split([lengths[i] for i in group])):
                encoded[i] = chunk
        t2 = time.perf_counter()
        feats = encoded[0].new_zeros(len(frames), max(lengths), encoded[0].shape[-1])
        mask = torch.zeros(feats.shape[:2], dtype=torch.bool, device=feats.device)
        for i, chunk in enumerate(encoded):
            feats[i, : len(chunk)], mask[i, : len(chunk)] = chunk, True
        p1, p2 = self.allocator(feats, mask, text, text_mask)
        scales = []
        for i, n in enumerate(lengths):
            a = self.allocator.latent_actions(p1[i, :n], p2[i, :n], self.mode, self.quantile, self.seed)
            scales.append(self.allocator.to_scale(a).double().cpu().numpy())
        n = len(frames)
        timings = dict(allocator_text_s=(t1 - t0) / n, allocator_visual_s=(t2 - t1) / n, allocator_predict_s=(time.perf_counter() - t2) / n)
        return scales, timings

    def __call__(self, num_frames: int, base_hw: tuple[int, int], grid: TokenGrid, spec: BudgetSpec, context: dict) -> np.ndarray:
        """Scales for `context["video"]`: the Allocator's (or those already in
        `context["raw_scales"]`), projected onto the target retention when there is one."""
        timings = context.setdefault("timings", {})
        if "raw_scales" not in context:
            context["raw_scales"] = self.raw_scales(context["video"].frames, context.get("query", ""), timings)
        scales = context["raw_scales"]
        if spec.retention is None:
            return np.clip(scales, spec.s_min, spec.s_max)
        t0 = time.perf_counter()
        projected = project_to_retention(scales, spec.retention, base_hw, grid, spec.s_min, spec.s_max, **spec.plan_bounds)
        timings["allocator_predict_s"] = timings.get("allocator_predict_s", 0.0) + time.perf_counter() - t0
        return projected
