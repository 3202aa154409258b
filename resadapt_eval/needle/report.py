"""`resadapt-eval needle report RUN_DIR`: the needle sweep's accuracy with standard errors, and
where each method's pixels went relative to the evidence pair.

Per done cell: accuracy (percent) and its binomial standard error over the logged samples, the
achieved R, and the evidence-pair fraction: the share of videos whose evidence pair has the
highest pair scale (mean of its two frames' `scales` from the sidecar, the scales the backbone
saw), strictly above every other pair. Uniform allocations (vanilla, fixed_scale, the token
compressors) have no unique highest pair, so their fraction is 0. The evidence pair of each video
comes from the data rows (`evidence_pair`), matched by video path.
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


def pair_scale_of(scales) -> np.ndarray:
    """Per-frame scales (T,) -> per-pair scales (ceil(T/2),), each the mean of its two frames."""
    return reduce_pair_scales(scales, pair_frames(len(scales)), "mean")


def evidence_is_highest(scales, evidence_pair: int) -> bool:
    """True when the evidence pair's scale is strictly above every other pair's."""
    pairs = pair_scale_of(scales)
    others = np.delete(pairs, evidence_pair)
    return bool(pairs[evidence_pair] > others.max())


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


def load_rows(data: str | Path) -> dict[str, dict]:
    """Needle data rows keyed by resolved video path."""
    rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
    return {str(Path(r["video_path"]).resolve()): r for r in rows}


def summarize_cell(run: CellRun, rows: dict[str, dict]) -> CellSummary:
    """Accuracy over the cell's logged samples; evidence fraction over its successful sidecar records
    (NaN for methods whose scales are not the Allocator's: their pairs never differ)."""
    scores = list(run.outcomes.values())
    allocated = METHODS[run.method].needs_allocator
    records = [r for r in run.records if allocated and r["error"] is None and str(Path(r["video"]).resolve()) in rows]
    hits = [evidence_is_highest(r["scales"], rows[str(Path(r["video"]).resolve())]["evidence_pair"]) for r in records]
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
    )


def summarize(run_dir: str | Path, data: str | Path) -> list[CellSummary]:
    """Every done cell of a needle sweep, in the paper's method order, then by target R (descending)."""
    rows = load_rows(data)
    cells = [summarize_cell(run, rows) for run in collect(run_dir)]
    return sorted(cells, key=lambda c: (list(METHODS).index(c.method), -(c.retention or 1.0)))


def to_markdown(cells: list[CellSummary]) -> str:
    lines = [
        "| method | R target | R achieved | accuracy % | evidence pair highest % | TFLOPs | n |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        target = "-" if c.retention is None else f"{c.retention:g}"
        evidence = (
            "-" if np.isnan(c.evidence_fraction) else f"{100 * c.evidence_fraction:.1f} ± {100 * c.evidence_se:.1f}"
        )
        lines.append(
            f"| {METHODS[c.method].display_name} | {target} | {c.achieved_retention:.3f} | "
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
    paths = [out / f"needle_evidence_{run.path.name}.png", out / f"needle_evidence_{run.path.name}.pdf"]
    for p in paths:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths


def write_report(
    run_dir: str | Path, data: str | Path, out: str | Path | None = None
) -> tuple[list[CellSummary], list[Path]]:
    """`summary.md` and one evidence plot per cell whose scales vary within videos, under `out`
    (default RUN_DIR/needle)."""
    out = Path(out) if out else Path(run_dir) / "needle"
    out.mkdir(parents=True, exist_ok=True)
    cells = summarize(run_dir, data)
    (out / "summary.md").write_text(to_markdown(cells) + "\n")
    rows = load_rows(data)
    written = [out / "summary.md"]
    for run in collect(run_dir):
        if any(len(set(r["scales"])) > 1 for r in run.records if r["error"] is None):
            written += evidence_plot(run, rows, out)
    return cells, written
