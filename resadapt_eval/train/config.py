"""`resadapt-eval train --config FILE.yaml`: the YAML layout and how it builds a trainer.

    output_dir: runs/allocator          # checkpoints/, metrics.jsonl
    data: path/to/train.jsonl           # see train/data.py for the columns
    backbone: {family: qwen25vl, pretrained: PATH, device: cpu, dtype: float32, attn_implementation: null}
                                        # device: cuda = each process's own GPU under `accelerate launch`
    rollout: {max_num_frames: 8, max_new_tokens: 32, temperature: 1.0, check_format: false,
              min_pixels: null, max_pixels: null, min_tokens_per_pair: 1, max_tokens_per_pair: null,
              pair_reduction: mean,
              answer: generate, choices: ABCD,          # or choice_logits (multiple choice, one forward)
              retention: null, s_min: 0.2, s_max: 1.8}  # R or [lo, hi] (R drawn per prompt): project each
                                                        # allocation onto R within [s_min, s_max]
    allocator: {checkpoint: null}       # or `untrained`, or a folder (with it, only text_positions: true
                                        # may be added: it adds no weights); otherwise AllocatorConfig fields
    capo: {...}                         # CAPOConfig fields
    train: {...}                        # TrainConfig fields (output_dir comes from the top level)

Relative paths resolve against the YAML file's folder.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import yaml

from ..allocator import UNTRAINED, Allocator, AllocatorConfig, load_allocator
from ..backbones.qwen import ADAPTERS
from ..budget.policies import BudgetSpec
from ..capo.losses import CAPOConfig
from .data import load_samples
from .engines import HFRolloutEngine
from .trainer import AllocatorTrainer, TrainConfig

CHECKPOINT_OVERRIDES = ("text_positions",)  # AllocatorConfig fields a `checkpoint` may change: no weights
SECTIONS = ("output_dir", "data", "backbone", "rollout", "allocator", "capo", "train")
BACKBONE_KEYS = ("family", "pretrained", "device", "dtype", "attn_implementation")
ROLLOUT_KEYS = (
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
    adapter = ADAPTERS[family].from_pretrained(
        pretrained,
        device=device,
        dtype=backbone_cfg.get("dtype", "auto"),
        attn_implementation=backbone_cfg.get("attn_implementation"),
    )

    rollout = dict(raw.get("rollout") or {})
    _check_keys(path, "rollout", rollout, ROLLOUT_KEYS)
    budget = BudgetSpec(
        s_min=rollout.get("s_min", 0.2),
        s_max=rollout.get("s_max", 1.8),
        min_tokens_per_pair=rollout.get("min_tokens_per_pair", 1),
        max_tokens_per_pair=rollout.get("max_tokens_per_pair"),
        pair_reduction=rollout.get("pair_reduction", "mean"),
    )
    engine = HFRolloutEngine(
        adapter,
        max_num_frames=rollout.get("max_num_frames", 8),
        budget=budget,
        min_pixels=rollout.get("min_pixels"),
        max_pixels=rollout.get("max_pixels"),
        max_new_tokens=rollout.get("max_new_tokens", 32),
        temperature=rollout.get("temperature", 1.0),
        check_format=rollout.get("check_format", False),
        answer=rollout.get("answer", "generate"),
        choices=rollout.get("choices", "ABCD"),
        retention=rollout.get("retention"),
        seed=(raw.get("train") or {}).get("seed", 0),
    )

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
    train_cfg = dict(raw.get("train") or {})
    if "output_dir" in train_cfg:
        raise ValueError(f"{path}: put output_dir at the top level, not in `train`")
    train_cfg["output_dir"] = resolve(raw["output_dir"])
    if steps is not None:
        train_cfg["steps"] = steps
    train = _dataclass_from(path, "train", TrainConfig, train_cfg)
    samples = load_samples(resolve(raw["data"]))
    return AllocatorTrainer(allocator, engine, samples, train, capo, backbone=adapter)
