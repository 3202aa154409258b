"""Analytic compute: FLOPs per sample from token grids and a backbone's config (`flops.py`)."""

from .configs import KNOWN_CONFIGS
from .flops import BackboneDims, SampleFlops, dims_from_config, load_dims, sample_flops

__all__ = ["KNOWN_CONFIGS", "BackboneDims", "SampleFlops", "dims_from_config", "load_dims", "sample_flops"]
