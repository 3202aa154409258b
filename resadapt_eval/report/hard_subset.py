"""Accuracy on the hard subset: the samples a reference cell answered wrongly (`--hard-subset`).

VTC-Bench reports methods on the samples plain downsampling gets wrong; FixedScale is this
package's downsampling, so the default reference is `fixed_scale` at each cell's own R. A reference
is `METHOD` (at each cell's R) or `METHOD@R` (one cell for all). A sample is answered wrongly when its
lmms-eval score (the logged per-sample metric, `collect.sample_score`) is below full credit: 1 on
tasks that score samples in [0, 1], 100 on those that score them in percent. A cell's hard-subset
score is its mean per-sample score over the subset's samples it logged, in percent of full credit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .collect import CellRun, write_markdown_and_csv


@dataclass(frozen=True)
class Reference:
    """The cell whose wrong answers make the subset: `method` at `retention` (None: each cell's own R)."""

    method: str
    retention: float | None = None

    @classmethod
    def parse(cls, text: str, flag: str = "--hard-subset") -> Reference:
        method, _, r = text.partition("@")
        if not method:
            raise ValueError(f"{flag} {text!r}: give METHOD or METHOD@R, e.g. fixed_scale@0.25")
        try:
            retention = float(r) if r else None
        except ValueError:
            raise ValueError(f"{flag} {text!r}: R must be a number, e.g. fixed_scale@0.25") from None
        return cls(method, retention)

    def label(self, retention: float | None) -> str:
        return f"{self.method}@{self.retention if self.retention is not None else retention}"


def full_credit(scores) -> float:
    """100 where a task's per-sample scores run past 1 (percent), else 1."""
    return 100.0 if any(s > 1 for s in scores) else 1.0


def hard_rows(runs: list[CellRun], reference: Reference) -> list[dict]:
    """Per cell and task: the reference's wrong answers there and the cell's score on them. A
    reference missing from the folders, or holding no logged samples, is a ValueError naming it."""
    rows, used = [], 0
    for run in runs:
        r = reference.retention if reference.retention is not None else run.retention
        ref = [
            c
            for c in runs
            if c.method == reference.method and c.retention == r and (c.card, c.frames) == (run.card, run.frames)
        ]
        if not ref:
            continue
        (ref,) = ref
        if not ref.outcomes:
            raise ValueError(
                f"{reference.label(run.retention)} ({ref.path}) logged no per-sample scores (run lmms-eval with "
                "--log_samples, as sweeps do)"
            )
        used += 1
        for task in sorted({t for t, _ in ref.outcomes}):
            scores = [s for (t, _), s in ref.outcomes.items() if t == task]
            full = full_credit(scores + [s for (t, _), s in run.outcomes.items() if t == task])
            subset = {doc for (t, doc), s in ref.outcomes.items() if t == task and s < full}
            mine = [run.outcomes[task, doc] for doc in subset if (task, doc) in run.outcomes]
            rows.append(
                dict(
                    card=run.card,
                    frames=run.frames,
                    task=task,
                    method=run.method,
                    retention=run.retention,
                    reference=reference.label(run.retention),
                    subset=len(subset),
                    scored=len(mine),
                    score=100 * sum(mine) / len(mine) / full if mine else None,
                )
            )
    if not used:
        cells = sorted({f"{c.method}@{c.retention}" for c in runs})
        raise ValueError(f"--hard-subset: no cell of {reference.label('R')} in the folders; cells: {', '.join(cells)}")
    return rows


def hard_markdown(rows: list[dict]) -> str:
    lines = [
        "Accuracy on the hard subset (samples the reference answered wrongly; score in % of full credit)",
        "",
        "| card | frames | task | reference | subset | method | R | score |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.1f}"
        lines.append(
            f"| {r['card']} | {r['frames']} | {r['task']} | {r['reference']} | {r['subset']} | {r['method']} | "
            f"{r['retention']} | {score} |"
        )
    return "\n".join(lines)


def write_hard(rows: list[dict], out: Path) -> list[Path]:
    """`hard_subset.md` and `.csv` in `out`."""
    return write_markdown_and_csv(out, "hard_subset", hard_markdown(rows) + "\n", rows)


def hard_plots(rows: list[dict], out: Path, save) -> list[Path]:
    """Per (card, frames, task): each method's hard-subset score against R, one line per method."""
    import matplotlib.pyplot as plt

    written = []
    keys = sorted({(r["card"], r["frames"], r["task"]) for r in rows})
    for card, frames, task in keys:
        mine = [
            r for r in rows if (r["card"], r["frames"], r["task"]) == (card, frames, task) and r["score"] is not None
        ]
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for method in dict.fromkeys(r["method"] for r in mine):
            points = sorted(
                (r["retention"] if r["retention"] is not None else 1.0, r["score"])
                for r in mine
                if r["method"] == method
            )
            ax.plot(*zip(*points), marker="o", label=method)
        references = sorted({f"{r['reference']} ({r['subset']})" for r in mine})
        ax.set_xlabel("target retention R")
        ax.set_ylabel(f"{task} on the hard subset (%)")
        ax.set_title(f"{card}, {frames} frames; subset: wrong under {', '.join(references)}", fontsize=7)
        ax.legend(fontsize=6)
        written += save(fig, out, f"hard_subset_{task}_{card}_f{frames}")
    return written
