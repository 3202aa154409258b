"""Token compressors inside vLLM: the request says which, the processor writes the kept count, the model compresses.

A request asks for a compressor in its prompt dict's `mm_processor_kwargs` (`request_kwargs`): method name,
retention R, seed, and a record number the engine's log answers to. vLLM passes those to
`CompressingProcessorMixin`, which attaches them to the request's one video item (a per-item field,
`COMPRESSION`) and writes floor(R N) placeholders (`kept_count`, as the HF path counts) before the
tower runs, as vLLM's EVS processor writes its own count. The model class (`CompressingModelMixin`) then,
on an engine started for compression (`ENGINE_FLAG` in `hf_overrides`):
- runs vLLM's vision tower, capturing the last block's attention inputs where the compressor reads the
  received attention and keys (`last_block_capture`, the same quantities as the HF path's
  `vision_attention.received_attention_and_keys`);
- compresses the merged tokens with the registry's compressor (one `VisualTokens` of the item's frame
  pairs, the HF path's per-pair sizes and grids, its seed), merges groups with `merge_groups`, and logs
  the kept indices, group sizes, FLOPs and seconds under the record number (`fetch_log`);
- returns the kept tokens' features with their M-RoPE positions (relative to the video's start, the
  uncompressed video's positions at the kept indices, as the HF path keeps them) in extra channels, which
  `recompute_mrope_positions` writes into the prompt's positions (vLLM's multimodal pruning path).
Text after the video keeps the uncompressed prompt's positions. The family's layout (`Qwen25Layout`,
`Qwen3Layout`) lays the item's rows out and places them.

The engine runs with chunked prefill and prefix caching off: a video's kept tokens and their positions
arrive in one prefill step. Attention-reading compressors need tensor_parallel_size=1 (the tower's heads
are split across ranks); `VLLMBackbone` refuses otherwise.
"""

from __future__ import annotations

import importlib
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
# hf_overrides key: the compressors the engine runs on request, {method name: "module:attribute" of its
# `TokenCompressor`} (`TokenCompressor.location`); absent, the model class does not compress
ENGINE_FLAG = "resadapt_token_compression"
# per row of a compressed item's embedding: its (t, h, w) position relative to the item's first, each as
# (p // 256, p % 256), exact in bfloat16 below 65536; then 1 where the row is a <|vision_start|> (Qwen3-VL)
POSITION_CHANNELS = 7


def engine_compressors(config) -> dict[str, str]:
    """The compressors an engine was started with (`ENGINE_FLAG` of its config), by method name ({}: none)."""
    return dict(getattr(config, ENGINE_FLAG, None) or {})


def load_compressor(location: str):
    """The `TokenCompressor` at "module:attribute"."""
    module, attribute = location.split(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class CompressionSetting:
    """One request's compressor: `method` (a name among the engine's compressors) at `retention`, with `seed`;
    `record`: the number its log entry is filed under; `query`: the question's token ids, for a compressor
    that reads the question's embeddings (empty otherwise)."""

    method: str
    retention: float
    seed: int
    record: int
    query: tuple[int, ...] = ()

    def request_kwargs(self) -> dict:
        """The prompt dict's `mm_processor_kwargs` asking for it."""
        setting = dict(method=self.method, retention=self.retention, seed=self.seed, record=self.record)
        return {COMPRESSION: dict(setting, query=list(self.query))}

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> CompressionSetting | None:
        value = kwargs.get(COMPRESSION)
        return None if value is None else cls(**dict(value, query=tuple(value.get("query", ()))))

    def as_tensor(self, names: list[str]) -> torch.Tensor:
        """(5 + M,) float64 [method's index in `names`, retention, seed, record, M, M query token ids]: a
        multimodal field must be a tensor (token ids and records are exact in float64)."""
        if self.method not in names:
            raise ValueError(f"this engine compresses with {', '.join(names)}; not with {self.method}")
        code = names.index(self.method)
        head = [code, self.retention, self.seed, self.record, len(self.query)]
        return torch.tensor(head + list(self.query), dtype=torch.float64)  # cpu: a processor field, kept on the host

    @classmethod
    def from_tensor(cls, value: torch.Tensor, names: list[str]) -> CompressionSetting:
        code, retention, seed, record, count, *query = value.tolist()
        if len(query) != int(count):
            raise ValueError(f"a compression setting with {int(count)} query tokens carries {len(query)}")
        return cls(names[int(code)], retention, int(seed), int(record), tuple(int(i) for i in query))

    def keep(self, num_tokens: int, num_pairs: int) -> int:
        """The tokens it keeps of `num_tokens` in `num_pairs` frame pairs (the HF path's `kept_count`)."""
        return kept_count(self.retention, num_tokens, num_pairs)


# ---------------------------------------------------------------------------------------------- processor
class CompressingProcessorMixin:
    """For a vLLM multimodal processor of a Qwen family: a request's `COMPRESSION` setting becomes a field of
    its video item and sets the item's placeholder count to the kept count."""

    def _apply_hf_processor_main(self, mm_items, hf_kwargs):
        setting = CompressionSetting.from_kwargs(hf_kwargs)
        hf_kwargs = {k: v for k, v in hf_kwargs.items() if k != COMPRESSION}
        outputs = super()._apply_hf_processor_main(mm_items, hf_kwargs)
        if setting is not None and "video_grid_thw" in outputs:
            videos = len(outputs["video_grid_thw"])
            if videos != 1:
                raise ValueError(f"a compressed request holds one video item, this one holds {videos}")
            outputs[COMPRESSION] = setting.as_tensor(sorted(engine_compressors(self.info.get_hf_config())))[None]
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

        def video_placeholders(item_idx: int):
            item = out_mm_kwargs["video"][item_idx]
            if COMPRESSION not in item:
                return stock(item_idx)
            t, h, w = item["video_grid_thw"].data.tolist()
            names = sorted(engine_compressors(self.info.get_hf_config()))
            keep = CompressionSetting.from_tensor(item[COMPRESSION].data, names).keep(t * h * w // merge**2, t)
            return self.compressed_placeholders(item, keep)

        (video,) = [u for u in updates if u.modality == "video"]
        stock = video.replacement
        compressed = PromptReplacement(modality="video", target=video.target, replacement=video_placeholders)
        return [compressed if u is video else u for u in updates]

    def compressed_placeholders(self, item, keep: int):
        """The prompt's replacement of a video item whose compressor keeps `keep` tokens."""
        return [self.info.get_hf_config().video_token_id] * keep


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


def encode_positions(positions: torch.Tensor, dtype: torch.dtype, starts: torch.Tensor | None = None) -> torch.Tensor:
    """(3, K) long positions (and (K,) bool `starts`: <|vision_start|> rows) -> (K, POSITION_CHANNELS) of `dtype`."""
    flags = torch.zeros_like(positions[0]) if starts is None else starts.long()
    return torch.cat([positions.T // 256, positions.T % 256, flags[:, None]], dim=1).to(dtype)


def decode_positions(channels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`encode_positions`' inverse: (K, POSITION_CHANNELS) -> (3, K) long positions, (K,) bool starts."""
    values = channels.float().round().long()
    return (values[:, :3] * 256 + values[:, 3:6]).T, values[:, 6] == 1


@dataclass
class LogEntry:
    """What a request's compressor did: kept token indices (sorted), group sizes, each token's destination
    (-1 dropped), its counted call."""

    kept: torch.Tensor
    sizes: torch.Tensor
    assignment: torch.Tensor
    call: CountedCall

    def summary(self) -> dict:
        return dict(
            kept=self.kept.tolist(),
            sizes=self.sizes.tolist(),
            assignment=self.assignment.tolist(),
            flops=self.call.flops,
            seconds=self.call.seconds(),
        )


class CompressingModelMixin:
    """For a vLLM Qwen model class: compresses the video items whose request asked for it (see the module
    docstring). `compresses_video`: the engine was started for it (`ENGINE_FLAG`); the worker then switches
    vLLM's multimodal pruning path on (`vllm_workers`)."""

    def _init_compression(self, config) -> None:
        self.compressors = {name: load_compressor(at) for name, at in engine_compressors(config).items()}
        self.compresses_video = bool(self.compressors)
        self.compression_log: dict[int, LogEntry] = {}
        if self.compresses_video:
            self.is_multimodal_pruning_enabled = True  # vLLM's own flag: no encoder CUDA graphs, per-item encoding

    # the family's layout (`Qwen25Layout`, `Qwen3Layout`)
    def unit_order(self, grids: torch.Tensor) -> torch.Tensor | None:
        """For each merged token of the encoder call (LLM order), its unit's index in the last block's order."""
        return None

    def split_features(self, embeds: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """An item's encoder output -> the merged tokens' features (N, D) and any more per-token features."""
        return embeds, []

    def item_rows(self, video, index: int, grid, kept, features, extra) -> torch.Tensor:
        """The rows item `index` of `video` puts into the prompt (its kept tokens' `features` and `extra`,
        `kept` their indices; None: every token) with their position channels."""
        raise NotImplementedError

    def place(self, ids: torch.Tensor, embeddings, positions: torch.Tensor) -> None:
        """Write each compressed item's positions (from its rows' channels) into the prompt's `positions`."""
        raise NotImplementedError

    def question_embeddings(self, ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """(M, D) the LLM's input embeddings of the question's token ids (the HF path's `question_embeddings`)."""
        return self.get_language_model().embed_input_ids(torch.tensor(ids, dtype=torch.long, device=device))

    def embed_multimodal(self, **kwargs):
        if not self.compresses_video:
            return super().embed_multimodal(**kwargs)
        settings = kwargs.pop(COMPRESSION, None)
        video = self._parse_and_validate_video_input(**kwargs)
        if video is None:
            raise ValueError("this engine compresses video requests; image requests run on the HF classes")
        grids = video["video_grid_thw"]
        names = sorted(self.compressors)
        chosen = [
            None if s is None else CompressionSetting.from_tensor(s, names) for s in unbatched(settings, len(grids))
        ]
        reads_attention = any(self.compressors[s.method].reads_attention for s in chosen if s is not None)
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
        out = []
        for i, (embedded, grid, setting) in enumerate(zip(embeds, grids.tolist(), chosen)):
            t, h, w = grid[0], grid[1] // merge, grid[2] // merge
            features, extra = self.split_features(embedded)
            if setting is None:  # a request without a compressor on this engine: every token
                out.append(self.item_rows(video, i, (t, h, w), None, features, extra))
                continue
            compressor = self.compressors[setting.method]
            tokens = VisualTokens(
                features=features,
                pair_sizes=[h * w] * t,
                grids=[(1, h, w)] * t,
                received_attention=received[i] if compressor.reads_attention else None,
                keys=keys[i] if compressor.reads_attention else None,
                query=self.question_embeddings(setting.query, features.device) if compressor.reads_query else None,
            )
            call = CountedCall(compressor.compress, Stopwatch(features.device))
            compression = call(tokens, setting.keep(t * h * w, t), setting.seed)
            kept, sizes, (merged, *merged_extra) = merge_groups(compression, features, *extra)
            self.compression_log[setting.record] = LogEntry(kept, sizes, compression.assignment, call)
            out.append(self.item_rows(video, i, (t, h, w), kept, merged, merged_extra))
        return tuple(out)

    def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens):
        """The prompt's positions with each compressed item's rows at the positions its channels carry
        (`place`); the features without those channels."""
        if not self.compresses_video:
            return super().recompute_mrope_positions(
                input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens
            )
        features = [e[:, :-POSITION_CHANNELS] for e in multimodal_embeddings]
        positions = mrope_positions.clone()
        if multimodal_embeddings:
            if num_computed_tokens != 0:
                raise RuntimeError("a compressing engine prefills a prompt in one step (chunked prefill is off)")
            self.place(torch.as_tensor(input_ids, device="cpu"), multimodal_embeddings, positions)  # cpu: ids
        return features, positions, int(positions.max()) + 1 - positions.shape[1]

    def fetch_log(self, records: list[int]) -> dict[int, dict]:
        """The log entries of `records` (removed from the log), as plain data."""
        return {r: self.compression_log.pop(r).summary() for r in records if r in self.compression_log}


def unbatched(settings, count: int) -> list:
    """The per-item settings vLLM batched (a (count, 5 + M) tensor, a list of such rows, or None)."""
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


class Qwen25Layout:
    """Qwen2.5-VL: a video item is one run of placeholders; positions by `mrope.qwen25_mrope_positions`
    (the HF adapter's rule); the tower's blocks run in window order."""

    def item_rows(self, video, index, grid, kept, features, extra):
        t, h, w = grid
        seconds = video.get("second_per_grid_ts")
        run = VisionRun(0, [(1, h, w)] * t, [float(seconds[index]) if seconds is not None else 1.0] * t)
        positions = qwen25_mrope_positions(run.num_tokens, [run], self.config.vision_config.tokens_per_second)
        positions = positions.to(features.device)
        positions = positions if kept is None else positions[:, kept]
        return torch.cat([features, encode_positions(positions, features.dtype)], dim=1)

    def place(self, ids, embeddings, positions):
        """Each run of video placeholders: one past the `<|vision_start|>` before it, plus its item's positions."""
        runs = video_runs(ids == self.config.video_token_id)
        if len(runs) != len(embeddings):
            raise RuntimeError(f"{len(runs)} video runs in the prompt, {len(embeddings)} video items")
        for (start, length), embedding in zip(runs, embeddings):
            relative, _ = decode_positions(embedding[:, -POSITION_CHANNELS:])
            if relative.shape[1] != length:
                raise RuntimeError(f"a video run of {length} placeholders got {relative.shape[1]} tokens")
            positions[:, start : start + length] = positions[0, start - 1] + 1 + relative.to(positions.device)

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


class Qwen3Layout:
    """Qwen3-VL: a video item is, per frame pair, its timestamp's text, `<|vision_start|>`, its tokens and
    `<|vision_end|>`. As for vLLM's own video pruning, the prompt holds the kept count in the first pair's
    slot and the model returns every row of the item (text and video, `item_rows`), the kept tokens in their
    own pairs; the positions are the uncompressed item's (vLLM's Qwen3-VL rule, the HF path's) at the rows
    kept; the text after the item keeps the uncompressed prompt's positions (`place`). The merged tokens
    carry their DeepStack features, merged with the same groups."""

    def split_features(self, embeds):
        main, deepstack = embeds.split([self.visual_dim, self.multiscale_dim], dim=-1)
        return main, [deepstack]

    def item_rows(self, video, index, grid, kept, features, extra):
        from vllm.model_executor.models.utils import _merge_multimodal_embeddings

        t, h, w = grid
        device, config = features.device, self.config
        kept = torch.arange(t * h * w, device=device) if kept is None else kept
        counts = torch.bincount(kept // (h * w), minlength=t).tolist()  # kept tokens per frame pair
        timestamps = video.timestamps[index]

        def repl(per_pair):
            rows = qwen3_video_repl(config, self._tokenizer, per_pair, timestamps).full
            return torch.tensor(rows)  # cpu: token ids of the item's rows

        ids, full_ids = repl(counts), repl([h * w] * t)
        full = self.uncompressed_positions(full_ids.tolist(), grid)  # (3, rows of the whole item)
        is_video, full_is_video = ids == config.video_token_id, full_ids == config.video_token_id
        positions = torch.empty(3, len(ids), dtype=torch.long)  # cpu: as `full`
        positions[:, ~is_video] = full[:, ~full_is_video]
        positions[:, is_video] = full[:, full_is_video][:, kept.cpu()]
        ids, is_video = ids.to(device), is_video.to(device)
        text = self.get_language_model().embed_input_ids(ids)
        deepstack, (main,) = self._compute_deepstack_embeds(
            inputs_embeds=text, multimodal_embeddings=[torch.cat([features, *extra], dim=-1)], is_multimodal=is_video
        )
        rows = _merge_multimodal_embeddings(inputs_embeds=text, multimodal_embeddings=[main], is_multimodal=is_video)
        deepstack = deepstack.permute(1, 0, 2).reshape(len(ids), -1)
        starts = ids == config.vision_start_token_id
        return torch.cat([rows, deepstack, encode_positions(positions.to(device), rows.dtype, starts)], dim=1)

    def uncompressed_positions(self, ids: list[int], grid) -> torch.Tensor:
        """(3, len(ids)) positions of a whole video item's rows from its first, by vLLM's Qwen3-VL rule."""
        from vllm.multimodal.inputs import (
            MultiModalFeatureSpec,
            MultiModalFieldConfig,
            MultiModalFieldElem,
            MultiModalKwargsItem,
            PlaceholderRange,
        )

        t, h, w = grid
        merge = self.visual.spatial_merge_size
        feature = MultiModalFeatureSpec(
            data=MultiModalKwargsItem(
                {
                    "video_grid_thw": MultiModalFieldElem(
                        data=torch.tensor([t, h * merge, w * merge]),  # cpu: a field, as vLLM's processor makes it
                        field=MultiModalFieldConfig.batched("video").field,
                    )
                }
            ),
            modality="video",
            identifier="compressed",
            mm_position=PlaceholderRange(offset=0, length=len(ids)),
        )
        return self.get_mrope_input_positions(input_tokens=ids, mm_features=[feature])[0]

    def place(self, ids, embeddings, positions):
        """The item's rows start where its prompt slot does (the first video placeholder less the rows before
        the first `<|vision_start|>` and itself); the text after continues from the item's last position."""
        (embedding,) = embeddings  # one video per compressed request
        relative, starts = decode_positions(embedding[:, -POSITION_CHANNELS:])
        first_start = int(torch.nonzero(starts)[0])
        start = int(torch.nonzero(ids == self.config.video_token_id)[0]) - first_start - 1
        end = start + relative.shape[1]
        base = positions[0, start - 1] + 1
        positions[:, start:end] = base + relative.to(positions.device)
        if end < positions.shape[1]:
            positions[:, end:] += base + int(relative[0, -1]) + 1 - positions[0, end]


def qwen3_video_repl(config, tokenizer, tokens_per_pair: list[int], timestamps):
    """vLLM's Qwen3-VL rows of a video item (`get_video_repl`: per pair its timestamp's text,
    `<|vision_start|>`, its tokens, `<|vision_end|>`) with `tokens_per_pair` video tokens."""
    from vllm.model_executor.models.qwen3_vl import Qwen3VLMultiModalProcessor

    return Qwen3VLMultiModalProcessor.get_video_repl(
        tokens_per_frame=tokens_per_pair,
        timestamps=timestamps,
        tokenizer=tokenizer,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id,
        video_token_id=config.video_token_id,
    )


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
