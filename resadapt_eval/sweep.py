"""Model cards and retention sweeps: a grid of (method, retention, frames) cells, one lmms-eval
process per cell, resumable.

Each cell writes `<output>/<cell>/cell.json` last: `status` is `done` (lmms-eval wrote its
results) or `failed` (with the end of its output). A re-run skips `done` cells and runs the rest
again from scratch, so a killed sweep loses at most the cell it was in.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from .lmms.manifests import BACKBONES
from .methods import METHODS, NO_RETENTION, get_method

CELL_FILE = "cell.json"


@dataclass
class ModelCard:
    """One evaluated configuration (see model_cards/README.md).

    backbone: qwen25vl | qwen3vl; pretrained: checkpoint folder or hub id; frames: default
    max_num_frames values; model_args: extra model_args for every cell (pixels, s-range, dtype,
    ...); allocator: checkpoint for method=resadapt (`untrained` = the untrained default, on purpose); gen_kwargs:
    lmms-eval --gen_kwargs; tasks / include_path: default tasks and where custom tasks live;
    paper_backbone: the paper's name for this backbone (for `tables --paper`); description: Markdown.
    """

    name: str
    backbone: str
    pretrained: str
    frames: list[int] = field(default_factory=lambda: [32])
    model_args: dict = field(default_factory=dict)
    allocator: str | None = None
    gen_kwargs: dict = field(default_factory=dict)
    tasks: list[str] = field(default_factory=list)
    include_path: str | None = None
    paper_backbone: str | None = None
    description: str = ""


def load_card(path: str | Path) -> ModelCard:
    """Read a card; relative local paths (pretrained, allocator, include_path) resolve against the
    card's folder when they exist there."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model card not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    known = set(ModelCard.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown card keys {unknown}; allowed: {sorted(known)}")
    for required in ("name", "backbone", "pretrained"):
        if required not in raw:
            raise ValueError(f"{path}: missing `{required}`")
    if raw["backbone"] not in BACKBONES:
        raise ValueError(f"{path}: backbone must be one of {sorted(BACKBONES)}, got {raw['backbone']!r}")

    def local(value):
        if value is None:
            return None
        candidate = path.parent / value
        return str(candidate.resolve()) if candidate.exists() else value

    raw["pretrained"] = local(raw["pretrained"])
    raw["include_path"] = local(raw.get("include_path"))
    if raw.get("allocator") not in (None, "untrained"):
        raw["allocator"] = local(raw["allocator"])
    raw["frames"] = [int(f) for f in raw.get("frames", [32])]
    return ModelCard(**raw)


@dataclass(frozen=True)
class Cell:
    method: str
    retention: float | None
    frames: int

    @property
    def name(self) -> str:
        r = "" if self.retention is None else f"-r{self.retention:g}"
        return f"{self.method}{r}-f{self.frames}"


def plan_cells(methods: list[str], retentions: list[float], frames: list[int]) -> list[Cell]:
    """The grid: every method at every retention and frame count; methods without a retention
    target (vanilla) once per frame count."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known methods: {', '.join(METHODS)}")
    cells = []
    for f in frames:
        for m in methods:
            if METHODS[m].retention == NO_RETENTION:
                cells.append(Cell(m, None, f))
            else:
                cells.extend(Cell(m, r, f) for r in retentions)
    return cells


def cell_command(
    card: ModelCard, cell: Cell, tasks: list[str], out: Path, launcher: str | None = None, limit: int | None = None
) -> list[str]:
    """The lmms-eval command line of one cell (under `launcher`, e.g. `accelerate launch --num_processes 8`)."""
    model = get_method(cell.method).model_names(card.backbone)[0]
    args = dict(pretrained=card.pretrained, method=cell.method, max_num_frames=cell.frames, **card.model_args)
    if cell.retention is not None:
        args["retention"] = cell.retention
    if get_method(cell.method).needs_allocator and card.allocator:
        args["allocator"] = card.allocator
    runner = shlex.split(launcher) if launcher else [sys.executable]
    cmd = [
        *runner,
        "-m",
        "lmms_eval",
        "--model",
        model,
        "--model_args",
        ",".join(f"{k}={v}" for k, v in args.items() if v is not None),
        "--tasks",
        ",".join(tasks),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    if card.include_path:
        cmd += ["--include_path", card.include_path]
    if card.gen_kwargs:
        cmd += ["--gen_kwargs", ",".join(f"{k}={v}" for k, v in card.gen_kwargs.items())]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    return cmd


def read_cell(cell_dir: Path) -> dict | None:
    path = cell_dir / CELL_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def run_sweep(
    card: ModelCard,
    cells: list[Cell],
    tasks: list[str],
    output: Path,
    launcher: str | None = None,
    limit: int | None = None,
    echo=print,
) -> list[dict]:
    """Run every unfinished cell; returns each cell's record (done, failed or skipped)."""
    if not tasks:
        raise ValueError("no tasks: pass --tasks or list them in the card")
    output.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if (read_cell(output / c.name) or {}).get("status") != "done"]
    echo(
        f"sweep {card.name}: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run -> {output}"
    )
    records, started, ran = [], time.perf_counter(), 0
    for cell in cells:
        cell_dir = output / cell.name
        previous = read_cell(cell_dir)
        if previous and previous.get("status") == "done":
            records.append(previous)
            continue
        if cell_dir.exists():
            shutil.rmtree(cell_dir)  # a failed or interrupted cell starts over
        cell_dir.mkdir(parents=True)
        cmd = cell_command(card, cell, tasks, cell_dir, launcher, limit)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        (cell_dir / "lmms_eval.log").write_text(proc.stdout + proc.stderr)
        results = sorted(cell_dir.rglob("*_results.json"))
        done = proc.returncode == 0 and bool(results)
        record = dict(
            card=card.name,
            backbone=card.backbone,
            paper_backbone=card.paper_backbone,
            cell=cell.name,
            **asdict(cell),
            tasks=tasks,
            status="done" if done else "failed",
            seconds=round(seconds, 2),
            command=cmd,
            results=str(results[-1].relative_to(cell_dir)) if results else None,
            error=None if done else _error_tail(proc),
        )
        (cell_dir / CELL_FILE).write_text(json.dumps(record, indent=2) + "\n")
        records.append(record)
        ran += 1
        elapsed = time.perf_counter() - started
        eta = elapsed / ran * (len(todo) - ran)
        echo(
            f"[{ran}/{len(todo)}] {cell.name}: {record['status']} in {seconds:.0f} s "
            f"(elapsed {elapsed:.0f} s, ETA {eta:.0f} s)"
        )
    failed = [r["cell"] for r in records if r["status"] == "failed"]
    if failed:
        echo(f"failed cells (see <cell>/cell.json and lmms_eval.log): {', '.join(failed)}")
    return records


def _error_tail(proc: subprocess.CompletedProcess, lines: int = 20) -> str:
    """The end of a failed cell's output; lmms-eval may exit 0 after an error, so the lines
    mentioning an error come first."""
    text = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in text if "Error" in line or "error" in line]
    return "\n".join((errors or text)[-lines:]) or f"exit code {proc.returncode}"
