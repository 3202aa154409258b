"""Decode a video once: uniformly spaced frames at the file's resolution."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .budget.plan import uniform_frame_indices


class VideoDecodeError(RuntimeError):
    """A video that is missing or cannot be decoded; the message names the path."""


@dataclass
class DecodedVideo:
    """Frames decoded once from a video file.

    frames: uint8 array (T, H, W, 3) in pixels at the file's resolution.
    indices: the frame index of each decoded frame in the file.
    total_frames: frames in the file; fps: the file's frame rate (frames per second).
    uniform: the frames are uniformly spaced (False after frame selection).
    """

    frames: np.ndarray
    indices: list[int]
    total_frames: int
    fps: float
    uniform: bool = True

    def subset(self, keep: list[int]) -> "DecodedVideo":
        """The frames at positions `keep` (sorted into time order), no longer uniformly spaced."""
        keep = sorted(keep)
        return DecodedVideo(
            frames=self.frames[keep],
            indices=[self.indices[i] for i in keep],
            total_frames=self.total_frames,
            fps=self.fps,
            uniform=False,
        )

    @property
    def sampled_fps(self) -> float:
        """Frames per second of video time covered by the sampled frames (Qwen's `sampled_fps`)."""
        return len(self.indices) / self.total_frames * self.fps


def decode_video(path: str | Path, max_num_frames: int) -> DecodedVideo:
    """`min(total, max_num_frames)` uniformly spaced frames of the video at `path`, with decord."""
    import decord

    path = Path(path)
    if not path.is_file():
        raise VideoDecodeError(f"video not found: {path}")
    try:
        reader = decord.VideoReader(str(path), num_threads=1)
        total = len(reader)
        indices = uniform_frame_indices(total, max_num_frames)
        frames = reader.get_batch(indices).asnumpy()
        fps = float(reader.get_avg_fps())
    except Exception as exc:  # decord raises its own error types for corrupt files
        raise VideoDecodeError(f"cannot decode video {path}: {exc}") from exc
    if frames.ndim != 4 or frames.shape[0] != len(indices):
        raise VideoDecodeError(f"cannot decode video {path}: got frames of shape {frames.shape}")
    return DecodedVideo(frames=frames, indices=indices, total_frames=total, fps=fps)
