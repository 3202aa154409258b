"""A sweep cell's files, which the sweep that runs it, the cluster jobs, `sweep-status` and the
reports all read: in `<output>/<cell>/`, `cell.json` (the record, written last), `submitted.json`
(the sweep's: executor, job id, attempt) and `started.json` (the cell process's: pid, host, start
time) beside lmms-eval's log; in `<output>/`, `sweep.json` (every cell any sweep command asked
for)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from .manifest import write_json

CELL_FILE = "cell.json"
JOB_FILE = "submitted.json"  # the sweep's: executor, job id, attempt (kept when the cell starts over)
STARTED_FILE = "started.json"  # the cell process's: pid, host, start time
PLAN_FILE = "sweep.json"  # in the sweep folder: every cell asked for
LOG_FILE = "lmms_eval.log"


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def read_cell(cell_dir: Path) -> dict | None:
    """The cell's record, None before it has one."""
    return read_json(cell_dir / CELL_FILE)


def write_marker(cell_dir: Path, executor: str, job_id: str | None, attempt: int, attempts: int, key: str, **extra):
    """The cell's `submitted.json`: which executor runs it under which job id, its attempt of
    `attempts` in this sweep command, its configuration key; the previous attempts' markers in
    `history` (not a marker of a cell only held back, `held`, whose job id is None)."""
    previous = read_json(cell_dir / JOB_FILE)
    history = [] if previous is None else [*previous.pop("history", []), previous]
    if previous is not None and previous.get("held"):  # only held back (`--max-parallel`), never submitted
        history.pop()
    marker = dict(
        executor=executor, job_id=job_id, attempt=attempt, attempts=attempts, key=key, submitted=time.time(), **extra
    )
    write_json(cell_dir / JOB_FILE, {**marker, "history": history[-10:]})
    return marker


def this_process() -> dict:
    return dict(pid=os.getpid(), host=socket.gethostname())
