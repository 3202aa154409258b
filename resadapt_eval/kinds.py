"""Method kinds: what a budget method does to a request, as code behind one small protocol.

A method (`methods.Method`) is a kind plus its algorithm (a scale policy, a compressor, a pruning
schedule, ...) and defaults. A kind owns
- its planning: the per-frame scales of a request's items (`scales`; `typical_scales` for the
  config-only FLOPs table, which has no video);
- its token rule: the `TokenBudget` of a planned sample (`token_budget`), computed once, before any
  input is built;
- its input building: the engine's request for a planned video (`build`);
- its checks: a method declaration of this kind (`check`), an engine that cannot run it
  (`check_engine`), settings the LLM's depth already rules out (`check_llm`), a retention below
  the lowest R any video reaches (`retention_floor`, checked by `check_retention`);
- what the serving engine is built with for it (`engine_args`), the FLOPs of the method's own
  work (`own_flops`) and, where its records carry no `compress_s`, why (`untimed_work`).
`pipeline.VideoPipeline`, `record.build_record`, `compute.flops`, the config-only rows
(`estimates.py`) and the vLLM classes call these and never branch on the kind. The run spec
(`runspec.RunSpec.kind`) picks the kind of a run: the method's, or `FRAME_SELECTION` under
`operator=select|select_resize`.

The kinds: `RESIZE_POLICY` (vanilla, fixed_scale, resadapt), `COMPRESSOR` (after the merger: ToMe,
VisionZip, ...), `IN_LLM_PRUNER` (FastV, PyramidDrop), `COMPRESSOR_THEN_PRUNER` (PruneVid, HoliTom),
`DECODE_PRUNER` (DyCoke), `ENGINE_PRUNER` (vLLM's EVS), `IN_TOWER_MERGER` (iLLaVA, between vision
blocks), `FRAME_SELECTION` (resadapt's operators).
Adding a kind is one subclass here; see docs/architecture.md for what else it touches.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import TYPE_CHECKING

import numpy as np

from .baselines.common import kept_count, per_pair_budget
from .baselines.framefusion import total_budget
from .baselines.inside_llm import entering_tokens, layer_counts
from .budget import policies
from .budget.plan import InfeasibleBudget, ResizePlan, pair_frames
from .budget.tokens import TokenBudget, engine_kept_tokens
from .compute.flops import (
    ENGINE_PRUNING,
    BackboneDims,
    TowerCounts,
    recomputed_attention,
    tower_attention,
)
from .measure.clock import peak_memory_mb, reset_peak_memory
from .measure.counting import CountedCall

if TYPE_CHECKING:
    import torch

    from .budget.planner import Planner
    from .methods import Method
    from .runspec import RunSpec
    from .video import DecodedVideo

# Where a kind acts on the visual budget (`MethodKind.stage`; messages and docs say it in words).
BEFORE_ENCODER = "before_encoder"  # resizes frames: fewer pixels enter the vision encoder
AFTER_MERGER = "after_merger"  # encodes the vanilla plan, then drops/merges tokens before the LLM
INSIDE_LLM = "inside_llm"  # prunes visual tokens between decoder layers
IN_ENGINE = "in_engine"  # the serving engine drops merged tokens before the LLM (vLLM's video pruning)
INSIDE_TOWER = "inside_tower"  # merges visual tokens between vision-tower blocks: fewer enter the later blocks
STAGES = (BEFORE_ENCODER, INSIDE_TOWER, AFTER_MERGER, INSIDE_LLM, IN_ENGINE)

# A method's algorithm slots (`methods.Method` fields); each kind says which it fills.
SLOTS = (
    "policy",
    "compressor",
    "prune",
    "adaptive_prune",
    "decode_prune",
    "engine_pruning",
    "tower_merge",
    "tower_prune",
)

FLOOR_PROBE_TOKENS = 10**7  # visual tokens: more than any request gives (`InLLMPruner.check_llm`)


@dataclass(frozen=True)
class FrameScales:
    """A kind's planning of one request: the kept items and each one's per-frame scales;
    reference: the vanilla tokens R is measured against (None: the plans' own); candidates: frames
    scored (frame selection); projection_s: seconds spent projecting scales onto R."""

    items: tuple
    scales: list
    reference: int | None = None
    candidates: int | None = None
    projection_s: float = 0.0


@dataclass(frozen=True)
class RetentionFloor:
    """The lowest R any video reaches under a run's settings, from configs alone
    (`MethodKind.retention_floor`): value; keeps: what the method keeps of every video, in words;
    detail: the numbers that give the value."""

    value: float
    keeps: str
    detail: str


def token_word(count: int) -> str:
    """`token` or `tokens`, for `count` of them."""
    return "token" if count == 1 else "tokens"


def rounded_up(value: float, digits: int = 4) -> str:
    """`value` rounded up to `digits` significant digits, as text: the least such number at or above
    it (a retention given as printed is never below `value`)."""
    exact = Decimal(value)
    shown = exact.quantize(Decimal(1).scaleb(exact.adjusted() - digits + 1), rounding=ROUND_CEILING)
    return f"{float(shown):g}"


@dataclass(frozen=True)
class ModelInputs:
    """A kind's engine request for one planned video; merged_sizes: a compressor's group sizes,
    compressor_flops: its work as counted, vision_s: its vision tower's seconds, peak_memory_mb:
    the peak while it encoded and compressed (None where the tower runs inside the engine call),
    compress_s: the compressor's own seconds (None: the kind has none, `untimed_work` says why);
    query_tokens: the question's tokens a compressor that reads it was given (None: it reads none);
    assignment: (N,) each planned token's destination among them, -1 dropped (`kept.KeptTokens`; None:
    every planned token enters the LLM as its own)."""

    request: object
    merged_sizes: tuple[int, ...] | None = None
    compressor_flops: int = 0
    vision_s: float = 0.0
    peak_memory_mb: float | None = None
    compress_s: float | None = None
    query_tokens: int | None = None
    assignment: torch.Tensor | None = None


class MethodKind:
    """The protocol every kind implements; these defaults are a method that plans every frame at
    the base size, puts the plan's tokens into the LLM and runs on any engine that does not prune
    video tokens itself. hf / vllm: the HF classes / the vLLM engine run it; images: it serves
    image requests; families: the backbones it runs on (the others stop at start, `check_llm`); slots: the
    algorithm slots a method of this kind fills (the others stay empty);
    untimed_work: why its records carry no `compress_s` (None: a compressor, which times its own work)."""

    untimed_work: str | None = "no compressor stage: the method's own work is planning (in preprocess_s)"

    name = "method"
    stage = BEFORE_ENCODER
    hf, vllm, images = True, False, False
    families: tuple[str, ...] = ("qwen25vl", "qwen3vl")
    slots: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"<{self.name}>"

    # ------------------------------------------------------------------ checks
    def check(self, method: Method) -> None:
        """Refuse a declaration whose algorithm slots do not fit this kind."""
        filled = {slot for slot in SLOTS if getattr(method, slot) is not None}
        missing = [slot for slot in self.slots if slot not in filled]
        if missing:
            raise ValueError(f"{method.name}: a {self.name} method gives {', '.join(s + '=' for s in missing)}")
        extra = sorted(filled - set(self.slots))
        if extra:
            raise ValueError(f"{method.name}: a {self.name} method takes no {', '.join(s + '=' for s in extra)}")
        if method.needs_allocator:
            raise ValueError(f"{method.name}: only a resize policy takes its scales from the Allocator")

    def check_engine(self, spec: RunSpec, backbone) -> None:
        """Stop at start when `backbone` (a `layout.Backbone`) cannot run this kind."""
        pruning = (backbone.video_pruning_method, backbone.video_pruning_rate)
        if pruning[0] is not None and pruning[1]:
            raise ValueError(
                f"method={spec.method.name} does not prune, but this engine prunes video tokens: {pruning}"
            )
        if backbone.compresses_in_engine:
            raise ValueError(
                f"method={spec.method.name} does not compress, but this vLLM engine was started for token "
                "compression (one video item per request): serve it on an engine without token_compression"
            )

    def check_llm(self, spec: RunSpec, dims: BackboneDims) -> None:
        """Stop at start on settings the LLM's depth already rules out (nothing, for most kinds)."""

    def check_retention(self, spec: RunSpec, planner: Planner, dims: BackboneDims | None) -> None:
        """Stop at start on a retention below `retention_floor`: no video can reach it, so it would
        fail every sample. A target above the floor that a given video cannot reach (a short or
        small one) still fails that sample alone (`InfeasibleBudget`)."""
        if spec.retention is None:
            return
        floor = self.retention_floor(spec, planner, dims)
        if floor is not None and spec.retention < floor.value:
            operator = f", operator={spec.operator.value}" if spec.operator.selects_frames else ""
            shown = rounded_up(floor.value)
            raise ValueError(
                f"retention={spec.retention}: method={spec.method.name}{operator} {floor.keeps}, so no video "
                f"reaches R below {shown} ({floor.detail}); raise retention to at least {shown}"
            )

    def retention_floor(self, spec: RunSpec, planner: Planner, dims: BackboneDims | None) -> RetentionFloor | None:
        """The lowest R any video can reach under `spec`, from the settings and the token grid alone
        (`planner`; `dims`: the LLM's, None where unknown; None: no floor this kind can state). The
        default, for a kind whose plans enter the LLM: every plan keeps at least
        min_tokens_per_pair tokens of each frame pair, and no vanilla pair has more tokens than the
        largest vanilla plan's (`Planner.largest_pairs`): min_tokens_per_pair / those tokens."""
        _, largest = planner.largest_pairs()
        least, most = spec.budget.min_tokens_per_pair, largest.reference_tokens
        return RetentionFloor(
            least / most,
            f"plans at least min_tokens_per_pair={least} {token_word(least)} per frame pair",
            f"{least} of {most} tokens per pair, the most a vanilla pair has at {planner.limits_text()}",
        )

    # ------------------------------------------------------------------ planning
    def scales(
        self, spec: RunSpec, planner: Planner, items: tuple[DecodedVideo, ...], base_hws: list, raw
    ) -> FrameScales:
        """Per-frame scales of a request's items at `base_hws` (raw: the Allocator's scales per
        item, None without it): every frame at the base size."""
        return FrameScales(
            items,
            [policies.vanilla(len(item.indices), hw, planner.grid, planner.spec) for item, hw in zip(items, base_hws)],
        )

    def typical_scales(self, spec: RunSpec, planner: Planner, frames: int, base_hw: tuple[int, int]) -> np.ndarray:
        """Scales of `frames` frames of a typical video, planned from configs alone."""
        return policies.vanilla(frames, base_hw, planner.grid, planner.spec)

    # ------------------------------------------------------------------ the token rule
    def token_budget(
        self, spec: RunSpec, plans: tuple[ResizePlan, ...], reference: int, dims: BackboneDims
    ) -> TokenBudget:
        """The visual tokens the `plans` of one sample put into the LLM (R against `reference`)."""
        return TokenBudget(reference, sum(p.visual_tokens for p in plans))

    # ------------------------------------------------------------------ inputs
    def build(self, spec: RunSpec, backbone, request, video, plan: ResizePlan, pairs, budget: TokenBudget):
        """The engine's request for `video` at `plan` (`pairs`: its frames resized by the layout),
        `request` the pipeline's `Request` (its prompt, and the question a compressor may read)."""
        return ModelInputs(backbone.build_inputs(request.prompt, video, plan, pairs))

    def engine_args(self, spec: RunSpec) -> dict:
        """`VLLMBackbone` arguments this kind needs (its own video pruning): none."""
        return {}

    def settle(self, spec: RunSpec, budget: TokenBudget, layers: list[int]) -> TokenBudget:
        """The sample's budget after the engine ran, from the visual tokens its decoder layers held
        (`layers`): the planned one, which the pipeline then holds the engine's counts to."""
        return budget

    # ------------------------------------------------------------------ compute
    def own_flops(self, method: Method, dims: BackboneDims, grids, retention: float | None, counted: int | None) -> int:
        """FLOPs a method adds to the backbone's own over the vanilla `grids`: the last ViT block's
        attention it recomputes, plus `counted` (its work as counted in a run; None from configs alone)."""
        return (recomputed_attention(dims.vision, grids) if method.needs_attention else 0) + (counted or 0)


class ResizePolicy(MethodKind):
    """Resizes frames before the encoder: per-frame scales from the method's policy, or the
    Allocator's scales projected onto R (`Planner.fit`, jointly over a request's images)."""

    name = "resize policy"
    hf, vllm, images = True, True, True
    slots = ()

    def check(self, method: Method) -> None:
        filled = sorted(slot for slot in SLOTS if slot != "policy" and getattr(method, slot) is not None)
        if filled:
            raise ValueError(f"{method.name}: a {self.name} method takes no {', '.join(s + '=' for s in filled)}")
        if (method.policy is None) != method.needs_allocator:
            raise ValueError(f"{method.name}: give a scale policy, or take the scales from the Allocator")

    def scales(self, spec, planner, items, base_hws, raw) -> FrameScales:
        method = spec.method
        if method.needs_allocator:
            t0 = time.perf_counter()
            scales = planner.fit(raw, base_hws, spec.retention)
            return FrameScales(items, scales, projection_s=time.perf_counter() - t0)
        grid, budget = planner.grid, planner.spec
        return FrameScales(
            items, [method.policy(len(item.indices), hw, grid, budget) for item, hw in zip(items, base_hws)]
        )

    def typical_scales(self, spec, planner, frames, base_hw) -> np.ndarray:
        """The method's policy; for the Allocator one scale for every frame at R (its scales depend on
        the video, but every allocation of those tokens has the same token count)."""
        policy = policies.fixed_scale if spec.method.needs_allocator else spec.method.policy
        return policy(frames, base_hw, planner.grid, planner.spec)


class FrameSelection(MethodKind):
    """Keeps the best-scoring of `candidates` frames by the Allocator's scales, at the base size or at
    their scales (`Planner.select`); R is against the candidates' vanilla tokens. A run's kind under
    `operator=select|select_resize` (`RunSpec.kind`), not a declared one."""

    name = "frame selection"
    hf, vllm, images = True, True, False

    def check(self, method: Method) -> None:
        raise ValueError(
            f"{method.name}: frame selection is what operator=select|select_resize makes of a method the "
            "Allocator scores; declare it as a resize policy"
        )

    def retention_floor(self, spec, planner, dims) -> RetentionFloor:
        """R is against all candidates: at least the fewest kept frames' pairs (one frame with a
        `score_threshold`, else min(top_k, candidates)) at min_tokens_per_pair tokens each, against
        every candidate's pair at the largest vanilla plan."""
        _, largest = planner.largest_pairs()
        least, most, temporal = spec.budget.min_tokens_per_pair, largest.reference_tokens, planner.grid.temporal_patch
        fewest = 1 if spec.score_threshold is not None or spec.top_k is None else min(spec.top_k, spec.candidates)
        kept, pairs = len(pair_frames(fewest, temporal)), len(pair_frames(spec.candidates, temporal))
        return RetentionFloor(
            kept * least / (pairs * most),
            f"keeps at least {fewest} of candidates={spec.candidates} frames, at least min_tokens_per_pair={least} "
            f"{token_word(least)} per frame pair",
            f"{kept * least} of {pairs} x {most} tokens, {most} the most a vanilla pair has at {planner.limits_text()}",
        )

    def scales(self, spec, planner, items, base_hws, raw) -> FrameScales:
        t0 = time.perf_counter()
        (video,), (scores,), (base_hw,) = items, raw, base_hws
        positions, kept_scales, reference = planner.select(
            scores, base_hw, spec.operator, spec.top_k, spec.score_threshold, spec.retention
        )
        return FrameScales(
            (video.subset(positions),), [kept_scales], reference, len(video.indices), time.perf_counter() - t0
        )


class EnginePruner(MethodKind):
    """The serving engine drops merged video tokens before the LLM (vLLM's `video_pruning_method` at
    `video_pruning_rate` = `Method.pruning_rate(R)`); the video is planned at the base size."""

    name = "engine-side pruner"
    untimed_work = "vLLM prunes inside its engine call, which does not time it apart"
    stage = IN_ENGINE
    hf, vllm, images = False, True, False
    slots = ("engine_pruning",)

    def engine_args(self, spec) -> dict:
        method = spec.method
        return dict(video_pruning_method=method.engine_pruning, video_pruning_rate=method.pruning_rate(spec.retention))

    def retention_floor(self, spec, planner, dims) -> RetentionFloor:
        """vLLM keeps the first frame pair whole (`engine_kept_tokens`): one pair of the most a video has."""
        pairs = len(pair_frames(spec.frames_to_decode, planner.grid.temporal_patch))
        return RetentionFloor(
            1 / pairs,
            f"keeps the first frame pair whole (vLLM's {spec.method.engine_pruning})",
            f"1 of the {pairs} pairs of max_num_frames={spec.frames_to_decode}",
        )

    def check_engine(self, spec, backbone) -> None:
        wanted = tuple(self.engine_args(spec).values())
        pruning = (backbone.video_pruning_method, backbone.video_pruning_rate)
        if pruning != wanted:
            raise ValueError(
                f"method={spec.method.name} at retention={spec.retention} needs an engine pruning video tokens with "
                f"{wanted[0]} at rate {wanted[1]}; {type(backbone).__name__} prunes with {pruning}: run it on the "
                "vLLM classes"
            )

    def token_budget(self, spec, plans, reference, dims) -> TokenBudget:
        (plan,) = plans
        rate = spec.method.pruning_rate(spec.retention)
        return TokenBudget(reference, engine_kept_tokens(plan.pair_tokens, rate, spec.method.engine_pruning))

    def own_flops(self, method, dims, grids, retention, counted) -> int:
        """The engine's pruning, by formula (it runs inside the engine, uncounted)."""
        return super().own_flops(method, dims, grids, retention, None) + ENGINE_PRUNING[method.engine_pruning](
            grids, dims.vision.out_hidden
        )


class InModel(MethodKind):
    """A kind that acts inside the model (after the merger or between decoder layers): it runs on
    engines that expose those (`Backbone.compresses_tokens`, the HF adapter), and its work is
    counted while it runs."""

    def check_engine(self, spec, backbone) -> None:
        super().check_engine(spec, backbone)
        if not backbone.compresses_tokens:
            raise ValueError(
                f"method={spec.method.name} compresses visual tokens inside the model, which "
                f"{type(backbone).__name__} does not expose: run it on the HF path"
            )


def probe_schedule(spec: RunSpec, dims: BackboneDims) -> None:
    """The method's in-LLM schedule on `FLOOR_PROBE_TOKENS` visual tokens (more than any video gives),
    to check its `prune_layers` on this LLM (a bad one is a `model_args` error) and its floor
    (`InfeasibleBudget`, raised for the caller)."""
    try:
        InLLMPruner.schedule(spec, dims, FLOOR_PROBE_TOKENS)
    except InfeasibleBudget:
        raise
    except ValueError as exc:  # `inside_llm.check_layers`: its message starts with prune_layers
        raise ValueError(f"model_args {exc}") from None


class InLLMPruner(InModel):
    """Prunes visual tokens between decoder layers (`backbones/layer_pruning.LayerPruner`): every visual token of
    the plan enters the LLM, the method's schedule keeps fewer from its stage layers on, and R is
    their layer average."""

    name = "in-LLM pruner"
    untimed_work = "no compressor stage: its ranking and pruning run inside the LLM (rank_s)"
    stage = INSIDE_LLM
    slots = ("prune",)

    def check_llm(self, spec, dims) -> None:
        """`prune_layers` (or the method's default layers) outside [first prunable layer, layers - 1],
        unordered or repeated; and a retention at or below the floor the schedule keeps on every video.

        That floor depends on the visual token count N only through terms that shrink as N grows
        (FastV keeps floor((R L - K) N / (L - K)) >= 1 tokens after layer K; PyramidDrop keeps at
        least one token per stage, a layer average of (b_1 N + L - b_1) / (L N) with b_1 its first
        stage): a target the schedule cannot reach with `FLOOR_PROBE_TOKENS` visual tokens is out of
        reach for every N below it too, and the floor reported is the one at that N (b_1 / L, or
        K / L, to 4 places). Targets just above it, reachable on long videos only, stay per sample
        (`InfeasibleBudget` naming that sample's floor)."""
        try:
            probe_schedule(spec, dims)
        except InfeasibleBudget as exc:
            given = spec.prune_layers_text
            which = f"prune_layers={given!r}" if given is not None else "the default prune_layers"
            raise ValueError(
                f"retention={spec.retention} with {which}: {exc.what} keeps a layer-averaged retention above "
                f"{exc.floor:.4f} on every video on this LLM of {dims.text.layers} layers (the layers before the "
                "first stage see every visual token); raise retention, or give prune_layers an earlier first layer"
            ) from None

    def retention_floor(self, spec, planner, dims) -> None:
        """None: every visual token enters the LLM, and the schedule's floor on every video is
        `check_llm`'s (it needs the LLM's depth)."""
        return None

    def token_budget(self, spec, plans, reference, dims) -> TokenBudget:
        visual = sum(p.visual_tokens for p in plans)
        stages = tuple(self.schedule(spec, dims, visual))
        return TokenBudget(reference, visual, tuple(layer_counts(stages, dims.text.layers, visual)), stages=stages)

    @staticmethod
    def schedule(spec, dims: BackboneDims, visual: int) -> list:
        """The method's stages for `visual` tokens entering this LLM."""
        layers = dims.text.layers
        return spec.method.prune(layers, visual, spec.retention, spec.stage_layers, dims.vision.deepstack)

    def build(self, spec, backbone, request, video, plan, pairs, budget) -> ModelInputs:
        inputs = backbone.build_inputs(request.prompt, video, plan, pairs)
        return ModelInputs(backbone.pruned_inputs(inputs, budget.stages))


class AdaptiveInLLMPruner(InLLMPruner):
    """Reduces visual tokens between decoder layers layer by layer, from the hidden states
    (`backbones/layer_pruning.FusionPruner`; FrameFusion): every visual token of the plan enters the
    LLM, and the per-layer counts follow from the video, within floor(R L N) visual token-layers. The
    plan counts them as on a video with no similar neighbours (the config-only rows); the sample's
    budget takes the counts its layers held (`settle`)."""

    name = "adaptive in-LLM pruner"
    slots = ("adaptive_prune",)

    def check_llm(self, spec, dims) -> None:
        """Nothing beyond `retention_floor`: the method takes no `prune_layers`."""

    def retention_floor(self, spec, planner, dims) -> RetentionFloor | None:
        """Every token up to the first merging layer f (after Qwen3-VL's deepstack layers); there a
        frame pair's P tokens at least (a token merges only into its patch's previous one), then one
        token a layer: (f N + P + L - f - 1) / (L N), lowest for the most tokens a video has,
        max_num_frames of the largest vanilla pairs (None where the LLM's depth is unknown)."""
        if dims is None:
            return None
        largest, _ = planner.largest_pairs()
        pair = largest.visual_tokens
        visual = len(pair_frames(spec.frames_to_decode, planner.grid.temporal_patch)) * pair
        layers, first = dims.text.layers, dims.vision.deepstack
        before = (
            f"keeps every visual token in its first {first} layer{'s' if first > 1 else ''}, then "
            if first
            else "keeps "
        )
        return RetentionFloor(
            (first * visual + pair + layers - first - 1) / (layers * visual),
            before + "a frame pair's tokens in its first merging layer (a token merges only into the token at its "
            "position in the pair before), then at least 1 in each layer",
            f"{visual} tokens at most, in pairs of {pair} (max_num_frames={spec.frames_to_decode} at "
            f"{planner.limits_text()}), over {layers} layers",
        )

    def token_budget(self, spec, plans, reference, dims) -> TokenBudget:
        (plan,) = plans
        layers = spec.method.adaptive_prune.typical_layers(
            dims.text.layers, plan.visual_tokens, spec.retention, dims.vision.deepstack, max(plan.pair_tokens)
        )
        return TokenBudget(reference, plan.visual_tokens, tuple(layers))

    def build(self, spec, backbone, request, video, plan, pairs, budget) -> ModelInputs:
        inputs = backbone.build_inputs(request.prompt, video, plan, pairs)
        allowed = total_budget(spec.retention, len(budget.layers), budget.reference)
        return ModelInputs(backbone.fusion_inputs(inputs, allowed))

    def settle(self, spec, budget, layers) -> TokenBudget:
        """The counts the layers held, once they are within floor(R L N) over the planned depth."""
        allowed = total_budget(spec.retention, len(budget.layers), budget.reference)
        if len(layers) != len(budget.layers) or sum(layers) > allowed or layers[0] > budget.entering:
            raise RuntimeError(
                f"the engine's layers held {list(layers)} visual tokens, more than the {allowed} token-layers of "
                f"R={spec.retention} over {len(budget.layers)} layers"
            )
        return dataclasses.replace(budget, layers=tuple(layers))


class Compressor(InModel):
    """Encodes the vanilla plan, then compresses its merged tokens before the LLM to floor(R N)
    (`baselines/<name>.compress`, run through `counting.CountedCall` so its work is counted): on the HF
    path while it builds the inputs, on vLLM inside the engine's model (`backbones/vllm_compression.py`),
    which reports what it kept with the engine's output."""

    name = "vision-side compressor"
    stage = AFTER_MERGER
    hf, vllm, images = True, True, False
    slots = ("compressor",)
    untimed_work = None

    def engine_args(self, spec) -> dict:
        """vLLM's engine started to run this method's compressor inside its model on request (a kind with a
        stage inside the LLM, vllm False: none)."""
        return dict(token_compression={spec.method.name: spec.method.compressor.location}) if self.vllm else {}

    def check_engine(self, spec, backbone) -> None:
        if backbone.compresses_in_engine and spec.method.vllm_compressor:
            return
        super().check_engine(spec, backbone)

    def retention_floor(self, spec, planner, dims) -> RetentionFloor:
        """It keeps at least one token per frame pair of the vanilla plan (`kept_count`): one of the
        most tokens a vanilla pair has (`Planner.largest_pairs`)."""
        largest, _ = planner.largest_pairs()
        return RetentionFloor(
            len(largest.grids) / largest.visual_tokens,
            "keeps at least 1 token per frame pair",
            f"1 of {largest.visual_tokens} tokens per pair, the most a vanilla pair has at {planner.limits_text()}",
        )

    def token_budget(self, spec, plans, reference, dims) -> TokenBudget:
        (plan,) = plans
        share = spec.retention
        return TokenBudget(reference, kept_count(share, plan.visual_tokens, len(plan.grids)), share=share)

    def build(self, spec, backbone, request, video, plan, pairs, budget) -> ModelInputs:
        method, timer = spec.method, backbone.vision_timer
        if backbone.compresses_in_engine:  # vLLM: its model compresses and reports
            query = request.query if method.needs_query else None
            engine_request, query_tokens = backbone.build_compressed_request(
                request.prompt, video, plan, method.name, budget.share, spec.compression_seed, pairs, query
            )
            return ModelInputs(engine_request, query_tokens=query_tokens)
        compressor = CountedCall(spec.method.compress, timer.stopwatch)  # its work counted and timed
        query = backbone.question_embeddings(request.query) if method.needs_query else None
        reset_peak_memory(backbone.device)  # the tower runs here, before the engine call
        with timer.recording():
            inputs, sizes = backbone.build_compressed_inputs(
                request.prompt,
                video,
                plan,
                compressor,
                budget.share,
                seed=spec.compression_seed,
                needs_attention=method.needs_attention,
                pairs=pairs,
                query=query,
            )
        merged = tuple(sizes.tolist())
        if len(merged) != budget.entering:
            raise RuntimeError(f"{method.name} kept {len(merged)} tokens; the token budget counts {budget.entering}")
        vision_s, peak = timer.take(), peak_memory_mb(backbone.device)
        inputs = self.then(backbone, inputs, budget, compressor.last)
        query_tokens = None if query is None else query.shape[0]
        assignment = compressor.last.assignment
        return ModelInputs(
            inputs, merged, compressor.flops, vision_s, peak, compressor.seconds(), query_tokens, assignment
        )

    def then(self, backbone, inputs, budget: TokenBudget, compression):
        """The compressed inputs as the engine runs them (`compression`: what the compressor returned):
        as they are."""
        return inputs

    def own_flops(self, method, dims, grids, retention, counted) -> int:
        """Counted in a run; from configs alone computed from the grids where a formula exists (ToMe,
        VisionZip, Random Drop), else an error (the work depends on the features)."""
        if counted is not None:
            return super().own_flops(method, dims, grids, retention, counted)
        formula = method.compressor.config_flops
        if formula is None:
            raise ValueError(f"method={method.name}: its compressor's work depends on the features; count it in a run")
        pair_sizes = [t * h * w for t, h, w in grids]
        keep = kept_count(retention, sum(pair_sizes), len(pair_sizes))
        return super().own_flops(method, dims, grids, retention, None) + formula(pair_sizes, keep, dims.vision)


class EngineCompressor(Compressor):
    """A compressor whose selection is the serving engine's own code (vLLM's VidCom2,
    `baselines/vidcom2_engine.py`), run inside our compressing vLLM engine as every compressor runs there: the
    same prompt count, positions and records. The HF classes do not offer it: its code ships with vLLM."""

    name = "engine's own compressor"
    hf, vllm, images = False, True, False

    def engine_args(self, spec) -> dict:
        """The compressing engine's table, once the engine's code it runs is there (`TokenCompressor.requires`)."""
        if spec.method.compressor.requires is not None:
            spec.method.compressor.requires()
        return super().engine_args(spec)


class CompressorThenPruner(Compressor):
    """A compressor followed by the method's own stage inside the LLM (on the tokens that entered):
    the compressor keeps the most tokens whose layer average over both stages stays within R
    (`inside_llm.entering_tokens`)."""

    name = "compressor plus in-LLM stage"
    hf, vllm, images = True, False, False  # its stage inside the LLM runs on the HF model
    slots = ("compressor", "prune")

    def check_llm(self, spec, dims) -> None:
        """Bad `prune_layers` only: the floor on every video is `retention_floor`'s."""
        try:
            probe_schedule(spec, dims)
        except InfeasibleBudget:
            return

    def retention_floor(self, spec, planner, dims) -> RetentionFloor | None:
        """At least one token per frame pair enters the LLM (or the fewest its compressor keeps), then
        the method's own stage keeps fewer: on P pairs of T tokens the layer average is at least that of
        P such tokens entering over P T (`inside_llm.entering_tokens`' floor), lowest at T the most a
        vanilla pair has; the least over P up to the pairs of max_num_frames. A schedule that keeps more
        at a higher R (MustDrop's) can have a floor above the R asked: then the lowest R that reaches its
        own floor. None without the LLM's depth (`dims`)."""
        if dims is None:
            return None
        floor = self._floor_at(spec, planner, dims)
        for _ in range(64):  # the floor grows with R: climb to the first R at or above its own floor
            if floor.value <= spec.retention:
                break
            spec = dataclasses.replace(spec, budget=dataclasses.replace(spec.budget, retention=floor.value))
            floor = self._floor_at(spec, planner, dims)
        return floor

    def _floor_at(self, spec, planner, dims) -> RetentionFloor:
        """The floor of `retention_floor` with the schedule at `spec`'s retention."""
        largest, _ = planner.largest_pairs()
        most, layers = largest.visual_tokens, dims.text.layers
        each = spec.method.compressor.fewest(largest.grids)  # the fewest such a pair keeps (one, or its compressor's)
        best = None
        for pairs in range(1, len(pair_frames(spec.frames_to_decode, planner.grid.temporal_patch)) + 1):
            stages = InLLMPruner.schedule(spec, dims, pairs * each)
            total = sum(layer_counts(stages, layers, pairs * each))
            if best is None or total / (layers * pairs * most) < best[0]:  # as `entering_tokens` states its floor
                best = (total / (layers * pairs * most), pairs, stages, total / layers)
        value, pairs, stages, average = best
        return RetentionFloor(
            value,
            f"keeps at least {each} {token_word(each)} per frame pair entering the LLM",
            f"{pairs} pair{'s' if pairs > 1 else ''} of {most} tokens, the most a vanilla pair has at "
            f"{planner.limits_text()}, {each} each entering this LLM of {layers} layers, then "
            f"{', '.join(f'{s.keep} from layer {s.layer}' for s in stages)}: {average:g} tokens on average",
        )

    def token_budget(self, spec, plans, reference, dims) -> TokenBudget:
        (plan,) = plans
        n, pairs, layers, first = plan.visual_tokens, len(plan.grids), dims.text.layers, dims.vision.deepstack
        fewest = spec.method.compressor.fewest(plan.grids)
        entering = entering_tokens(spec.method.prune, spec.retention, n, fewest, layers, spec.stage_layers, first)
        share = entering / n
        keep = kept_count(share, n, pairs)
        stages = tuple(InLLMPruner.schedule(spec, dims, keep))
        return TokenBudget(reference, keep, tuple(layer_counts(stages, layers, keep)), share, stages)

    def then(self, backbone, inputs, budget, compression):
        """A `LayerPruner` for the method's stages, keeping the tokens the compressor protected."""
        protected = None if compression.protected is None else compression.protected[compression.kept]
        return backbone.pruned_inputs(inputs, budget.stages, protected)


class DecodePruner(Compressor):
    """A compressor whose method also prunes the KV cache while decoding
    (`decode_pruning.DecodePruner`); the prefill, and so R, is the compressor's."""

    name = "decode-time KV pruner"
    hf, vllm, images = True, False, False  # its decoding stage edits the HF model's KV cache
    slots = ("compressor", "decode_prune")

    def token_budget(self, spec, plans, reference, dims) -> TokenBudget:
        budget = super().token_budget(spec, plans, reference, dims)
        stage = spec.method.decode_prune(dims.text.layers, budget.entering, spec.retention, dims.vision.deepstack)
        return dataclasses.replace(budget, decode_stage=stage)

    def then(self, backbone, inputs, budget, compression):
        return backbone.decode_pruned_inputs(inputs, budget.decode_stage)


class InTowerMerger(InModel):
    """Merges visual tokens between vision-tower blocks (`backbones/tower_reduction.TowerReducer`;
    iLLaVA): the later blocks, the merger and the LLM see floor(R N) merge units, R against the
    vanilla tokens as for a compressor; each frame pair keeps its share (`common.per_pair_budget`),
    reached over the method's merging blocks (`TowerMerging.layer_counts`). Qwen3-VL only."""

    name = "in-tower merger"
    stage = INSIDE_TOWER
    families = ("qwen3vl",)
    slots = ("tower_merge",)
    untimed_work = None

    def check_llm(self, spec, dims) -> None:
        """Qwen3-VL's tower only, with at least one block before its last to merge after; `tower_layers`
        within it."""
        check_tower(spec, dims, "merges")
        if spec.vision_blocks is not None:
            spec.method.tower_merge.check_layers(spec.vision_blocks, dims.vision.depth)

    def retention_floor(self, spec, planner, dims) -> RetentionFloor:
        """At least one unit per frame pair, as a compressor (`Compressor.retention_floor`)."""
        return COMPRESSOR.retention_floor(spec, planner, dims)

    @staticmethod
    def tower_counts(
        method, dims: BackboneDims, pair_units: list[int], retention: float, blocks: list[int] | None = None
    ) -> TowerCounts:
        """What the tower runs on frame pairs of `pair_units` merge units: each pair's share of
        floor(R N) units (`per_pair_budget`), reached over the merging blocks (`blocks`, None: the
        method's own; `layer_counts`)."""
        merging, vision = method.tower_merge, dims.vision
        unit, layers = vision.merge**2, blocks or merging.default_layers(vision.depth)
        keeps = per_pair_budget(pair_units, kept_count(retention, sum(pair_units), len(pair_units)))
        paths = [merging.layer_counts(n, k, len(layers)) for n, k in zip(pair_units, keeps)]
        units, current = [], tuple(pair_units)  # units entering each block, then the merger
        for block in range(vision.depth):
            units.append(current)
            if block in layers:
                current = tuple(path[layers.index(block)] for path in paths)
        units.append(current)
        return TowerCounts(
            tuple(tuple(n * unit for n in row) for row in units[:-1]),
            tuple(sum(units[tap + 1]) * unit for tap in vision.deepstack_taps),  # a tap reads its block's merged output
            sum(current) * unit,
        )

    def token_budget(self, spec, plans, reference, dims) -> TokenBudget:
        (plan,) = plans
        tower = self.tower_counts(spec.method, dims, list(plan.pair_tokens), spec.retention, spec.vision_blocks)
        return TokenBudget(reference, tower.merger // dims.vision.merge**2, share=spec.retention, tower=tower)

    def build(self, spec, backbone, request, video, plan, pairs, budget) -> ModelInputs:
        method, timer, blocks, unit = spec.method, backbone.vision_timer, budget.tower.blocks, backbone.merge_unit
        # a merge after block b: what b hands on, the next block's input, where it differs from b's
        schedule = {b: [n // unit for n in blocks[b + 1]] for b in range(len(blocks) - 1) if blocks[b + 1] != blocks[b]}
        reset_peak_memory(backbone.device)  # the tower runs here, before the engine call
        with timer.recording():
            inputs, reducer = backbone.build_tower_merged_inputs(
                request.prompt,
                video,
                plan,
                schedule,
                method.tower_merge.merge,
                lambda fn: CountedCall(fn, timer.stopwatch),
                pairs,
            )
        if [n * unit for n in reducer.block_units] != budget.tower.tokens:
            raise RuntimeError(
                f"{method.name}: the tower held {[n * unit for n in reducer.block_units]} patches; "
                f"the budget counts {budget.tower.tokens}"
            )
        vision_s, peak = timer.take(), peak_memory_mb(backbone.device)
        sizes = tuple(reducer.sizes.tolist())
        return ModelInputs(
            inputs, sizes, reducer.flops, vision_s, peak, reducer.seconds(), assignment=reducer.assignment
        )

    def own_flops(self, method, dims, grids, retention, counted) -> int:
        """Counted in a run; from configs alone (at the method's own merging blocks), the attention
        each merging block recomputes over the patches entering it (`flops.tower_attention`); the
        averages are not matmuls."""
        if counted is not None:
            return counted
        blocks = self.tower_counts(method, dims, [t * h * w for t, h, w in grids], retention).blocks
        return sum(
            tower_attention(dims.vision, blocks[b]) for b in range(len(blocks) - 1) if blocks[b + 1] != blocks[b]
        )


class InTowerThenPruner(InLLMPruner):
    """Prunes patches between vision-tower blocks and restores them where the mergers read them
    (`backbones/tower_reduction.TowerPruner`; IPCV), saving the tower's work; every visual token
    enters the LLM, whose stage (DART's, as IPCV's reference runs it) meets R, layer-averaged, as an
    in-LLM pruner's does. Qwen3-VL only."""

    name = "in-tower pruner plus in-LLM stage"
    untimed_work = None
    families = ("qwen3vl",)
    slots = ("tower_prune", "prune")

    def check_llm(self, spec, dims) -> None:
        """Qwen3-VL's tower of 2 blocks at least, `tower_layers` within it; then the in-LLM stage's checks."""
        check_tower(spec, dims, "prunes")
        if spec.vision_blocks is not None:
            spec.method.tower_prune.check_layers(spec.vision_blocks, dims.vision.depth)
        super().check_llm(spec, dims)

    @staticmethod
    def tower_counts(
        method, dims: BackboneDims, pair_units: list[int], retention: float, blocks: list[int] | None = None
    ) -> TowerCounts:
        """What the tower runs on frame pairs of `pair_units` merge units at R: every patch up to
        block K (`blocks`: [K], None: the method's own) and in the restoring blocks after it, each
        pair's kept patches in the later ones, every patch in the mergers."""
        pruning, vision = method.tower_prune, dims.vision
        patches = tuple(n * vision.merge**2 for n in pair_units)
        kept = tuple(pruning.kept_patches(n, retention) for n in patches)
        pruned, restoring = pruning.settings(vision.depth, blocks[0] if blocks else None)
        blocks = tuple(patches if b < pruned + restoring else kept for b in range(vision.depth))
        return TowerCounts(blocks, (sum(patches),) * len(vision.deepstack_taps), sum(patches))

    @staticmethod
    def tower_flops(method, tower: TowerCounts, width: int) -> int:
        """The neighbour search's FLOPs in a tower that ran `tower` at `width` (the vision hidden
        size): every removed patch against every kept one."""
        kept = sum(tower.blocks[-1])
        return method.tower_prune.distance_flops(tower.merger - kept, kept, width)

    def token_budget(self, spec, plans, reference, dims) -> TokenBudget:
        (plan,) = plans
        budget = super().token_budget(spec, plans, reference, dims)
        tower = self.tower_counts(spec.method, dims, list(plan.pair_tokens), spec.retention, spec.vision_blocks)
        return dataclasses.replace(budget, tower=tower)

    def build(self, spec, backbone, request, video, plan, pairs, budget) -> ModelInputs:
        method, timer = spec.method, backbone.vision_timer
        reset_peak_memory(backbone.device)  # the tower runs here, before the engine call
        with timer.recording():
            inputs, pruner = backbone.build_tower_pruned_inputs(
                request.prompt,
                video,
                plan,
                method.tower_prune,
                [method.tower_prune.kept_patches(n, spec.retention) for n in budget.tower.blocks[0]],
                lambda fn: CountedCall(fn, timer.stopwatch),
                pairs,
                spec.vision_blocks[0] if spec.vision_blocks else None,
            )
        if pruner.block_patches != budget.tower.tokens:
            raise RuntimeError(
                f"{method.name}: the tower held {pruner.block_patches} patches; the budget counts {budget.tower.tokens}"
            )
        expected = self.tower_flops(method, budget.tower, backbone.model.config.vision_config.hidden_size)
        if pruner.flops != expected:
            raise RuntimeError(f"{method.name}: the tower's pruning counted {pruner.flops} FLOPs, not {expected}")
        vision_s, peak = timer.take(), peak_memory_mb(backbone.device)
        return ModelInputs(backbone.pruned_inputs(inputs, budget.stages), None, 0, vision_s, peak, pruner.seconds())

    def own_flops(self, method, dims, grids, retention, counted) -> int:
        """The tower's neighbour search (`tower_flops`, checked against the count in a run) plus the
        in-LLM stage's ranking (`counted`: as counted in a run, or `estimates.stage_flops`)."""
        tower = self.tower_counts(method, dims, [t * h * w for t, h, w in grids], retention)
        return self.tower_flops(method, tower, dims.vision.hidden) + (counted or 0)


def check_tower(spec, dims: BackboneDims, acts: str) -> None:
    """Stop at start where a method cannot reduce tokens inside this vision tower: Qwen2.5-VL's (its
    windowed blocks are not re-formed) or one of a single block."""
    vision = dims.vision
    if vision.window_px is not None:
        raise ValueError(
            f"method={spec.method.name} {acts} inside the vision tower on Qwen3-VL only: Qwen2.5-VL's blocks "
            "between its full-attention blocks attend in windows, which it would have to re-form (not ported)"
        )
    if vision.depth < 2:
        raise ValueError(f"method={spec.method.name} needs a vision tower of 2 blocks at least, not {vision.depth}")


RESIZE_POLICY = ResizePolicy()
COMPRESSOR = Compressor()
ENGINE_COMPRESSOR = EngineCompressor()
IN_LLM_PRUNER = InLLMPruner()
ADAPTIVE_IN_LLM_PRUNER = AdaptiveInLLMPruner()
COMPRESSOR_THEN_PRUNER = CompressorThenPruner()
DECODE_PRUNER = DecodePruner()
ENGINE_PRUNER = EnginePruner()
IN_TOWER_MERGER = InTowerMerger()
IN_TOWER_THEN_PRUNER = InTowerThenPruner()
FRAME_SELECTION = FrameSelection()
KINDS = (
    RESIZE_POLICY,
    COMPRESSOR,
    ENGINE_COMPRESSOR,
    IN_LLM_PRUNER,
    ADAPTIVE_IN_LLM_PRUNER,
    COMPRESSOR_THEN_PRUNER,
    DECODE_PRUNER,
    ENGINE_PRUNER,
    IN_TOWER_MERGER,
    IN_TOWER_THEN_PRUNER,
    FRAME_SELECTION,
)
