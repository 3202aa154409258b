"""One request flow for every front end: decode -> scales -> plan -> token budget -> model inputs -> generation.

Each stage returns a small frozen result; the sidecar record is built once from them at the end.
The HF classes send batches of one, the vLLM classes chunks, images and videos take the same
stages, and the rollout engine plans with the same `Planner`. A sample that fails at any stage is
answered with an empty text and a record holding the exception's type and message, and the batch
goes on; with `strict=True` the original exception is raised instead. The settings arrive resolved
(`runspec.RunSpec`), and what a method does is its kind's code (`kinds.py`: planning, the token
budget, input building), called the same way for every method, never chosen by its name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .backbones.layout import Backbone, EngineOutput
from .budget.plan import ResizePlan
from .budget.planner import Planner
from .budget.tokens import TokenBudget
from .compute.flops import dims_from_config
from .kinds import FLOOR_PROBE_TOKENS, ModelInputs
from .methods import METHODS
from .record import SampleRecord, build_record
from .runspec import RunSpec, VideoPipelineConfig
from .video import DecodedVideo, decode_video, read_image

# FLOOR_PROBE_TOKENS (the in-LLM floor probe, `kinds.py`) is re-exported: benchmarks/gpu_check.py reads it here
__all__ = ["FLOOR_PROBE_TOKENS", "Request", "VideoPipeline", "VideoPipelineConfig"]


@dataclass(frozen=True)
class Request:
    """One sample: chat text holding one `<|video_pad|>` (a video file) or one `<|image_pad|>` per
    image (PIL, uint8 (H, W, 3) or an image file path); query: the user's text, for the Allocator; gen_kwargs: the
    backbone's `generate` arguments."""

    prompt: str
    video: str | None = None
    images: tuple = ()
    query: str = ""
    gen_kwargs: dict = field(default_factory=dict)
    doc_id: int | None = None
    task: str | None = None


@dataclass(frozen=True)
class Decoded:
    """items: the decoded video, or each image as a one-frame video; seconds: decode time."""

    items: tuple[DecodedVideo, ...]
    images: bool
    seconds: float


@dataclass(frozen=True)
class Scores:
    """The Allocator's raw scales per item (None for methods without it), its stage seconds and
    its FLOPs on this sample (`Allocator.flops`)."""

    raw: tuple[np.ndarray, ...] | None = None
    text_s: float = 0.0
    visual_s: float = 0.0
    predict_s: float = 0.0
    flops: int = 0


@dataclass(frozen=True)
class Planned:
    """The kept frames and their plans; reference_tokens: vanilla tokens R is measured against
    (all candidates' under frame selection); seconds: planning time, projection_s of it projecting."""

    items: tuple[DecodedVideo, ...]
    plans: tuple[ResizePlan, ...]
    reference_tokens: int
    candidates: int | None
    projection_s: float
    seconds: float


@dataclass(frozen=True)
class Built:
    """The engine's request; merged_sizes: group sizes of a token compressor, compressor_flops: its
    work as counted, vision_s: its vision tower's seconds, peak_memory_mb: the peak while it encoded
    and compressed (`measure.clock`; None for other methods, whose tower runs inside the engine
    call); seconds: building time, resize_s of it resizing frames; compress_s: a compressor's own
    seconds, within `seconds`; query_tokens: the question's tokens a compressor read (None: none read).
    The placeholders the request must hold are its token budget's."""

    request: object
    merged_sizes: tuple[int, ...] | None
    resize_s: float
    seconds: float
    compressor_flops: int = 0
    vision_s: float = 0.0
    peak_memory_mb: float | None = None
    compress_s: float | None = None
    query_tokens: int | None = None
    assignment: object = None


@dataclass(frozen=True)
class Generated:
    """The answer; prompt_ids: the engine's own prompt; visual_tokens: the visual placeholders
    among them (what entered the LLM); seconds: this sample's share of the engine call; engine:
    what the engine reported (its clocks)."""

    text: str
    prompt_ids: tuple[int, ...]
    visual_tokens: int
    output_tokens: int
    seconds: float
    engine: EngineOutput


class VideoPipeline:
    """Answers requests with a `Backbone` under one run spec (or the parsed model_args it resolves)."""

    def __init__(self, backbone: Backbone, spec: RunSpec | VideoPipelineConfig):
        self.backbone, self.spec = backbone, RunSpec.resolve(spec)
        self.kind, self.layout = self.spec.kind, backbone.layout
        self.kind.check_engine(self.spec, backbone)
        token_area = self.layout.grid.token_px**2
        if self.spec.max_pixels is not None and self.spec.max_pixels < token_area:
            raise ValueError(
                f"max_pixels={self.spec.max_pixels} is below one visual token ({token_area} px on this backbone)"
            )
        self.dims = dims_from_config(self.layout.config)  # the LLM's layers, for the in-LLM token rules
        self.kind.check_llm(self.spec, self.dims)
        self.planner = Planner(self.layout.grid, self.spec.budget, self.spec.min_pixels, self.spec.max_pixels)
        self.kind.check_retention(self.spec, self.planner, self.dims)  # a target no video reaches stops here
        self.allocator = None
        if self.spec.method.needs_allocator:
            from .allocator import AllocatorPolicy, load_allocator

            allocator = load_allocator(self.spec.allocator, device=backbone.device)
            self.allocator = AllocatorPolicy(
                allocator,
                self.spec.allocator_inference,
                self.spec.allocator_quantile,
                self.spec.allocator_seed,
                resize=self.spec.resize,
            )

    def run(self, request: Request) -> tuple[str, SampleRecord]:
        """Answer one request (a batch of one)."""
        return self.run_batch([request])[0]

    def run_batch(self, requests: list[Request]) -> list[tuple[str, SampleRecord]]:
        """Answer requests together: each stage runs over every sample still alive (the Allocator
        once for all, the engine's generation once for all); per request (text, record)."""
        failed: dict[int, Exception] = {}
        decoded = self._each(range(len(requests)), lambda i: self.decode(requests[i]), failed)
        scores = self.score(requests, decoded, failed)
        planned = self._each(scores, lambda i: self.plan(decoded[i], scores[i]), failed)
        budgets = self._each(planned, lambda i: self.token_budget(planned[i]), failed)
        built = self._each(budgets, lambda i: self.build(requests[i], decoded[i], planned[i], budgets[i]), failed)
        generated = self.generate(requests, budgets, built, failed)
        answers = []
        for i, request in enumerate(requests):
            stages = (decoded.get(i), scores.get(i), planned.get(i), budgets.get(i), built.get(i), generated.get(i))
            record = build_record(request, self.spec, self.layout, *stages, failed.get(i))
            if self.spec.strict and record.error and i not in failed:  # a non-finite value in the record
                raise ValueError(record.error)
            answers.append(("" if record.error else generated[i].text, record))
        return answers

    def _each(self, alive, stage: Callable, failed: dict) -> dict:
        """`stage(i)` for every sample i in `alive` not yet failed; a failure is kept in `failed`
        (or raised, with strict)."""
        out = {}
        for i in alive:
            if i in failed:
                continue
            try:
                out[i] = stage(i)
            except Exception as exc:
                if self.spec.strict:
                    raise
                failed[i] = exc
        return out

    # ------------------------------------------------------------------ stages
    def decode(self, request: Request) -> Decoded:
        """The frames this method starts from: `max_num_frames` of the video (all `candidates`
        when selecting frames), or the request's images (PIL, uint8 (H, W, 3), or image file path strings)."""
        t0 = time.perf_counter()
        if request.video is not None:
            items = (decode_video(request.video, self.spec.frames_to_decode),)
        else:
            if not request.images:
                raise ValueError("a request needs a video or at least one image")
            if not self.kind.images:
                takes = ", ".join(name for name, method in METHODS.items() if method.images)
                raise ValueError(
                    f"method={self.spec.method.name}, operator={self.spec.operator.value} works on videos only; "
                    f"images take {takes}"
                )
            if not self.backbone.serves_images:
                raise ValueError(
                    f"{type(self.backbone).__name__} answers video requests; image suites run on the HF classes"
                )
            frames = [
                read_image(im)
                if isinstance(im, str)
                else np.array(im.convert("RGB") if hasattr(im, "convert") else im, dtype=np.uint8)
                for im in request.images
            ]
            items = tuple(DecodedVideo(frames=f[None], indices=[0], total_frames=1, fps=1.0) for f in frames)
        return Decoded(items=items, images=request.video is None, seconds=time.perf_counter() - t0)

    def score(self, requests: list[Request], decoded: dict[int, Decoded], failed: dict) -> dict[int, Scores]:
        """The Allocator's raw scales for every decoded sample in one call (all images of a
        request in one sequence); empty scores for methods without the Allocator."""
        alive = [i for i in decoded if i not in failed]
        if self.allocator is None or not alive:
            return {i: Scores() for i in alive}
        sequences = [[item.frames for item in decoded[i].items] for i in alive]
        queries = {i: self.allocator_query(requests[i]) for i in alive}
        try:
            raw, seconds = self.allocator.raw_scales_batch(sequences, [queries[i] for i in alive])
        except Exception as exc:
            return self._fail_together(alive, exc, failed)
        out = {}
        for i, scales in zip(alive, raw):
            lengths = [len(item.indices) for item in decoded[i].items]
            per_item = tuple(np.split(scales, np.cumsum(lengths)[:-1]))
            out[i] = Scores(
                per_item,
                seconds["allocator_text_s"],
                seconds["allocator_visual_s"],
                seconds["allocator_predict_s"],
                self.allocator.flops(sum(lengths), queries[i]),
            )
        return out

    def allocator_query(self, request: Request) -> str:
        """The text the Allocator reads: the request's query, or "" under `allocator_query=empty`
        (the query ablation: the backbone still reads the question)."""
        return request.query if self.spec.reads_question else ""

    def _fail_together(self, alive: list[int], exc: Exception, failed: dict) -> dict:
        """A stage that ran for several samples at once failed: all of them fail with it."""
        if self.spec.strict:
            raise exc
        failed.update({i: exc for i in alive})
        return {}

    def plan(self, decoded: Decoded, scores: Scores) -> Planned:
        """Scales -> one resize plan per item, as the run's kind plans them (`MethodKind.scales`:
        the method's policy, the Allocator's scales fit to the retention jointly over a request's
        images, or frame selection)."""
        t0 = time.perf_counter()
        base_hws = [self.planner.base_hw(item.frames.shape[1:3]) for item in decoded.items]
        chosen = self.kind.scales(self.spec, self.planner, decoded.items, base_hws, scores.raw)
        plans = tuple(self.planner.plan(s, hw) for s, hw in zip(chosen.scales, base_hws))
        reference = chosen.reference
        if reference is None:  # frame selection measures R against all candidates
            reference = sum(p.reference_tokens for p in plans)
        return Planned(chosen.items, plans, reference, chosen.candidates, chosen.projection_s, time.perf_counter() - t0)

    def token_budget(self, planned: Planned) -> TokenBudget:
        """The visual tokens the plan puts into the LLM and each of its layers, by the kind's rule
        (a budget the method cannot reach on this sample fails it here, before any input is built)."""
        return self.kind.token_budget(self.spec, planned.plans, planned.reference_tokens, self.dims)

    def build(self, request: Request, decoded: Decoded, planned: Planned, budget: TokenBudget) -> Built:
        """The engine's request: frames resized to the plan, then the prompt and pixels as the kind
        builds them (token compressors: the encoded tokens compressed to the budget's count)."""
        t0 = time.perf_counter()
        if decoded.images:
            frames = [item.frames[0] for item in planned.items]
            resized = self.layout.resized_images(frames, list(planned.plans), self.spec.resize, self.backbone.device)
            resize_s = time.perf_counter() - t0
            inputs = ModelInputs(self.backbone.build_image_inputs(request.prompt, frames, list(planned.plans), resized))
        else:
            (video,), (plan,) = planned.items, planned.plans
            pairs = self.layout.resized_pairs(video, plan, self.spec.resize, self.backbone.device)
            resize_s = time.perf_counter() - t0
            inputs = self.kind.build(self.spec, self.backbone, request, video, plan, pairs, budget)
        seconds = time.perf_counter() - t0
        return Built(
            inputs.request,
            inputs.merged_sizes,
            resize_s,
            seconds,
            inputs.compressor_flops,
            inputs.vision_s,
            inputs.peak_memory_mb,
            inputs.compress_s,
            inputs.query_tokens,
            inputs.assignment,
        )

    def generate(
        self, requests: list[Request], budgets: dict[int, TokenBudget], built: dict[int, Built], failed: dict
    ) -> dict[int, Generated]:
        """Generate every built request in one engine call (its time shared equally); a prompt
        whose visual placeholders, or an in-LLM pruner whose per-layer tokens, differ from the token
        budget fails its sample."""
        alive = [i for i in built if i not in failed]
        if not alive:
            return {}
        t0 = time.perf_counter()
        try:
            outputs = self.backbone.generate_batch(
                [built[i].request for i in alive], [requests[i].gen_kwargs for i in alive]
            )
        except Exception as exc:
            return self._fail_together(alive, exc, failed)
        share = (time.perf_counter() - t0) / len(alive)
        out = {}
        for i, answer in zip(alive, outputs):
            counted = answer.prompt_ids.count(self.layout.placeholder_id(requests[i].video is None))
            out[i] = Generated(answer.text, tuple(answer.prompt_ids), counted, answer.output_tokens, share, answer)
            budget, layers = budgets[i], answer.layer_visual_tokens
            try:
                if layers is not None:  # a budget whose counts follow from the run takes them here
                    budget = budgets[i] = self.spec.kind.settle(self.spec, budget, layers)
                if counted != budget.entering:
                    raise RuntimeError(
                        f"the engine's prompt holds {counted} visual placeholders, the plan counts {budget.entering}"
                    )
                if layers is not None and tuple(layers) != budget.layers:
                    raise RuntimeError(
                        f"the engine's layers held {list(layers)} visual tokens, the plan counts {budget.layers}"
                    )
            except RuntimeError as exc:
                if self.spec.strict:
                    raise
                failed[i] = exc
        return out
