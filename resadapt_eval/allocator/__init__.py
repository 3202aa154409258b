"""The ResAdapt Allocator: model, frozen encoders, checkpoints, inference."""

from .encoders import ENCODERS, FrozenEncoders, build_encoders
from .inference import (
    BACKBONE_FILE,
    BUDGET_FILE,
    UNTRAINED,
    AllocatorPolicy,
    backbone_differences,
    backbone_identity,
    budget_source,
    check_backbone,
    check_checkpoint,
    known_allocators,
    load_allocator,
    training_backbone,
    training_budget,
)
from .model import (
    INFERENCE_MODES,
    Allocator,
    AllocatorConfig,
    CheckpointError,
    beta_actions,
    logit_normal_actions,
    logit_normal_mean,
)

__all__ = [
    "BACKBONE_FILE",
    "BUDGET_FILE",
    "backbone_differences",
    "check_backbone",
    "backbone_identity",
    "budget_source",
    "check_checkpoint",
    "training_backbone",
    "Allocator",
    "AllocatorConfig",
    "AllocatorPolicy",
    "CheckpointError",
    "ENCODERS",
    "FrozenEncoders",
    "INFERENCE_MODES",
    "beta_actions",
    "build_encoders",
    "UNTRAINED",
    "known_allocators",
    "load_allocator",
    "logit_normal_actions",
    "logit_normal_mean",
    "training_budget",
]
