"""`resadapt-eval train --config FILE.yaml`: the YAML layout and how it builds a trainer.

    output_dir: runs/allocator          # checkpoints/, metrics.jsonl
    data: path/to/train.jsonl           # see train/data.py for the columns
    backbone: {family: qwen25vl, pretrained: PATH, device: cpu, dtype: float32, attn_implementation: null}
                                        # device: cuda = each process's own GPU under `accelerate launch`
    rollout: {engine: hf,                               # or vllm: the whole step in one batched vLLM call
              max_num_frames: 8, max_new_tokens: 32, temperature: 1.0, check_format: false,
              min_pixels: null, max_pixels: null, min_tokens_per_pair: 1, max_tokens_per_pair: null,
              pair_reduction: mean,
              answer: generate, choices: ABCD,          # or choice_logits (multiple choice, one forward)
              retention: null, s_min: 0.2, s_max: 1.8,  # R or [lo, hi] (R drawn per prompt): project each
                                                        # allocation onto R within [s_min, s_max]
              vllm: {gpu_memory_utilization: 0.5, tensor_parallel_size: 1, max_model_len: null,
                     kv_cache_memory_bytes: null}}     # engine: vllm only (see VLLM_KEYS)
    cache: {frames_mb: 4096, pairs_mb: 2048,            # decoded videos, resized frame pairs and
            features_mb: 2048}                          # frozen-encoder features kept across steps
                                                        # (MB per process; 0: none)
    allocator: {checkpoint: null}       # or `untrained`, or a folder (with it, only text_positions: true
                                        # may be added: it adds no weights); otherwise AllocatorConfig fields
    capo: {...}                         # CAPOConfig fields
    train: {...}                        # TrainConfig fields (output_dir comes from the top level)

Relative paths resolve against the YAML file's folder.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import fields, replace
from pathlib import Path

import yaml

from ..allocator import UNTRAINED, Allocator, AllocatorConfig, load_allocator
from ..backbones.qwen import ADAPTERS
from ..budget.policies import BudgetSpec
from ..capo.losses import CAPOConfig
from .caches import FeatureCache, FrameCache, PairCache
from .data import load_samples
from .engines import HFRolloutEngine
from .trainer import AllocatorTrainer, TrainConfig

CHECKPOINT_OVERRIDES = ("text_positions",)  # AllocatorConfig fields a `checkpoint` may change: no weights
SECTIONS = ("output_dir", "data", "backbone", "rollout", "cache", "allocator", "capo", "train")
BACKBONE_KEYS = ("family", "pretrained", "device", "dtype", "attn_implementation")
ROLLOUT_KEYS = (
    "engine",
    "vllm",
    "max_num_frames",
    "max_new_tokens",
    "temperature",
    "check_format",
    "min_pixels",
    "max_pixels",
    "min_tokens_per_pair",
    "max_tokens_per_pair",
    "pair_reduction",
    "answer",
    "choices",
    "retention",
    "s_min",
    "s_max",
)
ENGINES = ("hf", "vllm")
# vLLM's own engine arguments: the fraction of each GPU's memory vLLM may take (weights, KV cache and
# activations; the Allocator shares the GPU), GPUs per engine (tensor parallel), the longest prompt plus
# answer in tokens (default: the checkpoint's), on CPU the KV cache size in bytes, vLLM's scheduler
# settings (chunked prefill, tokens per engine step) and eager mode (no torch.compile; see VLLMBackbone).
VLLM_KEYS = (
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "max_model_len",
    "kv_cache_memory_bytes",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "enforce_eager",
)
CACHE_KEYS = ("frames_mb", "pairs_mb", "features_mb")
CACHE_DEFAULTS = dict(frames_mb=4096, pairs_mb=2048, features_mb=2048)


def _check_keys(path: Path, section: str, given: dict, allowed) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown} in `{section}`; allowed: {sorted(allowed)}")


def _dataclass_from(path: Path, section: str, cls, given: dict):
    _check_keys(path, section, given, [f.name for f in fields(cls)])
    return cls(**given)


def build_trainer(config_path: str | Path, steps: int | None = None) -> AllocatorTrainer:
    """Read the YAML at `config_path` and build the trainer it describes."""
    path = Path(config_path)
    raw = yaml.safe_load(path.read_text()) or {}
    _check_keys(path, "top level", raw, SECTIONS)
    for required in ("output_dir", "data", "backbone"):
        if required not in raw:
            raise ValueError(f"{path}: missing `{required}`")

    def resolve(p: str) -> str:
        candidate = Path(p)
        return str(candidate if candidate.is_absolute() else (path.parent / candidate).resolve())

    backbone_cfg = dict(raw["backbone"])
    _check_keys(path, "backbone", backbone_cfg, BACKBONE_KEYS)
    family = backbone_cfg.get("family")
    if family not in ADAPTERS:
        raise ValueError(f"{path}: backbone.family must be one of {sorted(ADAPTERS)}, got {family!r}")
    pretrained = backbone_cfg["pretrained"]
    pretrained = resolve(pretrained) if Path(path.parent / pretrained).exists() else pretrained
    device = backbone_cfg.get("device", "cpu")
    if device == "cuda":  # one process per GPU under `accelerate launch`: this process's own (cuda:LOCAL_RANK)
        from accelerate import PartialState

        device = str(PartialState().device)
    rollout = dict(raw.get("rollout") or {})
    _check_keys(path, "rollout", rollout, ROLLOUT_KEYS)
    engine_name = rollout.pop("engine", "hf")
    if engine_name not in ENGINES:
        raise ValueError(f"{path}: rollout.engine must be one of {ENGINES}, got {engine_name!r}")
    vllm_settings = dict(rollout.pop("vllm", None) or {})
    _check_keys(path, "rollout.vllm", vllm_settings, VLLM_KEYS)
    if vllm_settings and engine_name != "vllm":
        raise ValueError(f"{path}: rollout.vllm sets the vLLM engine, but rollout.engine is {engine_name!r}")
    train_cfg = dict(raw.get("train") or {})
    if engine_name == "vllm" and backbone_cfg.get("attn_implementation") is not None:
        raise ValueError(
            f"{path}: backbone.attn_implementation is the HF engine's setting; vLLM picks its own attention "
            "kernels (remove it, or use rollout.engine hf)"
        )
    if engine_name == "vllm" and train_cfg.get("train_backbone"):
        from .vllm_rollouts import STALE_WEIGHTS

        raise ValueError(f"{path}: {STALE_WEIGHTS}")
    cache = {**CACHE_DEFAULTS, **(raw.get("cache") or {})}
    _check_keys(path, "cache", cache, CACHE_KEYS)
    max_num_frames = rollout.pop("max_num_frames", 8)
    frames = FrameCache(max_num_frames, cache["frames_mb"])
    budget = BudgetSpec(
        s_min=rollout.pop("s_min", 0.2),
        s_max=rollout.pop("s_max", 1.8),
        min_tokens_per_pair=rollout.pop("min_tokens_per_pair", 1),
        max_tokens_per_pair=rollout.pop("max_tokens_per_pair", None),
        pair_reduction=rollout.pop("pair_reduction", "mean"),
    )
    settings = dict(
        min_pixels=rollout.get("min_pixels"),
        max_pixels=rollout.get("max_pixels"),
        max_new_tokens=rollout.get("max_new_tokens", 32),
        temperature=rollout.get("temperature", 1.0),
        check_format=rollout.get("check_format", False),
        answer=rollout.get("answer", "generate"),
        choices=rollout.get("choices", "ABCD"),
        retention=rollout.get("retention"),
        seed=train_cfg.get("seed", 0),
        frames=frames,
        pairs=PairCache(cache["pairs_mb"]),
    )
    adapter = None
    if engine_name == "hf":
        adapter = ADAPTERS[family].from_pretrained(
            pretrained,
            device=device,
            dtype=backbone_cfg.get("dtype", "auto"),
            attn_implementation=backbone_cfg.get("attn_implementation"),
        )
        engine = HFRolloutEngine(adapter, max_num_frames, budget, **settings)
    else:
        from ..backbones.vllm_engine import VLLMBackbone
        from .vllm_rollouts import VLLMRolloutEngine, pin_engine_gpu

        pinned = nullcontext()
        if device.startswith("cuda"):
            from accelerate import PartialState

            tensor_parallel = vllm_settings.get("tensor_parallel_size", 1)
            pinned = pin_engine_gpu(device, PartialState().num_processes, tensor_parallel)
        with pinned:
            backbone = VLLMBackbone(
                family,
                pretrained,
                max_num_frames,
                dtype=backbone_cfg.get("dtype", "auto"),
                seed=settings["seed"],
                allocator_device=device,
                **vllm_settings,
            )
        engine = VLLMRolloutEngine(backbone, family, pretrained, max_num_frames, budget, **settings)

    allocator_cfg = dict(raw.get("allocator") or {})
    checkpoint = allocator_cfg.pop("checkpoint", None)
    if checkpoint is not None:
        if set(allocator_cfg) - set(CHECKPOINT_OVERRIDES):
            raise ValueError(
                f"{path}: `allocator` takes either `checkpoint` (with at most {', '.join(CHECKPOINT_OVERRIDES)}) "
                f"or AllocatorConfig fields, not both; got {sorted(allocator_cfg)}"
            )
        allocator = load_allocator(checkpoint if checkpoint == UNTRAINED else resolve(checkpoint), device=device)
        if allocator_cfg:  # settings that add no weights: the same weights under the new config
            changed = Allocator(replace(allocator.config, **allocator_cfg), encoders=allocator.encoders)
            changed.load_state_dict(allocator.state_dict())
            allocator = changed.to(device)
    else:
        allocator = Allocator(_dataclass_from(path, "allocator", AllocatorConfig, allocator_cfg)).to(device)

    capo = _dataclass_from(path, "capo", CAPOConfig, dict(raw.get("capo") or {}))
    if "output_dir" in train_cfg:
        raise ValueError(f"{path}: put output_dir at the top level, not in `train`")
    train_cfg["output_dir"] = resolve(raw["output_dir"])
    if steps is not None:
        train_cfg["steps"] = steps
    train = _dataclass_from(path, "train", TrainConfig, train_cfg)
    samples = load_samples(resolve(raw["data"]))
    features = FeatureCache(cache["features_mb"])
    return AllocatorTrainer(allocator, engine, samples, train, capo, backbone=adapter, features=features)
