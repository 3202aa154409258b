"""Figures from a sweep: Pareto frontiers (score vs achieved R, one line per method, per task and
frame count), per-frame scale profiles of sample videos, the case-by-frame scale heatmap, and the
per-video Gini of scales for correct vs incorrect answers, and where each token-reducing method keeps
its tokens in the frame and in the video (`kept_maps.py`). PNG and PDF."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..methods import METHODS  # noqa: E402
from ..train.trainer import gini  # noqa: E402
from .collect import CellRun  # noqa: E402
from .kept_maps import kept_plots  # noqa: E402


def _save(fig, out: Path, stem: str, tight: bool = True) -> list[Path]:
    """`fig` as OUT/STEM.png and .pdf (laid out tightly, unless it lays itself out: `tight` False)."""
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    if tight:
        fig.tight_layout()
    for p in paths:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths


AXES = {  # x axis of a Pareto plot: its label and how a cell is placed on it
    "retention": ("achieved retention R (visual tokens / vanilla)", lambda run: run.achieved_retention()),
    "tflops": ("TFLOPs per sample (vision tower, LLM, a method's own work, Allocator)", lambda run: run.tflops()),
    "vision_tflops": ("vision-tower TFLOPs per sample (its blocks and mergers)", lambda run: run.vision_tflops()),
}


def pareto_lines(
    runs: list[CellRun], column: str, frames: int, axis: str = "retention"
) -> dict[str, list[tuple[float, float]]]:
    """method -> (x, score) points sorted by x (achieved R, or TFLOPs per sample), for one score
    column and frame count; cells without a value on the axis are left out."""
    place = AXES[axis][1]
    lines = {}
    for method in METHODS:
        points = sorted(
            (place(r), r.scores[column])
            for r in runs
            if r.method == method and r.frames == frames and column in r.scores and place(r) is not None
        )
        if points:
            lines[method] = points
    return lines


def pareto(runs: list[CellRun], out: Path) -> list[Path]:
    """One figure per (column, frames, axis): score vs achieved R (`pareto_*`), vs TFLOPs per sample
    (`pareto_tflops_*`) and vs the vision tower's TFLOPs per sample (`pareto_vision_tflops_*`: where
    resizing and merging inside the tower save encoder work), the last two where the records carry
    FLOPs; a line per method."""
    written = []
    columns = list(dict.fromkeys(c for r in runs for c in r.scores))
    for col in columns:
        for frames in sorted({r.frames for r in runs}):
            written += _save(pareto_figure(runs, col, frames), out, f"pareto_{col}_f{frames}")
            for axis in ("tflops", "vision_tflops"):
                if pareto_lines(runs, col, frames, axis):
                    written += _save(pareto_figure(runs, col, frames, axis), out, f"pareto_{axis}_{col}_f{frames}")
    return written


MARKERS = "osD^v<>pPX*h"


def method_style(method: str) -> dict:
    """A colour and marker per registered method, fixed by its registry position, so every plot
    draws a method the same way and no two of up to 60 methods share a colour: the paper's seven
    methods and the next three take tab20's strong colours, the next ten its light ones, then
    tab20b's and tab20c's."""
    order = [m for m, spec in METHODS.items() if spec.in_paper] + [m for m, s in METHODS.items() if not s.in_paper]
    index = order.index(method)
    if index < 20:
        color = plt.get_cmap("tab20")(2 * index if index < 10 else 2 * (index - 10) + 1)
    else:
        color = plt.get_cmap("tab20b" if index < 40 else "tab20c")((index - 20) % 20)
    return dict(color=color, marker=MARKERS[index % len(MARKERS)])


def pareto_figure(runs: list[CellRun], column: str, frames: int, axis: str = "retention"):
    """Score vs achieved R (or TFLOPs) for one column and frame count, a line per method (its display name)."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    untrained = {r.method for r in runs if r.untrained}
    for method, points in pareto_lines(runs, column, frames, axis).items():
        xs, ys = zip(*points)
        label = METHODS[method].display_name + (" (untrained)" if method in untrained else "")
        ax.plot(xs, ys, linewidth=1.8, label=label, **method_style(method))
    ax.set_xlabel(AXES[axis][0])
    ax.set_ylabel(column)
    ax.set_title(f"{column}, {frames} frames")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8, ncol=2 if len(ax.get_lines()) > 8 else 1)
    return fig


def _scale_runs(runs: list[CellRun]) -> list[CellRun]:
    """Cells whose per-frame scales vary within videos (an Allocator's)."""
    return [r for r in runs if any(len(set(rec["scales"])) > 1 for rec in r.records if rec["error"] is None)]


def scale_profiles(runs: list[CellRun], out: Path, videos: int = 6) -> list[Path]:
    written = []
    for run in _scale_runs(runs):
        records = [rec for rec in run.records if rec["error"] is None][:videos]
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for rec in records:
            ax.plot(range(len(rec["scales"])), rec["scales"], marker=".", label=f"{rec['task']} #{rec['doc_id']}")
        ax.set_xlabel("frame index")
        ax.set_ylabel("scale $s_t$")
        ax.set_title(f"per-frame scales: {run.path.name}")
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=7, ncol=2)
        written += _save(fig, out, f"scales_{run.path.name}")
    return written


def scale_heatmap(runs: list[CellRun], out: Path, cases: int = 200) -> list[Path]:
    written = []
    for run in _scale_runs(runs):
        rows = [rec["scales"] for rec in run.records if rec["error"] is None][:cases]
        width = max(len(r) for r in rows)
        grid = np.full((len(rows), width), np.nan)
        for i, r in enumerate(rows):
            grid[i, : len(r)] = r
        fig, ax = plt.subplots(figsize=(6.5, max(2.5, 0.12 * len(rows) + 1.5)))
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        fig.colorbar(image, ax=ax, label="scale $s_t$")
        ax.set_xlabel("frame index")
        ax.set_ylabel("case")
        ax.set_title(f"case x frame scales: {run.path.name}")
        written += _save(fig, out, f"heatmap_{run.path.name}")
    return written


def gini_by_outcome(runs: list[CellRun], out: Path) -> list[Path]:
    """Per-video Gini of scales, split by whether the answer was scored correct (score >= 0.5)."""
    written = []
    for run in _scale_runs(runs):
        split = {"correct": [], "incorrect": []}
        for rec in run.records:
            score = run.outcomes.get((rec["task"], rec["doc_id"]))
            if rec["error"] is None and score is not None:
                split["correct" if score >= 0.5 else "incorrect"].append(gini(rec["scales"]))
        if not any(split.values()):
            continue
        fig, ax = plt.subplots(figsize=(4.5, 4))
        labels = [f"{k} (n={len(v)})" for k, v in split.items()]
        ax.boxplot([v if v else [np.nan] for v in split.values()], tick_labels=labels)
        ax.set_ylabel("Gini of per-frame scales")
        ax.set_title(f"scale inequality by outcome: {run.path.name}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        written += _save(fig, out, f"gini_{run.path.name}")
    return written


def write_plots(runs: list[CellRun], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = pareto(runs, out) + scale_profiles(runs, out) + scale_heatmap(runs, out) + gini_by_outcome(runs, out)
    return written + kept_plots(runs, out, _save)
