"""Token compressors inside vLLM: the request says which, the processor writes the kept count, the model compresses.

A request asks for a compressor in its prompt dict's `mm_processor_kwargs` (`request_kwargs`): method name,
retention R, seed, and a record number the engine's log answers to. vLLM passes those to
`CompressingProcessorMixin`, which attaches them to the request's one video item (a per-item field,
`COMPRESSION`) and writes floor(R N) placeholders (`kept_count`, as the HF path counts) before the
tower runs, as vLLM's EVS processor writes its own count. The model class (`CompressingModelMixin`) then,
on an engine started for compression (`ENGINE_FLAG` in `hf_overrides`):
- runs vLLM's vision tower, capturing the last block's attention inputs where the compressor reads the
  received attention and keys (`LastBlockCapture`, the same quantities as the HF path's
  `vision_attention.received_attention_and_keys`);
- compresses the merged tokens with the registry's compressor (one `VisualTokens` of the item's frame
  pairs, the HF path's per-pair sizes and grids, its seed), merges groups with `merge_groups`, and logs
  the kept indices, group sizes, FLOPs and seconds under the record number (`fetch_log`);
- returns the kept tokens' features with their M-RoPE positions (relative to the video's start, the
  uncompressed video's positions at the kept indices, as the HF path keeps them) in extra channels, which
  `recompute_mrope_positions` writes into the prompt's positions (vLLM's multimodal pruning path).
Text after the video keeps the uncompressed prompt's positions (`mrope.VisionRun.placeholders`).

The engine runs with chunked prefill and prefix caching off: a video's kept tokens and their positions
arrive in one prefill step. Attention-reading compressors need tensor_parallel_size=1 (the tower's heads
are split across ranks); `VLLMBackbone` refuses otherwise.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..baselines import VisualTokens, kept_count, merge_groups
from ..measure.clock import Stopwatch
from ..measure.counting import CountedCall
from .mrope import VisionRun, qwen25_mrope_positions
from .vision_attention import per_unit, received_attention

COMPRESSION = "resadapt_compression"  # the request's mm_processor_kwargs key and the video item's field
ENGINE_FLAG = "resadapt_token_compression"  # hf_overrides key: the model class compresses on request
POSITION_CHANNELS = 6  # (t, h, w) positions, each as (p // 256, p % 256): exact in bfloat16 below 65536


def compressor_names() -> list[str]:
    """The methods a vLLM engine compresses with (a setting names one by its index here)."""
    from ..methods import METHODS

    return sorted(name for name, method in METHODS.items() if method.vllm_compressor)


@dataclass(frozen=True)
class CompressionSetting:
    """One request's compressor: `method` (a `compressor_names` name) at `retention`, with `seed`;
    `record`: the number its log entry is filed under."""

    method: str
    retention: float
    seed: int
    record: int

    def request_kwargs(self) -> dict:
        """The prompt dict's `mm_processor_kwargs` asking for it."""
        return {COMPRESSION: dict(method=self.method, retention=self.retention, seed=self.seed, record=self.record)}

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> CompressionSetting | None:
        value = kwargs.get(COMPRESSION)
        return None if value is None else cls(**value)

    def as_tensor(self) -> torch.Tensor:
        """(4,) float64 [method index, retention, seed, record]: a multimodal field must be a tensor."""
        code = compressor_names().index(self.method)
        return torch.tensor([code, self.retention, self.seed, self.record], dtype=torch.float64)  # cpu: a field

    @classmethod
    def from_tensor(cls, value: torch.Tensor) -> CompressionSetting:
        code, retention, seed, record = value.tolist()
        return cls(compressor_names()[int(code)], retention, int(seed), int(record))

    def keep(self, num_tokens: int, num_pairs: int) -> int:
        """The tokens it keeps of `num_tokens` in `num_pairs` frame pairs (the HF path's `kept_count`)."""
        return kept_count(self.retention, num_tokens, num_pairs)


# ---------------------------------------------------------------------------------------------- processor
class CompressingProcessorMixin:
    """For a vLLM multimodal processor of a Qwen family: a request's `COMPRESSION` setting becomes a field of
    its video item and sets the item's placeholder count to the kept count."""

    def _call_hf_processor(self, hf_data, hf_kwargs):
        setting = CompressionSetting.from_kwargs(hf_kwargs)
        hf_kwargs = {k: v for k, v in hf_kwargs.items() if k != COMPRESSION}
        outputs = super()._call_hf_processor(hf_data, hf_kwargs)
        if setting is not None and "video_grid_thw" in outputs:
            videos = len(outputs["video_grid_thw"])
            if videos != 1:
                raise ValueError(f"a compressed request holds one video item, this one holds {videos}")
            outputs[COMPRESSION] = setting.as_tensor()[None]
        return outputs

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
        from vllm.multimodal.inputs import MultiModalFieldConfig

        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))
        if COMPRESSION in hf_inputs:
            fields[COMPRESSION] = MultiModalFieldConfig.batched("video", keep_on_cpu=True)
        return fields

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        from vllm.multimodal.processing import PromptReplacement

        kwargs = {k: v for k, v in hf_processor_mm_kwargs.items() if k != COMPRESSION}
        updates = super()._get_prompt_updates(mm_items, kwargs, out_mm_kwargs)
        merge = self.info.get_hf_config().vision_config.spatial_merge_size
        video_token = self.info.get_hf_config().video_token_id

        def video_placeholders(item_idx: int) -> list[int]:
            item = out_mm_kwargs["video"][item_idx]
            t, h, w = item["video_grid_thw"].data.tolist()
            tokens = t * h * w // merge**2
            if COMPRESSION in item:
                tokens = CompressionSetting.from_tensor(item[COMPRESSION].data).keep(tokens, t)
            return [video_token] * tokens

        return [
            update
            if update.modality != "video"
            else PromptReplacement(modality="video", target=update.target, replacement=video_placeholders)
            for update in updates
        ]


# ---------------------------------------------------------------------------------------------- model
@contextmanager
def last_block_capture(visual):
    """During a forward of vLLM's Qwen vision tower `visual`: its last block's pre-rotary qkv projection and
    the rotated queries and keys its attention kernel receives, with the segments (`cu_seqlens`)."""
    attn, captured = visual.blocks[-1].attn, {}

    def projection(module, args, output):
        captured["qkv"] = output[0] if isinstance(output, tuple) else output  # (L, 1, 3 * heads * head_dim)

    def kernel(module, args, kwargs):
        captured.update(query=kwargs["query"], key=kwargs["key"], cu_seqlens=kwargs["cu_seqlens"])

    hooks = [attn.qkv.register_forward_hook(projection), attn.attn.register_forward_pre_hook(kernel, with_kwargs=True)]
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()


def captured_scores(captured: dict, merge_unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) received attention and (N, head_dim) pre-rotary keys per merge unit, in the block's order,
    from `last_block_capture` (the quantities `vision_attention.received_attention_and_keys` computes)."""
    query, key = captured["query"][0], captured["key"][0]  # (L, heads, head_dim), rotated
    heads, head_dim = key.shape[1:]
    qkv = captured["qkv"].reshape(key.shape[0], 3, heads, head_dim)
    keys = qkv[:, 1].float().mean(dim=1)
    received = received_attention(query, key, captured["cu_seqlens"], head_dim**-0.5)
    return per_unit(received, merge_unit), per_unit(keys, merge_unit)


def encode_positions(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(3, K) long positions -> (K, POSITION_CHANNELS) channels of `dtype`, exact below 65536."""
    return torch.cat([positions.T // 256, positions.T % 256], dim=1).to(dtype)


def decode_positions(channels: torch.Tensor) -> torch.Tensor:
    """`encode_positions`' inverse: (K, POSITION_CHANNELS) -> (3, K) long."""
    values = channels.float().round().long()
    return (values[:, :3] * 256 + values[:, 3:]).T


@dataclass
class LogEntry:
    """What a request's compressor did: kept token indices (sorted), group sizes, its counted call."""

    kept: torch.Tensor
    sizes: torch.Tensor
    call: CountedCall

    def summary(self) -> dict:
        return dict(
            kept=self.kept.tolist(), sizes=self.sizes.tolist(), flops=self.call.flops, seconds=self.call.seconds()
        )


class CompressingModelMixin:
    """For a vLLM Qwen model class: compresses the video items whose request asked for it (see the module
    docstring). `compresses_video`: the engine was started for it (`ENGINE_FLAG`); the worker then switches
    vLLM's multimodal pruning path on (`vllm_workers`)."""

    def _init_compression(self, config) -> None:
        self.compresses_video = bool(getattr(config, ENGINE_FLAG, False))
        self.compression_log: dict[int, LogEntry] = {}
        if self.compresses_video:
            self.is_multimodal_pruning_enabled = True  # vLLM's own flag: no encoder CUDA graphs, per-item encoding

    def item_positions(self, grid: tuple[int, int, int], second_per_grid_t: float) -> torch.Tensor:
        """(3, N) M-RoPE positions of a video item's merged tokens relative to the video's first position."""
        raise NotImplementedError

    def unit_order(self, grids: torch.Tensor) -> torch.Tensor | None:
        """For each merged token of the encoder call (LLM order), its unit's index in the last block's order."""
        return None

    def embed_multimodal(self, **kwargs):
        if not self.compresses_video:
            return super().embed_multimodal(**kwargs)
        settings = kwargs.pop(COMPRESSION, None)
        video = self._parse_and_validate_video_input(**kwargs)
        if video is None:
            raise ValueError("this engine compresses video requests; image requests run on the HF classes")
        grids = video["video_grid_thw"]
        chosen = [None if s is None else CompressionSetting.from_tensor(s) for s in unbatched(settings, len(grids))]
        methods = {s.method: get_method(s.method) for s in chosen if s is not None}
        reads_attention = any(m.needs_attention for m in methods.values())
        merge = self.visual.spatial_merge_size
        with last_block_capture(self.visual) if reads_attention else nullcontext({}) as captured:
            embeds = self._process_video_input(video)
        if reads_attention:
            received, keys = captured_scores(captured, merge**2)
            order = self.unit_order(grids)
            if order is not None:
                received, keys = received[order], keys[order]
            per_item = [e.shape[0] for e in embeds]
            received, keys = received.split(per_item), keys.split(per_item)
        seconds = video.get("second_per_grid_ts")
        out = []
        for i, (features, grid, setting) in enumerate(zip(embeds, grids.tolist(), chosen)):
            t, h, w = grid[0], grid[1] // merge, grid[2] // merge
            positions = self.item_positions((t, h, w), float(seconds[i]) if seconds is not None else 1.0)
            positions = positions.to(features.device)
            if setting is None:  # a request without a compressor on this engine: every token, its own position
                out.append(torch.cat([features, encode_positions(positions, features.dtype)], dim=1))
                continue
            method = methods[setting.method]
            tokens = VisualTokens(
                features=features,
                pair_sizes=[h * w] * t,
                grids=[(1, h, w)] * t,
                received_attention=received[i] if method.needs_attention else None,
                keys=keys[i] if method.needs_attention else None,
            )
            call = CountedCall(method.compress, Stopwatch(features.device))
            compression = call(tokens, setting.keep(t * h * w, t), setting.seed)
            kept, sizes, (merged,) = merge_groups(compression, features)
            self.compression_log[setting.record] = LogEntry(kept, sizes, call)
            out.append(torch.cat([merged, encode_positions(positions[:, kept], merged.dtype)], dim=1))
        return tuple(out)

    def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens):
        """Each video run of placeholders takes its item's positions: the first video position (one past the
        `<|vision_start|>` before it) plus the item's relative positions; every other token keeps its own."""
        if not self.compresses_video:
            return super().recompute_mrope_positions(
                input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens
            )
        features = [e[:, :-POSITION_CHANNELS] for e in multimodal_embeddings]
        positions = mrope_positions.clone()
        if multimodal_embeddings:
            if num_computed_tokens != 0:
                raise RuntimeError("a compressing engine prefills a prompt in one step (chunked prefill is off)")
            ids = torch.as_tensor(input_ids, device="cpu")  # cpu: the prompt's runs are located on the host
            runs = video_runs(ids == self.config.video_token_id)
            if len(runs) != len(multimodal_embeddings):
                raise RuntimeError(f"{len(runs)} video runs in the prompt, {len(multimodal_embeddings)} video items")
            for (start, length), embedding in zip(runs, multimodal_embeddings):
                relative = decode_positions(embedding[:, -POSITION_CHANNELS:]).to(positions.device)
                if relative.shape[1] != length:
                    raise RuntimeError(f"a video run of {length} placeholders got {relative.shape[1]} tokens")
                positions[:, start : start + length] = positions[0, start - 1] + 1 + relative
        return features, positions, int(positions.max()) + 1 - positions.shape[1]

    def fetch_log(self, records: list[int]) -> dict[int, dict]:
        """The log entries of `records` (removed from the log), as plain data."""
        return {r: self.compression_log.pop(r).summary() for r in records if r in self.compression_log}


def unbatched(settings, count: int) -> list:
    """The per-item settings vLLM batched (a (count, 4) tensor, a list of (4,) tensors, or None)."""
    if settings is None:
        return [None] * count
    return list(settings) if not isinstance(settings, torch.Tensor) or settings.dim() == 2 else [settings]


def video_runs(is_video: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive True in `is_video` (L,)."""
    runs, position = [], 0
    for value, group in itertools.groupby(is_video.tolist()):
        length = len(list(group))
        if value:
            runs.append((position, length))
        position += length
    return runs


def get_method(name: str):
    from ..methods import get_method as registry

    return registry(name)


class Qwen25Positions:
    """Qwen2.5-VL's item positions (`mrope.qwen25_mrope_positions`) and the tower's window order."""

    def item_positions(self, grid, second_per_grid_t):
        t, h, w = grid
        run = VisionRun(offset=0, grids=[(1, h, w)] * t, second_per_grid_ts=[second_per_grid_t] * t)
        tokens_per_second = self.config.vision_config.tokens_per_second
        return qwen25_mrope_positions(run.num_tokens, [run], tokens_per_second)

    def unit_order(self, grids):
        from transformers.vision_utils import get_vision_window_index

        vision = self.config.vision_config
        window_index, _ = get_vision_window_index(
            grids.cpu(),
            spatial_merge_size=vision.spatial_merge_size,
            window_size=vision.window_size,
            patch_size=vision.patch_size,
        )
        return torch.argsort(window_index)


class PruningWorkerMixin:
    """For a vLLM worker class: after loading the model, vLLM's multimodal pruning path on where the model
    prunes (vLLM's own video pruning, or compression on request); `compression_log`, the model's log,
    reached through `LLM.collective_rpc("compression_log", ...)`."""

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        runner = self.model_runner
        runner.is_multimodal_pruning_enabled = prunes_video(runner.get_model(), self.model_config)

    def compression_log(self, records: list[int]) -> dict[int, dict]:
        model = self.model_runner.get_model()
        return model.fetch_log(records) if getattr(model, "compresses_video", False) else {}


def prunes_video(model, model_config) -> bool:
    """Whether vLLM's model runner takes its multimodal pruning path for `model`: vLLM's own video
    pruning is set, or the model compresses on request (`ENGINE_FLAG`)."""
    from vllm.model_executor.models.interfaces import supports_multimodal_pruning

    mm_config = model_config.multimodal_config
    configured = mm_config is not None and mm_config.is_multimodal_pruning_enabled()
    return supports_multimodal_pruning(model) and (configured or getattr(model, "compresses_video", False))
