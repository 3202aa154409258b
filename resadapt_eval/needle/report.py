"""`resadapt-eval needle report RUN_DIR`: the needle sweep's accuracy with standard errors, and
where each method's pixels went relative to the evidence pair.

Per done cell: accuracy (percent) and its binomial standard error over the logged samples, the
achieved R, and the evidence-pair fraction: the share of videos whose evidence pair has the
highest pair scale (mean of its two frames' `scales` from the sidecar, the scales the backbone
saw), strictly above every other pair; under frame selection (`operator=select|select_resize`,
records with `candidates`) the share whose two evidence frames are both among the kept
`frame_indices`. Methods without an Allocator (vanilla, fixed_scale, the token compressors) have no
per-pair scales of their own, so their fraction is NaN ("-" in the table). The evidence pair of
each video comes from the data rows (`evidence_pair`, `evidence_frames`), matched by video path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..budget.plan import pair_frames, reduce_pair_scales  # noqa: E402
from ..methods import METHODS  # noqa: E402
from ..report.collect import CellRun, collect  # noqa: E402
from ..report.plots import MARKERS, method_style  # noqa: E402


def pair_scale_of(scales) -> np.ndarray:
    """Per-frame scales (T,) -> per-pair scales (ceil(T/2),), each the mean of its two frames."""
    return reduce_pair_scales(scales, pair_frames(len(scales)), "mean")


def evidence_is_highest(scales, evidence_pair: int) -> bool:
    """True when the evidence pair's scale is strictly above every other pair's."""
    pairs = pair_scale_of(scales)
    others = np.delete(pairs, evidence_pair)
    return bool(pairs[evidence_pair] > others.max())


def evidence_hit(record: dict, row: dict) -> bool:
    """The evidence pair got the pixels: under frame selection both its frames were kept, else its
    pair scale is the highest (`evidence_is_highest`)."""
    if record.get("candidates"):
        return set(row["evidence_frames"]) <= set(record["frame_indices"])
    return evidence_is_highest(record["scales"], row["evidence_pair"])


def binomial_se(p: float, n: int) -> float:
    """Standard error of a proportion p over n samples, sqrt(p (1 - p) / n)."""
    return float(np.sqrt(p * (1 - p) / n)) if n else float("nan")


@dataclass
class CellSummary:
    """One cell: accuracy and evidence fraction in [0, 1] with standard errors, over n samples;
    tflops: mean TFLOPs per successful sample (None for records made before FLOPs were counted)."""

    method: str
    retention: float | None
    achieved_retention: float
    accuracy: float
    accuracy_se: float
    evidence_fraction: float
    evidence_se: float
    n: int
    path: Path
    tflops: float | None = None
    frames: int | None = None
    selection: bool = False  # frame selection (`operator=select|select_resize`): the records carry `candidates`
    empty_query: bool = False  # the Allocator read "" (`allocator_query=empty`), the backbone the question

    @property
    def label(self) -> str:
        """The method's display name, marked when the Allocator selected frames instead of resizing
        them, or read an empty query."""
        marks = [m for m, on in (("frame selection", self.selection), ("empty query", self.empty_query)) if on]
        return METHODS[self.method].display_name + "".join(f" ({m})" for m in marks)


def load_rows(data: str | Path) -> dict[str, dict]:
    """Needle data rows keyed by resolved video path."""
    rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
    return {str(Path(r["video_path"]).resolve()): r for r in rows}


def any_empty_query(records: list[dict]) -> bool:
    """The cell's Allocator read an empty query (`allocator_query=empty`, the query ablation)."""
    return any(r.get("allocator_query") == "empty" for r in records)


def summarize_cell(run: CellRun, rows: dict[str, dict]) -> CellSummary:
    """Accuracy over the cell's logged samples; evidence fraction over its successful sidecar records
    (NaN for methods whose scales are not the Allocator's: their pairs never differ)."""
    scores = list(run.outcomes.values())
    allocated = METHODS[run.method].needs_allocator
    records = [r for r in run.records if allocated and r["error"] is None and str(Path(r["video"]).resolve()) in rows]
    hits = [evidence_hit(r, rows[str(Path(r["video"]).resolve())]) for r in records]
    acc = float(np.mean(scores)) if scores else float("nan")
    frac = float(np.mean(hits)) if hits else float("nan")
    return CellSummary(
        run.method,
        run.retention,
        run.achieved_retention() or float("nan"),
        acc,
        binomial_se(acc, len(scores)),
        frac,
        binomial_se(frac, len(hits)),
        len(scores),
        run.path,
        run.tflops(),
        run.frames,
        any(r.get("candidates") for r in records),
        any_empty_query(records),
    )


def summarize(runs: list[CellRun], rows: dict[str, dict]) -> list[CellSummary]:
    """Every cell of `runs` (the done cells of one or several sweep folders), in the paper's method
    order, then by target R (descending) and frame count."""
    cells = [summarize_cell(run, rows) for run in runs]
    return sorted(
        cells,
        key=lambda c: (
            list(METHODS).index(c.method),
            c.selection,
            c.empty_query,
            -(c.retention or 1.0),
            c.frames or 0,
        ),
    )


def to_markdown(cells: list[CellSummary]) -> str:
    lines = [
        "| method | frames | R target | R achieved | accuracy % | evidence pair highest % | TFLOPs | n |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        target = "-" if c.retention is None else f"{c.retention:g}"
        evidence = (
            "-" if np.isnan(c.evidence_fraction) else f"{100 * c.evidence_fraction:.1f} ± {100 * c.evidence_se:.1f}"
        )
        lines.append(
            f"| {c.label} | {'-' if c.frames is None else c.frames} | {target} | {c.achieved_retention:.3f} | "
            f"{100 * c.accuracy:.1f} ± {100 * c.accuracy_se:.1f} | {evidence} | "
            f"{'-' if c.tflops is None else f'{c.tflops:.2e}'} | {c.n} |"
        )
    return "\n".join(lines)


def evidence_plot(run: CellRun, rows: dict[str, dict], out: Path, videos: int = 6) -> list[Path]:
    """Left: per-frame scales of the first `videos` test videos, evidence frames marked. Right:
    mean pair scale (+- one s.d. over videos) by pair position relative to the evidence pair."""
    records = [r for r in run.records if r["error"] is None and str(Path(r["video"]).resolve()) in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for rec in records[:videos]:
        frames = rows[str(Path(rec["video"]).resolve())]["evidence_frames"]
        line = left.plot(
            range(len(rec["scales"])), rec["scales"], marker=".", linewidth=1.2, label=f"#{rec['doc_id']}"
        )[0]
        left.plot(
            frames,
            [rec["scales"][t] for t in frames],
            "o",
            markersize=10,
            markerfacecolor="none",
            color=line.get_color(),
        )
    left.set_xlabel("frame index (circles: the evidence pair)")
    left.set_ylabel("scale $s_t$ (after projection)")
    left.set_title(f"{METHODS[run.method].display_name}, R={run.retention}: per-frame scales", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(frameon=False, fontsize=7, ncol=3)
    offsets: dict[int, list[float]] = {}
    for rec in records:
        pairs = pair_scale_of(rec["scales"])
        ev = rows[str(Path(rec["video"]).resolve())]["evidence_pair"]
        for k, s in enumerate(pairs):
            offsets.setdefault(k - ev, []).append(float(s))
    xs = sorted(offsets)
    mean = np.array([np.mean(offsets[x]) for x in xs])
    sd = np.array([np.std(offsets[x]) for x in xs])
    right.errorbar(xs, mean, yerr=sd, marker="o", capsize=3)
    right.set_xlabel("pair position relative to the evidence pair")
    right.set_ylabel("pair scale (mean ± s.d. over videos)")
    right.set_title(f"n={len(records)} videos", fontsize=10)
    right.grid(alpha=0.3)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    stem = f"needle_evidence_{run.path.name}" + ("_empty_query" if any_empty_query(run.records) else "")
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    for p in paths:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths


def cell_styles(cells: list[CellSummary]) -> list[dict]:
    """A colour and marker per cell: the method's from the Pareto plots (`method_style`), and for
    its cells after the first (another R or frame count, frame selection, the empty-query
    ablation) the next markers, so no two cells of up to 12 per method look alike."""
    seen: dict[str, int] = {}
    styles = []
    for c in cells:
        style = method_style(c.method)
        variant = seen[c.method] = seen.get(c.method, -1) + 1
        styles.append(
            dict(color=style["color"], marker=MARKERS[(MARKERS.index(style["marker"]) + variant) % len(MARKERS)])
        )
    return styles


def tflops_plot(cells: list[CellSummary], out: Path) -> list[Path]:
    """Accuracy (± one standard error) against mean TFLOPs a sample, one point per cell of any
    frame count (the long split compares vanilla at 8 frames with the methods at 128)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    costed = [c for c in cells if c.tflops is not None]
    for c, style in zip(costed, cell_styles(costed)):
        r = "" if c.retention is None else f", R={c.retention:g}"
        ax.errorbar(
            c.tflops,
            100 * c.accuracy,
            yerr=100 * c.accuracy_se,
            capsize=3,
            label=f"{c.label}, {c.frames} f{r}",
            **style,
        )
    ax.set_xlabel("TFLOPs per sample (vision tower, LLM, a method's own work, Allocator)")
    ax.set_ylabel("accuracy % (± s.e.)")
    ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "needle_accuracy_tflops.png", out / "needle_accuracy_tflops.pdf"]
    for p in paths:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths


def write_report(
    run_dirs: str | Path | list, data: str | Path, out: str | Path | None = None
) -> tuple[list[CellSummary], list[Path]]:
    """`summary.md`, the accuracy-TFLOPs plot of every cell and one evidence plot per cell whose
    scales vary within videos, under `out` (default: the first RUN_DIR/needle)."""
    dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    out = Path(out) if out else Path(dirs[0]) / "needle"
    out.mkdir(parents=True, exist_ok=True)
    runs = [run for d in dirs for run in collect(d)]  # read once: the table and the plots share them
    rows = load_rows(data)
    cells = summarize(runs, rows)
    (out / "summary.md").write_text(to_markdown(cells) + "\n")
    written = [out / "summary.md"]
    if any(c.tflops is not None for c in cells):
        written += tflops_plot(cells, out)
    for run in runs:
        if any(len(set(r["scales"])) > 1 for r in run.records if r["error"] is None):
            written += evidence_plot(run, rows, out)
    return cells, written
