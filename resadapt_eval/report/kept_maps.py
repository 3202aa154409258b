"""Where in the frame and in the video each method keeps its tokens, over every sample of a cell.

A token counts as kept when the LLM held it to the end: for a method acting before the LLM, the
tokens that entered it (`kept.KeptTokens.mask`); for a method with stages inside the LLM, those its
last stage held. Positions are normalised, so frames of every size share one grid of `BINS` x `BINS`
cells of the frame: a cell's share is the kept share of the frame area it covers (token by token, by
overlap), averaged over every frame pair of every sample. A pair p of P lies at (p + 0.5) / P of the
video, in `FRAME_BINS` bins, whose share is their kept tokens over their tokens. The top third of the
frame is the token rows r of h at (r + 0.5) / h < 1/3, the bottom third > 2/3: the top-third share is
the kept tokens lying there over all kept tokens (about 1/3 without a positional bias), and the top
over the bottom share is the bias as a number (1: none; attention-based pruners' recency bias keeps
the bottom, ratio < 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..kept import read_kept
from .collect import CellRun, write_markdown_and_csv

BINS = 12
FRAME_BINS = 10


@dataclass
class KeptMap:
    """The summed kept share per normalised (row, column) cell (BINS, BINS) and the frame pairs summed
    (`total`); kept and total tokens per video position (FRAME_BINS,); kept tokens in the frame's top
    and bottom thirds; over a cell's samples."""

    kept: np.ndarray
    total: np.ndarray
    frame_kept: np.ndarray
    frame_total: np.ndarray
    thirds_kept: np.ndarray  # (top, bottom)
    samples: int = 0

    @classmethod
    def empty(cls) -> KeptMap:
        zeros = np.zeros((BINS, BINS))
        return cls(zeros, zeros.copy(), np.zeros(FRAME_BINS), np.zeros(FRAME_BINS), np.zeros(2))

    @property
    def share(self) -> np.ndarray:
        """(BINS, BINS) kept share per cell (NaN where no token fell)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.kept / self.total

    @property
    def frame_share(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.frame_kept / self.frame_total

    @property
    def top_share(self) -> float:
        """The kept tokens in the frame's top third over all kept tokens."""
        kept = self.frame_kept.sum()
        return float(self.thirds_kept[0] / kept) if kept else float("nan")

    @property
    def bottom_share(self) -> float:
        """The kept tokens in the frame's bottom third over all kept tokens."""
        kept = self.frame_kept.sum()
        return float(self.thirds_kept[1] / kept) if kept else float("nan")

    @property
    def top_bottom_ratio(self) -> float:
        """The top third's kept share over the bottom third's (inf: the bottom kept nothing)."""
        bottom = self.bottom_share
        return float("inf") if bottom == 0 else self.top_share / bottom

    def add(self, record: dict) -> None:
        """Count one successful record's kept tokens (those the LLM held to the end)."""
        kept = read_kept(record)
        if kept is None:
            return
        held = kept.stages[-1][1] if kept.stages else kept.mask
        start, pairs = 0, len(record["grids"])
        for p, (t, h, w) in enumerate(record["grids"]):
            mask = held[start : start + t * h * w].reshape(t, h, w).sum(axis=0)  # kept per (row, column)
            start += t * h * w
            # each cell's kept share by area: the token grid repeated BINS times each way, averaged per cell
            area = np.repeat(np.repeat(mask / t, BINS, axis=0), BINS, axis=1)
            self.kept += area.reshape(BINS, h, BINS, w).mean(axis=(1, 3))
            self.total += 1
            at = min(int((p + 0.5) / pairs * FRAME_BINS), FRAME_BINS - 1)
            self.frame_kept[at] += mask.sum()
            self.frame_total[at] += t * h * w
            position = (np.arange(h) + 0.5) / h
            for third, rows_in in enumerate((position < 1 / 3, position > 2 / 3)):
                self.thirds_kept[third] += mask[rows_in].sum()
        self.samples += 1


def kept_map(run: CellRun) -> KeptMap:
    """The kept-token map of one cell over its successful samples."""
    found = KeptMap.empty()
    for record in run.records:
        if record.get("error") is None:
            found.add(record)
    return found


def maps_by_group(runs: list[CellRun]) -> dict[tuple[str, int], list[tuple[CellRun, KeptMap]]]:
    """The token-reducing cells (some sample kept fewer tokens than it planned: a map worth drawing) with
    their maps, by (card, frames), in their order."""
    out: dict[tuple[str, int], list[tuple[CellRun, KeptMap]]] = {}
    for run in runs:
        found = kept_map(run)
        if found.frame_kept.sum() < found.frame_total.sum():
            out.setdefault((run.card, run.frames), []).append((run, found))
    return out


def bias_rows(runs: list[CellRun]) -> list[dict]:
    """Per token-reducing cell: its kept share in the frame's top and bottom thirds and their ratio."""
    rows = []
    for (card, frames), cells in maps_by_group(runs).items():
        for run, found in cells:
            rows.append(
                dict(
                    card=card,
                    frames=frames,
                    method=run.method,
                    retention=run.retention,
                    samples=found.samples,
                    top=found.top_share,
                    bottom=found.bottom_share,
                    ratio=found.top_bottom_ratio,
                )
            )
    return rows


def bias_markdown(rows: list[dict]) -> str:
    lines = [
        "Where the kept tokens lie in the frame (shares of the kept tokens; about 1/3 each and a ratio of 1: no "
        "positional bias)",
        "",
        "| card | frames | method | R | samples | kept in the top third | kept in the bottom third | top / bottom |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['card']} | {r['frames']} | {r['method']} | {r['retention']} | {r['samples']} | "
            f"{r['top']:.3f} | {r['bottom']:.3f} | {r['ratio']:.2f} |"
        )
    return "\n".join(lines)


def write_bias(rows: list[dict], out: Path) -> list[Path]:
    """`kept_position.md` and `.csv` in `out`."""
    return write_markdown_and_csv(out, "kept_position", bias_markdown(rows) + "\n", rows)


def kept_plots(runs: list[CellRun], out: Path, save) -> list[Path]:
    """Per (card, frames): a heatmap grid of methods x R of the kept share per normalised cell, and
    the kept share per video position as a line per method, one panel per R."""
    import matplotlib.pyplot as plt

    written = []
    out.mkdir(parents=True, exist_ok=True)
    for (card, frames), cells in maps_by_group(runs).items():
        methods = list(dict.fromkeys(run.method for run, _ in cells))
        retentions = sorted({run.retention for run, _ in cells}, key=lambda r: -(r if r is not None else 2.0))
        maps = {(run.method, run.retention): found for run, found in cells}
        fig, axes = plt.subplots(
            len(methods),
            len(retentions),
            figsize=(max(6.0, 2.2 * len(retentions) + 1.5), 2.0 * len(methods)),
            squeeze=False,
            layout="constrained",
        )
        image = None
        for i, method in enumerate(methods):
            for j, r in enumerate(retentions):
                ax = axes[i][j]
                ax.set_xticks([])
                ax.set_yticks([])
                found = maps.get((method, r))
                if found is not None:
                    image = ax.imshow(found.share, vmin=0, vmax=1, cmap="magma")
                if i == 0:
                    ax.set_title(f"R={r}", fontsize=8)
                if j == 0:
                    ax.set_ylabel(method, fontsize=8)
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.6, label="kept share")
        fig.suptitle(f"{card}, {frames} frames: kept tokens by position in the frame", fontsize=9)
        written += save(fig, out, f"kept_map_{card}_f{frames}", tight=False)

        fig, axes = plt.subplots(1, len(retentions), figsize=(max(6.0, 3.6 * len(retentions)), 2.8), squeeze=False)
        positions = (np.arange(FRAME_BINS) + 0.5) / FRAME_BINS
        for j, r in enumerate(retentions):
            ax = axes[0][j]
            for method in methods:
                found = maps.get((method, r))
                if found is not None:  # bins no pair fell in (videos of fewer pairs than bins) left out
                    held = found.frame_total > 0
                    ax.plot(positions[held], found.frame_share[held], marker=".", label=method)
            ax.set_title(f"R={r}", fontsize=8)
            ax.set_xlabel("position in the video")
            ax.set_ylim(0, 1.05)
            if j == 0:
                ax.set_ylabel("kept share")
        axes[0][-1].legend(fontsize=6, loc="best")
        fig.suptitle(f"{card}, {frames} frames: kept tokens by position in the video", fontsize=9)
        fig.tight_layout()
        written += save(fig, out, f"kept_frames_{card}_f{frames}")
    return written
