"""lmms-eval chat model classes on the vLLM engine: `resadapt_qwen25vl_vllm`, `resadapt_qwen3vl_vllm`.

Same model_args, plans, sidecar records and run totals as `resadapt_<backbone>`; requests are
answered in chunks through `VideoPipeline.run_batch` (the Allocator runs once per chunk in this
process, then vLLM generates the chunk). Methods: vanilla, fixed_scale, resadapt (any operator,
frame selection included). Token compressors and image suites run on the HF classes.
"""

from __future__ import annotations

import json

from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from tqdm import tqdm

from ..pipeline import COMPRESSION_METHODS, VideoPipelineConfig
from .models import ResAdaptQwen, _cut_at_stop, _generation_args, _none_or


class ResAdaptQwenVLLM(ResAdaptQwen):
    """`ResAdaptQwen` served by vLLM.

    Extra model_args: tensor_parallel_size, gpu_memory_utilization (fraction of GPU memory vLLM
    may take), kv_cache_memory_bytes (KV cache size in bytes; needed on CPU), max_model_len
    (tokens), chunk_size (requests per vLLM call), seed. `device` is where the Allocator runs.
    The videos-per-prompt limit is ceil(max_num_frames / 2): one video item per frame pair.
    """

    family: str

    def __init__(
        self,
        pretrained: str,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        chunk_size: int = 32,
        seed: int = 0,
        **kwargs,
    ):
        method = kwargs.get("method") or "vanilla"
        if method in COMPRESSION_METHODS:
            raise ValueError(
                f"method={method} compresses visual tokens inside the model, which vLLM does not expose: "
                f"run it on the HF path (--model {method}_{self.family} or resadapt_{self.family})"
            )
        self.engine_args = dict(
            tensor_parallel_size=int(tensor_parallel_size),
            gpu_memory_utilization=float(gpu_memory_utilization),
            kv_cache_memory_bytes=_none_or(kv_cache_memory_bytes, int),
            max_model_len=_none_or(max_model_len, int),
            seed=int(seed),
        )
        self.chunk_size = int(chunk_size)
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        super().__init__(pretrained, **kwargs)

    def _build_backbone(self, pretrained: str, config: VideoPipelineConfig, device: str, dtype: str, attn_implementation: str | None):
        from ..backbones.vllm_engine import VLLMBackbone

        if attn_implementation is not None:
            raise ValueError("attn_implementation is an HF-path setting; vLLM picks its own attention backend")
        return VLLMBackbone(self.family, pretrained, config.max_num_frames, dtype=dtype, allocator_device=device, **self.engine_args)

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        self.sidecar_path.parent.mkdir(parents=True, exist_ok=True)
        results, records = [], []
        with open(self.sidecar_path, "a", encoding="utf-8") as sidecar, tqdm(total=len(requests), disable=self.rank != 0, desc=f"{type(self).__name__} [{self.method}]") as bar:
            for start in range(0, len(requests), self.chunk_size):
                for text, record in self._answer_chunk(requests[start : start + self.chunk_size]):
                    sidecar.write(json.dumps(record.to_dict()) + "\n")
                    records.append(record)
                    results.append(GenerationResult(text=text, token_counts=TokenCounts(input_tokens=record.input_tokens, output_tokens=record.output_tokens)))
                sidecar.flush()
                bar.update(min(self.chunk_size, len(requests) - start))
        self._log_run(records)
        return results

    def _answer_chunk(self, requests: list[Instance]) -> list[tuple[str, object]]:
        """Answers in request order; a request that fails is recorded and the chunk goes on."""
        answers, jobs, gen_kwargs, stops = [None] * len(requests), [], [], []
        for i, request in enumerate(requests):
            record = self._new_record(request)
            try:
                prompt, query, images, videos, kwargs = self._parse(request)
                if images:
                    raise ValueError("the vLLM classes answer video requests; image suites run on resadapt_<backbone>")
                jobs.append((i, (videos[0], prompt, query, record)))
                gen_kwargs.append(_generation_args(kwargs))
                stops.append(kwargs.get("until"))
            except Exception as exc:
                answers[i] = self._failed(record, exc)
        outputs = self.pipeline.run_batch([job for _, job in jobs], gen_kwargs) if jobs else []
        for (i, _), (text, record), until in zip(jobs, outputs, stops):
            if record.error is not None:
                answers[i] = self._failed(record)
            else:
                answers[i] = (_cut_at_stop(text, until), record)
        return answers


class ResAdaptQwen25VLVLLM(ResAdaptQwenVLLM):
    family = "qwen25vl"


class ResAdaptQwen3VLVLLM(ResAdaptQwenVLLM):
    family = "qwen3vl"
