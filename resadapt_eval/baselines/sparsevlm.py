"""SparseVLM (Zhang et al., ICML 2025, "SparseVLM: Visual Token Sparsification for Efficient
Vision-Language Model Inference"; code: Gumpest/SparseVLMs@26a5f48, LLaVA only, and the Qwen2.5-VL
port LightCompress runs: ModelTC/LightCompress@9701d03, `llmc/compression/token_reduction/sparsevlm.py`):
text raters chosen from the prompt rank the visual tokens by their attention at a few decoder layers;
the top ones stay, and the best of the dropped ones are recycled into a few cluster means.

The reference (lines of LightCompress's file; the same rule as Gumpest's `modelling_sparse_llama.py:186-320`):
1. raters, once per prefill at the LLM's input (`register_module_paras`, :114-119): the visual
   embeddings times the text embeddings after the image (v t^T, (N, T)), softmax over the text, mean
   over the visual tokens; the raters are the text tokens whose value is above the mean;
2. at each pruning layer l of `pruning_loc` = [2, 6, 15] (of LLaVA's 32), layer l's attention on its
   input with rotary and the causal mask, softmax over every key (`get_attn_logits_for_qwen25vl`,
   :366-424), averaged over heads, read at the raters' rows and the visual columns and averaged over
   the raters (`attn_postprocess_topk`, :566-604): the top min(k_i, n - 1) visual tokens stay after
   layer l (`decoder_attn_hook`, :207-346, a forward hook on layer l's output), k_i from the tables
   of `update_list` (:520-563: 300, 200, 110 of 576 for 192 kept on average, 303, 110, 36 for 128,
   66, 30, 17 for 64);
3. recycling (:264-317): of the p dropped visual tokens, the int(0.3 p) + 1 of highest rater
   attention are clustered on layer l's output by DPC-kNN (`cluster_and_merge`, :658-728) into
   int(m / 10) + 1 clusters: each token's density exp(-mean of its squared distances, / sqrt(C), to
   its nearest cluster-count tokens), its distance to the nearest denser token (the largest distance
   for the densest), the centres the top density x distance, each token joins its nearest centre,
   and a cluster's merged token is sum of x / (size + 1e-6); the merged tokens enter with the
   centres' positions (the position embeddings are sliced, not renumbered).

Here: `Stage(layer, keep, rank_by=RATERS, recycle=c)` in `inside_llm`; `backbones/layer_pruning.LayerPruner`
chooses the raters at the first layer's input (`raters`), reads the raters' attention in the layer
before the stage (`relation`) and recycles at the stage layer's input (`cluster_and_merge`), the
reference's layer l's output.

Deviations from the reference:
- counts from the layer-averaged target R, as for every in-LLM method here: the kept counts follow
  the shape of the reference's table nearest the target (its average of 192, 128 or 64 of 576
  tokens), scaled by the largest factor whose layer average, recycled tokens included, is not above
  R (`stages`); a stage that would keep every token is left out (so R = 1 is vanilla; the reference
  always drops one). One `prune_layers=` layer runs one stage, as the reference's single-layer
  configurations; three run the three-stage table;
- default stage layers at the reference's relative depths (after layers 2, 6 and 15 of 32: from 3, 6
  and 14 of Qwen2.5-VL-7B's 28, 3, 8 and 18 of Qwen3-VL-8B's 36), none before Qwen3-VL's deepstack
  layers (`first_layer`), which add features to every visual token; where these are not three
  distinct layers (a shallow LLM), one stage at the first;
- a recycled token stays at its centre's place in the sequence, at the centre's position (the
  reference appends the merged tokens after the kept visual tokens, at the centres' positions): every
  token here keeps one sorted place in the prompt, which the KV cache and the later stages read;
- the attention is softmaxed in float32 (the reference: in the model's dtype); where no text token
  is above the mean (one text token), every text token after the video rates (the reference's mean
  over no rater is NaN);
- DPC-kNN without the reference's random noise of 1e-6 on the densities, which orders tied densities at
  random: here tied densities stay tied (neither token is the denser), and ties go to the earlier token
  in every top-k and arg-min. Densities tie often: with one cluster (fewer than 10 members) k = 1
  reaches only the token itself and every density is 1, so the reference's centre, the merged token's
  position, is random (here the best-ranked member; the merged token is the same); with k = 2 each
  pair of mutual nearest neighbours ties; distances in float32 (or wider) from one matmul
  (|a|^2 + |b|^2 - 2 a.b, as `torch.cdist`'s fast path) where the reference forms an (m, m, C)
  difference tensor in the model's dtype;
- every visual token of the request is one pool, and the raters are the tokens after the last visual
  token (Qwen3-VL's timestamps between frames are neither), where the reference takes one contiguous
  image block.
"""

from __future__ import annotations

import math

import torch

from ..budget.plan import InfeasibleBudget
from .inside_llm import RATERS, Stage, check_layers, largest_within, layer_average, scaled_layer

REFERENCE_LAYERS = 32  # LLaVA-1.5-7B's decoder layers, where pruning_loc is set
PRUNING_LOC = (2, 6, 15)  # pruning after these layers: the stages start at the next one
# kept visual tokens per stage of the reference's tables (update_list, :525-529) for each average
# kept of LLaVA's 576: the shape a schedule follows, scaled to the target
TABLES = {192: (300, 200, 110), 128: (303, 110, 36), 64: (66, 30, 17)}
REFERENCE_TOKENS = 576
RECYCLE_SHARE = 0.3  # the top 30 % of the dropped tokens are recycled (:273)
CLUSTER_SIZE = 10  # a tenth of them as clusters (:291)
DENSITY_EPS = 1e-6  # the merged token divides by size + 1e-6 (:718)


def default_layers(num_layers: int, first_layer: int = 0) -> list[int]:
    """The stage layers at the reference's relative depths, none before `first_layer`; on an LLM too
    shallow for three distinct ones, the first alone (the reference's one-stage configuration)."""
    layers = sorted({scaled_layer(loc + 1, REFERENCE_LAYERS, num_layers, first_layer) for loc in PRUNING_LOC})
    return layers if len(layers) == len(PRUNING_LOC) else layers[:1]


def recycled_members(dropped: int) -> int:
    """How many of `dropped` tokens are clustered: int(0.3 p) + 1 (none of none)."""
    return int(dropped * RECYCLE_SHARE) + 1 if dropped else 0


def cluster_count(dropped: int) -> int:
    """Recycled tokens (clusters) from `dropped` tokens: int(m / 10) + 1 of their m members."""
    members = recycled_members(dropped)
    return int(members / CLUSTER_SIZE) + 1 if members else 0


def table_shape(retention: float, stages: int) -> list[float]:
    """Each stage's kept share in the reference's table whose average is nearest `retention`."""
    level = min(TABLES, key=lambda kept: abs(kept / REFERENCE_TOKENS - retention))
    return [t / REFERENCE_TOKENS for t in TABLES[level][:stages]]


def schedule(layers: list[int], visual: int, shape: list[float], scale: float) -> list[Stage]:
    """Stages keeping max(1, floor(scale * share * N)) top-ranked tokens each, plus their recycled
    clusters; a stage that would keep every token entering it is left out."""
    stages, entering = [], visual
    for layer, share in zip(layers, shape):
        selected = max(1, math.floor(scale * share * visual + 1e-9))
        if selected >= entering:
            continue
        recycled = cluster_count(entering - selected)
        entering = selected + recycled
        stages.append(Stage(layer, entering, rank_by=RATERS, recycle=recycled))
    return stages


def stages(
    num_layers: int, visual: int, retention: float, layers: list[int] | None = None, first_layer: int = 0
) -> list[Stage]:
    """The schedule with the largest scale whose layer-averaged retention is not above `retention`."""
    layers = layers or default_layers(num_layers, first_layer)
    check_layers(layers, num_layers, first_layer)
    if len(layers) not in (1, len(PRUNING_LOC)):
        raise ValueError(
            f"prune_layers {layers}: SparseVLM's reference schedules have 1 stage or {len(PRUNING_LOC)}, "
            f"not {len(layers)}"
        )
    shape = table_shape(retention, len(layers))

    def average(scale: float) -> float:
        return layer_average(schedule(layers, visual, shape, scale), num_layers, visual)

    if average(0.0) > retention:
        raise InfeasibleBudget(retention, average(0.0), f"SparseVLM with stages at {layers}")
    scale = largest_within(average, retention, high=1.0 / min(shape))  # at 1 / min(shape) no stage drops a token
    return schedule(layers, visual, shape, scale)


def raters(embeds: torch.Tensor, visual: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """(T,) float weights of the `after` text tokens: 1 for the raters, else 0. embeds: (L, H) the
    LLM's input; visual: (N,) rows of the visual tokens; after: (T,) rows of the text after the video.
    softmax over the text of v t^T, mean over the visual tokens, in the embeddings' dtype (:115-119); the
    raters are above its mean (every token where none is). No host sync."""
    relevance = (embeds[visual] @ embeds[after].T).softmax(dim=-1).mean(dim=0)  # (T,)
    chosen = relevance > relevance.mean()
    return torch.where(chosen.any(), chosen, torch.ones_like(chosen)).float()


def relation(attention: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(L,) each token's attention from the raters, mean over heads and raters. attention: (heads, T, L)
    the T text tokens after the video over every key; weights: (T,) `raters`."""
    rows = attention.mean(dim=0)  # (T, L)
    return (weights @ rows) / weights.sum()


def cluster_and_merge(x: torch.Tensor, clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged (c, C), centres (c,)): DPC-kNN over the m rows of `x` (m, C), ordered by decreasing
    attention, into c = `clusters` clusters (`cluster_and_merge`, :658-728): centres by density x
    distance to a denser token, every row to its nearest centre, a cluster's token the sum of its rows
    / (size + 1e-6) in x's dtype; `centres` index x's rows. Distances in float32 (float64 for float64
    rows); no host sync."""
    m, width = x.shape
    rows = x.to(torch.promote_types(x.dtype, torch.float32))
    squared = rows.square().sum(dim=-1)
    dist = (squared[:, None] + squared[None, :] - 2 * rows @ rows.T).clamp_min(0).sqrt() / width**0.5
    dist = (dist + dist.T).fill_diagonal_(0) / 2  # exactly symmetric, as the differences' norms are
    nearest = dist.sort(dim=-1, stable=True).values[:, :clusters]  # the k = c nearest, self included
    density = (-nearest.square().mean(dim=-1)).exp()
    denser = density[None, :] > density[:, None]  # [i, j]: j is denser than i
    to_denser = torch.where(denser, dist, dist.max()).min(dim=-1).values
    centres = (to_denser * density).argsort(descending=True, stable=True)[:clusters]
    assigned = dist[centres].argmin(dim=0)  # (m,) each row's nearest centre (the first of equals)
    assigned[centres] = torch.arange(clusters, device=x.device)
    sizes = torch.zeros(clusters, 1, dtype=x.dtype, device=x.device).index_add_(0, assigned, x.new_ones(m, 1))
    weights = 1 / (sizes + DENSITY_EPS)[assigned]  # (m, 1)
    merged = torch.zeros(clusters, width, dtype=x.dtype, device=x.device).index_add_(0, assigned, x * weights)
    return merged, centres


def own_flops(hidden: int, length: int, entering: int, text_after: int, stage: Stage, input_visual: int = 0) -> int:
    """FLOPs of a stage's matmuls besides its T = `text_after` query rows over `length` keys (counted as every
    ranking's, `compute.flops.ranking_flops`): the raters' mean of those rows (2 T L), the recycled members'
    distances (2 m^2 H, m from the `entering` visual tokens, H = `hidden`) and, on the first stage, the raters
    over the `input_visual` tokens at the LLM's input (2 N T H)."""
    members = recycled_members(entering - (stage.keep - stage.recycle)) if stage.recycle else 0
    return 2 * text_after * length + 2 * members**2 * hidden + 2 * input_visual * text_after * hidden
