"""Pooling: spatial average pooling of each frame pair's merged tokens, the plain baseline of
UniPruneBench (Peng et al., "Can Visual Input Be Compressed? A Visual Token Compression Benchmark for
Large Multimodal Models", arXiv:2511.02650, 2025: its `Pool`) and of the VidCom2 codebase's baselines
(the code of Liu et al., "Video Compression Commander", EMNLP 2025: its `pooling`). There is no pooling paper.

References (their pooling code read in full):
- xuyang-liu16/VidCom2@98dad55 (the head of the repository's pull request #9, by a VidCom2 author, adding
  baselines for Qwen3-VL; on no branch of the snapshot), `token_compressor/pooling/pooling.py` and
  `token_compressor/pooling/models/qwen3_vl.py`:
  - per frame pair (each `cu_seqlens` segment, one temporal patch: `models/qwen3_vl.py:142-158`), T =
    max(1, int(L R)) of its L tokens (`pooling.py:200`; all L where T >= L, `:117-118, 202-204`);
  - the input grid is guessed from L: the square root if L is a square, else the largest divisor of L
    below it as rows (`pooling.py:130-136`);
  - the output grid is near-square: th = floor(sqrt(T)) rows, tw = ceil(T / th) columns
    (`pooling.py:126-127`), by `F.adaptive_avg_pool2d` (`:139-144`, the default `POOLING_TYPE=avg`,
    `models/qwen3_vl.py:253`), flattened row-major (`:149-150`), then cut to its first T tokens
    (`:153-154`: the last row's surplus windows are dropped);
  - `spatial_average_pooling` (`pooling.py:19-61`) is the same with a whole factor s: `F.avg_pool2d`
    with kernel = stride = s; the `stride` mode keeps every s-th token (`:159-175`);
  - this runs inside the ViT, after block `num_blocks // 2` (`models/qwen3_vl.py:79-98, 255-258`); the
    pooled tokens' rotary positions are `linspace(0, L - 1, T)` of the segment's (`:174-181`) and in
    the LLM they take the first K video placeholders' positions (`:321-330`).
- TianfanPeng/VLMUniPruneBench@f93768f, `methods/Pool_PreLLM.py`: per image tile, the grid guessed
  the same way (`:34-41`), `F.adaptive_avg_pool2d` to a fixed s x s output, s*s in {4, 16, 25}
  (default 16, `:84-88`; `:44-46, 52-69`), the pooled tokens at the first s*s placeholder positions
  (`:133-134`). Wired for InternVL-3 only (`custom_internvl.py:54-64`); its Qwen2.5-VL hook
  (`custom_qwenvl.py:62-76`) has no pooling.

Rule here, per frame pair with budget k (its share of floor(R N), `per_pair_budget`), on the pair's real
(h, w) merged-token grid (`VisualTokens.grids`, raster order):
- h' = floor(sqrt(k h / w)) row bands, clamped to [ceil(k / w), min(h, k)] (VidCom2's th = floor(sqrt(T))
  on a square grid where th x tw fits it, the pair's aspect ratio otherwise);
- the h rows are cut into h' contiguous near-equal bands, band b = rows [floor(b h / h'),
  floor((b + 1) h / h')); the k windows are shared over the bands by the same cut (band b gets
  floor((b + 1) k / h') - floor(b k / h') of them, k / h' each when h' divides k); a band with m
  windows cuts the w columns the same way, window j = columns [floor(j w / m), floor((j + 1) w / m));
- every token belongs to exactly one window; a window's feature is the mean of its tokens (the
  `Compression` without weights), at its top-left token's own M-RoPE position.
So k windows exactly, at least one per pair. Where R = 1 / s^2 and s divides h and w, the windows are
exactly s x s (`F.avg_pool2d`, kernel = stride = s); on a square grid with h' x (k / h') windows that
divide it, the features are exactly `F.adaptive_avg_pool2d`'s (tests/test_fidelity_pooling.py).
Defaults: average pooling (the references' default), no parameter beyond R. `seed` is unused.

Deviations, each for a reason:
- Where: after the merger, on the merged tokens, as every compressor here acts, not inside the ViT
  after block depth // 2. The reference also reshapes each pair's patch sequence as an (h, w) raster
  (`pooling.py:130-140`) although Qwen's patches come in 2 x 2 merge-unit order, and the merger then
  fuses 4 consecutive pooled tokens, so its windows are not spatial on Qwen; here the merged tokens
  are in raster order and the windows are spatial rectangles.
- The pair's real (h, w) grid instead of a factorisation guessed from the token count (on a 9 x 16
  grid the guess is 12 x 12), and h' follows the pair's aspect ratio (the references assume square
  frames): the same output shape on square grids, and s x s windows at R = 1 / s^2 on any grid.
- Windows partition the pair: where a side of n tokens is cut into m bins and m does not divide n,
  `adaptive_avg_pool2d`'s windows [floor(i n / m), ceil((i + 1) n / m)) overlap by one row or column;
  here that shared row or column belongs to the later window only, [floor(i n / m), floor((i + 1) n /
  m)) (a `Compression` is a partition: each token is in one group).
- Exact budgets: every pair keeps its share of floor(R N), exactly (the reference's int(L R) per
  segment can sum to less, and UniPruneBench's s*s is fixed). Where h' does not divide k the bands get
  k / h' windows rounded down or up, covering every token, where the reference pools th x tw windows
  and drops the last th tw - T of them (their tokens are lost).
- Position: a pooled token sits at its window's top-left token's own M-RoPE position (the window's
  first token in LLM order), so the kept tokens keep the reference's row-major pooled order and, at a
  whole factor s, the positions form the stride-s lattice of the pooled map (its output (i, j) starts
  at input (s i, s j)). The references give the pooled tokens the positions of the first K visual
  tokens (VidCom2 `models/qwen3_vl.py:329`, UniPruneBench `Pool_PreLLM.py:133-134`), which on M-RoPE
  would put the whole video at its first frames' positions; a window's centre is not a token for even
  sides (2 x 2 at R = 1/4), and rounding it down gives the top-left token there anyway.
- Qwen3-VL's deepstack features are pooled with the same windows (in the reference, the deepstack
  blocks before the pooling one give unpooled features, `models/qwen3_vl.py:100-105`).

Cost, against the reference's (N tokens, P pairs, K kept, D width): the reference pools with
`adaptive_avg_pool2d` per segment (N D time, K D output) with a Python loop over segments and one
host sync (`models/qwen3_vl.py:143`, `.tolist()` of the segment lengths) plus two to place the tokens
(`:322` `nonzero`, `:327` boolean indexing). Here: O(P) Python integer work for the shapes, two small
host-to-device copies, and about 30 kernels (elementwise integer arithmetic over N, their number
independent of P) for the assignment, about 10 N int64 of temporaries; the means (N D, in float32) are
the shared `merge_groups`'s, as for every compressor. Host syncs: 0.
"""

from __future__ import annotations

import math

import torch

from .common import Compression, TokenCompressor, VisualTokens, holds_nothing, no_matmul, per_pair_budget


def pair_grid(grid: tuple[int, int, int], size: int) -> tuple[int, int]:
    """(h, w) of a pair's merged-token grid (t, h, w), which must hold its `size` tokens in one frame pair."""
    t, h, w = grid
    if t != 1 or h * w != size:
        raise ValueError(f"pooling needs one (h, w) grid per pair holding its tokens; got {grid} for {size} tokens")
    return h, w


def output_rows(h: int, w: int, k: int) -> int:
    """Row bands h' for k windows on an h x w grid: floor(sqrt(k h / w)) (VidCom2's floor(sqrt(T)) on
    the pair's aspect ratio), at least ceil(k / w) (no band has more windows than columns) and at
    most min(h, k) (no empty band or window)."""
    return max(-(-k // w), min(h, k, math.isqrt(k * h // w)))


def bin_of(index: torch.Tensor, length: int | torch.Tensor, bins: int | torch.Tensor) -> torch.Tensor:
    """The near-equal contiguous bin of `index` in [0, length) cut into `bins`: bin j holds
    [floor(j length / bins), floor((j + 1) length / bins))."""
    return ((index + 1) * bins - 1) // length


def bin_start(bin: torch.Tensor, length: int | torch.Tensor, bins: int | torch.Tensor) -> torch.Tensor:
    """First index of bin `bin` of [0, length) cut into `bins` near-equal contiguous bins."""
    return bin * length // bins


def windows(shapes: torch.Tensor, pair: torch.Tensor, n: int) -> torch.Tensor:
    """Each token's window destination (its top-left token's index). shapes: (P, 5) long rows
    (start, h, w, k, h') per pair; pair: (N,) each token's pair."""
    start, h, w, k, rows = shapes[pair].unbind(dim=1)
    local = torch.arange(n, device=pair.device) - start
    row, col = local // w, local % w
    band = bin_of(row, h, rows)
    per_band = bin_start(band + 1, k, rows) - bin_start(band, k, rows)  # windows of this band
    window = bin_of(col, w, per_band)
    return start + bin_start(band, h, rows) * w + bin_start(window, w, per_band)


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """Average-pool each pair's (h, w) grid into its share of `keep` windows (see the module docstring)."""
    budget = per_pair_budget(tokens.pair_sizes, keep)
    device, n = tokens.features.device, tokens.features.shape[0]
    rows = []
    for start, size, grid, k in zip(tokens.pair_starts, tokens.pair_sizes, tokens.grids, budget):
        h, w = pair_grid(grid, size)
        rows.append((start, h, w, k, output_rows(h, w, k)))
    shapes = torch.tensor(rows, dtype=torch.long, device=device)
    sizes = torch.tensor(tokens.pair_sizes, dtype=torch.long, device=device)
    pair = torch.repeat_interleave(torch.arange(len(rows), device=device), sizes, output_size=n)
    return Compression(windows(shapes, pair, n))


# index arithmetic; the means are the kept tokens' copy
COMPRESSOR = TokenCompressor(compress, working_bytes=holds_nothing, host_syncs=0, config_flops=no_matmul)
