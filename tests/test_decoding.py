"""Decoding what users have: decord where it works, PyAV otherwise (AV1, rotation, tiny frames, GIFs,
images), with the same frame count, indices, frame rate and timestamps whichever decoder read the file;
and lmms-eval's media classes (.webm as audio, every .gif as image) routed to the right request field."""

import struct
from pathlib import Path

import av
import decord
import numpy as np
import pytest
from lmms_eval.api.task import ConfigurableMessagesTask
from PIL import Image

from resadapt_eval import video as video_module
from resadapt_eval.budget.plan import uniform_frame_indices
from resadapt_eval.video import VideoDecodeError, decode_video, is_moving_video, probe_video, read_image

FRAMES, RATE = 10, 10  # every synthetic video: 10 frames at 10 fps
CLOCKWISE_90 = (0, 65536, 0, -65536, 0, 0, 0, 0, 0x40000000)  # a portrait phone video's track matrix
HALF_TURN = (-65536, 0, 0, 0, -65536, 0, 0, 0, 0x40000000)


def ramp(t: int, height: int, width: int) -> np.ndarray:
    """Frame t: red = 20 t everywhere, and a green top-left quadrant that shows where rotation moved it."""
    frame = np.zeros((height, width, 3), np.uint8)
    frame[..., 0] = 20 * t
    frame[: height // 2, : width // 2, 1] = 255
    return frame


def write_video(path: Path, codec: str, width: int, height: int, pix_fmt: str = "yuv420p", **options) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=RATE, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for t in range(FRAMES):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(ramp(t, height, width), format="rgb24")))
        container.mux(stream.encode())
    return path


def with_display_matrix(src: Path, dst: Path, matrix: tuple) -> Path:
    """`src` with its track header's display matrix set (ISO 14496-12 tkhd; PyAV cannot write it)."""
    data = bytearray(src.read_bytes())
    at = data.index(b"tkhd")
    matrix_at = at + 8 + (20 if data[at + 4] == 0 else 32) + 16  # after version/flags, times and ids, reserved
    data[matrix_at : matrix_at + 36] = struct.pack(">9i", *matrix)
    dst.write_bytes(bytes(data))
    return dst


def red_by_frame(frames: np.ndarray) -> np.ndarray:
    return frames[..., 0].reshape(len(frames), -1).mean(axis=1)


@pytest.mark.parametrize("codec, suffix", [("libx264", "mp4"), ("libvpx-vp9", "webm")])
def test_decord_and_pyav_give_the_same_frames_indices_rate_and_timestamps(tmp_path, codec, suffix):
    path = write_video(tmp_path / f"clip.{suffix}", codec, 64, 48)
    info = probe_video(path)
    with av.open(str(path)) as container:
        stored_count = container.streams.video[0].frames  # 0 for webm: the probe counts packets instead
    assert stored_count == (FRAMES if suffix == "mp4" else 0)
    reader = decord.VideoReader(str(path), num_threads=1)
    assert (info.total_frames, info.fps, info.rotation) == (FRAMES, RATE, 0)
    assert (len(reader), reader.get_avg_fps()) == (info.total_frames, info.fps)

    decoded = decode_video(path, 4)
    assert decoded.indices == uniform_frame_indices(FRAMES, 4) == [0, 3, 6, 9]
    assert (decoded.total_frames, decoded.fps, decoded.frames.shape) == (FRAMES, RATE, (4, 48, 64, 3))
    by_decord = video_module._read_decord(path, decoded.indices, info)
    by_pyav = video_module._read_pyav(path, decoded.indices, info)
    np.testing.assert_array_equal(decoded.frames, by_decord)
    np.testing.assert_array_equal(by_decord, by_pyav)
    np.testing.assert_allclose(red_by_frame(by_pyav), [0, 60, 120, 180], atol=4)
    # presentation timestamps (s) of the chosen frames, as each decoder reports them
    decord_times = reader.get_frame_timestamp(decoded.indices)[:, 0]
    with av.open(str(path)) as container:
        pyav_times = [frame.time for frame in container.decode(video=0)]
    np.testing.assert_allclose(decord_times, [pyav_times[i] for i in decoded.indices], atol=1e-6)
    np.testing.assert_allclose(decord_times, np.array(decoded.indices) / decoded.fps, atol=1e-6)


@pytest.mark.skipif("libaom-av1" not in av.codecs_available, reason="this PyAV wheel has no AV1 encoder")
def test_av1_which_decord_cannot_open_is_read_by_pyav(tmp_path):
    path = write_video(tmp_path / "clip.mp4", "libaom-av1", 64, 48, **{"cpu-used": "8"})
    with pytest.raises(decord.DECORDError, match="cannot find video stream"):
        decord.VideoReader(str(path), num_threads=1)
    decoded = decode_video(path, 4)
    assert (decoded.indices, decoded.total_frames, decoded.fps) == ([0, 3, 6, 9], FRAMES, RATE)
    assert decoded.frames.shape == (4, 48, 64, 3) and decoded.frames.dtype == np.uint8
    np.testing.assert_allclose(red_by_frame(decoded.frames), [0, 60, 120, 180], atol=6)


@pytest.mark.parametrize(
    "width, height, matrix, rotation, shape, green_at",
    [
        (96, 48, CLOCKWISE_90, -90, (96, 48), "top-right"),  # decord 0.6 fails on it
        (64, 64, CLOCKWISE_90, -90, (64, 64), "top-right"),  # decord 0.6 rotates it itself: not twice
        (96, 48, HALF_TURN, -180, (48, 96), "bottom-right"),
    ],
)
def test_the_display_rotation_is_applied(tmp_path, width, height, matrix, rotation, shape, green_at):
    stored = write_video(tmp_path / "stored.mp4", "libx264", width, height)
    path = with_display_matrix(stored, tmp_path / "rotated.mp4", matrix)
    assert probe_video(path).rotation == rotation
    decoded = decode_video(path, 4)
    assert decoded.frames.shape == (4, *shape, 3)
    assert (decoded.indices, decoded.total_frames, decoded.fps) == ([0, 3, 6, 9], FRAMES, RATE)
    h, w = shape[0] // 2, shape[1] // 2
    quadrants = {
        "top-left": decoded.frames[:, :h, :w, 1],
        "top-right": decoded.frames[:, :h, w:, 1],
        "bottom-left": decoded.frames[:, h:, :w, 1],
        "bottom-right": decoded.frames[:, h:, w:, 1],
    }
    assert {name: bool(q.mean() > 200) for name, q in quadrants.items()} == {
        name: name == green_at for name in quadrants
    }


def test_an_8x8_video_which_decord_garbles_is_read_by_pyav(tmp_path):
    path = write_video(tmp_path / "tiny.mp4", "libx264", 8, 8)
    assert decord.VideoReader(str(path), num_threads=1)[0].shape == (8, 8, 12)  # not (8, 8, 3)
    decoded = decode_video(path, 4)
    assert decoded.frames.shape == (4, 8, 8, 3)
    assert (decoded.indices, decoded.total_frames, decoded.fps) == ([0, 3, 6, 9], FRAMES, RATE)
    np.testing.assert_allclose(red_by_frame(decoded.frames), [0, 60, 120, 180], atol=8)


def test_an_animated_gif_is_a_video(tmp_path):
    path = write_video(tmp_path / "clip.gif", "gif", 32, 24, pix_fmt="rgb8")
    assert is_moving_video(path)
    decoded = decode_video(path, 4)
    assert decoded.frames.shape == (4, 24, 32, 3)
    assert (decoded.indices, decoded.total_frames, decoded.fps) == ([0, 3, 6, 9], FRAMES, RATE)
    assert np.all(np.diff(red_by_frame(decoded.frames)) > 30)  # 3-bit red palette, still increasing


def test_an_image_path_is_a_one_frame_video_or_an_image_with_its_exif_orientation(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    png = tmp_path / "still.png"
    Image.fromarray(pixels).save(png)
    assert not is_moving_video(png)
    decoded = decode_video(png, 4)
    assert (decoded.indices, decoded.total_frames) == ([0], 1)
    np.testing.assert_array_equal(decoded.frames, pixels[None])
    np.testing.assert_array_equal(read_image(png), pixels)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: display rotated 90 degrees clockwise
    jpg = tmp_path / "phone.jpg"
    Image.fromarray(pixels).save(jpg, exif=exif, quality=95)
    assert read_image(jpg).shape == (40, 30, 3)


def test_unreadable_files_raise_video_decode_error_naming_the_path(tmp_path):
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"not a video" * 100)
    with pytest.raises(VideoDecodeError, match=f"cannot decode video {garbage}: PyAV: .*Invalid data"):
        decode_video(garbage, 4)
    mp4 = write_video(tmp_path / "whole.mp4", "libx264", 64, 48).read_bytes()
    truncated = tmp_path / "truncated.mp4"  # the index (moov) is written last: cut away
    truncated.write_bytes(mp4[: len(mp4) // 2])
    with pytest.raises(VideoDecodeError, match=f"cannot decode video {truncated}: PyAV: "):
        decode_video(truncated, 4)
    with pytest.raises(VideoDecodeError, match=f"video not found: {tmp_path / 'missing.webm'}"):
        decode_video(tmp_path / "missing.webm", 4)


@pytest.mark.skipif("libaom-av1" not in av.codecs_available, reason="this PyAV wheel has no AV1 encoder")
def test_a_file_neither_decoder_can_read_names_both_reasons(tmp_path):
    path = write_video(tmp_path / "broken.mp4", "libaom-av1", 64, 48, **{"cpu-used": "8"})
    data = bytearray(path.read_bytes())
    with av.open(str(path)) as container:
        packets = [(p.pos, p.size) for p in container.demux(video=0) if p.size]
    for pos, size in packets[5:]:  # the first frames decode (the probe passes), the later ones are noise
        data[pos : pos + size] = b"\xff" * size
    path.write_bytes(bytes(data))
    with pytest.raises(VideoDecodeError, match=f"cannot decode video {path}: decord: .*; PyAV: .*Invalid data"):
        decode_video(path, 4)


def test_an_audio_only_file_is_not_a_video(tmp_path):
    path = tmp_path / "speech.webm"
    write_audio(path)
    assert not is_moving_video(path)
    with pytest.raises(VideoDecodeError, match=f"cannot decode video {path}: PyAV: the file has no video stream"):
        decode_video(path, 4)


def write_audio(path: Path) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libopus", rate=48000)
        for i in range(10):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 960), np.float32), format="flt", layout="mono")
            frame.sample_rate, frame.pts = 48000, i * 960
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


# ---------------------------------------------------------------- lmms-eval messages -> Request


@pytest.fixture(scope="module")
def model(fixtures_dir, tmp_path_factory):
    from resadapt_eval.lmms.models import ResAdaptQwen25VL

    return ResAdaptQwen25VL(
        pretrained=str(fixtures_dir / "qwen25vl"),
        dtype="float32",
        max_num_frames=4,
        sidecar_dir=str(tmp_path_factory.mktemp("sidecar")),
    )


def lmms_eval_messages(path: Path) -> list:
    """The chat turn lmms-eval's messages tasks build for a doc whose doc_to_visual returns `path`."""
    return ConfigurableMessagesTask._build_user_turn([str(path)], "What colour is it?")


def test_webm_and_gif_paths_become_videos_and_image_paths_images(model, tmp_path):
    webm = write_video(tmp_path / "clip.webm", "libvpx-vp9", 64, 48)
    gif = write_video(tmp_path / "clip.gif", "gif", 32, 24, pix_fmt="rgb8")
    png = tmp_path / "still.png"
    Image.fromarray(ramp(0, 56, 84)).save(png)
    kinds = {p.suffix: lmms_eval_messages(p)[0]["content"][0]["type"] for p in (webm, gif, png)}
    assert kinds == {".webm": "audio", ".gif": "image", ".png": "image"}  # lmms-eval 0.7.3's classes

    for path in (webm, gif):
        request = model._request(lmms_eval_messages(path), {"max_new_tokens": 2}, 0, "t")
        assert request.video == str(path) and request.images == ()
        assert request.prompt.count("<|video_pad|>") == 1 and "<|image_pad|>" not in request.prompt
        _, record = model.pipeline.run(request)
        assert record.error is None and record.frame_indices == [0, 3, 6, 9] and record.visual_tokens > 0

    request = model._request(lmms_eval_messages(png), {"max_new_tokens": 2}, 0, "t")
    assert request.video is None and request.images == (str(png),)
    assert request.prompt.count("<|image_pad|>") == 1 and "<|video_pad|>" not in request.prompt
    _, record = model.pipeline.run(request)
    assert record.error is None and record.base_size == [[56, 84]]


def test_an_audio_only_webm_stays_audio_and_is_refused(model, tmp_path):
    path = write_audio(tmp_path / "speech.webm")
    with pytest.raises(ValueError, match=r"expected one video or one or more images, got 0 video\(s\)"):
        model._request(lmms_eval_messages(path), {}, 0, "t")
