"""Decode a video once: uniformly spaced frames at the file's resolution, display rotation applied.

decord reads the frames when it can; PyAV reads what decord cannot (AV1, rotated videos, tiny frames,
GIFs, a still image as a one-frame video). The frame count, frame rate and rotation always come from
PyAV's view of the container, so the frame indices are the same whichever decoder read the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageOps

from .budget.plan import uniform_frame_indices


class VideoDecodeError(RuntimeError):
    """A video that is missing or cannot be decoded; the message names the path."""


class NoVideoStream(ValueError):
    """A file with no video stream (an audio file)."""


@dataclass
class DecodedVideo:
    """Frames decoded once from a video file.

    frames: uint8 array (T, H, W, 3) in pixels at the file's resolution, as displayed (rotation applied).
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


@dataclass(frozen=True)
class VideoInfo:
    """A video stream as PyAV sees it: total_frames (the container's count, else its packets),
    fps (frames per second), height and width of the stored frames in pixels, and rotation: the
    display matrix's counterclockwise rotation in degrees (a multiple of 90)."""

    total_frames: int
    fps: float
    height: int
    width: int
    rotation: int


def probe_video(path: str | Path) -> VideoInfo:
    """The first video stream of the file at `path` (PyAV; decodes its first frame for the rotation)."""
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise NoVideoStream("the file has no video stream")
        stream = container.streams.video[0]
        first = next(container.decode(stream), None)
        if first is None:
            raise ValueError("the video stream has no decodable frame")
        total, rate = stream.frames, stream.average_rate or stream.guessed_rate
    if not total:  # webm and still images store no frame count: count the stream's packets
        with av.open(str(path)) as container:
            total = sum(1 for packet in container.demux(container.streams.video[0]) if packet.size)
    if not rate:
        raise ValueError("the video stream has no frame rate")
    if first.rotation % 90:
        raise ValueError(f"display rotation {first.rotation} degrees is not a multiple of 90")
    return VideoInfo(total, float(rate), first.height, first.width, first.rotation)


def is_moving_video(path: str | Path) -> bool:
    """Whether the file at `path` holds a video stream of more than one frame: an mp4 or a .webm
    video does, and so does an animated GIF; a still image or an audio-only file does not."""
    try:
        return probe_video(path).total_frames > 1
    except NoVideoStream:
        return False


def read_image(path: str | Path) -> np.ndarray:
    """The image file at `path` as uint8 (H, W, 3) RGB, its EXIF orientation applied (the first
    frame of an animated image)."""
    with Image.open(path) as image:
        return np.array(ImageOps.exif_transpose(image).convert("RGB"))


def decode_video(path: str | Path, max_num_frames: int) -> DecodedVideo:
    """`min(total, max_num_frames)` uniformly spaced frames of the video at `path`, frames (T, H, W, 3)
    uint8 as displayed (rotation applied): with decord, or with PyAV when decord cannot read the file."""
    info = _probe(Path(path))
    indices = uniform_frame_indices(info.total_frames, max_num_frames)
    return DecodedVideo(
        frames=_read(Path(path), indices, info), indices=indices, total_frames=info.total_frames, fps=info.fps
    )


def read_frames(path: str | Path, indices: list[int]) -> np.ndarray:
    """The frames at `indices` (T, H, W, 3) uint8 of the video at `path`, as `decode_video` reads them."""
    info = _probe(Path(path))
    if indices and not 0 <= min(indices) <= max(indices) < info.total_frames:
        raise VideoDecodeError(f"frame indices {min(indices)}-{max(indices)} outside the {info.total_frames} of {path}")
    return _read(Path(path), list(indices), info)


def _probe(path: Path) -> VideoInfo:
    if not path.is_file():
        raise VideoDecodeError(f"video not found: {path}")
    try:
        return probe_video(path)
    except Exception as exc:
        raise VideoDecodeError(f"cannot decode video {path}: PyAV: {exc}") from exc


def _read(path: Path, indices: list[int], info: VideoInfo) -> np.ndarray:
    try:
        return _read_decord(path, indices, info)
    except Exception as decord_exc:  # decord raises its own error types for files it cannot read
        try:
            return _read_pyav(path, indices, info)
        except Exception as pyav_exc:
            raise VideoDecodeError(f"cannot decode video {path}: decord: {decord_exc}; PyAV: {pyav_exc}") from pyav_exc


def _read_decord(path: Path, indices: list[int], info: VideoInfo) -> np.ndarray:
    """The frames at `indices` (T, height, width, 3) with decord, which must count the same frames.
    Not for rotated videos: decord 0.6 rotates square frames itself and fails on the others."""
    import decord

    if info.rotation:
        raise ValueError(f"the video has a display rotation of {info.rotation} degrees")
    reader = decord.VideoReader(str(path), num_threads=1)
    if len(reader) != info.total_frames:
        raise ValueError(f"decord counts {len(reader)} frames, the container {info.total_frames}")
    frames = reader.get_batch(indices).asnumpy()
    if frames.shape != (len(indices), info.height, info.width, 3):
        raise ValueError(f"decord returned frames of shape {frames.shape} for a {info.width}x{info.height} video")
    return frames


def _read_pyav(path: Path, indices: list[int], info: VideoInfo) -> np.ndarray:
    """The frames at `indices` (T, H, W, 3) as displayed (rotation applied), decoding in order with PyAV."""
    wanted, frames = set(indices), []
    with av.open(str(path)) as container:
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            if index in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
            if len(frames) == len(indices):
                return np.ascontiguousarray(np.rot90(np.stack(frames), k=info.rotation // 90, axes=(1, 2)))
    raise ValueError(f"decoded {index + 1} frames, the container counts {info.total_frames}")
