"""Allocator training: data, rollout engines (HF backbone, simulation), the CAPO trainer."""
