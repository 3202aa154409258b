"""The reward-design ablation in simulation: the real Allocator (tiny encoders) and the real CAPO
trainer against `SimulatedBackbone`, four variants from the same initialisation.

Settings of the study (not paper defaults, stated where they differ): the direct-cost variant
uses lambda_cost = 4 (the paper gives no value; with lambda_cost = 1 the policy keeps the evidence
frames and cuts the rest, so the collapse only shows with a stronger penalty); the L_sim variant
uses lambda_sim = 0.1 (paper 1e-3, for a 7B-scale setting); Allocator lr 3e-3 (tiny model).
"""

from __future__ import annotations

import tempfile
from dataclasses import replace

import numpy as np
import torch

from ..allocator import Allocator, AllocatorConfig
from ..capo.losses import CAPOConfig
from .engines import SimulatedBackbone, make_sim_samples
from .trainer import AllocatorTrainer, TrainConfig

# name -> (CAPO settings, Allocator overrides)
VARIANTS = {
    "direct cost": (CAPOConfig(advantage="direct_cost", lambda_cost=4.0), {}),
    "accuracy only": (CAPOConfig(advantage="accuracy_only"), {}),
    "CAPO": (CAPOConfig(lambda_sim=0.0), {}),
    "CAPO + L_sim": (CAPOConfig(lambda_sim=0.1), {}),
}
N_CAPO = {"N-CAPO + L_sim": (CAPOConfig(lambda_sim=0.1), {"policy": "logit_normal"})}


def run_ablation(
    steps: int = 400, seed: int = 0, num_videos: int = 64, variants: dict = VARIANTS, progress: bool = False
) -> dict[str, list[dict]]:
    """Train every variant for `steps` steps; returns each variant's per-step metrics."""
    samples = make_sim_samples(num_videos, seed=seed)
    histories = {}
    for name, (capo, allocator_overrides) in variants.items():
        torch.manual_seed(seed)
        allocator = Allocator(
            AllocatorConfig(
                **{
                    **dict(encoder="tiny", width=64, num_heads=4, num_layers=1, head_init_std=0.02, seed=seed),
                    **allocator_overrides,
                }
            )
        )
        with tempfile.TemporaryDirectory() as out:
            config = TrainConfig(
                output_dir=out,
                steps=steps,
                batch_size=8,
                num_allocations=8,
                rollouts_per_allocation=1,
                lr=3e-3,
                save_every=steps,
                seed=seed,
            )
            trainer = AllocatorTrainer(allocator, SimulatedBackbone(seed=seed), samples, config, replace(capo))
            histories[name] = trainer.train(progress=progress)
    return histories


def summarize(histories: dict[str, list[dict]], last: int = 100) -> dict[str, dict]:
    """Means over the last `last` steps of each variant."""
    keys = ("mean_scale", "scale_std", "gini", "accuracy", "reward", "achieved_retention")
    return {name: {k: float(np.mean([m[k] for m in h[-last:]])) for k in keys} for name, h in histories.items()}
