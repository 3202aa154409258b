"""MustDrop (Liu et al., 2024, "Multi-Stage Vision Token Dropping: Towards Efficient Multimodal Large
Language Model", arXiv:2411.10803; code: liuting20/MustDrop@909afa5, LLaVA-1.5, and its vision stage
as LightCompress runs it: ModelTC/LightCompress@9701d03, `llmc/compression/token_reduction/mustdrop.py`):
visual tokens are dropped in three stages, vision encoding, prefilling and decoding.

The reference (lines of liuting20/MustDrop's files unless named otherwise):
1. vision stage: spatially adjacent tokens merge in non-overlapping 3 x 3 windows
   (`multimodal_encoder/local_merge.py:30-146`; LightCompress `mustdrop.py:29-213`): a window's
   similarity is the mean cosine similarity of its 9 tokens' pairs (self-pairs left out); the r windows
   of highest similarity each merge into their last (bottom-right) token, as the size-weighted mean of
   the 9; the authors take r as the windows at or above 0.8, LightCompress r = (N - retained) // 8 from
   its `retained_tokens`. A key set, the top ceil(0.08 n) tokens by the [CLS] query's attention (mean
   over heads) in the layer LLaVA projects (`clip_encoder.py:86-107`), is never dropped later;
2. prefilling stage: after each of LLM layers [2, 6, 10, 14] (`modelling_sparse_llama.py:103`,
   :235-267), that layer's attention (eager weights) from the text after the image to the image tokens,
   mean over heads: a token is dropped when both its summed attention over the text is below
   `global_thr` x the image tokens' total and its largest attention from one text token is below
   `individual_thr` (`dual_attention_filter`, :336-354), unless it is in the key set (:256-258);
   thresholds (0.001, 0.001), (0.0012, 0.001), (0.011, 0.01) for 192, 128, 64 tokens
   (`scripts/v1_5/eval/textvqa_{192,128,64}.sh`);
3. decoding stage: after the prefill the KV caches of layers 2 to 14 keep only the tokens the last
   stage kept (:300-325), so every decoding step attends there to the final tokens only.

Here: `compress` (the vision stage, a compressor on the merger's output, `kinds.COMPRESSOR_THEN_PRUNER`)
and `stages` (`Stage(layer, keep, rank_by=DUAL_FILTER, cut_cache=True)` in `inside_llm`, run by
`backbones/layer_pruning.LayerPruner`, which also cuts the caches for decoding).

Deviations from the reference:
- counts from the layer-averaged target R: the reference's thresholds fix no count. The five reductions
  (the vision merge and the four LLM stages) keep one share rho of the tokens before each, rho the
  largest whose layer average is at most R (`stage_ratio`; the vision stage's count follows from the
  LLM's, `inside_llm.entering_tokens`). The vision stage merges the top r = ceil((N - keep) / 8) windows,
  the last of them only the (N - keep) - 8 (r - 1) tokens before its last token, so exactly `keep` stay
  (LightCompress's fix_r leaves up to 7 more); a video with too few whole windows for that fails with
  `InfeasibleBudget`;
- the LLM stages rank by max(global / (g x total), individual / t), (g, t) the thresholds of the
  reference's setting nearest R, and keep the top k: the reference's dual filter with both thresholds
  scaled by one factor until k tokens pass (a token passes a scaled filter exactly when its score is
  above that factor); key-set tokens rank first;
- windows of 3 x 3 merged tokens (LLM tokens, 2 x 2 patches each) within a frame pair, on the merger's
  output, where the reference merges CLIP patches after its first layer (the authors) or at the layer
  it projects (LightCompress); every window of the video is one pool (the reference: one image's); a
  pair's rows and columns past the last whole window are never merged; a merged token sits at its last
  token's position;
- Qwen has no [CLS]: the key set is ranked by the attention each token received in the last ViT block
  (mean over heads and queries, as VisionZip's and FasterVLM's ports here), a merged token's the sum of
  its members', chosen among the tokens after the merge (the reference's key set is chosen on the merged
  tokens too);
- stage layers at the reference's relative depths (after layers 2, 6, 10, 14 of 32: from 3, 6, 10, 13 of
  Qwen2.5-VL-7B's 28; 3, 8, 12, 17 of Qwen3-VL-8B's 36), none before Qwen3-VL's deepstack layers; on an
  LLM too shallow for four distinct layers, the distinct ones; attention softmaxed in float32 from the
  layer's own q/k rows (the reference: eager weights), so SDPA and FlashAttention runs work;
- positions are not renumbered after a drop (the reference compacts LLaVA's 1-D positions); the caches
  cut for decoding are those of the layers before each stage, from the first to the last (the
  reference's layers 2 to 14).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..budget.plan import InfeasibleBudget
from .common import F32, Compression, TokenCompressor, VisualTokens, top
from .inside_llm import DUAL_FILTER, Stage, check_layers, largest_within, scaled_layer

WINDOW = 3  # window_size (3, 3)
KEY_SHARE = 0.08  # keep_rate of the key set (clip_encoder.py:102)
REFERENCE_LAYERS = 32
PRUNING_LAYERS = (2, 6, 10, 14)  # the reference drops after these layers
# (global_thr, individual_thr) of the reference's scripts for each average kept of LLaVA's 576 tokens
THRESHOLDS = {192: (0.001, 0.001), 128: (0.0012, 0.001), 64: (0.011, 0.01)}
REFERENCE_TOKENS = 576


# ------------------------------------------------------------------ the vision stage
def windows(grids: list[tuple[int, int, int]], device) -> torch.Tensor:
    """(W, 9) token indices of every whole 3 x 3 window of every frame pair's (t, h, w) grid, each
    window's tokens in row-major order (its last the bottom-right), pairs in order."""
    rows, offset = [], 0
    for t, h, w in grids:
        grid = torch.arange(t * h * w).view(t, h, w)  # cpu: built from the host's grids, moved once below
        grid = grid[:, : h // WINDOW * WINDOW, : w // WINDOW * WINDOW]
        blocks = grid.unfold(1, WINDOW, WINDOW).unfold(2, WINDOW, WINDOW)  # (t, h/3, w/3, 3, 3)
        rows.append(blocks.reshape(-1, WINDOW * WINDOW) + offset)
        offset += t * h * w
    return torch.cat(rows).to(device, non_blocking=True)  # host-built from the grids: no sync


def window_similarity(features: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """(W,) mean cosine similarity of each window's 9 tokens' pairs, self-pairs left out (local_merge.py:59-70),
    in float32 (float64 features stay float64)."""
    rows = features[windows].to(torch.promote_types(features.dtype, torch.float32))  # (W, 9, D)
    unit = F.normalize(rows, dim=-1)
    sims = unit @ unit.transpose(1, 2)
    off_diagonal = 1 - torch.eye(WINDOW * WINDOW, dtype=sims.dtype, device=sims.device)
    return (sims * off_diagonal).sum(dim=(1, 2)) / (WINDOW * WINDOW * (WINDOW * WINDOW - 1))


def compress(tokens: VisualTokens, keep: int, seed: int) -> Compression:
    """The vision stage on N tokens, keeping `keep`: the ceil((N - keep) / 8) most similar windows merge
    into their last token (the last of them only as many as needed), then the key set, the top
    ceil(0.08 keep) kept tokens by their members' summed received attention, is `protected`."""
    n, device = tokens.features.shape[0], tokens.features.device
    if tokens.received_attention is None:
        raise ValueError("MustDrop needs the attention received in the last ViT block (needs_attention)")
    table = windows(tokens.grids, device)
    dropped = n - keep
    count = -(-dropped // (WINDOW * WINDOW - 1))
    if count > len(table):
        floor = (n - len(table) * (WINDOW * WINDOW - 1)) / n
        raise InfeasibleBudget(keep / n, floor, f"MustDrop's merge of {len(table)} whole 3x3 windows")
    assignment = torch.arange(n, device=device)
    chosen = table[top(window_similarity(tokens.features, table), count)]  # (count, 9), most similar first
    if count:
        last = dropped - (WINDOW * WINDOW - 1) * (count - 1)  # tokens the last chosen window merges
        sources = torch.cat([chosen[:-1, :-1].flatten(), chosen[-1, -1 - last : -1]])
        targets = torch.cat([chosen[:-1, -1].repeat_interleave(WINDOW * WINDOW - 1), chosen[-1, -1].expand(last)])
        assignment[sources] = targets
    received = tokens.received_attention.detach().to(device)
    group = torch.zeros(n, dtype=received.dtype, device=device).index_add_(0, assignment, received)
    kept = torch.zeros(n, dtype=torch.bool, device=device)
    kept[assignment] = True
    key = top(group.masked_fill(~kept, -math.inf), math.ceil(KEY_SHARE * keep))
    protected = torch.zeros(n, dtype=torch.bool, device=device)
    protected[key] = True
    return Compression(assignment, protected=protected)


def working_bytes(pair_sizes: list[int], width: int, b: int) -> int:
    """The windows' gathered rows (in float32) and their unit copies, and the 9 x 9 similarities."""
    n = sum(pair_sizes)
    return 2 * n * width * F32 + n * WINDOW * WINDOW * F32


def fewest_per_pair(grid: tuple[int, int, int]) -> int:
    """A pair keeps at least its tokens less 8 for each of its whole 3 x 3 windows."""
    t, h, w = grid
    return t * h * w - (WINDOW * WINDOW - 1) * t * (h // WINDOW) * (w // WINDOW)


COMPRESSOR = TokenCompressor(
    compress, working_bytes=working_bytes, host_syncs=0, reads_attention=True, fewest_per_pair=fewest_per_pair
)


# ------------------------------------------------------------------ the prefilling and decoding stages
def default_layers(num_layers: int, first_layer: int = 0) -> list[int]:
    """The stage layers at the reference's relative depths (each after its pruning layer), none before
    `first_layer`; fewer where they coincide on a shallow LLM."""
    return sorted({scaled_layer(p + 1, REFERENCE_LAYERS, num_layers, first_layer) for p in PRUNING_LAYERS})


def thresholds(retention: float) -> tuple[float, float]:
    """(global_thr, individual_thr) of the reference's setting nearest `retention`."""
    level = min(THRESHOLDS, key=lambda kept: abs(kept / REFERENCE_TOKENS - retention))
    return THRESHOLDS[level]


def pyramid_average(ratio: float, layers: list[int], num_layers: int) -> float:
    """The layer-averaged share when the vision stage keeps `ratio` of N and stage i (at `layers`[i - 1]) keeps
    `ratio` of the tokens before it (continuous counts)."""
    bounds = [0, *layers, num_layers]
    return sum((bounds[i + 1] - bounds[i]) * ratio ** (i + 1) for i in range(len(bounds) - 1)) / num_layers


def stage_ratio(retention: float, layers: list[int], num_layers: int) -> float:
    """rho: the largest share per reduction whose pyramid average is at most `retention` (1 at R = 1)."""
    return largest_within(lambda ratio: pyramid_average(ratio, layers, num_layers), retention)


def stages(
    num_layers: int, visual: int, retention: float, layers: list[int] | None = None, first_layer: int = 0
) -> list[Stage]:
    """The LLM stages on the `visual` tokens that entered it: stage i keeps max(1, floor(rho^i n)), rho from
    `retention` (`stage_ratio`); a stage that would keep every token is left out. The vision stage before them
    keeps the most tokens whose layer average over every stage stays within R (`inside_llm.entering_tokens`)."""
    layers = layers or default_layers(num_layers, first_layer)
    check_layers(layers, num_layers, first_layer)
    ratio, pair = stage_ratio(retention, layers, num_layers), thresholds(retention)
    schedule, entering = [], visual
    for i, layer in enumerate(layers, start=1):
        keep = min(entering, max(1, math.floor(ratio**i * visual + 1e-9)))
        if keep < entering:
            schedule.append(Stage(layer, keep, rank_by=DUAL_FILTER, cut_cache=True, thresholds=pair))
            entering = keep
    return schedule


def dual_filter_scores(attention: torch.Tensor, visual: torch.Tensor, pair: tuple[float, float]) -> torch.Tensor:
    """(L,) each token's max(global / (g x total), individual / t) (`dual_attention_filter`, :342-348):
    attention (heads, T, L) of the T text tokens after the video over every key; global: a token's
    attention summed over the T, mean over heads; individual: its largest from one of the T; total: the
    visual tokens' (`visual`, (n,) indices into L) globals summed; (g, t) = `pair`."""
    rows = attention.mean(dim=0)  # (T, L)
    summed, largest = rows.sum(dim=0), rows.max(dim=0).values
    return torch.maximum(summed / (pair[0] * summed[visual].sum()), largest / pair[1])


def cut_layers(schedule: list[Stage]) -> range:
    """The layers whose caches the decoding stage cuts to the last stage's tokens: from the layer before
    the first stage to the layer before the last (the reference's 2 to 14)."""
    cut = [s for s in schedule if s.cut_cache]
    return range(cut[0].layer - 1, cut[-1].layer) if cut else range(0)
