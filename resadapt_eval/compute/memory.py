"""Peak GPU memory of one sample on the HF path, planned from the backbone's config before a run.

What `torch.cuda.max_memory_allocated` counts (the sidecar's `peak_memory_mb`): tensors only, not
the CUDA context, kernels' workspaces or the caching allocator's reserve (the headroom of
`resadapt-eval flops --memory` is for those). b: the model dtype's bytes; the tokens are those
`estimates.row_plan` plans (the same rule as the FLOPs); P: patches the vision tower encodes (every
pair at once, as HF runs it), D / I / m / d_v: its width, MLP width, spatial merge and head size;
L: prompt tokens entering the LLM, H / I / n_h / n_kv / d_h the LLM's sizes.

Exact (the tensors' sizes, `tests/test_memory.py`):
- weights: every parameter of the HF model (`parameter_count`: embeddings, every layer's linear
  weights and biases, norms, lm_head unless tied, vision tower, merger, deepstack mergers) x b.
- kv: transformers' DynamicCache after `generate`: per decoder layer 2 x n_kv x d_h x (that
  layer's prompt tokens + max_new_tokens - 1) x b (the last generated token is never fed back;
  an in-LLM pruner's layers hold only their kept tokens; DyCoke selects from a full cache).

Approximate (the largest tensors alive at once; transients smaller than one P x D or L x H
tensor and the kernels' own workspaces are left out):
- inputs: the pixel values in the model's dtype, P x C tp p^2 x b, alive while the tower runs
  (and through `generate` when the tower runs inside it, every method but a token compressor).
- vision: the tower's peak block. Always: the rotary tables (3.5 P d_v float32) and Qwen3-VL's
  deepstack outputs (P / m^2 x D_out x b each); the block's input and normed input 2 P D b; then
  the larger of its attention (qkv 3 P D b, the rotary's float32 q / k 6 P D x 4, and with eager
  attention the largest segment's scores, heads x L_s^2 x max(2 b, b + 4): the scores, float32
  softmax and cast back; SDPA / flash kernels keep O(L_s)) and its MLP (3 P I b gated, 2 P I b
  plain, plus its output P D b).
- llm: the prefill's peak layer over the L tokens entering it: inputs_embeds and the visual
  embeddings (with Qwen3-VL's deepstack features) held by the caller, the residual, normed input
  and output 3 L H b, the rotary tables 2 L d_h b, then the larger of the attention (q, rotated
  q, output 3 L n_h d_h, k, v, rotated k 3 L n_kv d_h, and k, v repeated to n_h heads 2 L n_h
  d_h, all x b; eager: n_h L^2 max(2 b, b + 4) scores plus the L^2 b causal mask) and the MLP
  (3 L I b + L H b). Counted at its first layer, with the whole prompt, against the whole cache:
  an upper bound for a method that prunes inside the LLM.
- extra, a method's own: before the LLM, a token compressor holds the encoded tokens (N x D_out x b,
  with deepstack) and its working tensors (its declaration's `TokenCompressor.working_bytes`, in its
  module: float32 copies of the tokens, its largest similarity or distance matrix over a pair,
  DivPrune's block of its N x N distances; VisionZip's selection holds only per-pair vectors), and
  an attention-reading method recomputes the last ViT block's attention (`recompute_bytes`: its
  captured input and rotary tables, qkv, the rotary's float32 q / k, per segment float32 q / k and
  two heads x L_s^2 float32 score matrices). Inside the LLM (`stage_bytes`): a stage's ranking row
  (the keys of every token, not repeated to n_h heads, float32 scores; PruneVid's rows of every text
  token; PyramidDrop's normed input; DART's keys, pivot similarities and a block of normed rows),
  HoliTom's merge (float32 unit rows of the kept and dropped tokens and their similarity, a block of
  dropped tokens at a time), the kept tokens' copy. The
  Allocator of method=resadapt: its parameters and buffers as loaded (float32; its activations,
  frames at its encoder's small input size, are not counted).

The vision tower's activations are freed before the LLM's prefill starts, so
peak = weights + Allocator + max(encoding, LLM) with encoding = inputs + max(vision, extra
before the LLM) and LLM = kv + llm + extra inside it (+ inputs when the tower runs in `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..baselines import dart
from ..baselines.inside_llm import BLOCK_ROWS, DUAL_FILTER, DUPLICATION, RATERS, STAGE_INPUT, TEXT_AFTER_VISUAL
from ..baselines.sparsevlm import recycled_members
from .flops import BackboneDims, RowPlan, TextDims, VisionDims, block_segments, per_layer

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ATTENTION = ("sdpa", "eager", "flash_attention_2")  # the HF attn_implementation values
F32 = 4


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def check_attention(attention: str) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")


# ---------------------------------------------------------------------- weights
def vision_parameters(v: VisionDims) -> int:
    """Parameters of the vision tower, its merger and deepstack mergers (Qwen2.5-VL: RMSNorms, gated
    MLP, no patch bias; Qwen3-VL: LayerNorms, plain MLP, patch bias, a learned position table)."""
    d, i, merged = v.hidden, v.intermediate, v.merge**2 * v.hidden
    norm = 2 if v.layer_norm else 1  # parameters per normalised channel
    patch = v.in_channels * v.temporal_patch * v.patch**2 * d + (d if v.patch_bias else 0)
    mlp = (3 * d * i + 2 * i + d) if v.gated_mlp else (2 * d * i + i + d)
    block = 2 * norm * d + (3 * d * d + 3 * d) + (d * d + d) + mlp

    def merger(norm_width: int) -> int:
        return norm * norm_width + merged * merged + merged + merged * v.out_hidden + v.out_hidden

    return patch + v.position_embeddings * d + v.depth * block + merger(d) + v.deepstack * merger(merged)


def text_parameters(x: TextDims) -> int:
    """Parameters of the LLM: embeddings, every decoder layer (q / k / v / o with their biases,
    Qwen3's q / k norms, the SwiGLU MLP, two RMSNorms), the final norm, lm_head unless tied."""
    q, kv = x.heads * x.head_dim, x.kv_heads * x.head_dim
    attention = x.hidden * (q + 2 * kv) + q * x.hidden
    attention += (q + 2 * kv if x.qkv_bias else 0) + (x.hidden if x.o_bias else 0)
    attention += 2 * x.head_dim if x.qk_norm else 0
    layer = attention + 3 * x.hidden * x.intermediate + 2 * x.hidden
    embeddings = x.vocab * x.hidden
    return embeddings + x.layers * layer + x.hidden + (0 if x.tied else embeddings)


def parameter_count(dims: BackboneDims) -> int:
    """Every parameter of the HF model (`sum(p.numel() for p in model.parameters())`)."""
    return vision_parameters(dims.vision) + text_parameters(dims.text)


def weight_bytes(dims: BackboneDims, dtype: str = "bfloat16") -> int:
    return parameter_count(dims) * dtype_bytes(dtype)


# ---------------------------------------------------------------------- KV cache
def kv_cache_bytes(x: TextDims, prompt_tokens: int | list[int], max_new_tokens: int, dtype: str = "bfloat16") -> int:
    """What the DynamicCache holds after `generate` made `max_new_tokens` tokens: per layer the
    keys and values of its prompt tokens (`prompt_tokens`, or that many in each layer) and of the
    generated ones but the last."""
    fed = max(max_new_tokens - 1, 0)
    tokens = sum(n + fed for n in per_layer(x, prompt_tokens))
    return 2 * x.kv_heads * x.head_dim * tokens * dtype_bytes(dtype)


# ---------------------------------------------------------------------- activations
def patches(v: VisionDims, grids) -> int:
    return sum(t * h * w for t, h, w in grids) * v.merge**2


def input_bytes(v: VisionDims, grids, dtype: str) -> int:
    """The pixel values the tower reads, in the model's dtype (the adapter casts them)."""
    return patches(v, grids) * v.in_channels * v.temporal_patch * v.patch**2 * dtype_bytes(dtype)


def largest_segment(v: VisionDims, grids, blocks) -> int:
    """Patches of the longest attention segment of `blocks` over `grids`."""
    return max(max(block_segments(v, tuple(g), b)) for g in grids for b in blocks)


def scores_bytes(heads: int, rows: int, cols: int, b: int) -> int:
    """An eager attention's score matrix at its largest: the scores (and their scaled copy, or the
    float32 softmax beside them), then that softmax and its cast back."""
    return heads * rows * cols * max(2 * b, b + F32)


def vision_activation_bytes(v: VisionDims, grids, dtype: str = "bfloat16", attention: str = "sdpa") -> int:
    """The vision tower's peak block over `grids` (see the module docstring)."""
    b, p = dtype_bytes(dtype), patches(v, grids)
    units = p // v.merge**2
    held = 7 * p * (v.hidden // v.heads) * F32 // 2 + v.deepstack * units * v.out_hidden * b
    attn = 3 * p * v.hidden * b + 6 * p * v.hidden * F32
    if attention == "eager":
        longest = largest_segment(v, grids, range(v.depth))
        attn += scores_bytes(v.heads, longest, longest, b)
    mlp = (3 if v.gated_mlp else 2) * p * v.intermediate * b + p * v.hidden * b
    return held + 2 * p * v.hidden * b + max(attn, mlp)


def llm_activation_bytes(
    dims: BackboneDims, tokens: int, visual: int, dtype: str = "bfloat16", attention: str = "sdpa"
) -> int:
    """The prefill's peak layer with `tokens` tokens, `visual` of them visual (see the module docstring)."""
    x, b = dims.text, dtype_bytes(dtype)
    q, kv = x.heads * x.head_dim, x.kv_heads * x.head_dim
    held = tokens * x.hidden * b + visual * dims.vision.out_hidden * (1 + dims.vision.deepstack) * b
    held += 3 * tokens * x.hidden * b + 2 * tokens * x.head_dim * b
    attn = tokens * (3 * q + 3 * kv + 2 * q) * b
    if attention == "eager":
        attn += scores_bytes(x.heads, tokens, tokens, b) + tokens * tokens * b
    mlp = tokens * (3 * x.intermediate + x.hidden) * b
    return held + max(attn, mlp)


# ---------------------------------------------------------------------- a method's own
def recompute_bytes(v: VisionDims, grids, dtype: str = "bfloat16") -> int:
    """The last ViT block's attention recomputed for the attention-reading methods
    (`vision_attention.received_attention_and_keys`): its captured input and rotary tables, qkv,
    the rotary's float32 q / k, per segment float32 q / k and two heads x L_s^2 float32 scores."""
    b, p = dtype_bytes(dtype), patches(v, grids)
    longest = largest_segment(v, grids, [v.depth - 1])
    held = 4 * p * v.hidden * b + 2 * p * (v.hidden // v.heads) * F32  # input, qkv, the rotary cos / sin
    return held + 6 * p * v.hidden * F32 + 2 * longest * v.hidden * F32 + 2 * v.heads * longest**2 * F32


def stage_bytes(x: TextDims, stage, tokens: int, visual: int, text: int, dtype: str = "bfloat16") -> int:
    """One stage inside the LLM over `tokens` tokens (`visual` visual, `text` text): its ranking
    (the rotated keys, n_kv heads, never repeated to n_h, formed a block of at most `BLOCK_ROWS`
    tokens at a time: the block's projected and rotated copies, and for PyramidDrop the block's
    normed input, two float32 B x H tensors inside RMSNorm; float32 rows of scores), HoliTom's
    merge (float32 unit rows of the kept tokens, then per block of at most `BLOCK_ROWS` dropped
    tokens their float32 unit rows and similarity to the kept; the merged copy) and the kept copy."""
    b, block = dtype_bytes(dtype), min(tokens, BLOCK_ROWS)
    if stage.rank_by == DUPLICATION:
        return duplication_bytes(x, stage, tokens, visual, b)
    rows = text if stage.rank_by in (TEXT_AFTER_VISUAL, RATERS, DUAL_FILTER) else 1
    total = (tokens + 2 * block) * x.kv_heads * x.head_dim * b
    total += 3 * x.heads * rows * tokens * F32
    if stage.recycle:  # SparseVLM's members: gathered and float32 rows, weighted copy; float32 (m, m) distances
        members = recycled_members(visual - (stage.keep - stage.recycle))
        total += members * x.hidden * (2 * b + F32) + 4 * members**2 * F32
    if stage.rank_by == STAGE_INPUT:
        total += 2 * block * x.hidden * F32
    if stage.merge:
        dropped = min(visual - stage.keep, BLOCK_ROWS)
        total += 2 * (dropped + stage.keep) * x.hidden * F32 + dropped * stage.keep * F32 + tokens * x.hidden * b
    return total + (tokens - visual + stage.keep) * x.hidden * b


def duplication_bytes(x: TextDims, stage, tokens: int, visual: int, b: int) -> int:
    """DART's stage over `tokens` tokens (`visual` visual): the layer before's keys as a ranking forms
    them (a block at a time) and their L1 norms; the pivots' normed rows; per block of at most
    `dart.SIMILARITY_ROWS` visual rows their gathered and normed copies (two float32 B x H tensors
    inside RMSNorm) and float32 norms; the (N, pivots) float32 similarity and one negated column; the
    scores and the kept copy."""
    block, pivots = min(visual, dart.SIMILARITY_ROWS), dart.PIVOT_IMAGE + dart.PIVOT_TEXT
    keys = (tokens + 2 * min(tokens, BLOCK_ROWS)) * x.kv_heads * x.head_dim * b + tokens * b
    similarity = 2 * visual * pivots * F32 + visual * F32 + pivots * x.hidden * b
    rows = 2 * block * x.hidden * b + 2 * block * x.hidden * F32
    return keys + similarity + rows + tokens * F32 + (tokens - visual + stage.keep) * x.hidden * b


# ---------------------------------------------------------------------- one sample
@dataclass(frozen=True)
class SampleMemory:
    """Bytes of one sample's peak (see the module docstring): weights, kv (exact); inputs, vision,
    llm; extra_encoding / extra_llm (a method's own, before / inside the LLM); allocator (the
    Allocator's parameters and buffers); tower_in_generate: the pixel values stay through `generate`."""

    weights: int
    kv: int
    inputs: int
    vision: int
    llm: int
    extra_encoding: int = 0
    extra_llm: int = 0
    allocator: int = 0
    tower_in_generate: bool = True

    @property
    def encoding(self) -> int:
        return self.inputs + max(self.vision, self.extra_encoding)

    @property
    def llm_phase(self) -> int:
        return self.kv + self.llm + self.extra_llm + (self.inputs if self.tower_in_generate else 0)

    @property
    def extra(self) -> int:
        return self.extra_encoding + self.extra_llm + self.allocator

    @property
    def peak(self) -> int:
        return self.weights + self.allocator + max(self.encoding, self.llm_phase)


def sample_memory(
    dims: BackboneDims,
    plan: RowPlan,
    max_new_tokens: int,
    dtype: str = "bfloat16",
    attention: str = "sdpa",
    allocator_bytes: int = 0,
) -> SampleMemory:
    """The memory plan of one sample planned as `plan` (`estimates.row_plan`), generating up to
    `max_new_tokens` tokens, with the model in `dtype` and its `attention` implementation."""
    check_attention(attention)
    b, method, v = dtype_bytes(dtype), plan.method, dims.vision
    prompt = per_layer(dims.text, plan.prompt)
    text = prompt[0] - plan.visual
    encoding = 0
    if method.compress is not None:  # the encoded vanilla tokens and the compressor's work
        sizes = [t * h * w for t, h, w in plan.grids]
        encoding = sum(sizes) * v.out_hidden * (1 + v.deepstack) * b
        encoding += method.compressor.working_bytes(sizes, v.out_hidden, b)
    if method.needs_attention:
        encoding += recompute_bytes(v, plan.grids, dtype)
    if method.tower_merge is not None:  # the first merging block's recomputed attention (it sees every
        # unit, as the last block does on Qwen3-VL) and the merge's float32 copies of its output
        encoding += recompute_bytes(v, plan.grids, dtype) + 3 * patches(v, plan.grids) * v.hidden * F32
    inside = 0  # the stages run one after another: the largest
    if method.adaptive_prune is not None:  # its merging or ranking layer, over the whole prompt at most
        inside = method.adaptive_prune.working_bytes(dims.text, prompt[0], plan.visual, b)
    for stage in plan.stages or []:
        tokens = prompt[stage.layer - 1]  # ranked over the tokens of the layer before
        inside = max(inside, stage_bytes(dims.text, stage, tokens, tokens - text, text, dtype))
    return SampleMemory(
        weights=weight_bytes(dims, dtype),
        kv=kv_cache_bytes(dims.text, plan.prompt, max_new_tokens, dtype),
        inputs=input_bytes(v, plan.grids, dtype),
        vision=vision_activation_bytes(v, plan.grids, dtype, attention),
        llm=llm_activation_bytes(dims, prompt[0], plan.visual, dtype, attention),
        extra_encoding=encoding,
        extra_llm=inside,
        allocator=allocator_bytes,
        tower_in_generate=method.compress is None and method.tower_merge is None,
    )


def module_bytes(module) -> int:
    """Bytes of a loaded module's parameters and buffers (the Allocator's, as it is placed on the GPU)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
