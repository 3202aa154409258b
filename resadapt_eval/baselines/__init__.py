"""Token compressors applied after the vision merger, before the LLM (batch size 1).

Each module has one entry point, `compress(tokens: VisualTokens, keep: int, seed) -> Compression`,
registered as a method in `resadapt_eval/methods.py`. FixedScale is a budget policy
(`budget.policies.fixed_scale`), not a compressor.
"""

from .common import DROPPED, Compression, VisualTokens, kept_count, merge_groups

__all__ = ["DROPPED", "Compression", "VisualTokens", "kept_count", "merge_groups"]
