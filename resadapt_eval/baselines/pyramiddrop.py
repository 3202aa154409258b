"""PyramidDrop (Xing et al., CVPR 2025, "PyramidDrop: Accelerating Your Large Vision-Language
Models via Pyramid Visual Redundancy Reduction"; code: github.com/Cooperx521/PyramidDrop): the LLM
is split into stages; at the end of each stage the visual tokens still present are ranked by the
attention of the last instruction token (in the stage's last layer) and a ratio lambda of them is
kept, so the token count shrinks geometrically: N, lambda N, lambda^2 N, lambda^3 N. The paper
ends stages at layers 8, 16, 24 of 32 (a quarter each) with lambda = 0.5.

Deviations from the reference:
- lambda is solved from the layer-averaged target R (`inside_llm`): the largest lambda whose counts
  max(1, floor(lambda^i N)) have a layer average not above R; with stage boundaries at L/4, L/2,
  3L/4 the layer average cannot go below 0.25, so lower targets need earlier boundaries
  (`prune_layers=`, as the VisionZip and SparseVLM comparisons configure it);
- on Qwen3-VL every boundary comes after the deepstack layers;
- the last token's attention row is computed from the layer's own q/k projections and rotary.
"""

from __future__ import annotations

import math

from .inside_llm import Stage, check_layers, infeasible, layer_average


def default_layers(num_layers: int, first_layer: int = 0) -> list[int]:
    """Stage boundaries at L/4, L/2 and 3L/4 (8, 16, 24 of 32), none before `first_layer`."""
    return sorted({max(first_layer, 1, num_layers * q // 4) for q in (1, 2, 3)})


def schedule(layers: list[int], visual: int, ratio: float) -> list[Stage]:
    """Stages keeping max(1, floor(ratio^i N)) tokens from boundary i (1-based) on."""
    return [Stage(layer, max(1, math.floor(ratio**i * visual + 1e-9))) for i, layer in enumerate(layers, start=1)]


def stages(
    num_layers: int, visual: int, retention: float, layers: list[int] | None = None, first_layer: int = 0
) -> list[Stage]:
    """The schedule with the largest lambda whose layer-averaged retention is not above `retention`."""
    layers = layers or default_layers(num_layers, first_layer)
    check_layers(layers, num_layers, first_layer)
    if layer_average(schedule(layers, visual, 0.0), num_layers, visual) > retention:
        raise infeasible(
            retention, schedule(layers, visual, 0.0), num_layers, visual, f"PyramidDrop with stages at {layers}"
        )
    low, high = 0.0, 1.0
    if layer_average(schedule(layers, visual, 1.0), num_layers, visual) <= retention:
        return schedule(layers, visual, 1.0)
    for _ in range(60):  # the layer average grows with lambda
        mid = (low + high) / 2
        low, high = (
            (mid, high) if layer_average(schedule(layers, visual, mid), num_layers, visual) <= retention else (low, mid)
        )
    return schedule(layers, visual, low)
