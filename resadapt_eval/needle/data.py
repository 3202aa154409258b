"""The needle benchmark's data: synthetic videos where one frame pair carries a tiny
high-frequency symbol that is readable only at full resolution.

Each video: T=16 frames of 224x224 pixels. Background: a two-colour gradient with 1-3 soft-edged
moving discs or squares (edges ~3 px, so distractors carry no fine detail); no pixel noise, which
would not compress losslessly (about 80 KB a video without it, over 1 MB with it). One
frame pair, at a random position among the first `evidence_pairs` pairs (default 4: the first
half; the Allocator's training split uses all 8 so that position alone cannot find it), carries a
glyph 12-20 px wide whose class is a pattern at the pixel Nyquist frequency with the background's
mean colour (zero-mean contrast): alternating rows, alternating columns, a grid, or a checkerboard.
Downscaling averages the pattern away, so a downscaled evidence pair is unreadable. With
`cue=True` the evidence frames also get a coarse bright border that a cheap encoder can see.

Videos are lossless (libx264rgb, qp 0, Matroska), so the glyph survives storage exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..fixtures import write_video

CLASSES = ("horizontal stripes", "vertical stripes", "grid", "checkerboard")
LETTERS = "ABCD"
QUESTION = (
    "Which symbol appears in the video?\n"
    + "\n".join(f"{letter}. {c}" for letter, c in zip(LETTERS, CLASSES))
    + "\nAnswer with the option's letter."
)
SIZE, FRAMES, FPS = 224, 16, 8
EVIDENCE_PAIRS = FRAMES // 4  # default: the evidence pair lies in the first half


@dataclass(frozen=True)
class NeedleSpec:
    """One video: glyph class (0-3), the evidence pair index, glyph size (px) and top-left corner."""

    label: int
    evidence_pair: int
    glyph: int
    x: int
    y: int


def glyph_pattern(label: int, size: int) -> np.ndarray:
    """(size, size) pattern in {-1, +1} at the pixel Nyquist frequency."""
    yy, xx = np.mgrid[0:size, 0:size]
    if label == 0:
        return np.where(yy % 2 == 0, 1.0, -1.0)
    if label == 1:
        return np.where(xx % 2 == 0, 1.0, -1.0)
    if label == 2:
        return np.where((yy % 2 == 0) | (xx % 2 == 0), 1.0, -1.0) - 0.5  # grid lines, zero-mean up to rounding
    return np.where((yy + xx) % 2 == 0, 1.0, -1.0)


def render_video(rng: np.random.Generator, spec: NeedleSpec, cue: bool = False, num_frames: int = FRAMES) -> np.ndarray:
    """uint8 frames (num_frames, SIZE, SIZE, 3); the evidence pair must lie within them."""
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    c1, c2 = rng.uniform(50, 200, 3), rng.uniform(50, 200, 3)
    w = (np.cos(rng.uniform(0, np.pi)) * xx + np.sin(rng.uniform(0, np.pi)) * yy)[..., None]
    w = (w - w.min()) / (w.max() - w.min() + 1e-9)
    background = c1 * (1 - w) + c2 * w
    frames = np.repeat(background[None], num_frames, axis=0).astype(np.float32)
    t = np.arange(num_frames, dtype=np.float32)[:, None, None]
    py, px = (yy * SIZE).astype(np.float32)[None], (xx * SIZE).astype(np.float32)[None]
    for _ in range(int(rng.integers(1, 4))):  # soft-edged moving shapes, all frames at once
        radius = rng.uniform(15, 40)
        start, velocity = rng.uniform(40, 184, 2), rng.uniform(-4, 4, 2)
        colour, square = rng.uniform(30, 225, 3).astype(np.float32), rng.random() < 0.5
        dy, dx = py - (start[0] + velocity[0] * t), px - (start[1] + velocity[1] * t)
        dist = np.maximum(np.abs(dy), np.abs(dx)) if square else np.hypot(dy, dx)
        alpha = np.clip((radius - dist) / 3.0, 0, 1)[..., None]
        frames = frames * (1 - alpha) + colour * alpha
    pattern = glyph_pattern(spec.label, spec.glyph)[..., None] * 60.0
    for t in (2 * spec.evidence_pair, 2 * spec.evidence_pair + 1):
        patch = frames[t, spec.y : spec.y + spec.glyph, spec.x : spec.x + spec.glyph]
        frames[t, spec.y : spec.y + spec.glyph, spec.x : spec.x + spec.glyph] = patch.mean(axis=(0, 1)) + pattern
        if cue:
            frames[t, :6], frames[t, -6:], frames[t, :, :6], frames[t, :, -6:] = 255, 255, 255, 255
    frames += rng.normal(0, 1.0, frames.shape)
    return frames.clip(0, 255).astype(np.uint8)


def make_split(
    out: Path,
    split: str,
    count: int,
    seed: int,
    cue: bool = False,
    evidence_pairs: int = EVIDENCE_PAIRS,
    progress: bool = True,
) -> Path:
    """Write `count` videos and `<split>.jsonl` (rows: video_path and video (the same path, for
    the lmms-eval task and the trainer), task_type, question, answer, label, evidence_pair,
    evidence_frames, cue) under `out`; returns the JSONL path. The first k rows of a split do
    not depend on `count`. The evidence pair is drawn from pairs 0 .. evidence_pairs - 1."""
    from tqdm import tqdm

    if not 1 <= evidence_pairs <= FRAMES // 2:
        raise ValueError(
            f"evidence_pairs must be in 1..{FRAMES // 2} (a video has {FRAMES // 2} frame pairs), got {evidence_pairs}"
        )
    rng = np.random.default_rng(seed)
    rows = []
    for i in tqdm(range(count), desc=f"needle {split}", disable=not progress):
        glyph = int(rng.integers(12, 21))
        spec = NeedleSpec(
            label=int(rng.integers(0, 4)),
            evidence_pair=int(rng.integers(0, evidence_pairs)),
            glyph=glyph,
            x=int(rng.integers(8, SIZE - glyph - 8)),
            y=int(rng.integers(8, SIZE - glyph - 8)),
        )
        path = out / split / f"needle_{split}_{i:05d}.mkv"
        write_video(path, render_video(rng, spec, cue), FPS, lossless=True)
        rows.append(
            dict(
                video_path=str(path.resolve()),
                video=str(path.resolve()),
                task_type="multiple_choice",
                question=QUESTION,
                answer=LETTERS[spec.label],
                label=spec.label,
                evidence_pair=spec.evidence_pair,
                evidence_frames=[2 * spec.evidence_pair, 2 * spec.evidence_pair + 1],
                cue=cue,
            )
        )
    jsonl = out / f"{split}.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return jsonl


def make_data(
    out: str | Path,
    train: int = 2000,
    val: int = 200,
    test: int = 400,
    seed: int = 0,
    cue: bool = False,
    evidence_pairs: int = EVIDENCE_PAIRS,
) -> dict[str, Path]:
    """The three splits, each from its own seed (seed, seed + 1, seed + 2); a split of 0 videos is skipped."""
    out = Path(out)
    splits = (("train", train), ("val", val), ("test", test))
    return {
        split: make_split(out, split, n, seed + k, cue, evidence_pairs) for k, (split, n) in enumerate(splits) if n > 0
    }


def ensure_test_split(out: str | Path, count: int, seed: int = 0, cue: bool = True) -> Path:
    """`out/test.jsonl` with at least `count` rows of the given cue setting: kept when already
    there, else written as the first `count` rows of `make_data(out, seed=seed, cue=cue)`'s test
    split (its seed is seed + 2)."""
    jsonl = Path(out) / "test.jsonl"
    if jsonl.is_file():
        rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
        if len(rows) >= count and all(r.get("cue") == cue and Path(r["video_path"]).is_file() for r in rows[:count]):
            return jsonl
    return make_split(Path(out), "test", count, seed + 2, cue)


def needle_process_results(doc, results):
    """Accuracy by the option letter (lmms-eval task `resadapt_needle`)."""
    from ..capo.rewards import choice_letter

    return {"needle_acc": float(choice_letter(results[0], LETTERS) == doc["answer"])}
