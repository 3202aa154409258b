"""One request end to end: decode once -> policy scales -> resize plan -> backbone -> answer + record.

This is the code path every method and every front end (lmms-eval, benchmarks, demo) shares.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .backbones.qwen import QwenVideoAdapter
from .budget.plan import ResizePlan, base_size, plan_from_scales, project_to_retention
from .budget.policies import POLICIES, BudgetSpec
from .budget.selection import OPERATORS, select_frames
from .video import DecodedVideo, decode_video

COMPRESSION_METHODS = ("random_drop", "tome", "visionzip", "flashvid")  # vanilla plan, then compress tokens
METHODS = (*POLICIES, "resadapt", *COMPRESSION_METHODS)


@dataclass
class SampleRecord:
    """What one sample spent; one line of the sidecar JSONL.

    scales: per-frame scale s_t; grids: (t, h, w) merged-token grid per pair; visual_tokens: tokens
    that entered the LLM; reference_tokens: the vanilla plan's tokens for the same frames;
    achieved_retention = visual_tokens / reference_tokens; raw_scales: an Allocator's scales before
    projection to the target R; merged_sizes: for token compressors, how many original tokens each
    kept token stands for (sums to the vanilla count for merging methods). Frame selection:
    candidates (frames scored), frame_indices (the kept ones), reference_tokens (the candidates'
    vanilla tokens, so R is against vanilla at the candidate count, as the paper reports it);
    frame_budget: visual tokens in full-resolution-frame equivalents (every method). Seconds: decode_s (video decode), allocator_{text,visual,predict}_s
    (Allocator stages; predict includes the projection), scale_apply_s (resizing frames to the plan),
    preprocess_s (planning and building the model inputs, resize included), generate_s.
    """

    doc_id: int | None
    task: str | None
    method: str
    video: str | None = None
    num_frames: int = 0
    frame_indices: list[int] = field(default_factory=list)
    base_size: list[int] | None = None
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


@dataclass
class VideoPipelineConfig:
    """Per-run settings. min_pixels/max_pixels bound one frame's base (vanilla) area in pixels."""

    method: str = "vanilla"
    max_num_frames: int = 32
    min_pixels: int | None = None
    max_pixels: int | None = None
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    allocator: str | None = None
    allocator_inference: str = "mean"
    allocator_quantile: float = 0.5
    allocator_seed: int = 0
    compression_seed: int = 0
    operator: str = "resize"
    candidates: int = 128
    top_k: int | None = 32
    score_threshold: float | None = None

    def __post_init__(self):
        if self.operator not in OPERATORS:
            raise ValueError(f"operator must be one of {OPERATORS}, got {self.operator!r}")
        if self.operator != "resize" and self.method != "resadapt":
            raise ValueError(f"operator={self.operator} ranks frames by the Allocator's scales: it needs method=resadapt")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; available: {', '.join(METHODS)}")
        if self.allocator is not None and self.method != "resadapt":
            raise ValueError(f"allocator= is only used by method=resadapt, not {self.method!r}")
        if self.method in COMPRESSION_METHODS and self.budget.retention is None:
            raise ValueError(f"method={self.method} needs a target retention (model_args retention=...)")
        if self.max_num_frames < 1:
            raise ValueError(f"max_num_frames must be at least 1, got {self.max_num_frames}")


class VideoPipeline:
    """Answers (video, prompt) requests with an adapter under one budget method."""

    def __init__(self, adapter: QwenVideoAdapter, config: VideoPipelineConfig):
        self.adapter = adapter
        self.config = config
        if config.method == "resadapt":
            from .allocator import AllocatorPolicy, load_allocator

            allocator = load_allocator(config.allocator, device=adapter.device)
            self.policy = AllocatorPolicy(allocator, config.allocator_inference, config.allocator_quantile, config.allocator_seed)
        elif config.method in COMPRESSION_METHODS:
            self.policy = POLICIES["vanilla"]  # compressors start from the vanilla plan
        else:
            self.policy = POLICIES[config.method]
        px = adapter.grid.token_px
        # Defaults: 4..768 tokens per frame at the base resolution (768 is qwen-vl-utils' video cap;
        # its 128-token video floor is not applied, so small videos are not upscaled).
        self.min_pixels = config.min_pixels if config.min_pixels is not None else 4 * px * px
        self.max_pixels = config.max_pixels if config.max_pixels is not None else 768 * px * px

    def base_hw(self, video: DecodedVideo) -> tuple[int, int]:
        """Base (vanilla) size of the video's frames in pixels."""
        return base_size(*video.frames.shape[1:3], self.adapter.grid, self.min_pixels, self.max_pixels)

    def select(self, video: DecodedVideo, query: str, context: dict) -> tuple[DecodedVideo, ResizePlan, int]:
        """Frame selection: the Allocator scores every candidate frame, the best are kept in time
        order (`select`: at the base size; `select_resize`: at their Allocator scales, projected
        so the tokens stay within `retention` x the candidates' vanilla tokens). Returns the kept
        frames, their plan, and the candidates' vanilla tokens (the reference for R)."""
        cfg, grid = self.config, self.adapter.grid
        if "raw_scales" not in context:
            context["raw_scales"] = self.policy.raw_scales(video.frames, query, context.setdefault("timings", {}))
        raw = context["raw_scales"]
        positions = select_frames(raw, cfg.top_k, cfg.score_threshold)  # sorted, into the candidates
        base = self.base_hw(video)
        reference = plan_from_scales(np.ones(len(video.indices)), base, grid, **cfg.budget.plan_bounds).reference_tokens
        if cfg.operator == "select":
            scales = np.ones(len(positions))
        elif cfg.budget.retention is None:
            scales = np.clip(raw[positions], cfg.budget.s_min, cfg.budget.s_max)
        else:
            kept_reference = plan_from_scales(np.ones(len(positions)), base, grid, **cfg.budget.plan_bounds).reference_tokens
            target = cfg.budget.retention * reference / kept_reference
            scales = project_to_retention(raw[positions], target, base, grid, cfg.budget.s_min, cfg.budget.s_max, **cfg.budget.plan_bounds)
        return video.subset(positions), plan_from_scales(scales, base, grid, **cfg.budget.plan_bounds), reference

    def plan(self, video: DecodedVideo, query: str = "", context: dict | None = None) -> ResizePlan:
        """The resize plan this pipeline's method gives `video`. Policies may leave timings and
        raw scales in `context`."""
        base_hw = self.base_hw(video)
        context = context if context is not None else {}
        context.update(video=video, query=query)
        scales = self.policy(len(video.indices), base_hw, self.adapter.grid, self.config.budget, context)
        return plan_from_scales(scales, base_hw, self.adapter.grid, **self.config.budget.plan_bounds)

    def prepare(self, video: DecodedVideo, query: str, record: SampleRecord, context: dict) -> tuple[DecodedVideo, ResizePlan]:
        """Frames and resize plan for one decoded video under this pipeline's method; fills the
        record's plan fields (frames, scales, sizes, grids, reference tokens). An Allocator's
        scales already in `context["raw_scales"]` (batched by `run_batch`) are used as they are."""
        if self.config.operator != "resize":
            record.candidates = len(video.indices)
            video, plan, reference = self.select(video, query, context)
        else:
            plan = self.plan(video, query, context)
            reference = plan.reference_tokens
        record.num_frames = len(video.indices)
        record.frame_indices = video.indices
        if "raw_scales" in context:
            record.raw_scales = [round(float(s), 6) for s in context["raw_scales"]]
        record.base_size = list(plan.base_hw)
        record.scales = [round(s, 6) for s in plan.frame_scales]
        record.pair_sizes = [list(hw) for hw in plan.pair_sizes]
        record.grids = [list(g) for g in plan.grids]
        record.reference_tokens = reference
        return video, plan

    def decode(self, video_path: str, record: SampleRecord) -> DecodedVideo:
        """Decode the frames this method starts from (all candidates when selecting frames)."""
        record.video = str(video_path)
        record.target_retention = self.config.budget.retention
        t0 = time.perf_counter()
        video = decode_video(video_path, self.config.candidates if self.config.operator != "resize" else self.config.max_num_frames)
        record.decode_s = time.perf_counter() - t0
        return video

    def stage_times(self, record: SampleRecord, context: dict, t0: float) -> None:
        """Record the stage times left in `context` and the preprocessing seconds since `t0`
        (planning and input building, the Allocator's own stages excluded)."""
        for name, seconds in context["timings"].items():
            setattr(record, name, seconds)
        allocator_s = record.allocator_text_s + record.allocator_visual_s + record.allocator_predict_s
        record.preprocess_s = time.perf_counter() - t0 - allocator_s

    def count_tokens(self, input_ids: list[int], plan: ResizePlan, record: SampleRecord) -> None:
        """Record what entered the LLM: the video placeholders among the prompt's `input_ids`,
        and the retention they achieve against the record's reference tokens."""
        record.visual_tokens = input_ids.count(self.adapter.processor.video_token_id)
        record.achieved_retention = record.visual_tokens / record.reference_tokens
        record.frame_budget = record.visual_tokens / (self.adapter.grid.tokens(*plan.base_hw) / self.adapter.grid.temporal_patch)
        record.input_tokens = len(input_ids)

    def run(self, video_path: str, prompt: str, query: str = "", gen_kwargs: dict | None = None, record: SampleRecord | None = None) -> tuple[str, SampleRecord]:
        """Answer `prompt` (chat text with one video placeholder) about the video at `video_path`.

        Errors propagate; `record` is filled as far as the request got.
        """
        record = record or SampleRecord(doc_id=None, task=None, method=self.config.method)
        video = self.decode(video_path, record)
        t0 = time.perf_counter()
        context = {"timings": {}}
        video, plan = self.prepare(video, query, record, context)
        if self.config.method in COMPRESSION_METHODS:
            from .baselines import COMPRESSORS, NEEDS_ATTENTION

            inputs, sizes = self.adapter.build_compressed_inputs(
                prompt, video, plan, COMPRESSORS[self.config.method], self.config.budget.retention,
                seed=self.config.compression_seed, needs_attention=self.config.method in NEEDS_ATTENTION, timings=context["timings"],
            )  # fmt: skip
            record.merged_sizes = sizes.tolist()
        else:
            inputs = self.adapter.build_inputs(prompt, video, plan, timings=context["timings"])
        self.stage_times(record, context, t0)
        # Tokens that actually enter the LLM: the video placeholders of the built prompt.
        self.count_tokens(inputs["input_ids"][0].tolist(), plan, record)
        return self._generate(inputs, gen_kwargs, record)

    def run_batch(self, jobs: list[tuple[str, str, str, SampleRecord]], gen_kwargs: list[dict]) -> list[tuple[str, SampleRecord]]:
        """Answer a chunk of (video_path, prompt, query, record) jobs with a batch engine
        (`VLLMBackbone`): decode every video, run the Allocator once over the chunk (its stage
        times shared equally by the chunk's samples), build one request per sample, generate
        them together. A job that fails is returned with an empty answer and `record.error`
        set; the others go on. `generate_s` is the chunk's generation time shared equally."""
        if self.config.method in COMPRESSION_METHODS:
            raise ValueError(f"method={self.config.method} compresses tokens inside the model: it runs on the HF path only")
        results: list[tuple[str, SampleRecord]] = [("", record) for _, _, _, record in jobs]
        decoded = {}
        for i, (path, _, _, record) in enumerate(jobs):
            try:
                decoded[i] = self.decode(path, record)
            except Exception as exc:
                record.error = f"{type(exc).__name__}: {exc}"
        contexts = {i: {"timings": {}} for i in decoded}
        if self.config.method == "resadapt" and decoded:
            order = list(decoded)
            raw, timings = self.policy.raw_scales_batch([decoded[i].frames for i in order], [jobs[i][2] for i in order])
            for i, scales in zip(order, raw):
                contexts[i].update(raw_scales=scales, timings=dict(timings))
        requests, built = [], []
        for i, video in decoded.items():
            _, prompt, query, record = jobs[i]
            try:
                t0 = time.perf_counter()
                video, plan = self.prepare(video, query, record, contexts[i])
                requests.append(self.adapter.build_request(prompt, video, plan, timings=contexts[i]["timings"]))
                self.stage_times(record, contexts[i], t0)
                built.append((i, plan))
            except Exception as exc:
                record.error = f"{type(exc).__name__}: {exc}"
        if requests:
            t0 = time.perf_counter()
            outputs = self.adapter.generate_batch(requests, [gen_kwargs[i] for i, _ in built])
            share = (time.perf_counter() - t0) / len(requests)
            for (i, plan), (text, prompt_ids, n_out) in zip(built, outputs):
                record = jobs[i][3]
                # Tokens that actually entered the LLM: the engine's own prompt ids.
                self.count_tokens(list(prompt_ids), plan, record)
                record.generate_s, record.output_tokens = share, n_out
                if record.visual_tokens != plan.visual_tokens:
                    record.error = f"the engine's prompt holds {record.visual_tokens} video placeholders, the plan counts {plan.visual_tokens}"
                    continue
                results[i] = (text, record)
        return results

    def _generate(self, inputs: dict, gen_kwargs: dict | None, record: SampleRecord) -> tuple[str, SampleRecord]:
        t0 = time.perf_counter()
        text, n_out = self.adapter.generate(inputs, **(gen_kwargs or {}))
        record.generate_s = time.perf_counter() - t0
        record.output_tokens = n_out
        return text, record

    def run_images(self, images: list, prompt: str, query: str = "", gen_kwargs: dict | None = None, record: SampleRecord | None = None) -> tuple[str, SampleRecord]:
        """Answer `prompt` (chat text with one image placeholder per image) about PIL or uint8
        images. Each image is a one-frame video with its own base size and scale from the same
        policy (a pair for the backbone); R is counted the same way."""
        if self.config.method in COMPRESSION_METHODS or self.config.operator != "resize":
            raise ValueError(f"method={self.config.method}, operator={self.config.operator} works on videos only; images take vanilla, fixed_scale or resadapt")
        record = record or SampleRecord(doc_id=None, task=None, method=self.config.method)
        record.target_retention = self.config.budget.retention
        t0 = time.perf_counter()
        frames = [np.array(image.convert("RGB") if hasattr(image, "convert") else image, dtype=np.uint8) for image in images]
        record.decode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        context = {"timings": {}}
        plans = []
        for frame in frames:
            video = DecodedVideo(frames=frame[None], indices=[0], total_frames=1, fps=1.0)
            plans.append(self.plan(video, query, context))
        record.num_frames = len(frames)
        record.base_size = [list(p.base_hw) for p in plans]
        record.scales = [round(p.frame_scales[0], 6) for p in plans]
        record.pair_sizes = [list(p.pair_sizes[0]) for p in plans]
        record.grids = [list(p.grids[0]) for p in plans]
        record.reference_tokens = sum(p.reference_tokens for p in plans)
        inputs = self.adapter.build_image_inputs(prompt, frames, plans, timings=context["timings"])
        self.stage_times(record, context, t0)
        record.visual_tokens = int((inputs["input_ids"] == self.adapter.processor.image_token_id).sum())
        record.achieved_retention = record.visual_tokens / record.reference_tokens
        record.frame_budget = record.visual_tokens / sum(self.adapter.grid.tokens(*p.base_hw) for p in plans) * len(plans)
        record.input_tokens = int(inputs["input_ids"].shape[1])
        return self._generate(inputs, gen_kwargs, record)
