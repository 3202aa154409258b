"""PyramidDrop (Xing et al., CVPR 2025, "PyramidDrop: Accelerating Your Large Vision-Language
Models via Pyramid Visual Redundancy Reduction"; code: github.com/Cooperx521/PyramidDrop, followed
at commit 6444f304aee4b7edcb022839fb9e8cd07859704a).

The reference (`llava/model/modeling_llama_pdrop.py`, `pdrop_forward` and `pdrop_rank_drop`):
stage boundaries `layer_list` = [8, 16, 24] of LLaVA-1.5's 32 layers and image-token ratios
[1, 0.5, 0.25, 0.125] (lambda = 0.5; the scripts pass `--layer_list '[8,16,24]'
--image_token_ratio_list "[0.5,0.25,0.125]"` and the loader prepends 1.0). After decoder layer
b - 1, for each boundary b, in prefill only (lines 1222-1224), the hidden states leaving layer
b - 1 go through layer b's own `input_layernorm`, then its `q_proj` / `k_proj` and rotary at the
current position ids (lines 1321-1342). The query is the last instruction token, at inference the
prompt's last token (`prompt_len + image_tokens - 1`, lines 1390-1391); its scores against every
key (divided by sqrt(head_dim) in the model's dtype, plus the causal mask, which hides nothing
from the last token) go through a float32 softmax cast back to the model's dtype, are averaged
over heads in that dtype and sliced to the image tokens (lines 1395-1401); `topk` of them, keep =
int(N * ratio) with N the image tokens before any drop (lines 1306-1307), stay in their original
order (lines 1405-1410) and enter layer b. Positions are then renumbered 0..len-1 (line 1446),
and each decode step's positions are shifted down by the dropped count (line 1266).

Here: `Stage(b, keep, rank_by=STAGE_INPUT)` in `inside_llm` computes that row (`stage_input_attention`)
from the same operations, in the same dtype order, in a forward pre-hook on layer b, on the hidden
states entering it; only the last token's query is projected (the reference projects every
token's and reads one row), Qwen's key heads are repeated for their query heads as its attention
does (the reference, written for LLaMA's equal head counts, does not need to), and Qwen3-VL's
per-head q/k norms are applied as that layer's attention applies them.

Deviations from the reference:
- keep counts from the layer-averaged target R (`inside_llm`): the largest lambda whose counts
  max(1, floor(lambda^i N)) (the floor with a 1e-9 guard against float error) have a layer average
  not above R, so every method is compared at the same R; each stage keeps at least one visual
  token (the reference's int() can reach 0), so the video never disappears and the lowest
  reachable R is one token per stage;
- default boundaries at floor(L/4), floor(L/2), floor(3L/4) (7, 14, 21 on Qwen2.5-VL-7B's 28
  layers, 9, 18, 27 on Qwen3-VL-8B's 36), the reference's relative depths; with them the layer
  average cannot go below about 0.25, so lower targets need earlier boundaries (`prune_layers=`);
- on Qwen3-VL no boundary comes before `first_layer` (its deepstack layers), which add features
  to every visual token of the full sequence; the ranking there sees the hidden states with them;
- positions are not renumbered: kept tokens keep their original M-RoPE positions, in the ranking
  at later boundaries, in every later layer and in decoding (as FastV's reference keeps them),
  since Qwen's 3-D (t, h, w) positions of visual tokens have no compacted equivalent;
- the ranked set is every visual token of the request (all frames or images, wherever they are;
  text between them, such as Qwen3-VL's timestamps, always stays), where the reference slices one
  contiguous image block;
- ties go to the earlier token (stable sort), where the reference's `topk` leaves their order
  unspecified.
"""

from __future__ import annotations

import math

from .inside_llm import STAGE_INPUT, Stage, check_layers, infeasible, largest_within, layer_average


def default_layers(num_layers: int, first_layer: int = 0) -> list[int]:
    """Stage boundaries at L/4, L/2 and 3L/4 (8, 16, 24 of 32), none before `first_layer`."""
    return sorted({max(first_layer, 1, num_layers * q // 4) for q in (1, 2, 3)})


def schedule(layers: list[int], visual: int, ratio: float) -> list[Stage]:
    """Stages keeping max(1, floor(ratio^i N)) tokens from boundary i (1-based) on, each ranked by
    its boundary layer's own projections on the hidden states entering it."""
    return [
        Stage(layer, max(1, math.floor(ratio**i * visual + 1e-9)), rank_by=STAGE_INPUT)
        for i, layer in enumerate(layers, start=1)
    ]


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
    ratio = largest_within(lambda x: layer_average(schedule(layers, visual, x), num_layers, visual), retention)
    return schedule(layers, visual, ratio)
