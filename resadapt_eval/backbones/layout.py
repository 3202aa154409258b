"""How a plan becomes model inputs, without a model: the part every engine shares.

A plan gives every frame pair its own size. Each pair becomes its own 2-frame video item with
one `video_grid_thw` row (1, h_k, w_k); the prompt keeps the stock single
`<|vision_start|> ... <|vision_end|>` block with one `<|video_pad|>` per pair, which the
processor expands to exactly the plan's tokens. A `QwenLayout` holds the processor and the
checkpoint's config (no weights): the HF backbone (`qwen.py`) and the vLLM engine
(`vllm_engine.py`) both build their requests from it.

`Backbone` is what the pipeline needs from an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.functional import resize
from torchvision.transforms.v2.functional import resize as resize_uint8
from transformers.video_utils import VideoMetadata

from ..budget.plan import QWEN3VL_GRID, QWEN25VL_GRID, ResizePlan, TokenGrid
from ..video import DecodedVideo

VIDEO_PAD = "<|video_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_TOKEN_TYPE = 2  # mm_token_type_ids: text 0, image 1, video 2


RESIZES = ("exact", "fast")  # model_args resize=: how frames are resized to their planned sizes
RESIZE_CHUNK_BYTES = 256 * 2**20  # the float32 copy of the source frames one resize call may hold


def resize_frames(
    frames: np.ndarray, height: int, width: int, mode: str = "exact", device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Bicubic, antialiased resize of uint8 frames (T, H, W, 3) to (T, 3, height, width) uint8 on
    the CPU, computed on `device` (the model's; a CUDA device resizes there), in chunks whose float32
    copy stays within `RESIZE_CHUNK_BYTES`.
    exact: torchvision's v1 `resize`, in float arithmetic, the interpolation qwen-vl-utils uses when
    it fetches videos (on CUDA the same float operations: within one uint8 level of the CPU's);
    fast: torchvision v2's uint8 kernel on the same frames, several times faster on CPU, its pixels
    a few uint8 levels off exact's (`benchmarks/method_cost.py` measures both)."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    if video.shape[-2:] == (height, width):
        return video
    chunk = max(1, RESIZE_CHUNK_BYTES // (4 * video[0].numel()))
    return torch.cat([_resized(part.to(device), height, width, mode).cpu() for part in video.split(chunk)])


def _resized(video: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    if mode == "fast":  # its uint8 kernel reads (T, 3, H, W) contiguous frames
        return resize_uint8(
            video.contiguous(), [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True
        )
    return resize(video, [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True)


def resize_pairs(
    video: DecodedVideo, plan: ResizePlan, mode: str = "exact", device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """Each pair's frames (2, 3, h, w) uint8 at its planned size in pixels, on the CPU
    (`resize_frames`' `mode`, computed on `device`): the frames of every pair of one size resized in
    one batch."""
    by_size: dict[tuple[int, int], list[int]] = {}
    for k, hw in enumerate(plan.pair_sizes):
        by_size.setdefault(tuple(hw), []).append(k)
    pairs: list[torch.Tensor] = [None] * len(plan.pair_sizes)
    for (h, w), members in by_size.items():
        groups = [list(plan.pair_frames[k]) for k in members]
        resized = resize_frames(video.frames[[i for g in groups for i in g]], h, w, mode, device)
        for k, part in zip(members, resized.split([len(g) for g in groups])):
            pairs[k] = part
    return pairs


class QwenLayout:
    """A Qwen family's input layout: token grid, processor, per-pair metadata and resizing.

    processor: the checkpoint's `AutoProcessor`; config: its model config (for
    `vision_config`), loadable without weights (`AutoConfig`).
    """

    family: str
    model_type: str  # the checkpoint config's `model_type`
    grid: TokenGrid

    def __init__(self, processor, config):
        self.check(config)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.config = config

    @classmethod
    def check(cls, config) -> None:
        """Refuse a checkpoint config of another model family (before any weights are loaded)."""
        if config.model_type != cls.model_type:
            raise ValueError(
                f"the checkpoint is a {config.model_type} model; {cls.family} needs a {cls.model_type} checkpoint"
            )

    @property
    def temporal_patch(self) -> int:
        return self.processor.video_processor.temporal_patch_size

    def placeholder_id(self, images: bool) -> int:
        """Token id of one visual placeholder in the prompt: image or video."""
        return self.processor.image_token_id if images else self.processor.video_token_id

    def video_prompt(self, prompt: str, num_pairs: int) -> str:
        """Chat text with one `<|video_pad|>` -> one placeholder per pair (the processor expands each)."""
        if prompt.count(VIDEO_PAD) != 1:
            raise ValueError(f"the prompt must hold exactly one {VIDEO_PAD}, found {prompt.count(VIDEO_PAD)}")
        return prompt.replace(VIDEO_PAD, VIDEO_PAD * num_pairs)

    def resized_pairs(
        self, video: DecodedVideo, plan: ResizePlan, mode: str = "exact", device: torch.device | str = "cpu"
    ) -> list[torch.Tensor]:
        """`resize_pairs` of `video` under `plan`."""
        return resize_pairs(video, plan, mode, device)

    def resized_images(
        self, images: list[np.ndarray], plans: list[ResizePlan], mode: str = "exact", device: torch.device | str = "cpu"
    ) -> list[torch.Tensor]:
        """Each uint8 image (H, W, 3) at its one-pair plan's size, (3, h, w) uint8 on the CPU."""
        return [resize_frames(image[None], *plan.pair_sizes[0], mode, device)[0] for image, plan in zip(images, plans)]

    def pair_metadata(self, video: DecodedVideo, plan: ResizePlan) -> list[VideoMetadata]:
        raise NotImplementedError

    def video_metadata(self, video: DecodedVideo) -> VideoMetadata:
        """Metadata of `video`'s frames as one stock video item (uniformly sampled frames)."""
        raise NotImplementedError


class Qwen25VLLayout(QwenLayout):
    family = "qwen25vl"
    model_type = "qwen2_5_vl"
    grid = QWEN25VL_GRID

    def pair_metadata(self, video: DecodedVideo, plan: ResizePlan) -> list[VideoMetadata]:
        """One 2-frame item per pair whose frame rate makes the processor's `second_per_grid_ts`
        the seconds from this pair's first frame to the next pair's: 2 / sampled_fps for
        uniformly spaced frames (the stock single-video value); after frame selection, the real
        gaps (the last pair takes 2 / sampled_fps of the kept frames)."""
        tail = self.temporal_patch / video.sampled_fps
        seconds = [(video.indices[group[0]] - video.indices[0]) / video.fps for group in plan.pair_frames]
        gaps = (
            [b - a for a, b in zip(seconds[:-1], seconds[1:])] + [tail] if not video.uniform else [tail] * len(seconds)
        )
        return [VideoMetadata(total_num_frames=2, fps=self.temporal_patch / gap, frames_indices=[0, 1]) for gap in gaps]

    def video_metadata(self, video: DecodedVideo) -> VideoMetadata:
        """The sampled frames at their sampling rate: `second_per_grid_ts` = 2 / sampled_fps."""
        n = len(video.indices)
        return VideoMetadata(total_num_frames=n, fps=video.sampled_fps, frames_indices=list(range(n)))


class Qwen3VLLayout(QwenLayout):
    family = "qwen3vl"
    model_type = "qwen3_vl"
    grid = QWEN3VL_GRID

    def pair_metadata(self, video: DecodedVideo, plan: ResizePlan) -> list[VideoMetadata]:
        """Frame indices of the pair in the file, so the processor writes the stock timestamp
        (mean of the pair's frame times) before each pair."""
        return [
            VideoMetadata(
                total_num_frames=video.total_frames, fps=video.fps, frames_indices=[video.indices[i] for i in group]
            )
            for group in plan.pair_frames
        ]

    def video_metadata(self, video: DecodedVideo) -> VideoMetadata:
        """The frames' indices in the file: the stock timestamps before each pair."""
        return VideoMetadata(total_num_frames=video.total_frames, fps=video.fps, frames_indices=list(video.indices))


LAYOUTS = {layout.family: layout for layout in (Qwen25VLLayout, Qwen3VLLayout)}


@dataclass(frozen=True)
class EngineOutput:
    """One request answered by an engine: text, the engine's own prompt token ids, generated
    tokens; first_token_s: seconds from the engine starting it to its first token (vision tower
    and prefill); per_token_s: seconds per later token; vision_s: the vision tower's seconds
    (None where the engine does not expose its tower); peak_memory_mb (`measure.clock`);
    layer_visual_tokens: visual tokens in each decoder layer, for a method that prunes inside the
    LLM (None otherwise), and method_flops: the FLOPs its ranking ran; decode_keys_dropped: key
    columns a decoding-time pruner kept its steps from attending to, summed over layers and steps;
    rank_s: seconds an in-LLM or decoding-time pruner's own ranking and selection took (None without
    one); prefill_s: the LLM's prefill alone, first_token_s less the vision tower and a prefill
    pruner's rank_s (None where the engine does not expose its tower); merged_sizes, compress_s and
    assignment: a compressor that ran inside the engine (vLLM's): its group sizes, seconds and each
    token's destination (-1 dropped; None otherwise; the HF path reports them when it builds the inputs);
    held_stages: for a pruner inside the LLM, (layer, the visual tokens held from that layer on, as
    ordinals among those that entered) for each layer whose input it reduced (None without one)."""

    text: str
    prompt_ids: list[int]
    output_tokens: int
    first_token_s: float | None = None
    per_token_s: float | None = None
    vision_s: float | None = None
    peak_memory_mb: float | None = None
    layer_visual_tokens: list[int] | None = None
    method_flops: int = 0
    decode_keys_dropped: int = 0
    rank_s: float | None = None
    prefill_s: float | None = None
    merged_sizes: list[int] | None = None
    compress_s: float | None = None
    assignment: list[int] | None = None
    held_stages: list[tuple[int, list[int]]] | None = None


class Backbone(Protocol):
    """What `VideoPipeline` needs from an engine (the HF adapter, `VLLMBackbone`).

    layout: its `QwenLayout`; device: where the Allocator runs; serves_images: it answers image
    requests. `build_*` return the engine's request for one sample, from frames already resized by
    the layout; `generate_batch` answers several, an `EngineOutput` each. vision_timer: times the
    vision tower where it runs outside `generate_batch` (a compressor's encode); None where the
    engine does not expose its tower.

    compresses_tokens: it runs AFTER_MERGER and INSIDE_LLM methods (`build_compressed_inputs`, and
    `pruned_inputs` / `decode_pruned_inputs` with the stages of the sample's `TokenBudget`, sized by
    the LLM's `num_text_layers` and `first_prunable_layer`; the HF adapter).
    compresses_in_engine: it runs a COMPRESSOR method's compressor inside its own model on request
    (`build_compressed_request`; what it kept comes back in `EngineOutput`: vLLM's engine started for it).
    video_pruning_method / video_pruning_rate: the engine's own video pruning (an IN_ENGINE
    method's `engine_pruning`) and the fraction of video tokens it drops, None when it has none;
    where it has one, `pruned_visual_tokens(plan)` counts the tokens of `plan` it keeps
    (`VLLMBackbone`).
    """

    layout: QwenLayout
    device: torch.device
    compresses_tokens: bool
    compresses_in_engine: bool
    vision_timer: object | None
    serves_images: bool
    video_pruning_method: str | None
    video_pruning_rate: float | None

    def pruned_visual_tokens(self, plan: ResizePlan) -> int: ...

    def build_inputs(
        self, prompt: str, video: DecodedVideo, plan: ResizePlan, pairs: list[torch.Tensor] | None = None
    ): ...

    def build_image_inputs(
        self, prompt: str, images: list[np.ndarray], plans: list[ResizePlan], resized: list[torch.Tensor] | None = None
    ): ...

    def build_compressed_inputs(
        self,
        prompt: str,
        video: DecodedVideo,
        plan: ResizePlan,
        compress,
        retention: float,
        seed: int = 0,
        needs_attention: bool = False,
        pairs: list[torch.Tensor] | None = None,
    ): ...

    def generate_batch(self, requests: list, gen_kwargs: list[dict]) -> list[EngineOutput]: ...
