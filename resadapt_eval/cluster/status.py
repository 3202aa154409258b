"""The state of every cell of a sweep folder, from its files and (for cells whose job has not
written a record) the scheduler: `resadapt-eval sweep-status`, and the missing cells a report lists."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..cells import CELL_FILE, JOB_FILE, PLAN_FILE, STARTED_FILE, read_json, this_process
from ..guard import process_alive

COMPLETE, FAILED = "complete", "failed"
ACTIVE = ("queued", "running", "retrying")  # a sweep or the scheduler will still change these
STATES = (COMPLETE, "running", "queued", "retrying", FAILED, "interrupted", "submitted", "not started")
QUEUED_SLURM_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "PREEMPTED", "CONFIGURING", "UNKNOWN")


@dataclass
class CellState:
    """One cell: its grid point, state (complete, failed, retrying, running, queued, submitted,
    interrupted, not started), job id, attempt of attempts, wall seconds, samples and failed samples
    (None where unknown), and for a cell not complete, why."""

    name: str
    method: str | None
    retention: float | None
    frames: int | None
    tasks: list[str]
    backbone: str | None
    card: str | None
    state: str
    job_id: str | None = None
    attempt: int | None = None
    attempts: int | None = None
    seconds: float | None = None
    samples: int | None = None
    failed_samples: int | None = None
    reason: str | None = None
    log: str | None = None


def sweep_alive(marker: dict) -> bool:
    """Whether the sweep that watches this cell's job (a sweep that waits) still runs here."""
    sweep = marker.get("sweep") or {}
    return sweep.get("host") == this_process()["host"] and process_alive(sweep.get("pid", -1))


def cell_states(run_dir: str | Path, ask_scheduler: bool = True) -> list[CellState]:
    """Every cell of the sweep folder: those its `sweep.json` lists, then any other cell folder.
    Without `ask_scheduler`, a cell whose SLURM job has written no record yet is `submitted`."""
    run_dir = Path(run_dir)
    plan = (read_json(run_dir / PLAN_FILE) or {}).get("cells", {})
    found = sorted({p.parent.name for name in (CELL_FILE, JOB_FILE) for p in run_dir.glob(f"*/{name}")})
    names = list(dict.fromkeys([*plan, *found]))
    records = {name: read_json(run_dir / name / CELL_FILE) for name in names}
    markers = {name: read_json(run_dir / name / JOB_FILE) for name in names}
    if any(markers.values()):  # submitted jobs: their states come through submitit (not imported otherwise:
        # its import reconfigures the process's logging, `logging.config.dictConfig`)
        from .jobs import LOCAL, SLURM, cell_log, ended_reason, refresh_slurm, scheduler_state
    if ask_scheduler:
        refresh_slurm([m for name, m in markers.items() if m is not None and records[name] is None])
    states = []
    for name in names:
        record, marker = records[name], markers[name] or {}
        started = read_json(run_dir / name / STARTED_FILE)
        about = plan.get(name) or record or {}
        cell = CellState(
            name=name,
            method=about.get("method"),
            retention=about.get("retention"),
            frames=about.get("frames"),
            tasks=list(about.get("tasks") or []),
            backbone=about.get("backbone"),
            card=about.get("card"),
            state="not started",
            job_id=marker.get("job_id"),
            attempt=marker.get("attempt"),
            attempts=marker.get("attempts"),
        )
        if record is not None:
            cell.seconds, cell.samples = record.get("seconds"), record.get("samples")  # older records lack some
            cell.failed_samples = record.get("failed_samples")
            if record.get("status") == "done":
                cell.state = COMPLETE
            else:
                retry = marker and marker.get("attempt", 1) < marker.get("attempts", 1) and sweep_alive(marker)
                cell.state = "retrying" if retry else "interrupted" if record.get("interrupted") else FAILED
                cell.reason, cell.log = record.get("error"), record.get("log")
        elif marker.get("held"):  # held back by the sweep that watches it (--max-parallel): queued while it runs
            cell.state = "queued" if sweep_alive(marker) else "interrupted"
            if cell.state == "interrupted":
                cell.reason = (
                    "the sweep that held it back (--max-parallel) ended first; run the same sweep command again"
                )
        elif marker and marker["executor"] == SLURM and not ask_scheduler:
            cell.state = "submitted"
        elif marker:
            state, active = scheduler_state(marker)
            if started is not None and (active or sweep_alive(marker)):
                cell.seconds = time.time() - started["started"]
            if active:
                queued = state in QUEUED_SLURM_STATES if marker["executor"] == SLURM else started is None
                cell.state = "queued" if queued else "running"
            elif sweep_alive(marker):  # the sweep that waits on it records its end in a moment
                cell.state = "running"
            elif marker["executor"] in (LOCAL, "local"):
                cell.state = "interrupted"
                cell.reason = "the sweep that ran it ended before the cell did; run the same sweep command again"
            else:
                cell.state = FAILED
                cell.reason = ended_reason(marker, state, run_dir / name)
                cell.log = cell_log(run_dir / name, marker)
        states.append(cell)
    return states


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def status_text(run_dir: str | Path, states: list[CellState], width: int = 30, verbose: bool = False) -> str:
    """The table of cells, a progress bar of complete cells, and why each failed, retrying or
    interrupted cell stopped (its reason's first line and its log; `verbose`: the reason's last
    lines and the log's last lines too)."""
    head = ["cell", "method", "R", "frames", "tasks", "backbone", "state", "job", "attempt", "wall", "failed samples"]
    rows = []
    for s in states:
        rows.append(
            [
                s.name,
                s.method or "—",
                "—" if s.retention is None else f"{s.retention:g}",
                "—" if s.frames is None else str(s.frames),
                ",".join(s.tasks) or "—",
                s.backbone or "—",
                s.state,
                s.job_id or "—",
                "—" if s.attempt is None else f"{s.attempt}/{s.attempts}",
                _duration(s.seconds),
                "—" if s.samples is None else f"{s.failed_samples}/{s.samples}",
            ]
        )
    lines = [f"sweep {run_dir}: {len(states)} cells", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    complete = sum(s.state == COMPLETE for s in states)
    filled = round(width * complete / len(states)) if states else 0
    counts = {state: sum(s.state == state for s in states) for state in STATES}
    summary = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    lines.append(f"complete [{'#' * filled}{'.' * (width - filled)}] {complete}/{len(states)} ({summary})")
    for s in states:
        if s.state in (FAILED, "retrying", "interrupted") and s.reason:
            reason = s.reason.strip().splitlines()
            shown = reason[:1] + (reason[1:][-5:] if verbose else [])
            lines.append(f"{s.name} ({s.state}): " + "\n    ".join(shown) + (f"\n    log: {s.log}" if s.log else ""))
            if verbose and s.log:
                lines += [f"    | {line}" for line in log_tail(s.log)]
    return "\n".join(lines)


def log_tail(path: str, lines: int = 15) -> list[str]:
    """The last `lines` lines of a log, or why there are none."""
    log = Path(path)
    if not log.is_file():
        return ["(the log does not exist)"]
    text = log.read_text(errors="replace").rstrip().splitlines()
    return text[-lines:] or ["(the log is empty)"]


def exit_code(states: list[CellState]) -> int:
    """`sweep-status`'s exit code: 1 while any cell has failed for good or was interrupted (neither
    will change by waiting), else 0 (complete, or still queued, running or retrying)."""
    return 1 if any(s.state in (FAILED, "interrupted") for s in states) else 0


def show_status(run_dir: str | Path, watch_s: float | None = None, verbose: bool = False, echo=print) -> int:
    """Print the status (every `watch_s` seconds until no cell is queued, running or retrying);
    returns `exit_code`."""
    while True:
        states = cell_states(run_dir)
        if watch_s is not None and sys.stdout.isatty():
            echo("\033[2J\033[H", end="")
        echo(status_text(run_dir, states, verbose=verbose))
        if watch_s is None or not any(s.state in ACTIVE for s in states):
            return exit_code(states)
        time.sleep(watch_s)
