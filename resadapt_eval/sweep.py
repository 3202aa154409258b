"""Model cards and retention sweeps: a grid of (method, retention, frames) cells, one lmms-eval
process per cell, resumable.

Each cell writes `<output>/<cell>/cell.json` last: `status` is `done` (lmms-eval wrote its
results and no more than `max_failed_fraction` of its samples failed) or `failed` (with the first
errors and the log's path). A re-run skips `done` cells and runs the rest again from scratch, so a
killed sweep loses at most the cells it was running. A cell is keyed by everything that determines
its result (the card, the cell, its model_args, tasks, limit and the package version): a `done`
cell computed under another configuration is never reused; the sweep stops and names what
changed, or, with `rerun_changed`, computes it again.

Beside it, `submitted.json` (written when the sweep starts or submits the cell: executor, job id,
attempt) and `started.json` (written by the cell's process: pid, host, time); `<output>/sweep.json`
lists every cell the sweep commands asked for, so a report can name the ones still missing.
`run_sweep` runs the cells here, one after another; `cluster.jobs.submit_sweep` submits them as
submitit jobs (SLURM, or submitit's local executor). Either way each lmms-eval run is in its own
process group, ended with the process that started it (`guard`).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from .cells import (
    CELL_FILE,
    JOB_FILE,
    LOG_FILE,
    PLAN_FILE,
    STARTED_FILE,
    read_cell,
    read_json,
    this_process,
    write_marker,
)
from .guard import ENDED_EXIT, exit_description, run_guarded
from .manifest import read_manifests, versions, write_json

# The method registry and the lmms-eval model names are imported where they are used: a cell's
# job process (cluster/jobs.py) needs neither, and would otherwise load torch before its cell starts.

# model_args every cell sets itself, and where a sweep takes them instead
CELL_MODEL_ARGS = {
    "pretrained": "the card's `pretrained:`",
    "method": "--methods",
    "max_num_frames": "--frames",
    "retention": "--retention",
}


@dataclass
class ModelCard:
    """One evaluated configuration (see model_cards/README.md).

    backbone: qwen25vl | qwen3vl; pretrained: checkpoint folder or hub id; frames: default
    max_num_frames values; model_args: extra model_args for every cell (pixels, s-range, dtype,
    ...); allocator: checkpoint for method=resadapt (`untrained` = the untrained default, on purpose); gen_kwargs:
    lmms-eval --gen_kwargs; tasks / include_path: default tasks and where custom tasks live;
    paper_backbone: the paper's name for this backbone (for `tables --paper`); description: Markdown;
    needle_data: a needle test split the card's task reads, written before the sweep when missing
    (`variant`, `out` (folder, relative to the card), `videos`, `cue`; see `needle.data.ensure_needle_data`);
    slurm: the jobs' SLURM settings for `sweep --executor slurm` (`cluster.settings.SlurmSettings`;
    not part of a cell's configuration: where a cell runs does not change its result).
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
    needle_data: dict | None = None
    slurm: dict = field(default_factory=dict)
    source: str | None = None  # the card file it was read from (for messages; not a card key)


def load_card(path: str | Path) -> ModelCard:
    """Read a card; relative local paths (pretrained, allocator, include_path) resolve against the
    card's folder when they exist there."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model card not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    known = set(ModelCard.__dataclass_fields__) - {"source"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown card keys {unknown}; allowed: {sorted(known)}")
    for required in ("name", "backbone", "pretrained"):
        if required not in raw:
            raise ValueError(f"{path}: missing `{required}`")
    from .lmms.manifests import BACKBONES

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
    raw["model_args"] = checked_model_args(raw.get("model_args") or {}, f"{path}: model_args")
    if "allocator" in raw["model_args"]:
        raise ValueError(f"{path}: model_args sets `allocator`; give it as the card's `allocator:` key")
    if raw.get("needle_data") is not None:
        data = dict(raw["needle_data"])
        extra = sorted(set(data) - {"variant", "out", "videos", "cue"})
        if extra or "out" not in data:
            raise ValueError(f"{path}: needle_data takes variant, out, videos, cue (out required); got {sorted(data)}")
        data["out"] = str((path.parent / data["out"]).resolve())
        raw["needle_data"] = data
    raw["slurm"] = raw.get("slurm") or {}  # checked by the sweep command (`cluster.settings.check_card_section`)
    return ModelCard(**raw, source=str(path))


def checked_model_args(model_args: dict, where: str) -> dict:
    """`model_args` unchanged, or ValueError when it sets what each cell sets itself (a value
    there would be overwritten by the cell's, so the run would not be what was asked)."""
    clash = sorted(set(model_args) & set(CELL_MODEL_ARGS))
    if clash:
        raise ValueError(
            f"{where} sets {', '.join(clash)}, which every cell sets itself; use "
            + ", ".join(f"{CELL_MODEL_ARGS[k]} for {k}" for k in clash)
        )
    return model_args


def with_model_args(card: ModelCard, pairs: str) -> ModelCard:
    """The card with `k=v,...` (sweep --model-args) added to its model_args; `allocator=PATH`
    replaces the card's Allocator (a path relative to the current folder)."""
    extra = {}
    for pair in pairs.split(","):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--model-args takes k=v,...; got {pair!r}")
        extra[key] = value
    allocator = extra.pop("allocator", None)
    if allocator not in (None, "untrained"):
        allocator = str(Path(allocator).resolve()) if Path(allocator).exists() else allocator
    model_args = {**card.model_args, **checked_model_args(extra, "--model-args")}
    return replace(card, model_args=model_args, allocator=allocator or card.allocator)


@dataclass(frozen=True)
class Cell:
    method: str
    retention: float | None
    frames: int

    @property
    def name(self) -> str:
        """Folder name; the retention is written in full (repr), so distinct targets never share one."""
        r = "" if self.retention is None else f"-r{float(self.retention)!r}"
        return f"{self.method}{r}-f{self.frames}"


def plan_cells(methods: list[str], retentions: list[float], frames: list[int]) -> list[Cell]:
    """The grid: every method at every retention and frame count; methods without a retention
    target (vanilla) once per frame count."""
    from .methods import METHODS

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known methods: {', '.join(METHODS)}")
    cells = []
    for f in frames:
        for m in methods:
            if METHODS[m].full_budget:
                cells.append(Cell(m, None, f))
            else:
                cells.extend(Cell(m, float(r), f) for r in retentions)
    return list(dict.fromkeys(cells))  # a repeated method, retention or frame count runs once


def cell_config(card: ModelCard, cell: Cell, tasks: list[str], limit: int | None) -> dict:
    """Everything that determines a cell's result: the card's contents, the cell, its tasks and
    limit, and the package version (not the launcher or the card's SLURM settings: 1 and N
    processes, here or on a cluster, give the same result; nor where the card file lies)."""
    contents = {k: v for k, v in asdict(card).items() if k not in ("slurm", "source")}
    return dict(card=contents, cell=asdict(cell), tasks=list(tasks), limit=limit, version=versions()["resadapt-eval"])


def config_key(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`name: old -> new` for every setting that differs between two cell configurations."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


def cell_model_args(card: ModelCard, cell: Cell) -> tuple[str, dict]:
    """The lmms-eval model name and model_args of one cell."""
    from .methods import get_method

    model = get_method(cell.method).model_names(card.backbone)[0]
    args = dict(pretrained=card.pretrained, method=cell.method, max_num_frames=cell.frames, **card.model_args)
    if cell.retention is not None:
        args["retention"] = cell.retention
    if get_method(cell.method).needs_allocator and card.allocator:
        args["allocator"] = card.allocator
    return model, args


def model_args_string(args: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in args.items() if v is not None)


def check_cells(card: ModelCard, cells: list[Cell]) -> None:
    """Stop before the first cell runs when a cell's model_args would stop its lmms-eval run at
    start: each cell's model_args, parsed as lmms-eval parses its command line, go through its
    model class's own checks (`ResAdaptQwen.checked_config`: names, types, values, the method's
    settings, the Allocator's budget.json), the Allocator's backbone against the card's
    (`allocator.check_backbone`) and the method's backbones (`MethodKind.families`) against the
    card's, which need no weights. A ValueError names the cell."""
    import importlib

    from lmms_eval.utils import simple_parse_args_string

    from .allocator import check_backbone
    from .lmms.manifests import model_names
    from .methods import get_method

    classes = model_names()
    check_card_allocator(card, cells)
    for cell in cells:
        families = get_method(cell.method).kind.families
        if card.backbone not in families:
            raise ValueError(
                f"cell {cell.name}: method={cell.method} runs on {', '.join(families)} only, not this card's "
                f"{card.backbone}"
            )
        model, args = cell_model_args(card, cell)
        module, _, name = classes[model][0].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        parsed = simple_parse_args_string(model_args_string(args))
        for key in ("pretrained", "device", "attn_implementation", "sidecar_dir"):  # checked when loading
            parsed.pop(key, None)
        try:
            config = cls.checked_config(**parsed)
            check_backbone(config.allocator, card.backbone, card.pretrained, config.allocator_transfer)
        except ValueError as exc:
            raise ValueError(f"cell {cell.name} ({model}): {exc}") from None


def cell_command(
    card: ModelCard, cell: Cell, tasks: list[str], out: Path, launcher: str | None = None, limit: int | None = None
) -> list[str]:
    """The lmms-eval command line of one cell (under `launcher`, e.g. `accelerate launch --num_processes 8`)."""
    model, args = cell_model_args(card, cell)
    runner = shlex.split(launcher) if launcher else [sys.executable]
    cmd = [
        *runner,
        "-m",
        "lmms_eval",
        "--model",
        model,
        "--model_args",
        model_args_string(args),
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


class ChangedCells(ValueError):
    """The output holds finished cells computed under another configuration."""


def check_card_allocator(card: ModelCard, cells: list[Cell]) -> None:
    """ValueError naming the card file when a cell's method needs an Allocator and the card sets none,
    offering the committed checkpoints trained with the card's backbone (never another's)."""
    from .methods import get_method

    needs = sorted({c.method for c in cells if get_method(c.method).needs_allocator})
    if needs and not card.allocator:
        from .allocator import known_allocators

        known = known_allocators(card.backbone, card.pretrained)
        offer = f"; committed for this backbone: {', '.join(known)}" if known else ""
        raise ValueError(
            f"card {card.name} sets no `allocator:` ({card.source or 'the card file'}); {', '.join(needs)} "
            "cells need one: set `allocator:` there to an Allocator checkpoint trained with this backbone "
            f"(resadapt-eval train writes one){offer}, or to `untrained` to run the untrained Allocator on purpose "
            "(or give sweep --model-args allocator=...)"
        )


def check_sweep(card: ModelCard, cells: list[Cell], tasks: list[str], max_failed_fraction: float) -> None:
    """ValueError for a sweep no cell of which could give a result."""

    if not tasks:
        raise ValueError("no tasks: pass --tasks or list them in the card")
    if not 0 <= max_failed_fraction <= 1:
        raise ValueError(f"max_failed_fraction must be in [0, 1], got {max_failed_fraction}")
    check_card_allocator(card, cells)


def sweep_configs(
    card: ModelCard, cells: list[Cell], tasks: list[str], output: Path, limit: int | None, rerun_changed: bool
) -> tuple[dict[Cell, dict], dict[Cell, dict]]:
    """Each cell's configuration, and the records of the cells already done under it. A done cell
    of another configuration raises `ChangedCells` naming what changed, unless `rerun_changed`."""
    configs = {c: cell_config(card, c, tasks, limit) for c in cells}
    previous = {c: read_cell(output / c.name) or {} for c in cells}
    reusable = {
        c: previous[c]
        for c in cells
        if previous[c].get("status") == "done" and previous[c].get("key") == config_key(configs[c])
    }
    changed = [c for c in cells if previous[c].get("status") == "done" and c not in reusable]
    if changed and not rerun_changed:
        example = config_changes(previous[changed[0]].get("config") or {}, configs[changed[0]])
        raise ChangedCells(
            f"{output} holds {len(changed)} finished cell(s) computed under another configuration "
            f"({', '.join(c.name for c in changed)}); {changed[0].name} changed: {'; '.join(example[:6])}. "
            "Use another --output, or --rerun-changed to compute them again"
        )
    return configs, reusable


def write_plan(output: Path, card: ModelCard, cells: list[Cell], tasks: list[str]) -> None:
    """Add the cells to `<output>/sweep.json` (every cell any sweep command into `output` asked for)."""
    plan = read_json(output / PLAN_FILE) or {"cells": {}}
    for cell in cells:
        plan["cells"][cell.name] = dict(card=card.name, backbone=card.backbone, **asdict(cell), tasks=list(tasks))
    write_json(output / PLAN_FILE, plan)


def run_sweep(
    card: ModelCard,
    cells: list[Cell],
    tasks: list[str],
    output: Path,
    launcher: str | None = None,
    limit: int | None = None,
    max_failed_fraction: float = 0.0,
    rerun_changed: bool = False,
    retries: int = 0,
    echo=print,
) -> list[dict]:
    """Run every unfinished cell here, one after another; returns each cell's record (done,
    failed or skipped).

    A cell is done when lmms-eval wrote its results and at most `max_failed_fraction` of its
    samples failed (0: any failed sample fails the cell); a failed cell runs again up to `retries`
    times. A done cell of another configuration raises `ChangedCells` naming what changed, unless
    `rerun_changed`."""
    check_sweep(card, cells, tasks, max_failed_fraction)
    output.mkdir(parents=True, exist_ok=True)
    configs, reusable = sweep_configs(card, cells, tasks, output, limit, rerun_changed)
    write_plan(output, card, cells, tasks)
    todo = [c for c in cells if c not in reusable]
    echo(f"sweep {card.name}: {len(cells)} cells, {len(reusable)} already done, {len(todo)} to run -> {output}")
    records, started, ran = [], time.perf_counter(), 0
    for cell in cells:
        if cell in reusable:
            records.append(reusable[cell])
            continue
        for attempt in range(1, retries + 2):
            cell_dir = output / cell.name
            cell_dir.mkdir(parents=True, exist_ok=True)
            key = config_key(configs[cell])
            write_marker(cell_dir, "local", None, attempt, retries + 1, key, sweep=this_process())
            command = cell_command(card, cell, tasks, cell_dir, launcher, limit)
            job = dict(executor="local", job_id=None)
            record = run_cell(card, cell, tasks, cell_dir, configs[cell], command, max_failed_fraction, job=job)
            if record["status"] == "done" or attempt > retries:
                break
            echo(f"{cell.name}: failed (attempt {attempt} of {retries + 1}), running it again: {record['error']}")
        records.append(record)
        ran += 1
        elapsed = time.perf_counter() - started
        eta = elapsed / ran * (len(todo) - ran)
        failures = (
            f", {record['failed_samples']}/{record['samples']} samples failed" if record["failed_samples"] else ""
        )
        echo(
            f"[{ran}/{len(todo)}] {cell.name}: {record['status']} in {record['seconds']:.0f} s{failures} "
            f"(elapsed {elapsed:.0f} s, ETA {eta:.0f} s)"
        )
    failed = [r for r in records if r["status"] == "failed"]
    for r in failed:
        echo(f"failed cell {r['cell']} (see {r['cell']}/cell.json and {LOG_FILE}):\n{r['error']}")
    return records


def clear_cell_dir(cell_dir: Path) -> None:
    """An empty cell folder but for its `submitted.json`: a failed, interrupted or changed cell starts over."""
    cell_dir.mkdir(parents=True, exist_ok=True)
    for path in cell_dir.iterdir():
        if path.name == JOB_FILE:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def run_cell(
    card: ModelCard,
    cell: Cell,
    tasks: list[str],
    cell_dir: Path,
    config: dict,
    cmd: list[str],
    max_failed_fraction: float,
    watch: tuple[int, ...] = (),
    job: dict | None = None,
) -> dict:
    """Run one cell from scratch (its lmms-eval command line `cmd`, `cell_command`) and write its
    `cell.json` (last). The lmms-eval run is in its own process group, ended when this process or a
    `watch` process ends (`guard`); `job` (executor, job id) goes into the record with this
    process's pid and host."""
    clear_cell_dir(cell_dir)
    job = {**(job or {}), **this_process()}
    write_json(cell_dir / STARTED_FILE, dict(job, started=time.time()))
    log = cell_dir / LOG_FILE
    t0 = time.perf_counter()
    returncode = run_guarded(cmd, log, watch)
    seconds = time.perf_counter() - t0
    output = log.read_text(errors="replace")
    results = sorted(cell_dir.rglob("*_results.json"))
    runs = read_manifests(cell_dir)
    samples = sum(m["samples"] for m in runs)
    failed_samples = sum(m["failed_samples"] for m in runs)
    if returncode == ENDED_EXIT:
        error = "interrupted: " + (output.strip().splitlines() or ["the guard ended the run"])[-1]
    elif returncode != 0 or not results or not runs:
        error = _error_tail(output, returncode)
    elif samples == 0:
        error = "no samples were answered"
    elif failed_samples > max_failed_fraction * samples:
        errors = [f"{e['task']} doc {e['doc_id']}: {e['error']}" for m in runs for e in m["first_errors"]]
        allowed = f"max_failed_fraction={max_failed_fraction}"
        first = errors[0].strip().splitlines()[0] if errors else "no error recorded"
        error = f"{failed_samples} of {samples} samples failed ({allowed}); first: {first}"
        if len(errors) > 1 or (errors and errors[0].strip() != first):
            error += "\n" + "\n".join(f"  {e}" for e in errors)
    else:
        error = None
    record = dict(
        card=card.name,
        backbone=card.backbone,
        paper_backbone=card.paper_backbone,
        cell=cell.name,
        **asdict(cell),
        tasks=tasks,
        status="failed" if error else "done",
        samples=samples,
        failed_samples=failed_samples,
        seconds=round(seconds, 2),
        command=cmd,
        results=str(results[-1].relative_to(cell_dir)) if results else None,
        error=error,
        interrupted=returncode == ENDED_EXIT,
        log=str(log),
        job=job,
        key=config_key(config),
        config=config,
    )
    write_json(cell_dir / CELL_FILE, record)
    return record


def _error_tail(output: str, returncode: int, lines: int = 20) -> str:
    """How the cell's lmms-eval run ended (`exit_description`), then the end of its output: the
    lines mentioning an error first (lmms-eval may exit 0 after an error)."""
    text = output.splitlines()
    errors = [line for line in text if "Error" in line or "error" in line]
    tail = (errors or text)[-lines:]
    if returncode == 0:
        head = f"lmms-eval exited with exit code 0 but wrote no results: {tail[-1].strip() if tail else 'no output'}"
    else:
        head = f"lmms-eval {exit_description(returncode)}" + (f": {tail[-1].strip()}" if tail else "")
    return "\n".join([head, *tail])
