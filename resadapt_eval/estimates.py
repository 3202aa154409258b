"""A method's tokens, FLOPs and memory for `frames` frames of a typical video, from the backbone's
config alone (no weights, no video): the rows of `resadapt-eval flops` and `resadapt-eval memory`.
A row is planned as a run plans it (`RunSpec` and its kind: `MethodKind.typical_scales`,
`MethodKind.token_budget`) and counted by the formulas of `compute/` (`flops.sample_flops`,
`memory.sample_memory`), so a row and a run's records agree."""

from __future__ import annotations

from .baselines import dart, mustdrop, sparsevlm
from .baselines.inside_llm import DUAL_FILTER, DUPLICATION, RATERS
from .budget.plan import TokenGrid
from .budget.planner import Planner
from .compute.flops import BackboneDims, RowPlan, SampleFlops, ranking_flops, sample_flops
from .compute.memory import SampleMemory, module_bytes, sample_memory
from .runspec import RunSpec


def row_plan(
    dims: BackboneDims,
    method_name: str,
    frames: int,
    size_hw: tuple[int, int],
    retention: float | None = None,
    text_tokens: int = 24,
    prune_layers: list[int] | None = None,
) -> RowPlan:
    """The tokens of `frames` frames of a `size_hw` (height, width) pixel source under a method,
    planned as the pipeline plans it (the default 768-token base size; the scales of the method's
    kind for a typical video, `MethodKind.typical_scales`) and counted by the same token rule as a
    run (`MethodKind.token_budget`: a compressor keeps floor(R * N) of the vanilla tokens, an in-LLM
    schedule its layer counts, ...), with `text_tokens` of text in the prompt (`prune_layers`: the
    stage layers of a method with stages inside the LLM, as `prune_layers=` gives them; None: its
    default). A method scored by the Allocator is planned with one scale for every frame at R: its
    scales depend on the video, but every allocation of those tokens has the same token count."""
    return spec_row_plan(dims, RunSpec.named(method_name, retention, prune_layers), frames, size_hw, text_tokens)


def spec_row_plan(dims: BackboneDims, spec, frames: int, size_hw: tuple[int, int], text_tokens: int = 24) -> RowPlan:
    """`row_plan` under a `runspec.RunSpec`."""
    grid = TokenGrid(token_px=dims.token_px, temporal_patch=dims.vision.temporal_patch)
    planner = Planner(grid, spec.budget)
    base_hw = planner.base_hw(size_hw)
    plan = planner.plan(spec.kind.typical_scales(spec, planner, frames, base_hw), base_hw)
    budget = spec.kind.token_budget(spec, (plan,), plan.reference_tokens, dims)
    stages = list(budget.stages) if budget.stages else None
    return RowPlan(spec.method, list(plan.grids), budget.entering, budget.prompt_tokens(text_tokens), stages, budget)


def row_flops(
    dims: BackboneDims,
    method_name: str,
    frames: int,
    size_hw: tuple[int, int],
    retention: float | None = None,
    text_tokens: int = 24,
    output_tokens: int = 0,
    allocator=None,
    query_tokens: int = 16,
) -> tuple[SampleFlops, int]:
    """(FLOPs, visual tokens entering the LLM) of `frames` frames of a `size_hw` (height, width)
    pixel source under a method, planned by `row_plan`, with `text_tokens` of text in the prompt
    and `output_tokens` generated. A method scored by `allocator` (an `Allocator`, reading
    `query_tokens` of question) is planned with one scale for every frame at R: its scales depend
    on the video, but every allocation with the same tokens has the same linear FLOPs."""
    spec = RunSpec.named(method_name, retention)
    method = spec.method
    if method.needs_allocator and allocator is None:
        raise ValueError(f"method={method_name} needs an Allocator to count")
    plan = spec_row_plan(dims, spec, frames, size_hw, text_tokens)
    scoring = allocator.flops(frames, query_tokens) if method.needs_allocator else 0
    ranking = None  # each stage's ranking, in the layer before it
    if plan.stages is not None:
        ranking = sum(stage_flops(dims.text, s, plan, text_tokens, i == 0) for i, s in enumerate(plan.stages))
    cut = mustdrop.cut_layers(list(plan.stages or []))  # caches cut for decoding (MustDrop): key columns skipped
    keys_dropped = max(0, output_tokens - 1) * sum(plan.prompt[i] - plan.prompt[plan.stages[-1].layer] for i in cut)
    flops = sample_flops(
        dims,
        method,
        plan.grids,
        retention,
        plan.prompt,
        output_tokens,
        ranking,
        allocator=scoring,
        decode_keys_dropped=keys_dropped,
        tower=plan.budget.tower,
    )
    return flops, plan.visual


def stage_flops(x, stage, plan: RowPlan, text_tokens: int, first: bool = False) -> int:
    """A stage's own FLOPs inside the LLM, from the prompt its layer before sees: DART's keys and
    pivot similarities (`dart.ranking_flops`); the query rows of the text after the video (the
    `text_tokens` taken as that text) for MustDrop, and for SparseVLM with its raters and recycling
    (`sparsevlm.own_flops`, the raters on the `first` stage); else the last token's attention row
    (`ranking_flops`)."""
    length = plan.prompt[stage.layer - 1]
    if stage.rank_by == DUAL_FILTER:
        return ranking_flops(x, length, text_tokens)
    if stage.rank_by == RATERS:
        entering = length - (plan.prompt[0] - plan.visual)
        extra = sparsevlm.own_flops(x.hidden, length, entering, text_tokens, stage, plan.visual if first else 0)
        return ranking_flops(x, length, text_tokens) + extra
    if stage.rank_by == DUPLICATION:
        visual = length - (plan.prompt[0] - plan.visual)
        return dart.ranking_flops(x.hidden, x.kv_heads * x.head_dim, length, visual, stage.keep, text_tokens)
    return ranking_flops(x, length)


def row_memory(
    dims: BackboneDims,
    method_name: str,
    frames: int,
    size_hw: tuple[int, int],
    retention: float | None = None,
    text_tokens: int = 24,
    max_new_tokens: int = 128,
    dtype: str = "bfloat16",
    attention: str = "sdpa",
    allocator=None,
    prune_layers: list[int] | None = None,
) -> tuple[SampleMemory, int]:
    """(memory plan, visual tokens entering the LLM) of `frames` frames of a `size_hw` (height,
    width) source under a method, planned by `row_plan` (`prune_layers`: its stage layers
    inside the LLM, None: the default); `allocator`: the Allocator a method=resadapt row holds
    (its parameters and buffers)."""
    plan = row_plan(dims, method_name, frames, size_hw, retention, text_tokens, prune_layers)
    if not plan.method.hf:
        raise ValueError(f"method={method_name} runs inside vLLM, which preallocates its cache: no HF memory plan")
    resident = module_bytes(allocator) if plan.method.needs_allocator and allocator is not None else 0
    return sample_memory(dims, plan, max_new_tokens, dtype, attention, resident), plan.visual
