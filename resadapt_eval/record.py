"""The sidecar record: what one sample spent, one line of the sidecar JSONL."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np

from .compute.flops import dims_from_config, sample_flops
from .kept import KeptTokens, encode

if TYPE_CHECKING:
    from .backbones.layout import QwenLayout
    from .budget.tokens import TokenBudget
    from .pipeline import Built, Decoded, Generated, Planned, Request, Scores
    from .runspec import RunSpec


@dataclass
class SampleRecord:
    """What one sample spent; built once by the pipeline from its stage results.

    scales: per-frame scale s_t; grids: (t, h, w) merged-token grid per pair; visual_tokens: tokens
    that entered the LLM; layer_visual_tokens: those in each decoder layer, for a method that prunes
    inside the LLM (None otherwise); layer_averaged_tokens: their mean over layers (visual_tokens
    for every other method); reference_tokens: the vanilla plan's tokens for the same frames;
    achieved_retention = layer_averaged_tokens / reference_tokens (for every method but those
    pruning inside the LLM, visual_tokens / reference_tokens); raw_scales: an Allocator's scales before
    projection to the target R; merged_sizes: for token compressors, how many original tokens each
    kept token stands for (sums to the vanilla count for merging methods); kept: which of the plan's
    tokens entered the LLM, how merged tokens were grouped and which an in-LLM method held from each
    of its stages on (`kept.py`: encoded compactly, read back by `kept.read_kept`; null for a failed
    sample, and where the engine pruned without saying which: vLLM's EVS); tower_tokens: for a method
    merging inside the vision tower, the patches entering each vision block, then the merger's. Frame selection:
    candidates (frames scored), frame_indices (the kept ones), reference_tokens (the candidates'
    vanilla tokens, so R is against vanilla at the candidate count, as the paper reports it);
    frame_budget: visual tokens in full-resolution-frame equivalents (every method). Images: one
    entry per image in base_size, scales, pair_sizes and grids. Seconds: decode_s (video decode),
    allocator_{text,visual,predict}_s (Allocator stages; predict includes the projection), scale_apply_s
    (resizing frames to the plan, by `resize`: exact or fast), preprocess_s (planning and building the
    model inputs, resize included), generate_s (this sample's share of the engine call), vision_s (the
    vision tower, inside generate_s or, for a compressor, in preprocess_s; None on vLLM), compress_s (a
    token compressor's own work, within preprocess_s; null where the method has no such stage,
    compress_s_reason saying why), query_tokens (the question's tokens a compressor that reads the
    question embedded; 0 with query_tokens_reason when the request had no question text; null for a
    method that does not read it), rank_s (an in-LLM pruner's own ranking and pruning inside the
    prefill, or a decoding-time pruner's ranking and selection over its steps; null for a method
    without a stage inside the LLM, rank_s_reason saying why), first_token_s (the engine starting
    this request to its first token: vision tower, a prefill pruner's rank_s and the LLM's
    prefill), prefill_s (the LLM's prefill alone: first_token_s less the vision tower's part in it and
    a prefill pruner's rank_s; null on vLLM, whose tower is not timed apart), per_token_s (each
    later token), peak_memory_mb
    (`measure.clock.peak_memory_mb`: on CUDA `torch.cuda.max_memory_allocated` in MiB since a reset
    before the engine call and, for a token compressor, before it encoded and compressed, the larger of
    the two; None on vLLM).
    Stage clocks are CUDA events on a GPU, wall clocks on CPU. error: `ExceptionType: message`.
    allocator: the Allocator checkpoint of method=resadapt (`untrained` when run on purpose without one).
    allocator_query: what that Allocator read as the query (`question`, or `empty` in the ablation).
    allocator_budget: `budget.json` when that checkpoint records the budget it was trained under
    (settings not given came from it), `missing` when it does not (the run fell back on model_args
    and the defaults, s in [0.2, 1.8]); null without a checkpoint (`allocator.budget_source`).
    budget_rule: the rule that sized the plan (`BudgetSpec.rule_label`: `paper` or `authors_code`,
    with any setting given against it, e.g. `authors_code (fixed_scale_rule=search)`).
    FLOPs of a successful sample (0 for a failed one; counted by `compute.flops`, 2 per multiply-add
    of every matmul and convolution): vision_flops / vision_attention_flops (vision tower: linear
    layers / attention scores), llm_prefill_flops / llm_attention_flops (LLM over the prompt: linear
    layers with lm_head on the last token / attention scores), decode_flops (all decode steps),
    method_flops (a method's own work: recomputed attention, its compressor's work as counted while
    it ran), allocator_flops (the Allocator's encoders and decoder on this sample alone, padding in a
    batch not counted), total_flops (their sum).
    """

    doc_id: int | None
    task: str | None
    method: str
    allocator: str | None = None
    allocator_query: str | None = None
    allocator_budget: str | None = None
    budget_rule: str | None = None
    video: str | None = None
    num_frames: int = 0
    frame_indices: list[int] = field(default_factory=list)
    base_size: list | None = None
    scales: list[float] = field(default_factory=list)
    pair_sizes: list[list[int]] = field(default_factory=list)
    grids: list[list[int]] = field(default_factory=list)
    visual_tokens: int = 0
    layer_visual_tokens: list[int] | None = None
    layer_averaged_tokens: float | None = None
    reference_tokens: int = 0
    achieved_retention: float | None = None
    target_retention: float | None = None
    raw_scales: list[float] | None = None
    merged_sizes: list[int] | None = None
    kept: dict | None = None
    tower_tokens: list[int] | None = None
    candidates: int | None = None
    frame_budget: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    decode_s: float = 0.0
    allocator_text_s: float = 0.0
    allocator_visual_s: float = 0.0
    allocator_predict_s: float = 0.0
    scale_apply_s: float = 0.0
    resize: str | None = None
    preprocess_s: float = 0.0
    generate_s: float = 0.0
    vision_s: float | None = None
    compress_s: float | None = None
    compress_s_reason: str | None = None
    query_tokens: int | None = None
    query_tokens_reason: str | None = None
    rank_s: float | None = None
    rank_s_reason: str | None = None
    first_token_s: float | None = None
    prefill_s: float | None = None
    per_token_s: float | None = None
    peak_memory_mb: float | None = None
    vision_flops: int = 0
    vision_attention_flops: int = 0
    llm_prefill_flops: int = 0
    llm_attention_flops: int = 0
    decode_flops: int = 0
    method_flops: int = 0
    allocator_flops: int = 0
    total_flops: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _finite(value) -> bool:
    """False when `value` is, or holds (in lists, at any depth), a NaN or infinite float."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


def with_finite_values(record: SampleRecord) -> SampleRecord:
    """`record`, or, when a field holds a NaN or infinite number (JSON cannot hold one: an
    Allocator's NaN scales, a division by zero), the sample failed: those fields null and the
    reason in `error` (added to an error it already had)."""
    bad = [f.name for f in fields(record) if not _finite(getattr(record, f.name))]
    if not bad:
        return record
    reason = f"non-finite values (NaN or inf) in {', '.join(bad)}"
    for name in bad:
        setattr(record, name, None)
    record.error = f"ValueError: {reason}" if record.error is None else f"{record.error} (and {reason})"
    return record


def sidecar_line(record: SampleRecord) -> str:
    """One sidecar JSONL line: the record as JSON with NaN and infinity refused (a non-finite
    value fails the sample instead, `with_finite_values`), so writing a record never stops a run."""
    return json.dumps(with_finite_values(record).to_dict(), allow_nan=False) + "\n"


def _budget_source(allocator: str | None) -> str | None:
    from .allocator.inference import budget_source

    return budget_source(allocator)


def error_text(exc: BaseException) -> str:
    """How a failed sample's exception is recorded: its type and message."""
    return f"{type(exc).__name__}: {exc}"


def kept_field(planned: Planned, built: Built, engine, budget: TokenBudget) -> dict | None:
    """The record's `kept`: the compressor's assignment (from the engine, or from building the inputs),
    else every planned token as its own; an in-LLM pruner's stages over it. None where the tokens that
    entered are fewer than the plan's and nothing said which (an engine's own pruning)."""
    pair_sizes = [t * h * w for p in planned.plans for t, h, w in p.grids]
    planned_tokens = sum(pair_sizes)
    if engine.assignment is not None:
        kept = KeptTokens(np.asarray(engine.assignment, dtype=np.int64))
    elif built.assignment is not None:
        kept = KeptTokens(built.assignment.cpu().numpy().astype(np.int64))
    elif budget.entering == planned_tokens:
        kept = KeptTokens.everything(planned_tokens)
    else:
        return None
    if len(kept.assignment) != planned_tokens or len(kept.kept) != budget.entering:
        raise RuntimeError(
            f"the method kept {len(kept.kept)} of {len(kept.assignment)} tokens; the plan counts "
            f"{budget.entering} of {planned_tokens}"
        )
    if engine.held_stages:
        stages = tuple(kept.stage_from_entering(layer, entering) for layer, entering in engine.held_stages)
        kept = KeptTokens(kept.assignment, stages)
    return encode(kept, pair_sizes)


def build_record(
    request: Request,
    spec: RunSpec,
    layout: QwenLayout,
    decoded: Decoded | None,
    scores: Scores | None,
    planned: Planned | None,
    budget: TokenBudget | None,
    built: Built | None,
    generated: Generated | None,
    error: Exception | None,
) -> SampleRecord:
    """The sidecar record of one sample, from the stages it completed. Its token counts and R are
    the sample's token budget (`budget.tokens`), which the engine's prompt was checked against."""
    record = SampleRecord(
        doc_id=request.doc_id,
        task=request.task,
        method=spec.method.name,
        allocator=spec.allocator,
        allocator_query=spec.allocator_query if spec.allocator else None,
        allocator_budget=_budget_source(spec.allocator),
        budget_rule=spec.budget.rule_label,
        video=None if request.video is None else str(request.video),
        target_retention=spec.retention,
        error=error_text(error) if error else None,
    )
    if decoded is not None:
        record.decode_s = decoded.seconds
    if scores is not None:
        record.allocator_text_s, record.allocator_visual_s = scores.text_s, scores.visual_s
        record.allocator_predict_s = scores.predict_s
        if scores.raw is not None:
            record.raw_scales = [round(float(s), 6) for item in scores.raw for s in item]
    if planned is not None:
        plans = planned.plans
        record.num_frames = sum(len(item.indices) for item in planned.items)
        record.frame_indices = [] if decoded.images else planned.items[0].indices
        record.base_size = [list(p.base_hw) for p in plans] if decoded.images else list(plans[0].base_hw)
        record.scales = [round(s, 6) for p in plans for s in p.frame_scales]
        record.pair_sizes = [list(hw) for p in plans for hw in p.pair_sizes]
        record.grids = [list(g) for p in plans for g in p.grids]
        record.reference_tokens = planned.reference_tokens
        record.candidates = planned.candidates
        record.allocator_predict_s += planned.projection_s
        record.preprocess_s = planned.seconds - planned.projection_s
    if built is not None:
        record.merged_sizes = list(built.merged_sizes) if built.merged_sizes is not None else None
        record.scale_apply_s = built.resize_s
        record.resize = spec.resize
        record.preprocess_s += built.seconds
        record.compress_s = built.compress_s
        if built.compress_s is None:
            record.compress_s_reason = spec.kind.untimed_work or "an image request: not compressed"
        record.query_tokens = built.query_tokens
        if built.query_tokens == 0:
            record.query_tokens_reason = "no question text: compressed as its reference does with an empty instruction"
    if generated is not None:
        record.visual_tokens = budget.entering
        record.layer_visual_tokens = list(budget.layers) if budget.layers is not None else None
        record.layer_averaged_tokens = budget.layer_average
        record.achieved_retention = budget.achieved_retention
        # full-resolution frames: a video frame is half a pair at the base size, an image a whole one
        frame_tokens = [
            p.vanilla_pair_tokens / (1 if decoded.images else layout.grid.temporal_patch) for p in planned.plans
        ]
        record.frame_budget = record.visual_tokens / sum(frame_tokens) * len(frame_tokens)
        record.input_tokens, record.output_tokens = len(generated.prompt_ids), generated.output_tokens
        record.generate_s = generated.seconds
        engine = generated.engine
        if engine.merged_sizes is not None:  # a compressor that ran inside the engine
            record.merged_sizes, record.compress_s = engine.merged_sizes, engine.compress_s
            record.compress_s_reason = None
        record.first_token_s, record.per_token_s = engine.first_token_s, engine.per_token_s
        record.rank_s, record.prefill_s = engine.rank_s, engine.prefill_s
        if engine.rank_s is None:
            record.rank_s_reason = "no stage inside the LLM"
        record.peak_memory_mb = engine.peak_memory_mb
        if engine.peak_memory_mb is not None and built.peak_memory_mb is not None:  # a compressor's encoding
            record.peak_memory_mb = max(engine.peak_memory_mb, built.peak_memory_mb)
        if engine.vision_s is not None:
            record.vision_s = engine.vision_s + built.vision_s
        dims = dims_from_config(layout.config)
        try:
            record.kept = kept_field(planned, built, engine, budget)
        except RuntimeError as exc:  # what it kept disagrees with its count: the sample fails, the run goes on
            record.error = error_text(exc)
        if budget.tower is not None:  # patches entering each vision block, then the merger
            record.tower_tokens = budget.tower.tokens
        flops = sample_flops(
            dims,
            spec.method,
            [g for p in planned.plans for g in p.grids],
            spec.retention,
            budget.prompt_tokens(record.input_tokens - record.visual_tokens),  # the text, then each layer's visual
            record.output_tokens,
            compressor=built.compressor_flops + engine.method_flops,  # what the method's work counted while it ran
            allocator=scores.flops,
            decode_keys_dropped=engine.decode_keys_dropped,
            tower=budget.tower,
        )
        record.vision_flops, record.vision_attention_flops = flops.vision, flops.vision_attention
        record.llm_prefill_flops, record.llm_attention_flops = flops.llm_prefill, flops.llm_attention
        record.decode_flops, record.method_flops, record.allocator_flops = flops.decode, flops.method, flops.allocator
        record.total_flops = flops.total
    return with_finite_values(record)
