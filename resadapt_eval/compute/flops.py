"""FLOPs of one sample, counted from its token grids and the backbone's config (no weights).

Convention (torch.utils.flop_counter's): 2 FLOPs per multiply-add of every matmul and
convolution that runs; norms, activations, softmax, rotary, embeddings and bias adds are not
counted. *Linear* terms: the patch-embed Conv3d and every nn.Linear. *Attention* terms: the QK^T
and AV products over the whole Lq x Lk score matrix, 4 * Lq * Lk * heads * head_dim per layer
(a causal mask is not exploited, as eager attention and FlopCounterMode count it; a causal
kernel does about half of the LLM's prefill share).

What runs per sample (Qwen2.5-VL / Qwen3-VL as in transformers):
- vision tower, per pair grid (t, h, w) in merged tokens, P = t * h * w * m^2 patches (m: spatial
  merge): Conv3d 2 * P * (C * tp * p^2) * D; per block qkv + proj 2 * P * 4D^2 and MLP
  2 * P * k * D * I (k = 3 gated (SwiGLU, Qwen2.5-VL), 2 plain (Qwen3-VL)); attention
  4 * D * sum(L_s^2) over the block's segments: one per temporal patch (h * w * m^2 patches),
  or for Qwen2.5-VL's windowed blocks one per window of (window / p / m)^2 merge units
  (partial windows at the right and bottom edges); merger (and each Qwen3-VL deepstack merger)
  2 * (P / m^2) * m^2 D * (m^2 D + D_out).
- LLM prefill over the L prompt tokens: per token and layer 2 * (2 H * n_h * d_h + 2 H * n_kv * d_h
  + 3 H * I), plus lm_head 2 * H * V on the last token only (HF generate's logits_to_keep=1).
- decode: n generated tokens take n - 1 more forwards (the first comes from prefill); step i
  (1..n-1) runs one token against L + i keys.
- a method's own work: the recomputed last-block attention of VisionZip / FlashVid (qkv
  2 * P * 3 D^2 and QK^T 2 * D * sum(L_s^2)), and the compressor's similarities. In a run the
  compressor's work is counted while it runs (`counting.CountedCall`: FlashVid's depends on its
  segments and merge trees); from configs alone (`row_flops`) ToMe's and VisionZip's are computed
  (2 * rows * cols * width per similarity matrix: D_out, or the vision head size for VisionZip's
  keys), FlashVid's cannot be.
- the Allocator (method=resadapt): its frozen encoders per frame and per query length, and its
  decoder (`Allocator.flops`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from ..budget.tokens import TokenBudget
from .configs import KNOWN_CONFIGS

TERA = 1e12


@dataclass(frozen=True)
class VisionDims:
    """The vision tower: D = hidden, I = intermediate, p = patch, m = merge, tp = temporal patch;
    window_px: Qwen2.5-VL's attention window in pixels (None: every block attends per temporal
    patch); full_blocks: blocks that attend per temporal patch anyway; deepstack: extra mergers;
    heads: attention heads (head size D / heads); deepstack_taps: the blocks the DeepStack mergers
    read (Qwen3-VL's `deepstack_visual_indexes`). For the parameter count (`memory.py`):
    position_embeddings: rows of Qwen3-VL's learned position table; layer_norm: LayerNorms with
    a bias (Qwen3-VL) instead of RMSNorms; patch_bias: the patch embedding's bias."""

    depth: int
    hidden: int
    intermediate: int
    in_channels: int
    patch: int
    merge: int
    temporal_patch: int
    out_hidden: int
    gated_mlp: bool
    window_px: int | None
    full_blocks: tuple[int, ...]
    deepstack: int
    heads: int
    position_embeddings: int = 0
    layer_norm: bool = False
    patch_bias: bool = False
    deepstack_taps: tuple[int, ...] = ()


@dataclass(frozen=True)
class TextDims:
    """The LLM: H = hidden, I = intermediate, n_h / n_kv heads of d_h, V = vocabulary. For the
    parameter count (`memory.py`): tied: lm_head is the embedding matrix; qkv_bias / o_bias: the
    attention projections' biases; qk_norm: Qwen3's per-head q and k RMSNorms."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    context: int | None = None  # max_position_embeddings: the longest sequence, in tokens (None: not stated)


@dataclass(frozen=True)
class BackboneDims:
    model_type: str
    vision: VisionDims
    text: TextDims

    @property
    def token_px(self) -> int:
        """Side in pixels of the square that becomes one LLM token (p * m)."""
        return self.vision.patch * self.vision.merge


def dims_from_config(config) -> BackboneDims:
    """The counted dimensions of a Qwen2.5-VL / Qwen3-VL config: a transformers config object or
    its config.json dict."""
    config = config if isinstance(config, dict) else config.to_dict()
    model_type, text, vision = config["model_type"], config["text_config"], config["vision_config"]
    if model_type not in ("qwen2_5_vl", "qwen3_vl"):
        raise ValueError(f"FLOPs are counted for qwen2_5_vl and qwen3_vl configs, not {model_type!r}")
    qwen25 = model_type == "qwen2_5_vl"
    heads = text["num_attention_heads"]
    # lm_head tied as transformers ties it: Qwen2.5-VL by either config's flag, Qwen3-VL by the top one
    tied = bool(config.get("tie_word_embeddings")) or (qwen25 and bool(text.get("tie_word_embeddings")))
    attention_bias = bool(text.get("attention_bias", False))  # Qwen3-VL's q, k, v and o (Qwen2.5-VL: q, k, v)
    return BackboneDims(
        model_type,
        VisionDims(
            depth=vision["depth"],
            hidden=vision["hidden_size"],
            intermediate=vision["intermediate_size"],
            in_channels=vision.get("in_channels", 3),
            patch=vision["patch_size"],
            merge=vision["spatial_merge_size"],
            temporal_patch=vision["temporal_patch_size"],
            out_hidden=vision["out_hidden_size"],
            gated_mlp=qwen25,
            window_px=vision["window_size"] if qwen25 else None,
            full_blocks=tuple(vision.get("fullatt_block_indexes", ())),
            deepstack=len(vision.get("deepstack_visual_indexes", ())),
            heads=vision["num_heads"],
            position_embeddings=0 if qwen25 else vision.get("num_position_embeddings", 2304),
            layer_norm=not qwen25,
            patch_bias=not qwen25,
            deepstack_taps=tuple(vision.get("deepstack_visual_indexes", ())),
        ),
        TextDims(
            hidden=text["hidden_size"],
            layers=text["num_hidden_layers"],
            intermediate=text["intermediate_size"],
            heads=heads,
            kv_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            vocab=text["vocab_size"],
            context=text.get("max_position_embeddings"),
            tied=tied,
            qkv_bias=qwen25 or attention_bias,
            o_bias=not qwen25 and attention_bias,
            qk_norm=not qwen25,
        ),
    )


def load_dims(backbone: str) -> BackboneDims:
    """A known backbone by name (`KNOWN_CONFIGS`), or a `pretrained` folder / config.json path."""
    if backbone in KNOWN_CONFIGS:
        return dims_from_config(KNOWN_CONFIGS[backbone])
    path = Path(backbone)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"unknown backbone {backbone!r}: give one of {', '.join(KNOWN_CONFIGS)} or a config folder")
    return dims_from_config(json.loads(path.read_text()))


# ---------------------------------------------------------------------- vision tower
def segments(v: VisionDims, grid: tuple[int, int, int], windowed: bool) -> list[int]:
    """Patches per attention segment of one grid (t, h, w) in merged tokens: one per temporal
    patch, or per window (Qwen2.5-VL's `get_vision_window_index`)."""
    t, h, w = grid
    unit = v.merge**2
    if not windowed:
        return [h * w * unit] * t
    n = v.window_px // v.merge // v.patch  # window side in merged tokens
    rows = [min(n, h - i) for i in range(0, h, n)]
    cols = [min(n, w - j) for j in range(0, w, n)]
    return [r * c * unit for r in rows for c in cols] * t


def block_segments(v: VisionDims, grid: tuple[int, int, int], block: int) -> list[int]:
    """The attention segments of vision block `block` over one grid."""
    return segments(v, grid, v.window_px is not None and block not in v.full_blocks)


def vision_flops(v: VisionDims, grids, tower: TowerCounts | None = None) -> tuple[int, int]:
    """(linear, attention) FLOPs of the vision tower over merged-token grids (t, h, w); `tower`: what
    each block and merger ran, for a method that reduces tokens inside the tower (None: every block
    sees every patch)."""
    if tower is not None:
        return merged_tower_flops(v, grids, tower)
    linear = attention = 0
    unit = v.merge**2
    for grid in grids:
        t, h, w = grid
        units = t * h * w
        patches = units * unit
        linear += 2 * patches * v.in_channels * v.temporal_patch * v.patch**2 * v.hidden
        linear += v.depth * 2 * patches * block_linear(v)
        linear += (1 + v.deepstack) * merger_flops(v, units)
        attention += sum(4 * v.hidden * sum(s * s for s in block_segments(v, grid, b)) for b in range(v.depth))
    return linear, attention


def block_linear(v: VisionDims) -> int:
    """Linear FLOPs of one patch through one vision block (q, k, v, o and the MLP), per multiply-add pair."""
    return 4 * v.hidden**2 + (3 if v.gated_mlp else 2) * v.hidden * v.intermediate


def merger_flops(v: VisionDims, units: int) -> int:
    """One merger (or DeepStack merger) over `units` merge units."""
    unit = v.merge**2
    return 2 * units * unit * v.hidden * (unit * v.hidden + v.out_hidden)


@dataclass(frozen=True)
class TowerCounts:
    """What a vision tower that reduces tokens between its blocks runs (Qwen3-VL: every block attends
    per frame pair): blocks: the patches of each frame pair entering each block (its attention and
    MLP); taps: the patches each DeepStack merger reads; merger: the patches the merger reads."""

    blocks: tuple[tuple[int, ...], ...]
    taps: tuple[int, ...]
    merger: int

    @property
    def tokens(self) -> list[int]:
        """Patches entering each block, then the merger's (a record's `tower_tokens`)."""
        return [sum(block) for block in self.blocks] + [self.merger]


def merged_tower_flops(v: VisionDims, grids, tower: TowerCounts) -> tuple[int, int]:
    """`vision_flops` of a tower that reduces tokens between blocks: the patch embedding over every
    patch, each block over its `tower.blocks` patches, the mergers over theirs."""
    if v.window_px is not None:
        raise ValueError(
            "a method reducing tokens inside the vision tower runs on Qwen3-VL only (Qwen2.5-VL's windows)"
        )
    unit = v.merge**2
    patches = sum(t * h * w for t, h, w in grids) * unit
    linear = 2 * patches * v.in_channels * v.temporal_patch * v.patch**2 * v.hidden
    linear += sum(2 * sum(block) * block_linear(v) for block in tower.blocks)
    linear += sum(merger_flops(v, n // unit) for n in (tower.merger, *tower.taps))
    attention = sum(4 * v.hidden * sum(s * s for s in block) for block in tower.blocks)
    return linear, attention


def tower_attention(v: VisionDims, segments: tuple[int, ...]) -> int:
    """One vision block's attention recomputed eagerly over attention segments of `segments`
    patches: its qkv projection 2 P 3 D^2 and QK^T 2 D L_s^2 per segment
    (`vision_attention.received_attention_and_keys`)."""
    return 2 * sum(segments) * 3 * v.hidden**2 + sum(2 * v.hidden * s * s for s in segments)


# ---------------------------------------------------------------------- LLM
def token_linear(x: TextDims) -> int:
    """Linear FLOPs of one token through every decoder layer (q, k, v, o and the SwiGLU MLP)."""
    return x.layers * layer_linear(x)


def layer_linear(x: TextDims) -> int:
    """Linear FLOPs of one token through one decoder layer."""
    attn = 2 * x.hidden * x.heads * x.head_dim + 2 * x.hidden * x.kv_heads * x.head_dim
    return 2 * (attn + 3 * x.hidden * x.intermediate)


def per_layer(x: TextDims, prompt_tokens: int | list[int]) -> list[int]:
    """Prompt tokens in each decoder layer: the same in every layer, or as given (a method that
    prunes inside the LLM)."""
    lengths = [prompt_tokens] * x.layers if isinstance(prompt_tokens, int) else list(prompt_tokens)
    if len(lengths) != x.layers:
        raise ValueError(f"{len(lengths)} per-layer prompt lengths for an LLM of {x.layers} layers")
    return lengths


def prefill_flops(x: TextDims, prompt_tokens: int | list[int]) -> tuple[int, int]:
    """(linear, attention) FLOPs of the LLM's prefill over `prompt_tokens` tokens (or that many in
    each layer), lm_head on the last."""
    lengths = per_layer(x, prompt_tokens)
    linear = sum(lengths) * layer_linear(x) + 2 * x.hidden * x.vocab
    return linear, sum(4 * n**2 * x.heads * x.head_dim for n in lengths)


def decode_flops(x: TextDims, prompt_tokens: int | list[int], output_tokens: int, keys_dropped: int = 0) -> int:
    """FLOPs (linear and attention) of the n - 1 decode steps after prefill, step i against the
    layer's prompt plus i keys, less `keys_dropped` key columns (summed over layers and steps) a
    decoding-time pruner kept the steps from."""
    steps = max(0, output_tokens - 1)
    keys = sum(n + i for n in per_layer(x, prompt_tokens) for i in range(1, steps + 1)) - keys_dropped
    return steps * (token_linear(x) + 2 * x.hidden * x.vocab) + 4 * keys * x.heads * x.head_dim


def ranking_flops(x: TextDims, length: int, queries: int = 1) -> int:
    """The attention rows of the last `queries` tokens (Q; 1: the last token's, `inside_llm`) over `length`
    tokens in one layer: their queries 2 Q H n_h d_h, every key 2 L H n_kv d_h, the scores 2 n_h Q L d_h."""
    return (
        2 * queries * x.hidden * x.heads * x.head_dim
        + 2 * length * x.hidden * x.kv_heads * x.head_dim
        + (2 * x.heads * queries * length * x.head_dim)
    )


# ---------------------------------------------------------------------- a method's own work
def evs_similarity(grids, width: int) -> int:
    """vLLM's EVS over one video of equal pairs: each token of a later pair is compared by cosine
    (three `width`-long dot products) with the token at its position in the pair before."""
    return sum(6 * width * t * h * w for t, h, w in grids[1:])


ENGINE_PRUNING = {"evs": evs_similarity}


def recomputed_attention(v: VisionDims, grids) -> int:
    """The last vision block's attention recomputed eagerly for VisionZip / FlashVid: its qkv
    projection 2 * P * 3 D^2 and QK^T 2 * D * L_s^2 per segment (`vision_attention.received_attention_and_keys`)."""
    last = v.depth - 1
    total = 0
    for grid in grids:
        t, h, w = grid
        total += 2 * t * h * w * v.merge**2 * 3 * v.hidden**2
        total += sum(2 * v.hidden * s * s for s in block_segments(v, grid, last))
    return total


def method_flops(method, dims: BackboneDims, grids, retention: float | None, compressor: int | None = None) -> int:
    """FLOPs a method adds to the backbone's own (a `methods.Method` over the vanilla `grids`), as
    its kind counts them (`MethodKind.own_flops`): the recomputed attention it reads, its
    compressor's or ranking's work, `compressor` FLOPs as counted in a run or else computed from the
    grids (ToMe, VisionZip), an engine's pruning by formula; zero for methods that only resize."""
    return method.kind.own_flops(method, dims, grids, retention, compressor)


# ---------------------------------------------------------------------- one sample
@dataclass(frozen=True)
class SampleFlops:
    """FLOPs of one sample. vision / vision_attention: the tower's linear and attention terms;
    llm_prefill / llm_attention: the LLM's prefill linear (lm_head on the last token) and attention
    terms; decode: every decode step (linear and attention); method: a method's own work;
    allocator: the Allocator's (encoders and decoder)."""

    vision: int
    vision_attention: int
    llm_prefill: int
    llm_attention: int
    decode: int
    method: int
    allocator: int = 0

    @property
    def linear(self) -> int:
        """The paper's latency-table counting: prefill's linear layers (vision tower and LLM)."""
        return self.vision + self.llm_prefill

    @property
    def attention(self) -> int:
        return self.vision_attention + self.llm_attention

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def sample_flops(
    dims: BackboneDims,
    method,
    grids,
    retention: float | None,
    prompt_tokens: int | list[int],
    output_tokens: int,
    compressor: int | None = None,
    allocator: int = 0,
    decode_keys_dropped: int = 0,
    tower: TowerCounts | None = None,
) -> SampleFlops:
    """FLOPs of one sample: the vision tower over the planned `grids` (t, h, w merged tokens, the
    vanilla ones for a token compressor), the LLM over the `prompt_tokens` that entered it (or
    that many in each layer) and `output_tokens` generated (less `decode_keys_dropped` key columns
    a decoding-time pruner kept the steps from), the `method`'s own work at `retention`
    (`compressor`: its compressor's counted FLOPs, see `method_flops`) and the Allocator's
    `allocator` FLOPs; `tower`: the units each vision block sees, for a method that merges inside
    the tower (`TokenBudget.tower`)."""
    vision, vision_attention = vision_flops(dims.vision, grids, tower)
    prefill, attention = prefill_flops(dims.text, prompt_tokens)
    return SampleFlops(
        vision=vision,
        vision_attention=vision_attention,
        llm_prefill=prefill,
        llm_attention=attention,
        decode=decode_flops(dims.text, prompt_tokens, output_tokens, decode_keys_dropped),
        method=method_flops(method, dims, grids, retention, compressor),
        allocator=allocator,
    )


# ---------------------------------------------------------------------- a table row from configs alone
@dataclass(frozen=True)
class RowPlan:
    """What `frames` frames of a source become under a method, from configs alone: grids: what the
    vision tower encodes (t, h, w merged tokens; the vanilla ones for a token compressor); visual:
    the visual tokens entering the LLM; prompt: the prompt's tokens (the same in every decoder
    layer) or a list of them per layer (a method with stages inside the LLM); stages: those stages
    (`inside_llm.Stage`), None without; budget: the sample's `TokenBudget`, as a run's record reads it."""

    method: object
    grids: list
    visual: int
    prompt: int | list[int]
    stages: list | None
    budget: TokenBudget
