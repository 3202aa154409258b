"""The sidecar record: what one sample spent, one line of the sidecar JSONL."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SampleRecord:
    """What one sample spent; built once by the pipeline from its stage results.

    scales: per-frame scale s_t; grids: (t, h, w) merged-token grid per pair; visual_tokens: tokens
    that entered the LLM; reference_tokens: the vanilla plan's tokens for the same frames;
    achieved_retention = visual_tokens / reference_tokens; raw_scales: an Allocator's scales before
    projection to the target R; merged_sizes: for token compressors, how many original tokens each
    kept token stands for (sums to the vanilla count for merging methods). Frame selection:
    candidates (frames scored), frame_indices (the kept ones), reference_tokens (the candidates'
    vanilla tokens, so R is against vanilla at the candidate count, as the paper reports it);
    frame_budget: visual tokens in full-resolution-frame equivalents (every method). Images: one
    entry per image in base_size, scales, pair_sizes and grids. Seconds: decode_s (video decode),
    allocator_{text,visual,predict}_s (Allocator stages; predict includes the projection),
    scale_apply_s (resizing frames to the plan), preprocess_s (planning and building the model
    inputs, resize included), generate_s. error: `ExceptionType: message` of a failed sample.
    """

    doc_id: int | None
    task: str | None
    method: str
    video: str | None = None
    num_frames: int = 0
    frame_indices: list[int] = field(default_factory=list)
    base_size: list | None = None
    scales: list[float] = field(default_factory=list)
    pair_sizes: list[list[int]] = field(default_factory=list)
    grids: list[list[int]] = field(default_factory=list)
    visual_tokens: int = 0
    reference_tokens: int = 0
    achieved_retention: float | None = None
    target_retention: float | None = None
    raw_scales: list[float] | None = None
    merged_sizes: list[int] | None = None
    candidates: int | None = None
    frame_budget: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    decode_s: float = 0.0
    allocator_text_s: float = 0.0
    allocator_visual_s: float = 0.0
    allocator_predict_s: float = 0.0
    scale_apply_s: float = 0.0
    preprocess_s: float = 0.0
    generate_s: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def error_text(exc: BaseException) -> str:
    """How a failed sample's exception is recorded: its type and message."""
    return f"{type(exc).__name__}: {exc}"
