"""The ResAdapt Allocator: model, frozen encoders, checkpoints, inference."""

from .encoders import ENCODERS, FrozenEncoders, build_encoders
from .inference import BUILTIN, INFERENCE_MODES, AllocatorPolicy, latent_actions, load_allocator
from .model import Allocator, AllocatorConfig, CheckpointError

__all__ = [
    "Allocator", "AllocatorConfig", "AllocatorPolicy", "BUILTIN", "CheckpointError", "ENCODERS",
    "FrozenEncoders", "INFERENCE_MODES", "build_encoders", "latent_actions", "load_allocator",
]  # fmt: skip
