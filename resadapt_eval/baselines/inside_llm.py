"""Schedules of the methods that prune visual tokens inside the LLM (FastV, PyramidDrop, and the
second stages of PruneVid, HoliTom and DyCoke): which decoder layers keep how many visual tokens,
ranked how. The hooks that carry a schedule out on the HF path are `backbones/layer_pruning.py`
(`LayerPruner`, prefill) and `backbones/decode_pruning.py` (`DecodePruner`, decoding).

A schedule is a list of `Stage(layer, keep)`: from decoder layer `layer` on, only `keep` visual
tokens remain. At each stage the visual tokens still present are ranked by `Stage.rank_by` and the
top `keep` stay, in their original order (ties: the earlier token first):
- `LAST_TOKEN`: the attention the prompt's last token pays them in the layer before the stage, from
  that layer's own q/k on its attention input (softmax over every key and head mean in float32; FastV,
  HoliTom);
- `STAGE_INPUT`: the same row computed with the stage layer's own input_layernorm and q/k
  projections on the hidden states entering it, softmax in float32 cast back to the model's dtype,
  mean over heads in that dtype (PyramidDrop's `pdrop_rank_drop`);
- `TEXT_AFTER_VISUAL`: every text token after the video, in the layer before the stage, on the map
  PruneVid's reference ranks by (`attn_weights_wo_pos`, Visual-AI/PruneVid@b12600c
  models/pllava/llama.py:445-449, :514): q k^T / sqrt(head_dim) of that layer's q/k projections with
  no rotary and no causal mask, softmax over every key in float32 cast back to the model's dtype, max
  over those tokens and heads in that dtype (elastic_cache.py:125, :163);
- `RATERS`: the attention the text raters (the text after the video most relevant to its visual
  tokens at the LLM's input) pay them in the layer before the stage, from that layer's own q/k with
  rotary and the causal mask, softmax in float32, mean over heads and raters (SparseVLM,
  `baselines/sparsevlm.py`);
- `DUAL_FILTER`: the attention of every text token after the video in the layer before the stage
  (its own q/k, rotary, causal mask, softmax in float32, mean over heads): each visual token's larger
  of its summed attention over a global threshold's share and its largest over an individual
  threshold (MustDrop, `baselines/mustdrop.py`); tokens the compressor before protected rank first;
- `DUPLICATION`: no attention: the pivots are the visual and text tokens of largest key L1 norm in the
  layer before the stage, and the kept tokens those least cosine-similar to them on the hidden states
  entering the stage through the LLM's final norm (DART, `baselines/dart.py`).

Retention (one rule for every method, see docs/budget.md): R is the layer-averaged share of visual
tokens, sum over layers of the visual tokens in that layer / (layers x N); the schedules solve
for the keep counts whose layer average is the largest not above the target. A method that also
compresses before the LLM keeps its paper's share inside it (or R, if larger, so that R = 1 keeps
every token), and its compressor keeps the most tokens that leave the layer average within R
(`entering_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..budget.plan import InfeasibleBudget

# How a stage ranks the visual tokens (see the module docstring):
LAST_TOKEN = "last_token"  # the prompt's last token's attention in the layer before, mean over heads (FastV, HoliTom)
STAGE_INPUT = "stage_input"  # the same row from the stage layer's own norm and q/k on its input (PyramidDrop)
# at most this many tokens' keys or similarity rows a stage forms at a time (`backbones.layer_pruning`)
BLOCK_ROWS = 4096
TEXT_AFTER_VISUAL = "text_after_visual"  # text after the video, no rotary nor mask, max over them and heads (PruneVid)
DUPLICATION = "duplication"  # least similar to the pivots of largest key L1 norm, before the stage layer (DART)
RATERS = "raters"  # the text raters' attention in the layer before, mean over heads and raters (SparseVLM)
DUAL_FILTER = "dual_filter"  # the text after the video's summed and largest attention, thresholds scaled (MustDrop)


@dataclass(frozen=True)
class Stage:
    """From decoder layer `layer` (0-based) on, `keep` visual tokens remain, the best by `rank_by`;
    with `merge`, each dropped token's hidden state is first averaged into its most cosine-similar
    kept token, in token order (HoliTom: kept = (kept + dropped) / 2 for each dropped in turn); with
    `recycle` > 0, `recycle` of the `keep` are the best-ranked dropped tokens clustered and averaged
    (SparseVLM's recycling, `baselines/sparsevlm.py`), the other keep - recycle the top ranked; with
    `cut_cache`, once the prefill ends the KV caches from the layer before the first such stage to the
    layer before the last keep only the last stage's tokens (MustDrop's decoding stage); `thresholds`:
    a DUAL_FILTER stage's (global, individual) thresholds."""

    layer: int
    keep: int
    rank_by: str = LAST_TOKEN
    merge: bool = False
    recycle: int = 0
    cut_cache: bool = False
    thresholds: tuple[float, float] | None = None


@dataclass(frozen=True)
class DecodeStage:
    """From decoder layer `layer` on, each re-selecting decoding step attends to `keep` visual
    tokens; it re-selects when its visual attention's cosine to the previous step's is below `threshold`."""

    layer: int
    keep: int
    threshold: float


@dataclass(frozen=True)
class AdaptiveSchedule:
    """An in-LLM method whose per-layer counts follow from the hidden states, decided layer by layer
    (FrameFusion; run by `backbones/layer_pruning.FusionPruner`). typical_layers(num_layers, visual,
    retention, first_layer, patches) -> the visual tokens in each layer on a video of pairs of
    `patches` tokens with no similar neighbours
    (the config-only rows; `InfeasibleBudget` below its floor); working_bytes(text_dims, tokens,
    visual, b) -> the most bytes its working tensors hold over `tokens` prompt tokens (`visual`
    visual) in a dtype of `b` bytes."""

    typical_layers: Callable
    working_bytes: Callable


def layer_counts(stages: list[Stage], num_layers: int, visual: int) -> list[int]:
    """Visual tokens in each decoder layer under `stages`."""
    counts, current = [], visual
    bounds = {s.layer: s.keep for s in stages}
    for layer in range(num_layers):
        current = bounds.get(layer, current)
        counts.append(current)
    return counts


def layer_average(stages: list[Stage], num_layers: int, visual: int) -> float:
    """The layer-averaged retention of a schedule: mean visual tokens per layer / N."""
    return sum(layer_counts(stages, num_layers, visual)) / (num_layers * visual)


def check_layers(layers: list[int], num_layers: int, first_layer: int) -> None:
    """Stage layers strictly increasing within [first_layer, num_layers - 1]."""
    if not layers or sorted(set(layers)) != list(layers):
        raise ValueError(f"prune_layers must be strictly increasing, got {layers}")
    if layers[0] < max(1, first_layer) or layers[-1] >= num_layers:
        raise ValueError(
            f"prune_layers {layers} must lie in [{max(1, first_layer)}, {num_layers - 1}] on this LLM of "
            f"{num_layers} layers (the first layers see every visual token: a stage ranks by attention in "
            "its layer or the one before, after at least one full layer, and Qwen3-VL's deepstack features "
            "are added after its first layers)"
        )


def scaled_layer(paper_layer: int, paper_layers: int, num_layers: int, first_layer: int) -> int:
    """A stage the paper puts at layer `paper_layer` of a `paper_layers`-layer LLM, at the same
    relative depth of this `num_layers`-layer LLM, not before `first_layer` (nor layer 1)."""
    return min(num_layers - 1, max(first_layer, 1, round(paper_layer * num_layers / paper_layers)))


def one_stage(
    num_layers: int,
    visual: int,
    retention: float,
    layers: list[int] | None,
    first_layer: int,
    default_layer: int,
    rank_by: str,
    what: str,
) -> list[Stage]:
    """One stage at K (`layers`, default max(`default_layer`, first_layer)) keeping the most tokens
    whose layer average is not above `retention`: the K first layers see all N, the rest
    k = floor((R L - K) N / (L - K)) (FastV, DART)."""
    (k_layer,) = layers or [max(default_layer, first_layer)]
    check_layers([k_layer], num_layers, first_layer)
    keep = min(visual, math.floor((retention * num_layers - k_layer) * visual / (num_layers - k_layer) + 1e-9))
    if keep < 1:
        raise infeasible(retention, [Stage(k_layer, 1)], num_layers, visual, f"{what} pruning after layer {k_layer}")
    return [Stage(k_layer, keep, rank_by)]


def largest_within(average: Callable[[float], float], retention: float, high: float = 1.0) -> float:
    """The largest x in [0, high] whose `average(x)` (growing with x) is not above `retention`: `high`
    where it fits, else found by 60 halvings (PyramidDrop's lambda, SparseVLM's scale, MustDrop's rho)."""
    if average(high) <= retention:
        return high
    low = 0.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if average(mid) <= retention else (low, mid)
    return low


def infeasible(retention: float, stages: list[Stage], num_layers: int, visual: int, what: str) -> InfeasibleBudget:
    return InfeasibleBudget(retention, layer_average(stages, num_layers, visual), what)


def entering_tokens(
    schedule, retention: float, total: int, minimum: int, num_layers: int, layers: list[int] | None, first_layer: int
) -> int:
    """For a method that compresses before the LLM and then prunes inside it with its own
    `schedule` (`(num_layers, visual, retention, layers, first_layer) -> [Stage]`, a share of the
    tokens that entered): the most tokens n in [minimum, total] that may enter the LLM so that the
    layer-averaged retention over the `total` vanilla tokens is not above `retention` (the sum
    over layers grows with n)."""

    def layer_sum(n: int) -> int:
        return sum(layer_counts(schedule(num_layers, n, retention, layers, first_layer), num_layers, n))

    budget = retention * total * num_layers + 1e-6
    if layer_sum(minimum) > budget:
        stages = schedule(num_layers, minimum, retention, layers, first_layer)
        floor = layer_sum(minimum) / (num_layers * total)
        raise InfeasibleBudget(retention, floor, f"{minimum} tokens entering the LLM, then {stages}")
    low, high = minimum, total
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if layer_sum(mid) <= budget else (low, mid - 1)
    return low
