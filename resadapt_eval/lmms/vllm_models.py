"""lmms-eval chat model classes on the vLLM engine: `resadapt_qwen25vl_vllm`, `resadapt_qwen3vl_vllm`.

Same model_args, plans, sidecar records and run totals as `resadapt_<backbone>`; requests are
answered in chunks through `VideoPipeline.run_batch` (the Allocator runs once per chunk in this
process, then vLLM generates the chunk). Methods: those the registry marks `vllm` (vanilla,
fixed_scale, resadapt with any operator). Token compressors and image suites run on the HF classes.
"""

from __future__ import annotations

from ..methods import get_method
from ..pipeline import VideoPipelineConfig
from .models import ResAdaptQwen, _none_or


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
        method = get_method(kwargs.get("method") or "vanilla")
        if not method.vllm:
            raise ValueError(
                f"method={method.name} acts {method.stage.replace('_', ' ')}, which vLLM does not expose: "
                f"run it on the HF path (--model {method.name}_{self.family} or resadapt_{self.family})"
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

    def _build_backbone(
        self, pretrained: str, config: VideoPipelineConfig, device: str, dtype: str, attn_implementation: str | None
    ):
        from ..backbones.vllm_engine import VLLMBackbone

        if attn_implementation is not None:
            raise ValueError("attn_implementation is an HF-path setting; vLLM picks its own attention backend")
        return VLLMBackbone(
            self.family, pretrained, config.max_num_frames, dtype=dtype, allocator_device=device, **self.engine_args
        )


class ResAdaptQwen25VLVLLM(ResAdaptQwenVLLM):
    family = "qwen25vl"


class ResAdaptQwen3VLVLLM(ResAdaptQwenVLLM):
    family = "qwen3vl"
