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

Two more variants test the paper's two central claims (`make_split(..., variant=...)`):
- `query`: k (default 3) candidate pairs, each with its own glyph (distinct classes) on a card of
  its own colour, and a border of that colour on its frames (coarse: a cheap encoder sees it);
  the question names one colour ("... in the frames with the red border?"). Only the question
  says which candidate matters, so an allocation that ignores it can at best guess.
- `long`: 128 frames; the evidence (glyph and white border cue) lasts one pair, anywhere. Read at
  a visual-token budget equal to vanilla at 8 frames: 8 frames at full size rarely include it,
  128 frames mostly small with the evidence at full size do.

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
VARIANTS = ("single", "query", "long")
LONG_FRAMES = 128
CANDIDATES = 3
# Cue colours (RGB) of the query variant: saturated, far from each other and from the backgrounds' greys.
COLOURS = {"red": (205, 40, 40), "green": (40, 175, 60), "blue": (45, 75, 215), "yellow": (215, 200, 35)}
BORDER_PX, CARD_MARGIN_PX = 8, 10
CUE_BORDER_PX = 6  # the white `--cue` border


def query_question(colour: str) -> str:
    """The query variant's question: the single variant's, ending with which frames to read (the
    needle LLM reads characters; its 3 layers find a word near the answer far more easily)."""
    return f"{QUESTION} Read the frames with the {colour} border."


@dataclass(frozen=True)
class NeedleSpec:
    """One video: glyph class (0-3), the evidence pair index, glyph size (px) and top-left corner."""

    label: int
    evidence_pair: int
    glyph: int
    x: int
    y: int
    colour: str | None = None  # the query variant's cue colour (a COLOURS key)
    contrast: float = 60.0  # the glyph's amplitude (grey levels); 0: the card and border alone


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


def render_background(rng: np.random.Generator, num_frames: int, dtype=np.float64) -> np.ndarray:
    """Frames (num_frames, SIZE, SIZE, 3): a two-colour gradient with 1-3 soft-edged moving shapes.
    dtype: the shapes' arithmetic (float64 as the first needle data was made; the long variant's
    128 frames use float32, ~4x faster)."""
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    c1, c2 = rng.uniform(50, 200, 3), rng.uniform(50, 200, 3)
    w = (np.cos(rng.uniform(0, np.pi)) * xx + np.sin(rng.uniform(0, np.pi)) * yy)[..., None]
    w = (w - w.min()) / (w.max() - w.min() + 1e-9)
    background = c1 * (1 - w) + c2 * w
    frames = np.repeat(background[None], num_frames, axis=0).astype(np.float32)
    t = np.arange(num_frames, dtype=np.float32)[:, None, None]
    py, px = (yy * SIZE).astype(np.float32)[None], (xx * SIZE).astype(np.float32)[None]
    for _ in range(int(rng.integers(1, 4))):  # soft-edged moving shapes, all frames at once
        radius = dtype(rng.uniform(15, 40))
        start, velocity = rng.uniform(40, 184, 2).astype(dtype), rng.uniform(-4, 4, 2).astype(dtype)
        colour, square = rng.uniform(30, 225, 3).astype(np.float32), rng.random() < 0.5
        dy, dx = py - (start[0] + velocity[0] * t), px - (start[1] + velocity[1] * t)
        dist = np.maximum(np.abs(dy), np.abs(dx)) if square else np.hypot(dy, dx)
        alpha = np.clip((radius - dist) / 3.0, 0, 1)[..., None]
        frames = frames * (1 - alpha) + colour * alpha
    return frames


def draw_evidence(frames: np.ndarray, spec: NeedleSpec, cue: bool) -> None:
    """Draw `spec`'s glyph on its pair's two frames, in place. With a colour: on a card of that
    colour (CARD_MARGIN_PX around the glyph) with a border of that colour; else with `cue`, a
    white border."""
    pattern = glyph_pattern(spec.label, spec.glyph)[..., None] * spec.contrast
    x, y, g = spec.x, spec.y, spec.glyph
    for t in (2 * spec.evidence_pair, 2 * spec.evidence_pair + 1):
        if spec.colour is not None:
            colour = np.array(COLOURS[spec.colour], np.float32)
            m = CARD_MARGIN_PX
            frames[t, max(0, y - m) : y + g + m, max(0, x - m) : x + g + m] = colour
            frames[t, y : y + g, x : x + g] = colour + pattern
            border = colour
        else:
            patch = frames[t, y : y + g, x : x + g]
            frames[t, y : y + g, x : x + g] = patch.mean(axis=(0, 1)) + pattern
            border = 255.0 if cue else None
        if border is not None:
            b = BORDER_PX if spec.colour is not None else CUE_BORDER_PX
            frames[t, :b], frames[t, -b:], frames[t, :, :b], frames[t, :, -b:] = border, border, border, border


def finish(rng: np.random.Generator, frames: np.ndarray, noise: bool = True) -> np.ndarray:
    """uint8 frames, with pixel noise of standard deviation 1 unless `noise` is False (the long
    variant's 128 frames: noise makes a lossless video ~7 MB instead of ~0.6 MB)."""
    if noise:
        frames += rng.normal(0, 1.0, frames.shape)
    return frames.clip(0, 255).astype(np.uint8)


def render_video(
    rng: np.random.Generator, spec: NeedleSpec, cue: bool = False, num_frames: int = FRAMES, noise: bool = True
) -> np.ndarray:
    """uint8 frames (num_frames, SIZE, SIZE, 3); the evidence pair must lie within them. Without
    `noise` (the long variant) the shapes are drawn in float32."""
    frames = render_background(rng, num_frames, np.float64 if noise else np.float32)
    draw_evidence(frames, spec, cue)
    return finish(rng, frames, noise)


def render_query_video(rng: np.random.Generator, candidates: list[NeedleSpec], num_frames: int = FRAMES) -> np.ndarray:
    """uint8 frames with every candidate's glyph, card and border (each its own pair and colour)."""
    frames = render_background(rng, num_frames)
    for spec in candidates:
        draw_evidence(frames, spec, cue=True)
    return finish(rng, frames)


def random_spec(rng: np.random.Generator, evidence_pairs: int, glyph_range=(12, 20)) -> NeedleSpec:
    """A glyph of a random class in one of pairs 0 .. evidence_pairs - 1, at a random size (px) and
    place (draws: size, class, pair, x, y; the order every needle split was made in)."""
    glyph = int(rng.integers(glyph_range[0], glyph_range[1] + 1))
    return NeedleSpec(
        label=int(rng.integers(0, 4)),
        evidence_pair=int(rng.integers(0, evidence_pairs)),
        glyph=glyph,
        x=int(rng.integers(8, SIZE - glyph - 8)),
        y=int(rng.integers(8, SIZE - glyph - 8)),
    )


def random_glyph(rng: np.random.Generator, label: int, pair: int, glyph_range=(12, 20), colour=None) -> NeedleSpec:
    """A glyph of `label` in `pair` at a random size (px) and place, clear of the border and card margin."""
    glyph = int(rng.integers(glyph_range[0], glyph_range[1] + 1))
    margin = 8 if colour is None else BORDER_PX + CARD_MARGIN_PX
    return NeedleSpec(
        label=label,
        evidence_pair=pair,
        glyph=glyph,
        x=int(rng.integers(margin, SIZE - glyph - margin)),
        y=int(rng.integers(margin, SIZE - glyph - margin)),
        colour=colour,
    )


def random_query(
    rng: np.random.Generator, pairs: int = FRAMES // 2, candidates: int = CANDIDATES, glyph_range=(12, 20)
) -> tuple[list[NeedleSpec], int]:
    """`candidates` glyphs of distinct classes and colours in distinct pairs, and the target's index."""
    chosen = rng.choice(pairs, size=candidates, replace=False)
    labels = rng.choice(len(CLASSES), size=candidates, replace=False)
    colours = rng.choice(list(COLOURS), size=candidates, replace=False)
    specs = [
        random_glyph(rng, int(label), int(pair), glyph_range, str(colour))
        for pair, label, colour in zip(chosen, labels, colours)
    ]
    return specs, int(rng.integers(0, candidates))


def make_split(
    out: Path,
    split: str,
    count: int,
    seed: int,
    cue: bool = False,
    evidence_pairs: int | None = None,
    progress: bool = True,
    variant: str = "single",
    candidates: int = CANDIDATES,
) -> Path:
    """Write `count` videos and `<split>.jsonl` (rows: video_path and video (the same path, for
    the lmms-eval task and the trainer), task_type, question, answer, label, evidence_pair,
    evidence_frames, cue, variant; the query variant adds colour and candidate_pairs / _colours / _labels) under `out`;
    returns the JSONL path. The first k rows of a split do not depend on `count`. The evidence
    pair is drawn from pairs 0 .. evidence_pairs - 1 (default: the first half for `single`, any
    pair for `long`; `query` puts its candidates anywhere)."""
    from tqdm import tqdm

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    num_frames = LONG_FRAMES if variant == "long" else FRAMES
    pairs = num_frames // 2
    if evidence_pairs is None:
        evidence_pairs = EVIDENCE_PAIRS if variant == "single" else pairs
    if not 1 <= evidence_pairs <= pairs:
        raise ValueError(
            f"evidence_pairs must be in 1..{pairs} (a {variant} video has {pairs} frame pairs), got {evidence_pairs}"
        )
    if variant == "query" and not 2 <= candidates <= min(len(CLASSES), len(COLOURS)):
        raise ValueError(f"candidates must be in 2..{min(len(CLASSES), len(COLOURS))}, got {candidates}")
    rng = np.random.default_rng(seed)
    rows = []
    for i in tqdm(range(count), desc=f"needle {variant} {split}", disable=not progress):
        extra = {}
        if variant == "query":
            specs, target = random_query(rng, pairs, candidates)
            spec = specs[target]
            frames = render_query_video(rng, specs, num_frames)
            question = query_question(spec.colour)
            extra = dict(
                colour=spec.colour,
                candidate_pairs=[s.evidence_pair for s in specs],
                candidate_colours=[s.colour for s in specs],
                candidate_labels=[s.label for s in specs],
            )
        else:
            spec = random_spec(rng, evidence_pairs)
            frames = render_video(rng, spec, cue, num_frames, noise=variant != "long")
            question = QUESTION
        path = out / split / f"needle_{split}_{i:05d}.mkv"
        write_video(path, frames, FPS, lossless=True)
        rows.append(
            dict(
                video_path=str(path.resolve()),
                video=str(path.resolve()),
                task_type="multiple_choice",
                question=question,
                answer=LETTERS[spec.label],
                label=spec.label,
                evidence_pair=spec.evidence_pair,
                evidence_frames=[2 * spec.evidence_pair, 2 * spec.evidence_pair + 1],
                cue=bool(cue or variant == "query"),
                variant=variant,
                **extra,
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
    evidence_pairs: int | None = None,
    variant: str = "single",
    candidates: int = CANDIDATES,
) -> dict[str, Path]:
    """The three splits, each from its own seed (seed, seed + 1, seed + 2); a split of 0 videos is skipped."""
    out = Path(out)
    splits = (("train", train), ("val", val), ("test", test))
    return {
        split: make_split(out, split, n, seed + k, cue, evidence_pairs, variant=variant, candidates=candidates)
        for k, (split, n) in enumerate(splits)
        if n > 0
    }


def ensure_test_split(out: str | Path, count: int, seed: int = 0, cue: bool = True, variant: str = "single") -> Path:
    """`out/test.jsonl` with at least `count` rows of the given cue setting and variant: kept when
    already there, else written as the first `count` rows of `make_data(out, seed=seed, cue=cue,
    variant=variant)`'s test split (its seed is seed + 2)."""
    jsonl = Path(out) / "test.jsonl"
    if jsonl.is_file():
        rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
        if len(rows) >= count and all(
            r.get("cue") == cue and r.get("variant", "single") == variant and Path(r["video_path"]).is_file()
            for r in rows[:count]
        ):
            return jsonl
    return make_split(Path(out), "test", count, seed + 2, cue, variant=variant)


def needle_process_results(doc, results):
    """Accuracy by the option letter (lmms-eval task `resadapt_needle`)."""
    from ..capo.rewards import choice_letter

    return {"needle_acc": float(choice_letter(results[0], LETTERS) == doc["answer"])}


def ensure_needle_data(needle_data: dict | None, limit: int | None = None, echo=print) -> Path | None:
    """Write a card's needle test split (its `needle_data:` section) when it is missing or short:
    `videos` rows (`limit` rows when a sweep reads only its first `limit`) of `resadapt-eval needle
    make-data --variant V [--cue] --out OUT`'s test split; a later, longer sweep extends it with the
    same videos first. None for a card without the section."""
    if needle_data is None:
        return None
    count = limit or int(needle_data.get("videos", 400))
    jsonl = ensure_test_split(
        needle_data["out"], count, cue=bool(needle_data.get("cue", True)), variant=needle_data.get("variant", "single")
    )
    echo(f"needle data: {jsonl}")
    return jsonl
