"""The paper's tables from a sweep: video QA (Table 1), temporal grounding (Table 2), image
transfer; Markdown, LaTeX (booktabs) and CSV, achieved R and mean TFLOPs per sample on every row,
best of each group in bold.
A cell with more failed samples than its sweep allowed shows `failed k/n` instead of scores (the
CSV: empty scores, its status and counts); rows of the untrained Allocator say so. The cells of a
sweep that are not complete (failed, still running, not started) are listed under the Markdown
table, never shown as a score.

Rows are (card, frames, method, target R); a group is the rows sharing card, frames and target R
(vanilla is its own group). `paper=True` adds, for every score, the paper's number for the same
backbone, frames, method and nearest retention, and our delta to it.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path

from ..methods import METHODS
from .collect import CellRun, table_of

TABLES = {"video_qa": "Video QA", "temporal_grounding": "Temporal grounding", "image": "Image transfer"}
PAPER_R_TOLERANCE = 5.0  # percentage points between our target R and the paper row's R


@dataclass
class Table:
    name: str
    title: str
    columns: list[str]
    rows: list[dict] = field(default_factory=list)  # card, frames, method, target, R, <column>: score, paper_<column>
    missing: list = field(default_factory=list)  # cluster.status.CellState of the sweep's cells not complete

    def groups(self) -> dict[tuple, list[dict]]:
        out: dict[tuple, list[dict]] = {}
        for row in self.rows:
            out.setdefault((row["card"], row["frames"], row["target"]), []).append(row)
        return out

    def best(self) -> set[tuple[int, str]]:
        """(row index, column) of the best score of each column within each group of 2+ rows."""
        marks = set()
        for rows in self.groups().values():
            if len(rows) < 2:
                continue
            for col in self.columns:
                values = [r[col] for r in rows if r.get(col) is not None and r["status"] == "done"]
                if values:
                    top = max(values)
                    marks |= {(self.rows.index(r), col) for r in rows if r.get(col) == top}
        return marks


def build_tables(runs: list[CellRun], paper_dir: Path | None = None, missing: list = ()) -> list[Table]:
    """The tables of `runs`; each lists the `missing` cells (collect.missing_cells) of its tasks."""
    tables = []
    for name, title in TABLES.items():
        columns = list(dict.fromkeys(c for run in runs for c in run.columns_by_table.get(name, [])))
        if not columns:
            continue
        table = Table(name, title, columns, missing=[m for m in missing if name in {table_of(t) for t in m.tasks}])
        order = list(METHODS)  # the registry's order is the paper's row order
        ordered = sorted(
            (r for r in runs if name in r.columns_by_table),
            key=lambda r: (r.card, r.frames, -(r.retention if r.retention is not None else 2.0), order.index(r.method)),
        )
        paper = read_paper(paper_dir / f"{name}.csv") if paper_dir else []
        for run in ordered:
            row = dict(
                card=run.card,
                frames=run.frames,
                method=METHODS[run.method].display_name + (" (untrained)" if run.untrained else ""),
                target=run.retention,
                R=run.achieved_retention(name),
                TFLOPs=run.tflops(name),
                status=run.status,
                samples=run.samples,
                failed_samples=run.failed_samples,
            )
            done = run.status == "done"  # a failed cell's scores are not results: its row shows the failures
            row.update({c: run.scores.get(c) if done else None for c in columns})
            if paper_dir:
                match = paper_row(paper, run)
                row.update({f"paper_{c}": _number(match.get(c)) if match else None for c in columns})
                row["paper_R"] = _number(match.get("retention")) if match else None
            table.rows.append(row)
        tables.append(table)
    return tables


def read_paper(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def paper_row(rows: list[dict], run: CellRun) -> dict | None:
    """The paper's row for the run's backbone, frames and method, with the nearest retention.
    Tables without a frames or retention column (image transfer) match on the rest."""
    if not run.paper_backbone:
        return None
    target = 100.0 if run.retention is None else 100 * run.retention

    def gap(r):
        return abs(_number(r["retention"]) - target) if _number(r.get("retention")) is not None else 0.0

    candidates = [
        r
        for r in rows
        if r.get("backbone") == run.paper_backbone
        and r.get("method") == METHODS[run.method].display_name
        and ("frames" not in r or str(r["frames"]) == str(run.frames))
        and gap(r) <= PAPER_R_TOLERANCE
    ]
    return min(candidates, key=gap, default=None)


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _fmt(value, digits=1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _cells(table: Table, row: dict, with_paper: bool) -> list[str]:
    """Display cells of one row (without bold)."""
    out = [row["card"], str(row["frames"]), row["method"], _fmt(None if row["R"] is None else 100 * row["R"]) + "%"]
    out.append("—" if row.get("TFLOPs") is None else f"{row['TFLOPs']:.3g}")  # 3 significant digits
    for col in table.columns:
        out.append(_fmt(row[col]) if row["status"] == "done" else f"failed {row['failed_samples']}/{row['samples']}")
        if with_paper:
            paper = row.get(f"paper_{col}")
            out += [_fmt(paper), "—" if paper is None or row[col] is None else f"{row[col] - paper:+.1f}"]
    return out


def _header(table: Table, with_paper: bool) -> list[str]:
    head = ["card", "frames", "method", "R", "TFLOPs"]
    for col in table.columns:
        head += [col, f"{col} (paper)", f"{col} Δ"] if with_paper else [col]
    return head


def _score_index(table: Table, col: str, with_paper: bool) -> int:
    return 5 + table.columns.index(col) * (3 if with_paper else 1)


def to_markdown(table: Table, with_paper: bool = False) -> str:
    best = table.best()
    lines = [
        f"### {table.title}",
        "",
        "| " + " | ".join(_header(table, with_paper)) + " |",
        "|" + "---|" * len(_header(table, with_paper)),
    ]
    for i, row in enumerate(table.rows):
        cells = _cells(table, row, with_paper)
        for col in table.columns:
            if (i, col) in best:
                j = _score_index(table, col, with_paper)
                cells[j] = f"**{cells[j]}**"
        lines.append("| " + " | ".join(cells) + " |")
    if table.missing:
        lines += ["", missing_markdown(table.missing).rstrip("\n")]
    return "\n".join(lines) + "\n"


def missing_markdown(missing: list) -> str:
    """The cells not complete, one line each: grid point, state, job, the whole first line of why
    and the cell's log."""
    lines = [f"Missing cells ({len(missing)}; not complete, never shown as a score):"]
    for m in missing:
        point = ", ".join(
            part
            for part in (
                m.method,
                None if m.retention is None else f"R={m.retention:g}",
                None if m.frames is None else f"{m.frames} frames",
            )
            if part
        )
        job = f", job {m.job_id}" if m.job_id else ""
        why = f": {m.reason.strip().splitlines()[0]}" if m.reason else ""
        log = f" (log: {m.log})" if m.log else ""
        lines.append(f"- {m.name} ({point or 'unknown cell'}): {m.state}{job}{why}{log}")
    return "\n".join(lines) + "\n"


def to_latex(table: Table, with_paper: bool = False) -> str:
    best = table.best()
    head = _header(table, with_paper)

    def esc(text: str) -> str:
        return text.replace("%", r"\%").replace("_", r"\_").replace("Δ", r"$\Delta$").replace("—", "--")

    lines = [
        r"\begin{tabular}{lll" + "c" * (len(head) - 3) + "}",
        r"\toprule",
        " & ".join(esc(h) for h in head) + r" \\",
        r"\midrule",
    ]
    last_group = None
    for i, row in enumerate(table.rows):
        group = (row["card"], row["frames"], row["target"])
        if last_group is not None and group != last_group:
            lines.append(r"\midrule" if group[:2] != last_group[:2] else r"\cmidrule{3-" + str(len(head)) + "}")
        last_group = group
        cells = [esc(c) for c in _cells(table, row, with_paper)]
        for col in table.columns:
            if (i, col) in best:
                j = _score_index(table, col, with_paper)
                cells[j] = rf"\textbf{{{cells[j]}}}"
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def to_csv(table: Table, with_paper: bool = False) -> str:
    """Machine-readable: full-precision scores, R as a fraction, the target, the paper columns."""
    fields = [
        "card",
        "frames",
        "method",
        "target",
        "R",
        "TFLOPs",
        "status",
        "samples",
        "failed_samples",
        *table.columns,
    ]
    if with_paper:
        fields += ["paper_R", *[f"paper_{c}" for c in table.columns]]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(table.rows)
    return buffer.getvalue()


def write_tables(tables: list[Table], out: Path, with_paper: bool = False) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for table in tables:
        for suffix, render in (("md", to_markdown), ("tex", to_latex), ("csv", to_csv)):
            path = out / f"{table.name}.{suffix}"
            path.write_text(render(table, with_paper))
            written.append(path)
    return written
