"""Token compressors applied after the vision merger, before the LLM (batch size 1).

Each module has one entry point, `compress(tokens: VisualTokens, keep: int, seed) -> assignment`.
FixedScale is a budget policy (`budget.policies.fixed_scale`), not a compressor.
"""

from . import flashvid, random_drop, tome, visionzip
from .common import DROPPED, VisualTokens, kept_count, merge_groups

COMPRESSORS = {
    "random_drop": random_drop.compress,
    "tome": tome.compress,
    "visionzip": visionzip.compress,
    "flashvid": flashvid.compress,
}
NEEDS_ATTENTION = {"visionzip", "flashvid"}  # use the attention received in the last ViT block

__all__ = ["COMPRESSORS", "DROPPED", "NEEDS_ATTENTION", "VisualTokens", "kept_count", "merge_groups"]
