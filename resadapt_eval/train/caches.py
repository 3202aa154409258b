"""What a CAPO step would otherwise recompute every time a sample is drawn again, and its clock.

- `FrameCache`: decoded videos (uint8 frames) per (file, max_num_frames), least recently used
  first out once the frames exceed `max_mb` megabytes. A file that changed on disk (size or
  modification time) is decoded again.
- `FeatureCache`: the Allocator's frozen-encoder features per (video, frame indices, query,
  encoder), in the Allocator's device memory, bounded the same way. The encoder is named by its
  config (`encoder`, `encoder_path`, `seed`): another encoder never reads these features.
- `PairCache`: each frame pair resized to a planned size, per (video, frame indices, pair, size).
  Planned sizes lie on the backbone's token grid, so the M allocations of a step and the later
  draws of the same video ask for the same few sizes of each pair again.
- `StepClock`: seconds per phase of one step.

Decoding and the frozen encoders are deterministic, so a hit returns the very tensors a miss
would compute: training with the caches gives the same allocations, losses and weights.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import torch

from ..backbones.layout import resize_frames
from ..budget.plan import ResizePlan
from ..video import DecodedVideo, decode_video

MB = 1 << 20


class LRUCache:
    """A mapping bounded by the bytes of its values (`max_mb` megabytes; 0 keeps nothing), least
    recently used first out; counts hits and misses."""

    def __init__(self, max_mb: float, size_of):
        if max_mb < 0:
            raise ValueError(f"a cache size must be >= 0 MB, got {max_mb}")
        self.max_bytes, self.size_of = int(max_mb * MB), size_of
        self.entries: OrderedDict = OrderedDict()
        self.bytes = self.hits = self.misses = 0

    def get(self, key, compute):
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        self.misses += 1
        value = compute()
        size = self.size_of(value)
        if size <= self.max_bytes:
            self.entries[key] = value
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, evicted = self.entries.popitem(last=False)
                self.bytes -= self.size_of(evicted)
        return value

    def counts(self) -> tuple[int, int]:
        """(hits, misses) so far."""
        return self.hits, self.misses


def _video_bytes(video: DecodedVideo) -> int:
    return int(video.frames.nbytes)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _feature_bytes(features: dict) -> int:
    return sum(_tensor_bytes(t) for t in features.values())


class FrameCache:
    """`decode(path)`: `decode_video(path, max_num_frames)`, kept across steps up to `max_mb` MB."""

    def __init__(self, max_num_frames: int, max_mb: float):
        self.max_num_frames = max_num_frames
        self.cache = LRUCache(max_mb, _video_bytes)

    def decode(self, path: str | Path) -> DecodedVideo:
        path = Path(path)
        stat = path.stat() if path.is_file() else None  # a missing file is decode_video's error to raise
        key = (str(path), self.max_num_frames, stat and (stat.st_size, stat.st_mtime_ns))
        return self.cache.get(key, lambda: decode_video(path, self.max_num_frames))


class FeatureCache:
    """`encode(allocator, prompt)`: the Allocator's `encode([frames], [query])` for one prompt,
    kept across steps up to `max_mb` MB, keyed by the prompt's video key, query and encoder."""

    def __init__(self, max_mb: float):
        self.cache = LRUCache(max_mb, _feature_bytes)

    @staticmethod
    def encoder_key(allocator) -> tuple:
        config = allocator.config
        return (config.encoder, config.encoder_path, config.seed, str(allocator.encoders.device))

    def encode(self, allocator, frames, query: str, video_key: tuple | None) -> dict:
        def compute():
            return allocator.encode([torch.from_numpy(frames).contiguous()], [query])

        if video_key is None:  # frames without a name (simulated videos): nothing to key them by
            return compute()
        return self.cache.get((video_key, query, self.encoder_key(allocator)), compute)


class PairCache:
    """`resized_pairs(video, plan, video_key)`: `QwenLayout.resized_pairs`, each pair kept across
    allocations and steps up to `max_mb` MB."""

    def __init__(self, max_mb: float):
        self.cache = LRUCache(max_mb, _tensor_bytes)

    def resized_pairs(self, video: DecodedVideo, plan: ResizePlan, video_key: tuple) -> list[torch.Tensor]:
        """Each pair's frames (2, 3, h, w) uint8 at its planned size in pixels."""
        return [
            self.cache.get(
                (video_key, tuple(group), h, w), lambda g=group, h=h, w=w: resize_frames(video.frames[list(g)], h, w)
            )
            for group, (h, w) in zip(plan.pair_frames, plan.pair_sizes)
        ]


class StepClock:
    """Wall seconds per phase (`with clock.phase("decode"): ...`), summed over a step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
