"""Our vLLM model classes: Qwen2.5-VL with our per-pair M-RoPE layout; both families with token compressors.

vLLM positions every video item as its own block, each starting after the previous block's
largest index, so per-pair items would not get the HF path's (stock single-video) positions.
`ResAdaptQwen2_5_VLForConditionalGeneration` is vLLM's own Qwen2.5-VL class with one method
overridden, `get_mrope_input_positions` (vLLM's `SupportsMRoPE` interface), computing positions
with the rule the HF adapter uses (`mrope.qwen25_mrope_positions`). It is registered with vLLM's
`ModelRegistry` by `vllm_plugin.register`, which vLLM calls in every process through the
`vllm.general_plugins` entry point; `VLLMBackbone` selects it with `hf_overrides`.

Qwen3-VL needs no position override: its per-pair timestamps make vLLM's layout equal the HF path's
(checked by tests/test_vllm.py). Both classes (`ResAdaptQwen3VLForConditionalGeneration` only on an engine
started for compression) run token compressors on request, with their processors
(`vllm_compression.py`).
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from .mrope import VisionRun, qwen25_mrope_positions
from .vllm_compression import (
    CompressingModelMixin,
    CompressingProcessorMixin,
    Qwen3Layout,
    Qwen25Layout,
    qwen3_video_repl,
)


def vision_runs(mm_features, spatial_merge_size: int) -> list[VisionRun]:
    """Group vLLM's multimodal features into runs of back-to-back items (in prompt order)."""
    runs: list[VisionRun] = []
    for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
        data = feature.data
        t, h, w = data[f"{feature.modality}_grid_thw"].data.tolist()
        grid = (t, h // spatial_merge_size, w // spatial_merge_size)
        seconds = (
            data["second_per_grid_ts"].data.item()
            if feature.modality == "video" and data.get("second_per_grid_ts")
            else 1.0
        )
        offset, placeholders = feature.mm_position.offset, feature.mm_position.length
        if placeholders != t * grid[1] * grid[2]:  # compressed inside the engine (`vllm_compression`): a run alone
            runs.append(VisionRun(offset, [grid], [seconds], placeholders))
        elif (
            feature.modality == "video"
            and runs
            and runs[-1].placeholders is None
            and runs[-1].offset + runs[-1].num_tokens == offset
        ):
            runs[-1].grids.append(grid)
            runs[-1].second_per_grid_ts.append(seconds)
        else:
            runs.append(VisionRun(offset=offset, grids=[grid], second_per_grid_ts=[seconds]))
    return runs


class CompressingQwen2_5_VLProcessor(CompressingProcessorMixin, Qwen2_5_VLMultiModalProcessor):
    """vLLM's Qwen2.5-VL processor writing a compressed video's kept count (`vllm_compression`)."""


@MULTIMODAL_REGISTRY.register_processor(
    CompressingQwen2_5_VLProcessor, info=Qwen2_5_VLProcessingInfo, dummy_inputs=Qwen2_5_VLDummyInputsBuilder
)
class ResAdaptQwen2_5_VLForConditionalGeneration(
    Qwen25Layout, CompressingModelMixin, Qwen2_5_VLForConditionalGeneration
):
    """vLLM's Qwen2.5-VL with the HF path's M-RoPE layout for per-pair video items, and token compressors
    on request where the engine was started for them (`vllm_compression`)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._init_compression(self.config)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features) -> tuple[torch.Tensor, int]:
        vision = self.config.vision_config
        runs = vision_runs(mm_features, vision.spatial_merge_size)
        positions = qwen25_mrope_positions(len(input_tokens), runs, getattr(vision, "tokens_per_second", 1.0))
        return positions, int(positions.max()) + 1 - len(input_tokens)


class CompressingQwen3VLProcessor(CompressingProcessorMixin, Qwen3VLMultiModalProcessor):
    """vLLM's Qwen3-VL processor writing a compressed video's kept count in its first frame pair's slot,
    every row of the item an embedding (as vLLM's own video pruning writes it; `vllm_compression.Qwen3Layout`)."""

    def compressed_placeholders(self, item, keep: int):
        t = int(item["video_grid_thw"].data[0])
        tokenizer = self.info.get_tokenizer()
        return qwen3_video_repl(self.info.get_hf_config(), tokenizer, [keep] + [0] * (t - 1), item["timestamps"].data)


@MULTIMODAL_REGISTRY.register_processor(
    CompressingQwen3VLProcessor, info=Qwen3VLProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class ResAdaptQwen3VLForConditionalGeneration(Qwen3Layout, CompressingModelMixin, Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL with token compressors on request where the engine was started for them
    (`vllm_compression`); without them, vLLM's own class (its positions already equal the HF path's)."""

    def __init__(self, *, vllm_config, prefix: str = "model"):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._init_compression(self.config)
