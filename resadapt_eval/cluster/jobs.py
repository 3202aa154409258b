"""A sweep's cells as submitit jobs: one job per cell on SLURM (a job array when the command does
not wait), or submitit's local executor on this machine (`--slurm-local`), each cell a separate
process running the same `CellJob`.

Inside the job the cell runs through `sweep.run_cell` with the sweep's `--launcher` (e.g.
accelerate across the job's GPUs). A re-run of the same sweep command skips the cells that are
complete or whose job the scheduler still runs, and submits the rest. A sweep that waits
(`--wait`, always with `--slurm-local`) watches its jobs and resubmits a cell whose job died
(preempted, time limit, node failure, killed) or whose cell failed, up to `retries` times; a
preempted job is also requeued by submitit's checkpointing (`CellJob` is Checkpointable; the cell
starts over). A job that reaches its time limit is not requeued: it would only reach it again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import submitit

from ..cells import CELL_FILE, JOB_FILE, LOG_FILE, STARTED_FILE, read_cell, read_json, this_process, write_marker
from ..guard import GRACE_S, process_alive
from ..manifest import write_json
from ..sweep import Cell, ModelCard, cell_command, check_sweep, config_key, run_cell, sweep_configs, write_plan
from .settings import BadSlurmSetting, SlurmSettings, executor_parameters, where

SUBMITIT_DIR = ".submitit"  # in the sweep folder: submitit's pickles and each job's logs
CONTROLLER_LOG = "controllers.log"  # in SUBMITIT_DIR: what the local executor's job controllers print
LOCAL, SLURM = "slurm-local", "slurm"  # the executors of a cell's submitted.json (`local`: run_sweep)
UNKNOWN_GRACE_S = 600  # a job sacct does not know yet is taken as queued for this long after submission
POLL_S = {LOCAL: 1.0, SLURM: 30.0}  # seconds between checks of the jobs of a sweep that waits


class SubmissionFailed(RuntimeError):
    """The scheduler refused a submission (sbatch's error); the cells named were not submitted."""


class CellJob(submitit.helpers.Checkpointable):
    """One cell as a submitit job: `run_cell` in the job's process, on the lmms-eval command line
    the sweep made (`cell_command`); returns the cell's record. `owner_pid`: with the local
    executor, the sweep's process, whose end ends the cell."""

    def __init__(
        self,
        card: ModelCard,
        cell: Cell,
        tasks: list[str],
        cell_dir: Path,
        config: dict,
        cmd: list[str],
        max_failed_fraction: float,
        executor: str,
        owner_pid: int | None = None,
    ):
        self.card, self.cell, self.tasks, self.cell_dir, self.config = card, cell, tasks, cell_dir, config
        self.cmd, self.max_failed_fraction = cmd, max_failed_fraction
        self.executor, self.owner_pid = executor, owner_pid

    def __call__(self) -> dict:
        job = dict(executor=self.executor, job_id=submitit.JobEnvironment().job_id)
        watch = () if self.owner_pid is None else (self.owner_pid,)
        return run_cell(
            self.card,
            self.cell,
            self.tasks,
            self.cell_dir,
            self.config,
            self.cmd,
            self.max_failed_fraction,
            watch=watch,
            job=job,
        )


@dataclass
class SweepSpec:
    """What every cell job of one sweep command shares."""

    card: ModelCard
    tasks: list[str]
    output: Path
    launcher: str | None
    limit: int | None
    max_failed_fraction: float
    configs: dict


def make_executor(output: Path, settings: SlurmSettings, local: bool, max_parallel: int | None):
    """submitit's executor for the sweep's jobs; BadSlurmSetting when SLURM is not here or refuses
    a setting (a partition the cluster does not have included). Nothing is submitted."""
    cluster = "local" if local else "slurm"
    if not local and shutil.which("srun") is None:
        raise BadSlurmSetting("--executor slurm: no SLURM here (srun not found); --slurm-local runs the jobs here")
    if not local and settings.partition:
        check_partitions(settings.partition)
    executor = submitit.AutoExecutor(
        folder=output / SUBMITIT_DIR, cluster=cluster, slurm_max_num_timeout=0, local_max_num_timeout=0
    )
    try:
        executor.update_parameters(**executor_parameters(settings, "resadapt-eval", max_parallel))
    except (NameError, ValueError, AssertionError) as exc:
        raise BadSlurmSetting(f"submitit refused the SLURM settings: {str(exc).splitlines()[0]}") from None
    return executor


def check_partitions(partition: str) -> None:
    """BadSlurmSetting naming a partition (of a comma-separated list) that `sinfo` does not list."""
    try:
        listed = subprocess.run(["sinfo", "--noheader", "--format=%R"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return  # no sinfo to ask: sbatch checks it
    known = set(listed.stdout.split())
    missing = [p for p in partition.split(",") if p.strip() not in known]
    if listed.returncode == 0 and known and missing:
        raise BadSlurmSetting(
            f"--slurm-partition (card slurm.partition) {missing[0]!r}: the cluster has no such partition "
            f"(sinfo lists {', '.join(sorted(known))})"
        )


def attach(marker: dict):
    """The submitit job of a cell's `submitted.json`, re-attached by folder and job id."""
    cls = submitit.LocalJob if marker["executor"] == LOCAL else submitit.SlurmJob
    return cls(folder=marker["folder"], job_id=marker["job_id"])


def refresh_slurm(markers: list[dict]) -> None:
    """One sacct call (through submitit) for the SLURM jobs of these markers; `scheduler_state` reads its answer."""
    jobs = [attach(m) for m in markers if m["executor"] == SLURM and m.get("job_id") is not None]
    if jobs:
        jobs[0].watcher.update()


def scheduler_state(marker: dict) -> tuple[str, bool]:
    """(state, active) of a cell's job as its scheduler sees it: sacct through submitit for SLURM
    (as of the last `refresh_slurm`), the job's controller process for the local executor (whose
    jobs live no longer than the sweep that started them), the sweep's process for `run_sweep`'s cells."""
    if marker["executor"] == "local":
        sweep = marker.get("sweep") or {}
        alive = sweep.get("host") == this_process()["host"] and process_alive(sweep.get("pid", -1))
        return ("RUNNING" if alive else "ENDED"), alive
    if marker["executor"] == LOCAL:
        alive = marker.get("host") == this_process()["host"] and process_alive(int(marker["job_id"]))
        return ("RUNNING" if alive else "ENDED"), alive
    job = attach(marker)
    if job.paths.result_pickle.exists():
        return "FINISHED", False
    state = job.get_info(mode="cache").get("State") or "UNKNOWN"
    if state == "UNKNOWN":  # sacct has no line for it (yet)
        return state, time.time() - marker.get("submitted", 0) < UNKNOWN_GRACE_S
    return state, not job.watcher.is_done(job.job_id, mode="cache")


# SLURM's job states (sacct) of a job that ended, in words; others are quoted as the scheduler gives them
SLURM_ENDINGS = {
    "OUT_OF_MEMORY": "ran out of memory (raise --slurm-mem-gb)",
    "TIMEOUT": "reached its time limit (raise --slurm-timeout-min)",
    "CANCELLED": "was cancelled (scancel, or the cluster's administrators)",
    "NODE_FAIL": "lost its node (node failure)",
    "PREEMPTED": "was preempted",
    "FAILED": "failed (its batch script exited non-zero)",
    "BOOT_FAIL": "could not start on its node (boot failure)",
    "DEADLINE": "reached its deadline",
    "COMPLETED": "finished without writing its cell's record",
}


def ended_reason(marker: dict, state: str, cell_dir: Path) -> str:
    """Why a cell's job ended without the cell's record, first line first: the exception it raised,
    how its process died (the local executor: no result and no record means a signal: SIGKILL,
    the out-of-memory killer, a crash), or the scheduler's state in words; then where to look."""
    job = attach(marker)
    head = f"job {marker['job_id']}"
    if job.paths.result_pickle.exists():
        exception = job.exception()
        if exception is None:
            return f"{head} finished without writing its cell's record"
        lines = str(exception).strip().splitlines()
        return f"{head} raised {(lines or ['an exception'])[-1]}\n" + "\n".join(lines[-12:])
    if marker["executor"] == LOCAL:
        started = read_json(cell_dir / STARTED_FILE)
        if started is None:
            return f"{head} ended before its cell started (killed by a signal; scheduler state {state})"
        return (
            f"{head} was killed by a signal: its process {started['pid']} ended without a result or its cell's "
            "record (SIGKILL, the out-of-memory killer or a crash)"
        )
    words = SLURM_ENDINGS.get(state.split()[0] if state else "", "ended")
    return f"{head} {words} (SLURM state {state}) before finishing its cell"


def cell_log(cell_dir: Path, marker: dict) -> str:
    """Where to read why a cell ended: its own lmms-eval log once that has lines, else its job's stderr."""
    log = cell_dir / LOG_FILE
    if log.is_file() and log.stat().st_size:
        return str(log)
    return str(attach(marker).paths.stderr)


def record_failure(spec: SweepSpec, cell: Cell, job, marker: dict) -> dict:
    """The `cell.json` of a cell whose job ended without one: failed, with how it ended and its log."""
    cell_dir = spec.output / cell.name
    record = dict(
        card=spec.card.name,
        backbone=spec.card.backbone,
        paper_backbone=spec.card.paper_backbone,
        cell=cell.name,
        **asdict(cell),
        tasks=spec.tasks,
        status="failed",
        samples=0,
        failed_samples=0,
        seconds=None,
        command=None,
        results=None,
        error=ended_reason(marker, job.state, cell_dir),
        log=cell_log(cell_dir, marker),
        job=dict(job_id=job.job_id, stdout=str(job.paths.stdout), stderr=str(job.paths.stderr)),
        key=config_key(spec.configs[cell]),
        config=spec.configs[cell],
    )
    write_json(cell_dir / CELL_FILE, record)
    return record


@contextlib.contextmanager
def controllers_output(log: Path, redirect: bool):
    """While submitting to the local executor: this process's stdout and stderr (file descriptors 1
    and 2, which the job controllers it starts inherit) go to `log`, so that Ctrl-C in the terminal,
    which reaches the controllers too, prints their tracebacks there, not on the terminal."""
    if not redirect:
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log, "a") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        yield
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def warn_unchecked(settings: SlurmSettings, echo) -> None:
    """--slurm-local: one line for each SLURM-only setting given, which the local executor neither
    checks nor applies (the cluster's sbatch would)."""
    for key in ("partition", "account", "qos", "options", "additional"):
        value = getattr(settings, key)
        if value:
            shown = ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value
            echo(f"warning: {where(key)} {shown}: SLURM only; --slurm-local neither checks nor applies it")


def forget_earlier_attempt(cell_dir: Path) -> None:
    """Remove an earlier attempt's record and start: they must not stand for the attempt to come."""
    for name in (CELL_FILE, STARTED_FILE):
        (cell_dir / name).unlink(missing_ok=True)


def submit(executor, spec: SweepSpec, cells: list[Cell], kind: str, attempts: dict, max_attempts: int, watched: bool):
    """Submit `cells` (one sbatch job array when there are several), write their markers; returns
    cell -> job. `attempts[cell]` is the attempt this is."""
    owner = this_process()["pid"] if kind == LOCAL else None
    functions = [
        CellJob(
            spec.card,
            cell,
            spec.tasks,
            spec.output / cell.name,
            spec.configs[cell],
            cell_command(spec.card, cell, spec.tasks, spec.output / cell.name, spec.launcher, spec.limit),
            spec.max_failed_fraction,
            kind,
            owner,
        )
        for cell in cells
    ]
    for cell in cells:
        forget_earlier_attempt(spec.output / cell.name)
    try:
        with controllers_output(spec.output / SUBMITIT_DIR / CONTROLLER_LOG, kind == LOCAL):
            if len(cells) == 1:
                executor.update_parameters(name=f"{spec.card.name}:{cells[0].name}")
                jobs = [executor.submit(functions[0])]
            else:
                executor.update_parameters(name=spec.card.name)
                with executor.batch():
                    jobs = [executor.submit(f) for f in functions]
    except RuntimeError as exc:  # submitit's FailedJobError (sbatch's exit status) or FailedSubmissionError
        raise SubmissionFailed(f"the scheduler refused {', '.join(c.name for c in cells)}: {exc}") from exc
    for cell, job in zip(cells, jobs):
        write_marker(
            spec.output / cell.name,
            kind,
            str(job.job_id),
            attempts[cell],
            max_attempts,
            config_key(spec.configs[cell]),
            folder=str(executor.folder),
            host=this_process()["host"],
            sweep=this_process() if watched else None,
        )
    return dict(zip(cells, jobs))


def submit_sweep(
    card: ModelCard,
    cells: list[Cell],
    tasks: list[str],
    output: Path,
    settings: SlurmSettings,
    local: bool = False,
    wait: bool = False,
    retries: int = 0,
    max_parallel: int | None = None,
    launcher: str | None = None,
    limit: int | None = None,
    max_failed_fraction: float = 0.0,
    rerun_changed: bool = False,
    echo=print,
) -> list[dict] | None:
    """Submit every cell that is neither complete nor still running as a submitit job. Without
    `wait` (SLURM only) return None after submitting; else watch the jobs, at most `max_parallel`
    at once, resubmit a cell that failed or whose job died up to `retries` times, and return every
    cell's record (None for a cell still running under an earlier sweep's job). BadSlurmSetting or
    ChangedCells (nothing submitted) when a setting is wrong."""
    kind = LOCAL if local else SLURM
    wait = wait or local
    check_sweep(card, cells, tasks, max_failed_fraction)
    output.mkdir(parents=True, exist_ok=True)
    configs, done = sweep_configs(card, cells, tasks, output, limit, rerun_changed)
    markers = {c: read_json(output / c.name / JOB_FILE) for c in cells if c not in done}
    markers = {
        c: m
        for c, m in markers.items()
        if m is not None and m.get("job_id") is not None and read_cell(output / c.name) is None
    }
    refresh_slurm(list(markers.values()))
    running = {}
    for cell, marker in markers.items():
        state, active = scheduler_state(marker)
        if not active:
            continue
        if marker.get("key") != config_key(configs[cell]):
            raise BadSlurmSetting(
                f"{cell.name} still runs as job {marker['job_id']} under another configuration: wait for it, "
                "or cancel it (scancel, or stop the sweep that runs it)"
            )
        running[cell] = (marker, state)
    executor = make_executor(output, settings, local, max_parallel)
    if local:
        warn_unchecked(settings, echo)
    write_plan(output, card, cells, tasks)
    todo = [c for c in cells if c not in done and c not in running]
    echo(
        f"sweep {card.name}: {len(cells)} cells, {len(done)} already done, {len(running)} still running, "
        f"{len(todo)} to submit -> {output}"
    )
    for cell in cells:
        if cell in done:
            echo(f"skipped {cell.name}: complete")
        elif cell in running:
            marker, state = running[cell]
            echo(f"skipped {cell.name}: job {marker['job_id']} is {state}")
    spec = SweepSpec(card, tasks, output, launcher, limit, max_failed_fraction, configs)
    if not wait:
        jobs = submit(executor, spec, todo, kind, dict.fromkeys(todo, 1), retries + 1, watched=False) if todo else {}
        for cell, job in jobs.items():
            echo(f"submitted {cell.name}: job {job.job_id}")
        echo(f"job ids: {' '.join(str(j.job_id) for j in jobs.values()) or 'none'}")
        echo(f"sweep folder: {output} (job logs: {output / SUBMITIT_DIR})")
        echo(f"follow it: resadapt-eval sweep-status {output}")
        return None
    records = watch(executor, spec, todo, kind, retries, max_parallel, echo)
    if running:
        echo(f"{len(running)} cells run on under jobs of an earlier sweep: resadapt-eval sweep-status {output}")
    return [records.get(c) or done.get(c) or read_cell(output / c.name) for c in cells]


def hold(spec: SweepSpec, cells: list[Cell], kind: str, attempts: int) -> None:
    """Mark `cells` as held back by this sweep (`--max-parallel`): `sweep-status` shows them queued
    while it runs. An earlier attempt's record or start no longer stands for them."""
    for cell in cells:
        cell_dir = spec.output / cell.name
        cell_dir.mkdir(parents=True, exist_ok=True)
        forget_earlier_attempt(cell_dir)
        key = config_key(spec.configs[cell])
        write_marker(cell_dir, kind, None, 1, attempts, key, held=True, sweep=this_process())


def watch(executor, spec: SweepSpec, cells: list[Cell], kind: str, retries: int, max_parallel, echo) -> dict:
    """Run `cells` as jobs, at most `max_parallel` at once, until each is done or has failed
    `retries + 1` times; returns cell -> record. Interrupted, it cancels the local executor's jobs
    (their cells end with them) and leaves SLURM's running."""
    queue, active, records, attempts = list(cells), {}, {}, dict.fromkeys(cells, 0)
    total, finished, started = len(cells), 0, time.perf_counter()
    if max_parallel is not None:
        hold(spec, queue[max_parallel:], kind, retries + 1)
    try:
        while queue or active:
            while queue and (max_parallel is None or len(active) < max_parallel):
                batch = queue[: None if max_parallel is None else max_parallel - len(active)]
                del queue[: len(batch)]
                for cell in batch:
                    attempts[cell] += 1
                for cell, job in submit(executor, spec, batch, kind, attempts, retries + 1, watched=True).items():
                    active[cell] = job
                    echo(f"submitted {cell.name}: job {job.job_id} (attempt {attempts[cell]} of {retries + 1})")
            time.sleep(POLL_S[kind])
            if kind == SLURM and active:
                next(iter(active.values())).watcher.update()  # one sacct call for every job
            for cell, job in list(active.items()):
                if not job.done():
                    continue
                del active[cell]
                marker = read_json(spec.output / cell.name / JOB_FILE)
                record = read_cell(spec.output / cell.name) or record_failure(spec, cell, job, marker)
                if record["status"] != "done" and attempts[cell] <= retries:
                    attempt = f"attempt {attempts[cell]} of {retries + 1}"
                    echo(f"{cell.name}: failed ({attempt}), resubmitting: {record['error']}")
                    queue.insert(0, cell)
                    continue
                records[cell] = record
                finished += 1
                seconds = "" if record["seconds"] is None else f" in {record['seconds']:.0f} s"
                echo(
                    f"[{finished}/{total}] {cell.name}: {record['status']}{seconds} (job {job.job_id}, "
                    f"elapsed {time.perf_counter() - started:.0f} s)"
                )
    except KeyboardInterrupt:
        if kind == LOCAL:
            for job in active.values():
                job.cancel()
            deadline = time.time() + GRACE_S + 10
            while any(not job.done() for job in active.values()) and time.time() < deadline:
                time.sleep(0.2)
        else:
            echo(f"stopped watching; {len(active)} jobs go on: resadapt-eval sweep-status {spec.output}")
        raise
    for record in records.values():
        if record["status"] != "done":
            echo(
                f"failed cell {record['cell']} (see {record['cell']}/cell.json and {record['log']}):\n{record['error']}"
            )
    return records
