"""Qwen2.5-VL / Qwen3-VL on transformers: a plan laid out by `layout.py` -> model inputs -> generation.

Positions: Qwen3-VL's stock rope already gives every pair its own temporal group (the processor
writes a `<t seconds>` timestamp per pair). Qwen2.5-VL's stock rope treats a run of video tokens
as one video, so `Qwen25VLAdapter` builds the M-RoPE positions itself (`mrope.py`, shared with the
vLLM engine): pair k keeps the stock temporal index of pair k, and its h/w indices span its own
merged grid.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, LogitsProcessorList
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision as qwen25_vision_rotary
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision as qwen3_vision_rotary
from transformers.vision_utils import get_vision_window_index

from ..budget.plan import ResizePlan
from ..measure.clock import FirstLogits, ModuleTimer, Stopwatch, peak_memory_mb, reset_peak_memory
from ..video import DecodedVideo
from .decode_pruning import DecodePruner
from .layer_pruning import FusionPruner, LayerPruner
from .layout import IMAGE_PAD, VIDEO_TOKEN_TYPE, EngineOutput, Qwen3VLLayout, Qwen25VLLayout, QwenLayout
from .mrope import VisionRun, qwen25_mrope_positions
from .tower_reduction import TowerPruner, TowerReducer
from .vision_attention import last_block_input, received_attention_and_keys


@dataclass(frozen=True)
class PrunedInputs:
    """Model inputs and the pruner `generate_batch` attaches while generating them."""

    inputs: dict
    pruner: LayerPruner | DecodePruner


class QwenVideoAdapter:
    """The HF backbone (`layout.Backbone`): a loaded model and its layout. Subclasses fix the
    layout and the position rule."""

    layout_cls: type[QwenLayout]
    compresses_tokens = True
    compresses_in_engine = False
    serves_images = True
    video_pruning_method = video_pruning_rate = None

    def __init__(self, model, processor):
        self.model = model
        self.layout = self.layout_cls(processor, model.config)
        self.processor, self.tokenizer, self.grid = processor, processor.tokenizer, self.layout.grid
        self.stopwatch = Stopwatch(model.device)
        self.vision_timer = ModuleTimer(model.model.visual, self.stopwatch)

    @classmethod
    def from_pretrained(
        cls, path: str, device: str = "cpu", dtype: str = "auto", attn_implementation: str | None = None
    ):
        """Load model and processor from a `save_pretrained` folder or hub id."""
        config = AutoConfig.from_pretrained(path)
        cls.layout_cls.check(config)  # a checkpoint of the other family stops before its weights load
        if attn_implementation == "flash_attention_2":
            check_flash_attention(dtype, config)
        kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForImageTextToText.from_pretrained(path, config=config, **kwargs).to(device).eval()
        return cls(model, AutoProcessor.from_pretrained(path))

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ------------------------------------------------------------------ inputs
    def build_inputs(
        self, prompt: str, video: DecodedVideo, plan: ResizePlan, pairs: list[torch.Tensor] | None = None
    ) -> dict:
        """Tokenised prompt with the video realised at the plan's per-pair sizes.

        `prompt` is chat-formatted text holding one `<|video_pad|>` where the video goes; `pairs`
        the frames already resized by `layout.resized_pairs` (resized here when omitted).
        Returns tensors for `model.generate` (batch of one).
        """
        text = self.layout.video_prompt(prompt, len(plan.pair_sizes))
        pairs = pairs if pairs is not None else self.layout.resized_pairs(video, plan)
        inputs = self.processor(
            text=[text],
            videos=pairs,
            video_metadata=self.layout.pair_metadata(video, plan),
            do_resize=False,
            do_sample_frames=False,
            return_tensors="pt",
        )
        placeholders = int((inputs["input_ids"] == self.processor.video_token_id).sum())
        if placeholders != plan.visual_tokens:
            raise RuntimeError(
                f"processor wrote {placeholders} video placeholders, the plan counts {plan.visual_tokens}"
            )
        inputs = inputs.to(self.device)
        if "pixel_values_videos" in inputs:
            inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(self.model.dtype)
        positions = self.position_ids(inputs, plan, video)
        if positions is not None:
            inputs["position_ids"] = positions
        return dict(inputs)

    def build_image_inputs(
        self, prompt: str, images: list[np.ndarray], plans: list[ResizePlan], resized: list[torch.Tensor] | None = None
    ) -> dict:
        """Tokenised prompt with each image at its plan's size (one plan of one pair per image:
        Qwen duplicates an image into a temporal pair). `prompt` holds one `<|image_pad|>` per
        image; images are uint8 (H, W, 3). The stock rope positions images (one group each)."""
        if prompt.count(IMAGE_PAD) != len(images):
            raise ValueError(
                f"the prompt holds {prompt.count(IMAGE_PAD)} {IMAGE_PAD}, expected one per image ({len(images)})"
            )
        resized = resized if resized is not None else self.layout.resized_images(images, plans)
        inputs = self.processor(text=[prompt], images=resized, do_resize=False, return_tensors="pt")
        placeholders = int((inputs["input_ids"] == self.processor.image_token_id).sum())
        expected = sum(p.visual_tokens for p in plans)
        if placeholders != expected:
            raise RuntimeError(f"processor wrote {placeholders} image placeholders, the plans count {expected}")
        inputs = inputs.to(self.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        return dict(inputs)

    def position_ids(self, inputs, plan: ResizePlan, video: DecodedVideo) -> torch.Tensor | None:
        """Explicit M-RoPE positions (3, 1, L), or None where the stock rope is already right."""
        return None

    def full_positions(self, inputs: dict) -> torch.Tensor:
        """M-RoPE positions (3, 1, L) of `build_inputs` output, explicit or the stock rope's."""
        if "position_ids" in inputs:
            return inputs["position_ids"]
        positions, _ = self.model.model.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            video_grid_thw=inputs["video_grid_thw"],
            attention_mask=inputs["attention_mask"],
        )
        return positions

    # ------------------------------------------------------------------ token compression
    def unit_order(self, grid_thw: torch.Tensor) -> torch.Tensor | None:
        """For each merged token (LLM order), its merge unit's index in the last ViT block's
        sequence order; None when the orders agree."""
        return None

    def last_block_scores(self, captured: dict, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) attention each merged token's patches receive in the last ViT block and (N, head_dim)
        their keys before rotary (see `vision_attention.py`), in LLM order."""
        received, keys = received_attention_and_keys(
            captured, self.vision_rotary, self.model.config.vision_config.spatial_merge_size**2
        )
        order = self.unit_order(grid_thw)
        return (received, keys) if order is None else (received[order], keys[order])

    @torch.inference_mode()
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
        query: torch.Tensor | None = None,
    ) -> tuple[dict, torch.Tensor]:
        """Inputs for `plan` with its merged visual tokens compressed by `compress` to
        floor(retention * N) tokens; kept tokens keep their full-sequence M-RoPE positions and text
        after the video keeps its positions. `query`: the question's embeddings (M, D), for a
        compressor that reads them (`question_embeddings`). Returns (inputs for `generate`, group sizes (K,))."""
        from ..baselines import VisualTokens, kept_count, merge_groups

        full = self.build_inputs(prompt, video, plan, pairs)
        positions = self.full_positions(full)
        with last_block_input(self.model) if needs_attention else nullcontext({}) as captured:
            encoded = self.model.model.get_video_features(
                full["pixel_values_videos"], full["video_grid_thw"], return_dict=True
            )
        features = torch.cat(encoded.pooler_output)
        received, keys = self.last_block_scores(captured, full["video_grid_thw"]) if needs_attention else (None, None)
        tokens = VisualTokens(
            features=features,
            pair_sizes=plan.pair_tokens,
            grids=plan.grids,
            received_attention=received,
            keys=keys,
            query=query,
        )
        compression = compress(tokens, kept_count(retention, features.shape[0], len(plan.grids)), seed)
        deepstack = getattr(encoded, "deepstack_features", None)
        extra = [torch.cat(layer) for layer in deepstack] if deepstack is not None else []
        kept, sizes, (merged, *merged_deepstack) = merge_groups(compression, features, *extra)
        return encoded_sequence(
            full, positions, kept, encoded, merged, merged_deepstack if deepstack is not None else None
        ), sizes

    @property
    def merge_unit(self) -> int:
        """Patches of one merge unit (one LLM token): spatial_merge_size^2."""
        return self.model.config.vision_config.spatial_merge_size**2

    @torch.inference_mode()
    def build_tower_merged_inputs(
        self,
        prompt: str,
        video: DecodedVideo,
        plan: ResizePlan,
        schedule: dict[int, list[int]],
        merge,
        count,
        pairs=None,
    ) -> tuple[dict, TowerReducer]:
        """Inputs for `plan` with its visual tokens merged inside the vision tower: after each block
        of `schedule` (block -> units each frame pair keeps after it) by `merge`
        (`baselines/illava.merge_units`), the work wrapped by `count` (`CountedCall` factory). Kept
        units keep their M-RoPE positions; returns (inputs for `generate`, the reducer, whose
        `origin`, `sizes` and `block_units` describe what it kept)."""
        full = self.build_inputs(prompt, video, plan, pairs)
        visual = self.model.model.visual
        reducer = TowerReducer(visual, schedule, list(plan.pair_tokens), self.vision_rotary, merge, count)
        encoded = self.tower_forward(full, reducer)
        reducer.block_units.append(int(reducer.origin.shape[0]))  # the merger's
        deepstack = reducer.follow(list(encoded.deepstack_features), list(visual.deepstack_visual_indexes))
        positions = self.full_positions(full)
        return encoded_sequence(full, positions, reducer.origin, encoded, encoded.pooler_output, deepstack), reducer

    @torch.inference_mode()
    def build_tower_pruned_inputs(
        self,
        prompt: str,
        video: DecodedVideo,
        plan: ResizePlan,
        pruning,
        keeps: list[int],
        count,
        pairs=None,
        pruned: int | None = None,
    ) -> tuple[dict, TowerPruner]:
        """Inputs for `plan` whose vision tower pruned patches between its blocks and restored them where
        they are read (`pruning`: `baselines/ipcv.PRUNING`, each frame pair keeping `keeps` patches in the
        pruned blocks, from block `pruned` (None: the method's own K); `count`: a `CountedCall` factory for its
        work): every video token, at its M-RoPE position. Returns (inputs for `generate` or an
        in-LLM stage, the pruner, whose `block_patches` say what each block ran)."""
        full = self.build_inputs(prompt, video, plan, pairs)
        unit = self.merge_unit
        pruner = TowerPruner(
            self.model.model.visual, pruning, [n * unit for n in plan.pair_tokens], keeps, count, pruned
        )
        encoded = self.tower_forward(full, pruner)
        positions = self.full_positions(full)
        everything = torch.arange(encoded.pooler_output.shape[0], device=positions.device)
        pruner.block_patches.append(int(everything.shape[0]) * unit)  # the merger's
        pooler, deepstack = encoded.pooler_output, encoded.deepstack_features
        return encoded_sequence(full, positions, everything, encoded, pooler, deepstack), pruner

    def tower_forward(self, full: dict, hooks):
        """The vision tower over `full`'s video (`build_inputs` output) with `hooks` (a
        `TowerReducer` or `TowerPruner`) attached: its output, undivided."""
        visual = self.model.model.visual
        with hooks.attached():
            return visual(
                full["pixel_values_videos"].type(visual.dtype), grid_thw=full["video_grid_thw"], return_dict=True
            )

    def question_embeddings(self, text: str) -> torch.Tensor:
        """(M, D) the LLM's input embeddings of the M tokens of `text` (no special tokens; M = 0 for
        an empty text), on the model's device in its dtype: the space the merged visual tokens enter."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        embed = self.model.get_input_embeddings()
        return embed(torch.tensor(ids, dtype=torch.long, device=embed.weight.device))

    # ------------------------------------------------------------------ pruning inside the LLM
    @property
    def num_text_layers(self) -> int:
        """Decoder layers of the LLM."""
        return len(self.model.model.language_model.layers)

    @property
    def first_prunable_layer(self) -> int:
        """The first layer a stage may start at: after Qwen3-VL's deepstack layers (0 on Qwen2.5-VL)."""
        return len(getattr(self.model.config.vision_config, "deepstack_visual_indexes", None) or ())

    def visual_positions(self, inputs: dict) -> torch.Tensor:
        """(N,) indices of the video tokens in the prompt of `inputs`."""
        return torch.nonzero(inputs["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE).flatten()

    def pruned_inputs(self, inputs: dict, stages, protected: torch.Tensor | None = None) -> PrunedInputs:
        """`inputs` (from `build_inputs`, or `build_compressed_inputs` for a compressor with its own
        stage in the LLM) with a `LayerPruner` running `stages` (the token budget's schedule);
        `protected`: (N,) bool over the visual tokens, those the stages must keep."""
        visual = self.visual_positions(inputs)
        keep = None if protected is None else visual[protected.to(visual.device)]
        return PrunedInputs(inputs, LayerPruner(self.model.model.language_model, stages, visual, self.stopwatch, keep))

    def fusion_inputs(self, inputs: dict, budget: int) -> PrunedInputs:
        """`inputs` (from `build_inputs`) with a `FusionPruner` holding the prefill to `budget` visual
        token-layers; each visual token's patch is its position within its frame pair."""
        merge = self.model.config.vision_config.spatial_merge_size
        pairs = inputs["video_grid_thw"].tolist()
        patches = [torch.arange(h * w // merge**2) for _, h, w in pairs]  # cpu: host facts (moved once, by the pruner)
        patches = torch.cat([p.repeat(t) for p, (t, _, _) in zip(patches, pairs)])
        pruner = FusionPruner(
            self.model.model.language_model,
            self.visual_positions(inputs),
            patches,
            budget,
            self.first_prunable_layer,
            self.stopwatch,
        )
        return PrunedInputs(inputs, pruner)

    def build_pruned_inputs(self, inputs: dict, schedule, retention: float, layers: list[int] | None) -> PrunedInputs:
        """`pruned_inputs` with the stages `schedule` gives for `retention` on this LLM and the
        visual tokens of `inputs`."""
        visual = len(self.visual_positions(inputs))
        return self.pruned_inputs(
            inputs, schedule(self.num_text_layers, visual, retention, layers, self.first_prunable_layer)
        )

    def decode_pruned_inputs(self, inputs: dict, stage) -> PrunedInputs:
        """`inputs` (from `build_compressed_inputs`) with a `DecodePruner` at `stage` (the token
        budget's `DecodeStage`)."""
        return PrunedInputs(
            inputs, DecodePruner(self.model.model.language_model, stage, self.visual_positions(inputs), self.stopwatch)
        )

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(
        self,
        inputs: dict,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float | None = None,
        num_beams: int = 1,
    ) -> tuple[str, int]:
        """Generate from `build_inputs` output; returns (text, number of generated tokens)."""
        text, tokens = self.generate_ids(inputs, max_new_tokens, temperature, top_p, num_beams)
        return text, int(tokens.numel())

    def generate_batch(self, requests: list[dict], gen_kwargs: list[dict]) -> list[EngineOutput]:
        """Generate each built input in turn, timing its vision tower, first token and later tokens."""
        outputs = []
        for inputs, kwargs in zip(requests, gen_kwargs):
            pruner = inputs.pruner if isinstance(inputs, PrunedInputs) else None
            inputs = inputs.inputs if pruner is not None else inputs
            reset_peak_memory(self.device)
            first = FirstLogits(self.stopwatch)
            with self.vision_timer.recording(), pruner.attached() if pruner is not None else nullcontext():
                start = self.stopwatch.mark()
                extra = pruner.generate_kwargs() if pruner is not None else {}
                text, tokens = self.generate_ids(inputs, **kwargs, logits_processor=[first], **extra)
                end = self.stopwatch.mark()
            n_out = int(tokens.numel())
            first_token_s, vision_s = self.stopwatch.seconds(start, first.first), self.vision_timer.take()
            rank_s = pruner.seconds() if pruner is not None else None
            outputs.append(
                EngineOutput(
                    text,
                    inputs["input_ids"][0].tolist(),
                    n_out,
                    first_token_s=first_token_s,
                    per_token_s=self.stopwatch.seconds(first.first, end) / (n_out - 1) if n_out > 1 else 0.0,
                    vision_s=vision_s,
                    rank_s=rank_s,
                    prefill_s=first_token_s - vision_s - (rank_s if pruner is not None and pruner.in_prefill else 0.0),
                    peak_memory_mb=peak_memory_mb(self.device),
                    layer_visual_tokens=pruner.layer_tokens if pruner is not None else None,
                    method_flops=pruner.flops if pruner is not None else 0,
                    decode_keys_dropped=getattr(pruner, "keys_dropped", 0),
                    held_stages=pruner.held_stages() if pruner is not None else None,
                )
            )
        return outputs

    @torch.inference_mode()
    def generate_ids(
        self,
        inputs: dict,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float | None = None,
        num_beams: int = 1,
        logits_processor: list | None = None,
        past_key_values=None,
    ) -> tuple[str, torch.Tensor]:
        """Generate from `build_inputs` output; returns (text, generated token ids (L,)).
        logits_processor: transformers `LogitsProcessor`s run besides the sampling settings';
        past_key_values: the cache to fill (a decoding-time pruner's; None: generate's own)."""
        self.model.model.rope_deltas = None  # never reuse positions cached by an earlier call
        sampling = (
            dict(do_sample=True, temperature=temperature, top_p=top_p)
            if temperature and temperature > 0
            else dict(do_sample=False)
        )
        out = self.model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            num_beams=num_beams,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            logits_processor=LogitsProcessorList(logits_processor or []),
            **sampling,
            **({} if past_key_values is None else dict(past_key_values=past_key_values)),
        )
        new_tokens = out[0, inputs["input_ids"].shape[1] :]
        return self.tokenizer.decode(new_tokens, skip_special_tokens=True), new_tokens

    def sequence_logprobs(self, inputs: dict, response_ids: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (L,) of `response_ids` (L,) following the prompt in `inputs`, with
        gradients (teacher forcing; temperature 1). Used by the backbone's PPO update."""
        return self.sequence_outputs(inputs, response_ids)[0]

    def sequence_outputs(self, inputs: dict, response_ids: torch.Tensor, **forward_kwargs):
        """`sequence_logprobs` and the model's whole output (`forward_kwargs` such as
        output_attentions=True go to the model's forward)."""
        response_ids = response_ids.clone()  # ids from `generate_ids` are inference-mode tensors
        ids = torch.cat([inputs["input_ids"], response_ids[None].to(inputs["input_ids"].device)], dim=1)
        extra = response_ids.numel()
        batch = dict(inputs, input_ids=ids)
        batch["attention_mask"] = torch.cat(
            [inputs["attention_mask"], inputs["attention_mask"].new_ones(1, extra)], dim=1
        )
        batch["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], inputs["mm_token_type_ids"].new_zeros(1, extra)], dim=1
        )
        if "position_ids" in inputs:
            pos = inputs["position_ids"]
            tail = pos[..., -1:] + torch.arange(1, extra + 1, device=pos.device)
            batch["position_ids"] = torch.cat([pos, tail], dim=-1)
        self.model.model.rope_deltas = None
        outputs = self.model(**batch, **forward_kwargs)
        logits = outputs.logits[0, inputs["input_ids"].shape[1] - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, response_ids[:, None].to(logits.device))[:, 0]
        return logprobs, outputs


class Qwen25VLAdapter(QwenVideoAdapter):
    layout_cls = Qwen25VLLayout
    vision_rotary = staticmethod(qwen25_vision_rotary)

    def position_ids(self, inputs, plan: ResizePlan, video: DecodedVideo) -> torch.Tensor:
        """Stock Qwen2.5-VL M-RoPE generalised to one grid per pair (see `qwen25_mrope_positions`)."""
        input_ids = inputs["input_ids"][0]
        is_video = inputs["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE
        video_at = torch.nonzero(is_video).flatten()
        start, end = int(video_at[0]), int(video_at[-1]) + 1
        if int(is_video[start:end].sum()) != end - start or int(is_video.sum()) != plan.visual_tokens:
            raise ValueError("expected one contiguous run of video tokens holding the whole plan")
        run = VisionRun(offset=start, grids=list(plan.grids), second_per_grid_ts=inputs["second_per_grid_ts"].tolist())
        positions = qwen25_mrope_positions(len(input_ids), [run], self.model.config.vision_config.tokens_per_second)
        return positions.to(input_ids.device).unsqueeze(1)

    def unit_order(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """The vision tower runs its blocks in window order; its merger output is put back with
        argsort(window_index), so merged token i is window-order unit argsort(window_index)[i]."""
        vision = self.model.config.vision_config
        window_index, _ = get_vision_window_index(
            grid_thw,
            spatial_merge_size=vision.spatial_merge_size,
            window_size=vision.window_size,
            patch_size=vision.patch_size,
        )
        return torch.argsort(window_index)


class Qwen3VLAdapter(QwenVideoAdapter):
    layout_cls = Qwen3VLLayout
    vision_rotary = staticmethod(qwen3_vision_rotary)


ADAPTERS = {"qwen25vl": Qwen25VLAdapter, "qwen3vl": Qwen3VLAdapter}


def compressed_sequence(full: dict, positions: torch.Tensor, kept: torch.Tensor) -> dict:
    """The prompt of `full` (`build_inputs` output) and its M-RoPE `positions` (3, 1, L) with only
    the video tokens at `kept` left (indices among the video tokens, as `merge_groups` returns
    them): input_ids, attention_mask, mm_token_type_ids and position_ids; every other token and
    every position stay as they were."""
    video_at = torch.nonzero(full["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE).flatten()
    keep_seq = torch.ones(full["input_ids"].shape[1], dtype=torch.bool, device=video_at.device)
    keep_seq[video_at] = False
    keep_seq[video_at[kept]] = True
    return dict(
        input_ids=full["input_ids"][:, keep_seq],
        attention_mask=full["attention_mask"][:, keep_seq],
        mm_token_type_ids=full["mm_token_type_ids"][:, keep_seq],
        position_ids=positions[..., keep_seq],
    )


def encoded_sequence(full: dict, positions: torch.Tensor, kept: torch.Tensor, encoded, pooler, deepstack) -> dict:
    """`compressed_sequence` of the video tokens at `kept`, with the vision tower's output for them
    already computed (`mm_encoder_outputs`, as `encoded`'s type): `pooler` (K, D) and, on Qwen3-VL,
    the `deepstack` features (a list of (K, D); None without them)."""
    outputs = dict(pooler_output=[pooler])
    if deepstack is not None:
        outputs["deepstack_features"] = [[d] for d in deepstack]
    encoder_outputs = {"video": type(encoded)(**outputs)}
    return dict(compressed_sequence(full, positions, kept), mm_encoder_outputs=encoder_outputs)


def check_flash_attention(dtype: str, config) -> None:
    """Stop before the weights load where `attn_implementation=flash_attention_2` cannot run: a
    dtype other than float16 / bfloat16 (`auto`: the checkpoint's `config.dtype`), or no
    `flash_attn` package."""
    chosen = (config.dtype or torch.get_default_dtype()) if dtype == "auto" else getattr(torch, dtype)
    if chosen not in (torch.float16, torch.bfloat16):
        given = f"dtype={dtype}" + (
            f" (the checkpoint's {str(chosen).removeprefix('torch.')})" if dtype == "auto" else ""
        )
        raise ValueError(
            f"attn_implementation=flash_attention_2 runs in float16 or bfloat16, not {given}: give dtype=bfloat16, "
            "or attn_implementation=sdpa"
        )
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            "attn_implementation=flash_attention_2 needs the flash_attn package, which is not installed here: "
            "install flash-attn, or give attn_implementation=sdpa"
        )


def family_of(pretrained: str) -> str:
    """`qwen25vl` or `qwen3vl`: the family of the checkpoint at `pretrained` (read from its config)."""
    model_type = AutoConfig.from_pretrained(pretrained).model_type
    for family, adapter in ADAPTERS.items():
        if adapter.layout_cls.model_type == model_type:
            return family
    raise ValueError(f"{pretrained} is a {model_type} checkpoint; known families: {', '.join(ADAPTERS)}")
