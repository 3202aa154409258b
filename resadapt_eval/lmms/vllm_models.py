"""lmms-eval chat model classes on the vLLM engine: `resadapt_qwen25vl_vllm`, `resadapt_qwen3vl_vllm`.

Same model_args, plans, sidecar records and run totals as `resadapt_<backbone>`; requests are
answered in chunks through `VideoPipeline.run_batch` (the Allocator runs once per chunk in this
process, then vLLM generates the chunk). Methods: those the registry marks `vllm` (vanilla,
fixed_scale, resadapt with any operator, the vision-side token compressors, run inside our vLLM model
class, and vLLM's own video pruning and VidCom2, `evs` and `vidcom2_engine`, whose model names
`<method>_<backbone>` are classes of this module). Methods with stages inside the LLM or the vision
tower, and image suites, run on the HF classes.
"""

from __future__ import annotations

from ..methods import Method
from ..pipeline import VideoPipelineConfig
from ..runspec import RunSpec, cast_model_arg
from .manifests import method_class
from .models import ResAdaptQwen

# vLLM's own arguments the model_args may set: (name, type, default)
ENGINE_ARGS = (
    ("tensor_parallel_size", int, 1),
    ("gpu_memory_utilization", float, 0.9),
    ("kv_cache_memory_bytes", int | None, None),
    ("max_model_len", int | None, None),
    ("seed", int, 0),
    ("enforce_eager", bool, False),
)


class ResAdaptQwenVLLM(ResAdaptQwen):
    """`ResAdaptQwen` served by vLLM.

    Extra model_args: tensor_parallel_size, gpu_memory_utilization (fraction of GPU memory vLLM
    may take), kv_cache_memory_bytes (KV cache size in bytes; needed on CPU), max_model_len
    (tokens), chunk_size (requests per vLLM call), seed, enforce_eager (vLLM's: no torch.compile or
    CUDA graphs; see `VLLMBackbone`). `device` is where the Allocator runs.
    The videos-per-prompt limit is ceil(max_num_frames / 2): one video item per frame pair.
    """

    family: str

    def __init__(self, pretrained: str, **kwargs):
        self.engine_args, self.chunk_size, kwargs = self.engine_settings(kwargs)
        super().__init__(pretrained, **kwargs)

    @staticmethod
    def engine_settings(model_args: dict) -> tuple[dict, int, dict]:
        """vLLM's arguments, the chunk size and the other model_args, from model_args; a bad value names
        its argument."""
        rest = dict(model_args)
        engine_args = {name: cast_model_arg(name, rest.pop(name, default), hint) for name, hint, default in ENGINE_ARGS}
        chunk_size = rest.pop("chunk_size", 32)
        chunk = cast_model_arg("chunk_size", chunk_size, int)
        if chunk < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        return engine_args, chunk, rest

    @classmethod
    def checked_config(cls, **model_args) -> VideoPipelineConfig:
        *_, rest = cls.engine_settings(model_args)
        return super().checked_config(**rest)

    @classmethod
    def backbone_family(cls) -> str:
        return cls.family

    @classmethod
    def check_engine(cls, method: Method) -> None:
        if not method.vllm:
            raise ValueError(
                f"method={method.name} acts {method.stage.replace('_', ' ')}, which vLLM does not expose: "
                f"run it on the HF path (--model {method.name}_{cls.family} or resadapt_{cls.family})"
            )

    def _build_backbone(self, pretrained: str, spec: RunSpec, device: str, dtype: str, attn_implementation: str | None):
        from ..backbones.vllm_engine import VLLMBackbone

        if attn_implementation is not None:
            raise ValueError("attn_implementation is an HF-path setting; vLLM picks its own attention backend")
        return VLLMBackbone(
            self.family,
            pretrained,
            spec.max_num_frames,
            dtype=dtype,
            allocator_device=device,
            **self.engine_args,
            **spec.kind.engine_args(spec),  # the method kind's own engine settings (EVS: its pruning and rate)
        )


class ResAdaptQwen25VLVLLM(ResAdaptQwenVLLM):
    family = "qwen25vl"


class ResAdaptQwen3VLVLLM(ResAdaptQwenVLLM):
    family = "qwen3vl"


def __getattr__(name: str) -> type:
    """The `<Method><Backbone>` classes of the methods only vLLM runs (e.g. EVSQwen25VL; every one is
    listed in docs/models.md): made on first use by `manifests.method_class` (PEP 562 module attribute)."""
    cls = globals()[name] = method_class(
        name, {"qwen25vl": ResAdaptQwen25VLVLLM, "qwen3vl": ResAdaptQwen3VLVLLM}, hf=False
    )
    return cls
