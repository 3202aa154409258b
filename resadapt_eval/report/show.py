"""A contact sheet of one sample: what each method put in front of the LLM (`resadapt-eval show`).

One row per method: the sample's frames as the backbone received them (resized to the record's
plan, drawn at their true relative sizes in pixels), the visual tokens that did not enter the LLM
dimmed on the token grid (28 px on Qwen2.5-VL, 32 px on Qwen3-VL: a pair's size over its grid),
merged groups tinted in one colour per group with their destination outlined, under each frame its
scale where the method planned scales, and beside the frames an in-LLM method's visual tokens per
decoder layer. The row title holds the method, R, the question, the answer and the ground truth
(from lmms-eval's `--log_samples` file beside the sidecar, where there is one).

It reads the sidecar records (`kept.read_kept`) and the video only, never a model; a folder copied
from another machine is drawn with `video_root`, the folder that now holds the videos.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..kept import read_kept
from ..methods import METHODS
from ..video import read_frames
from .collect import collect, read_jsonl

DIM = 0.25  # a dropped token's brightness
TINT = 0.3  # a merged member's share of its group's colour
GAP = 8  # px between frames


@dataclass(frozen=True)
class Row:
    """One method's record of the sample; label: its row name; sample: lmms-eval's logged sample (None: not logged)."""

    label: str
    record: dict
    sample: dict | None


@dataclass(frozen=True)
class Frame:
    """One frame as drawn: image (h, w, 3) uint8; scale (None: the method plans none); dropped: its
    pair's tokens that did not enter the LLM, (grid h, grid w) bool."""

    image: np.ndarray
    scale: float | None
    dropped: np.ndarray


@dataclass(frozen=True)
class Sheet:
    """What `contact_sheet` wrote: the PNG, its size in pixels, each row's label and its frames'
    dropped-token counts."""

    path: Path
    size: tuple[int, int]
    labels: list[str]
    dropped: list[list[int]]


def sample_rows(
    run_dir: str | Path, doc_id: int, task: str | None = None, methods: list[str] | None = None
) -> list[Row]:
    """The records of sample `doc_id` in a sweep folder (every complete cell holding it, in the
    sweep's order) or in one run's output folder (its sidecars); `task` picks one where several
    tasks have that doc id; `methods` keeps those methods, in that order."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no such folder: {run_dir}")
    cells = collect(run_dir)
    found: list[tuple[str, dict, Path]] = []
    if cells:
        for cell in cells:
            for record in cell.records:
                found.append((_label(record, cell.retention), record, cell.path))
    else:
        for sidecar in sorted(run_dir.rglob("resadapt_samples_*.jsonl")):
            for record in read_jsonl(sidecar, "sidecar record; skipped")[0]:
                found.append((_label(record, record.get("target_retention")), record, sidecar.parent))
    if not found:
        raise FileNotFoundError(f"{run_dir} holds no sidecar records (resadapt_samples_*.jsonl) of a run or sweep")
    matching = [f for f in found if f[1].get("doc_id") == doc_id and (task is None or f[1].get("task") == task)]
    if not matching:
        held = sorted({r.get("doc_id") for _, r, _ in found if r.get("doc_id") is not None})
        shown = ", ".join(map(str, held[:12])) + (" ..." if len(held) > 12 else "")
        which = f"doc id {doc_id}" + (f" of task {task}" if task else "")
        raise ValueError(f"{run_dir}: no record of {which}; the folder holds doc ids {shown}")
    tasks = sorted({r.get("task") for _, r, _ in matching})
    if len(tasks) > 1:
        raise ValueError(f"doc id {doc_id} is a sample of tasks {', '.join(tasks)}: name one with --task")
    order = list(METHODS)  # the registry's order: the paper's rows
    matching.sort(key=lambda f: (order.index(f[1]["method"]) if f[1]["method"] in order else len(order), -_r(f[1])))
    if methods:
        unknown = sorted(set(methods) - {r["method"] for _, r, _ in matching})
        if unknown:
            raise ValueError(f"no record of doc id {doc_id} by {', '.join(unknown)} in {run_dir}")
        matching = sorted(
            (f for f in matching if f[1]["method"] in methods), key=lambda f: methods.index(f[1]["method"])
        )
    return [Row(label, record, logged_sample(folder, record)) for label, record, folder in matching]


def _r(record: dict) -> float:
    r = record.get("target_retention")
    return 2.0 if r is None else r


def _label(record: dict, retention) -> str:
    return record["method"] if retention is None else f"{record['method']} R={retention}"


def logged_sample(folder: Path, record: dict) -> dict | None:
    """lmms-eval's logged sample of this record (`*_samples_<task>.jsonl` under `folder`), or None."""
    for path in sorted(folder.rglob(f"*_samples_{record.get('task')}.jsonl")):
        if path.name.startswith("resadapt_samples_"):
            continue
        for sample in read_jsonl(path, "lmms-eval sample; skipped")[0]:
            if sample.get("doc_id") == record.get("doc_id"):
                return sample
    return None


def find_video(recorded: str, video_root: str | Path | None) -> Path:
    """The video a record names: its path, or under `video_root` the longest tail of that path that
    exists there (a folder copied from another machine)."""
    path = Path(recorded)
    if video_root is None:
        if not path.is_file():
            raise FileNotFoundError(f"video not found: {path} (give --video-root, the folder now holding the videos)")
        return path
    root = Path(video_root)
    if not root.is_dir():
        raise FileNotFoundError(f"--video-root {root} is not a folder")
    for start in range(len(path.parts)):
        candidate = root.joinpath(*path.parts[start:]) if not Path(*path.parts[start:]).is_absolute() else None
        if candidate is not None and candidate.is_file():
            return candidate
    raise FileNotFoundError(f"--video-root {root} does not hold the video {path.name} (the record's video: {path})")


def frames_of(record: dict, video_root: str | Path | None = None) -> list[Frame]:
    """The record's frames as drawn (see the module docstring)."""
    if record.get("error"):
        raise ValueError(f"doc id {record.get('doc_id')} failed under {record['method']}: {record['error']}")
    if record.get("video") is None:
        raise ValueError(f"doc id {record.get('doc_id')} is an image request; show draws video samples")
    kept = read_kept(record)
    if kept is None:
        raise ValueError(
            f"the record of doc id {record.get('doc_id')} by {record['method']} holds no kept tokens (a run made "
            "before they were recorded, or an engine that pruned without saying which: vLLM's EVS)"
        )
    images = read_frames(find_video(record["video"], video_root), record["frame_indices"])
    grids, sizes = record["grids"], record["pair_sizes"]
    starts = np.concatenate([[0], np.cumsum([t * h * w for t, h, w in grids])])
    mask = kept.mask
    scales = record.get("scales") or []
    plans_scales = any(abs(s - 1.0) > 1e-6 for s in scales)  # a resize policy's scales (vanilla's are all 1)
    frames = []
    for i, image in enumerate(images):
        pair = min(i * len(grids) // len(images), len(grids) - 1)
        _, gh, gw = grids[pair]
        tokens = slice(starts[pair], starts[pair + 1])
        drawn = draw_tokens(image, sizes[pair], (gh, gw), kept.assignment[tokens], int(starts[pair]))
        scale = scales[i] if plans_scales and i < len(scales) else None
        frames.append(Frame(drawn, scale, ~mask[tokens].reshape(gh, gw)))
    return frames


def group_colour(destination: int) -> np.ndarray:
    """An RGB colour in [0, 1] per group, by its destination token (golden-ratio hues)."""
    import matplotlib.colors as mcolors

    return np.array(mcolors.hsv_to_rgb(((destination * 0.618034) % 1.0, 0.85, 1.0)))


def draw_tokens(image: np.ndarray, size: list[int], grid: tuple[int, int], assignment, start: int) -> np.ndarray:
    """`image` resized to `size` (h, w) px, with its pair's tokens on a (gh, gw) `grid` (`assignment`:
    their destinations, the pair's first token being `start`): those not entering the LLM as their own
    dimmed, merged members tinted in their group's colour, each group's destination outlined in it."""
    h, w = size
    gh, gw = grid
    frame = np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32) / 255
    th, tw = h // gh, w // gw  # the token's size in px
    own = assignment == np.arange(start, start + len(assignment))
    members = (assignment >= 0) & ~own
    for cell in np.flatnonzero(~own):
        r, c = divmod(int(cell), gw)
        block = frame[r * th : (r + 1) * th, c * tw : (c + 1) * tw]
        block *= DIM
        if members[cell]:
            block += TINT * group_colour(int(assignment[cell]))
    for destination in np.unique(assignment[members]):
        local = int(destination) - start
        if 0 <= local < len(own):  # a group sitting in this pair
            r, c = divmod(local, gw)
            colour = group_colour(int(destination))
            block = frame[r * th : (r + 1) * th, c * tw : (c + 1) * tw]
            block[[0, -1], :] = colour
            block[:, [0, -1]] = colour
    return (np.clip(frame, 0, 1) * 255).astype(np.uint8)


def _title(row: Row) -> str:
    record, sample = row.record, row.sample
    parts = [f"{row.label}: {record['visual_tokens']} of {record['reference_tokens']} tokens"]
    if record.get("achieved_retention") is not None:
        parts[0] += f" (R {record['achieved_retention']:.3f})"
    if sample is not None:
        doc = sample.get("doc") or {}
        question = doc.get("question") or doc.get("query") or doc.get("caption") or sample.get("input")
        answer = (sample.get("filtered_resps") or sample.get("resps") or [""])[0]
        while isinstance(answer, list):
            answer = answer[0] if answer else ""
        if question:
            parts.append(f"Q: {_short(question)}")
        parts.append(f"A: {_short(answer)}")
        parts.append(f"GT: {_short(sample.get('target'))}")
    return "  |  ".join(parts)


def _short(text, limit: int = 70) -> str:
    text = " ".join(str(text).splitlines()[0].split()) if str(text).strip() else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def contact_sheet(rows: list[Row], out: str | Path, video_root: str | Path | None = None) -> Sheet:
    """Draw `rows` (from `sample_rows`) into the PNG `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [frames_of(row.record, video_root) for row in rows]
    widths = [sum(f.image.shape[1] for f in frames) + GAP * (len(frames) - 1) for frames in drawn]
    heights = [max(f.image.shape[0] for f in frames) for frames in drawn]
    layers = [row.record.get("layer_visual_tokens") for row in rows]
    strip = max(heights) * 0.12  # the scale strip under the frames
    width_px, dpi = max(widths), 100
    inch = min(24.0, max(8.0, width_px / dpi)) / width_px  # inches per frame pixel
    row_in = [(h + strip) * inch + 0.45 for h in heights]
    plot_in = 2.4 if any(layers) else 0.0
    fig = plt.figure(figsize=(width_px * inch + plot_in + 0.3, sum(row_in)), dpi=dpi)
    top = 1.0
    for row, frames, height, row_h, per_layer in zip(rows, drawn, heights, row_in, layers):
        frac = row_h / sum(row_in)
        frames_w = (width_px * inch) / fig.get_figwidth()
        bottom, height_frac = top - frac + 0.1 / fig.get_figheight(), frac - 0.45 / fig.get_figheight()
        ax = fig.add_axes((0.01, bottom, frames_w, height_frac))  # 0.35 in above it for the title
        x = 0
        for frame in frames:
            h, w = frame.image.shape[:2]
            ax.imshow(frame.image, extent=(x, x + w, height, height - h), interpolation="nearest")
            if frame.scale is not None:
                ax.add_patch(
                    plt.Rectangle((x, height + 2), w * min(frame.scale, 2.0) / 2.0, strip * 0.6, color="tab:orange")
                )
                ax.text(x + 2, height + strip * 0.95, f"s={frame.scale:.2f}", fontsize=7, va="bottom")
            x += w + GAP
        ax.set_xlim(0, width_px)
        ax.set_ylim(height + strip, 0)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(_title(row), fontsize=8, loc="left")
        if per_layer:
            inset = fig.add_axes(
                (
                    frames_w + 0.04,
                    bottom + 0.35 / fig.get_figheight(),
                    plot_in / fig.get_figwidth() - 0.05,
                    height_frac * 0.6,
                )
            )
            inset.plot(range(len(per_layer)), per_layer, marker=".", markersize=3)
            inset.set_xlabel("decoder layer", fontsize=7)
            inset.set_ylabel("visual tokens", fontsize=7)
            inset.tick_params(labelsize=6)
        top -= frac
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    with Image.open(out) as png:
        size = png.size
    return Sheet(out, size, [row.label for row in rows], [[int(f.dropped.sum()) for f in frames] for frames in drawn])


def describe(sheet: Sheet) -> str:
    """One line per row: its label and frames' dropped tokens."""
    lines = [f"{sheet.path} ({sheet.size[0]}x{sheet.size[1]} px)"]
    lines += [f"  {label}: dropped tokens per frame {dropped}" for label, dropped in zip(sheet.labels, sheet.dropped)]
    return "\n".join(lines)


def uneven_sample(run_dir: str | Path, method: str = "resadapt") -> int | None:
    """The doc id `method` answered right with its most uneven scales (largest max / min) in a sweep
    folder, or answered at all where it answered none right: a sample whose sheet shows where it spent
    its tokens (None: no such cell, or no sample succeeded)."""
    for cell in collect(run_dir):
        if cell.method != method:
            continue
        right = {doc for (_, doc), score in cell.outcomes.items() if score > 0}
        scored = [
            (r["doc_id"] in right, max(r["scales"]) / min(r["scales"]), r["doc_id"])
            for r in cell.records
            if r.get("error") is None and r.get("scales") and min(r["scales"]) > 0
        ]
        return max(scored)[2] if scored else None
    return None
