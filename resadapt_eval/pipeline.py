"""One request flow for every front end: decode -> scales -> plan -> model inputs -> generation.

Each stage returns a small frozen result; the sidecar record is built once from them at the end.
The HF classes send batches of one, the vLLM classes chunks, images and videos take the same
stages, and the rollout engine plans with the same `Planner`. A sample that fails at any stage is
answered with an empty text and a record holding the exception's type and message, and the batch
goes on; with `strict=True` the original exception is raised instead. What a method does comes
from the method registry (`methods.py`), never from its name.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .backbones.layout import Backbone, EngineOutput
from .baselines.inside_llm import entering_tokens
from .budget.plan import InfeasibleBudget, ResizePlan
from .budget.planner import Planner
from .budget.policies import BudgetSpec
from .budget.selection import OPERATORS
from .compute.counting import CountedCall
from .methods import BEFORE_ENCODER, IN_ENGINE, INSIDE_LLM, METHODS, NO_RETENTION, REQUIRED_RETENTION, get_method
from .profile.clock import peak_memory_mb, reset_peak_memory
from .record import SampleRecord, build_record
from .video import DecodedVideo, decode_video, read_image

ALLOCATOR_QUERIES = ("question", "empty")
FLOOR_PROBE_TOKENS = 10**7  # visual tokens: more than any request gives (`VideoPipeline.check_pruning`)


@dataclass
class VideoPipelineConfig:
    """Per-run settings. min_pixels/max_pixels bound one frame's base (vanilla) area in pixels;
    strict: raise a failed sample's exception instead of recording it; num_threads: torch's
    intra-op threads for this process (None: torch's default for one process, the machine's CPUs
    divided among the processes when several run, see `apply_num_threads`); prune_layers: the
    decoder layers where an inside-the-LLM method prunes, comma-separated (None: the method's own);
    allocator_query: what the Allocator reads as the query, `question` or `empty` (the ablation)."""

    method: str = "vanilla"
    max_num_frames: int = 32
    min_pixels: int | None = None
    max_pixels: int | None = None
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    allocator: str | None = None
    allocator_inference: str = "mean"
    allocator_quantile: float = 0.5
    allocator_seed: int = 0
    allocator_query: str = "question"
    compression_seed: int = 0
    operator: str = "resize"
    candidates: int = 128
    top_k: int | None = 32
    score_threshold: float | None = None
    strict: bool = False
    num_threads: int | None = None
    prune_layers: str | None = None

    def __post_init__(self):
        method = get_method(self.method)
        if self.prune_layers is not None and method.prune is None:
            raise ValueError(f"prune_layers= is only used by methods that prune inside the LLM, not {self.method!r}")
        if self.prune_layers is not None:
            if not str(self.prune_layers).strip(" ,;"):
                raise ValueError(
                    "prune_layers is empty: give decoder layer indices (e.g. prune_layers=2, or 3;6;9: lmms-eval "
                    "splits model_args at commas), or leave it out for the method's own layers"
                )
            try:
                self.pruning_layers
            except ValueError:
                raise ValueError(
                    f"prune_layers must be comma-separated layer indices (';'-separated in lmms-eval's model_args), "
                    f"got {self.prune_layers!r}"
                ) from None
            count = method.prune_layer_count
            if count is not None and len(self.pruning_layers) != count:
                raise ValueError(
                    f"prune_layers={self.prune_layers!r} names {len(self.pruning_layers)} layers; method={self.method} "
                    f"prunes at {count} layer{'s' if count > 1 else ''}"
                )
        if self.operator not in OPERATORS:
            raise ValueError(f"operator must be one of {OPERATORS}, got {self.operator!r}")
        if self.operator != "resize" and not method.needs_allocator:
            raise ValueError(
                f"operator={self.operator} ranks frames by the Allocator's scales: it needs method=resadapt"
            )
        if self.allocator is not None and not method.needs_allocator:
            raise ValueError(f"allocator= is only used by method=resadapt, not {self.method!r}")
        if self.allocator is None and method.needs_allocator:
            from .allocator import UNTRAINED, known_allocators

            known = "; ".join(known_allocators()) or "none in this installation"
            raise ValueError(
                f"method={self.method} needs model_args allocator=<checkpoint folder> (committed: {known}), "
                f"or allocator={UNTRAINED} to run the untrained Allocator on purpose"
            )
        if method.retention == REQUIRED_RETENTION and self.budget.retention is None:
            raise ValueError(f"method={self.method} needs a target retention (model_args retention=...)")
        if method.retention == NO_RETENTION and self.budget.retention is not None:
            raise ValueError(f"method={self.method} has no retention target; drop retention={self.budget.retention}")
        at_least_one = dict(
            max_num_frames=self.max_num_frames,
            candidates=self.candidates,
            top_k=self.top_k,
            num_threads=self.num_threads,
        )
        for name, value in at_least_one.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.allocator_query not in ALLOCATOR_QUERIES:
            raise ValueError(f"allocator_query must be one of {ALLOCATOR_QUERIES}, got {self.allocator_query!r}")
        if self.allocator_query != "question" and not method.needs_allocator:
            raise ValueError(f"allocator_query= is only used by method=resadapt, not {self.method!r}")
        if not 0 < self.allocator_quantile < 1:
            raise ValueError(f"allocator_quantile must be in (0, 1), got {self.allocator_quantile}")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}")

    @property
    def pruning_layers(self) -> list[int] | None:
        """`prune_layers` as decoder layer indices."""
        if self.prune_layers is None:
            return None
        return [int(v) for v in str(self.prune_layers).replace(";", ",").split(",") if v.strip()]

    def apply_num_threads(self, processes: int) -> int:
        """Set torch's intra-op threads for this process and return them: `num_threads` if given;
        else, with `processes` > 1 data-parallel processes (assumed on one machine), the CPUs this
        process may use divided among them (at least 1), since each process taking all of them
        oversubscribes the cores; else torch's default, unchanged."""
        threads = self.num_threads
        if threads is None and processes > 1:
            threads = max(1, len(os.sched_getaffinity(0)) // processes)
        if threads is not None:
            torch.set_num_threads(threads)
        return torch.get_num_threads()


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
    """The engine's request; visual_tokens: placeholders it must hold; merged_sizes: group sizes
    of a token compressor, compressor_flops: its work as counted, vision_s: its vision tower's
    seconds, peak_memory_mb: the peak while it encoded and compressed (`profile.clock`; None for
    other methods, whose tower runs inside the engine call); seconds: building time, resize_s of
    it resizing frames."""

    request: object
    visual_tokens: int
    merged_sizes: tuple[int, ...] | None
    resize_s: float
    seconds: float
    compressor_flops: int = 0
    vision_s: float = 0.0
    peak_memory_mb: float | None = None


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
    """Answers requests with a `Backbone` under one budget method."""

    def __init__(self, backbone: Backbone, config: VideoPipelineConfig):
        self.backbone, self.config, self.method = backbone, config, get_method(config.method)
        pruning = (backbone.video_pruning_method, backbone.video_pruning_rate)
        if self.method.stage == IN_ENGINE:
            wanted = (self.method.engine_pruning, self.method.pruning_rate(config.budget.retention))
            if pruning != wanted:
                raise ValueError(
                    f"method={config.method} at retention={config.budget.retention} needs an engine pruning video "
                    f"tokens with {wanted[0]} at rate {wanted[1]}; {type(backbone).__name__} prunes with {pruning}: "
                    "run it on the vLLM classes"
                )
        elif pruning[0] is not None and pruning[1]:
            raise ValueError(f"method={config.method} does not prune, but this engine prunes video tokens: {pruning}")
        elif self.method.stage != BEFORE_ENCODER and not backbone.compresses_tokens:
            raise ValueError(
                f"method={config.method} compresses visual tokens inside the model, which {type(backbone).__name__} "
                "does not expose: run it on the HF path"
            )
        self.layout = backbone.layout
        token_area = self.layout.grid.token_px**2
        if config.max_pixels is not None and config.max_pixels < token_area:
            raise ValueError(
                f"max_pixels={config.max_pixels} is below one visual token ({token_area} px on this backbone)"
            )
        if self.method.prune is not None:
            self.check_pruning()
        self.planner = Planner(self.layout.grid, config.budget, config.min_pixels, config.max_pixels)
        self.allocator = None
        if self.method.needs_allocator:
            from .allocator import AllocatorPolicy, load_allocator

            allocator = load_allocator(config.allocator, device=backbone.device)
            self.allocator = AllocatorPolicy(
                allocator, config.allocator_inference, config.allocator_quantile, config.allocator_seed
            )

    def check_pruning(self) -> None:
        """Stop at start on what the LLM's layer count already decides for a method with stages
        inside the LLM: `prune_layers` (or the method's default layers) outside
        [first prunable layer, layers - 1], unordered or repeated; and, for a method that prunes
        only inside the LLM (FastV, PyramidDrop), a retention at or below the floor its schedule
        keeps on every video.

        That floor depends on the visual token count N only through terms that shrink as N grows
        (FastV keeps floor((R L - K) N / (L - K)) >= 1 tokens after layer K; PyramidDrop keeps at
        least one token per stage, a layer average of (b_1 N + L - b_1) / (L N) with b_1 its first
        stage): a target the schedule cannot reach with `FLOOR_PROBE_TOKENS` visual tokens, more
        than any video gives, is out of reach for every N below it too, and the floor reported is
        the one at that N (b_1 / L, or K / L, to 4 places). Targets just above it, reachable on
        long videos only, stay per sample (`InfeasibleBudget` naming that sample's floor); so do the
        floors of compressors, which depend on the video's frame pairs and tokens."""
        backbone, config = self.backbone, self.config
        layers, first, retention = backbone.num_text_layers, backbone.first_prunable_layer, config.budget.retention
        given = config.pruning_layers
        try:
            self.method.prune(layers, FLOOR_PROBE_TOKENS, retention, given, first)
        except InfeasibleBudget as exc:
            if self.method.stage != INSIDE_LLM:
                return
            which = f"prune_layers={config.prune_layers!r}" if given is not None else "the default prune_layers"
            raise ValueError(
                f"retention={retention} with {which}: {exc.what} keeps a layer-averaged retention above "
                f"{exc.floor:.4f} on every video on this LLM of {layers} layers (the layers before the first "
                "stage see every visual token); raise retention, or give prune_layers an earlier first layer"
            ) from None
        except ValueError as exc:  # `inside_llm.check_layers`: its message starts with prune_layers
            raise ValueError(f"model_args {exc}") from None

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
        built = self._each(planned, lambda i: self.build(requests[i], decoded[i], planned[i]), failed)
        generated = self.generate(requests, built, failed)
        answers = []
        for i, request in enumerate(requests):
            stages = (decoded.get(i), scores.get(i), planned.get(i), built.get(i), generated.get(i))
            record = build_record(request, self.config, self.layout, *stages, failed.get(i))
            if self.config.strict and record.error and i not in failed:  # a non-finite value in the record
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
                if self.config.strict:
                    raise
                failed[i] = exc
        return out

    # ------------------------------------------------------------------ stages
    def decode(self, request: Request) -> Decoded:
        """The frames this method starts from: `max_num_frames` of the video (all `candidates`
        when selecting frames), or the request's images (PIL, uint8 (H, W, 3), or image file path strings)."""
        t0 = time.perf_counter()
        if request.video is not None:
            selecting = self.config.operator != "resize"
            items = (decode_video(request.video, self.config.candidates if selecting else self.config.max_num_frames),)
        else:
            if not request.images:
                raise ValueError("a request needs a video or at least one image")
            if not self.method.images or self.config.operator != "resize":
                takes = ", ".join(name for name, method in METHODS.items() if method.images)
                raise ValueError(
                    f"method={self.config.method}, operator={self.config.operator} works on videos only; "
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
        return request.query if self.config.allocator_query == "question" else ""

    def _fail_together(self, alive: list[int], exc: Exception, failed: dict) -> dict:
        """A stage that ran for several samples at once failed: all of them fail with it."""
        if self.config.strict:
            raise exc
        failed.update({i: exc for i in alive})
        return {}

    def plan(self, decoded: Decoded, scores: Scores) -> Planned:
        """Scales -> one resize plan per item: the method's policy, or the Allocator's scales fit
        to the retention (jointly over a request's images); or frame selection (`Planner.select`)."""
        t0 = time.perf_counter()
        items, candidates, reference, projection_s = decoded.items, None, None, 0.0
        base_hws = [self.planner.base_hw(item.frames.shape[1:3]) for item in items]
        if not self.method.needs_allocator:
            grid, spec = self.layout.grid, self.config.budget
            scales = [self.method.policy(len(item.indices), hw, grid, spec) for item, hw in zip(items, base_hws)]
        elif self.config.operator == "resize":
            t1 = time.perf_counter()
            scales = self.planner.fit(scores.raw, base_hws, self.config.budget.retention)
            projection_s = time.perf_counter() - t1
        else:
            t1, cfg, candidates = time.perf_counter(), self.config, len(items[0].indices)
            positions, kept_scales, reference = self.planner.select(
                scores.raw[0], base_hws[0], cfg.operator, cfg.top_k, cfg.score_threshold
            )
            items, scales = (items[0].subset(positions),), [kept_scales]
            projection_s = time.perf_counter() - t1
        plans = tuple(self.planner.plan(s, hw) for s, hw in zip(scales, base_hws))
        if reference is None:  # frame selection measures R against all candidates
            reference = sum(p.reference_tokens for p in plans)
        return Planned(items, plans, reference, candidates, projection_s, time.perf_counter() - t0)

    def build(self, request: Request, decoded: Decoded, planned: Planned) -> Built:
        """The engine's request: frames resized to the plan, then the prompt and pixels (and, for
        token compressors, the encoded tokens compressed to round(R * N))."""
        t0 = time.perf_counter()
        merged, compressor, vision_s, peak_mb = None, CountedCall(self.method.compress), 0.0, None
        if decoded.images:
            frames = [item.frames[0] for item in planned.items]
            resized = self.layout.resized_images(frames, list(planned.plans))
            resize_s = time.perf_counter() - t0
            payload = self.backbone.build_image_inputs(request.prompt, frames, list(planned.plans), resized)
            visual = sum(p.visual_tokens for p in planned.plans)
        else:
            (video,), (plan,) = planned.items, planned.plans
            pairs = self.layout.resized_pairs(video, plan)
            resize_s = time.perf_counter() - t0
            if self.method.stage == INSIDE_LLM:
                payload, visual = self.backbone.build_inputs(request.prompt, video, plan, pairs), plan.visual_tokens
                payload = self.backbone.build_pruned_inputs(
                    payload, self.method.prune, self.config.budget.retention, self.config.pruning_layers
                )
            elif self.method.stage == IN_ENGINE:  # the engine drops tokens after the merger
                payload = self.backbone.build_inputs(request.prompt, video, plan, pairs)
                visual = self.backbone.pruned_visual_tokens(plan)
            elif self.method.compress is None:
                payload, visual = self.backbone.build_inputs(request.prompt, video, plan, pairs), plan.visual_tokens
            else:
                timer, retention = self.backbone.vision_timer, self.config.budget.retention
                if self.method.prune is not None:  # a stage inside the LLM follows: keep what leaves R in reach
                    retention = self.entering_share(plan)
                reset_peak_memory(self.backbone.device)  # the tower runs here, before the engine call
                with timer.recording():
                    payload, sizes = self.backbone.build_compressed_inputs(
                        request.prompt,
                        video,
                        plan,
                        compressor,
                        retention,
                        seed=self.config.compression_seed,
                        needs_attention=self.method.needs_attention,
                        pairs=pairs,
                    )
                merged, vision_s, peak_mb = tuple(sizes.tolist()), timer.take(), peak_memory_mb(self.backbone.device)
                visual = len(merged)
                if self.method.prune is not None:
                    payload = self.backbone.build_pruned_inputs(
                        payload, self.method.prune, self.config.budget.retention, self.config.pruning_layers
                    )
                if self.method.decode_prune is not None:
                    payload = self.backbone.build_decode_pruned_inputs(
                        payload, self.method.decode_prune, self.config.budget.retention
                    )
        seconds = time.perf_counter() - t0
        return Built(payload, visual, merged, resize_s, seconds, compressor.flops, vision_s, peak_mb)

    def entering_share(self, plan: ResizePlan) -> float:
        """For a compressor followed by the method's own stage inside the LLM: the share of the
        plan's N tokens the compressor keeps, the most whose layer average stays within R."""
        n, pairs = plan.visual_tokens, len(plan.grids)
        backbone, layers = self.backbone, self.config.pruning_layers
        args = (self.method.prune, self.config.budget.retention, n, pairs, backbone.num_text_layers, layers)
        return entering_tokens(*args, backbone.first_prunable_layer) / n

    def generate(self, requests: list[Request], built: dict[int, Built], failed: dict) -> dict[int, Generated]:
        """Generate every built request in one engine call (its time shared equally); a prompt
        whose visual placeholders differ from what was built fails its sample."""
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
            if counted != built[i].visual_tokens:
                exc = RuntimeError(
                    f"the engine's prompt holds {counted} visual placeholders, the plan counts {built[i].visual_tokens}"
                )
                if self.config.strict:
                    raise exc
                failed[i] = exc
        return out
