"""Sweeps as submitit jobs (issue 34): the SLURM code path run by submitit's local executor on the
tiny fixtures (each cell a separate process), a cell killed mid-run and resumed, sweeps that end
their lmms-eval runs when interrupted or killed, retries of a cell that always fails, bad SLURM
settings stopped before anything is submitted, and the real SLURM executor against stub
sbatch/sacct/sinfo commands."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from resadapt_eval.cli import main
from resadapt_eval.report.collect import collect
from resadapt_eval.report.tables import build_tables, to_markdown

from .helpers import REPO, REPORT_GRID

CARD = REPO / "model_cards" / "tiny-qwen25vl.yaml"
# four cells of the session's report sweep (`REPORT_GRID`): the local executor's run of them is shared
GRID = ["--methods", "fixed_scale,resadapt", "--retention", REPORT_GRID["retention"]]
GRID += ["--limit", str(REPORT_GRID["limit"])]
CELLS = ["fixed_scale-r0.5-f8", "fixed_scale-r0.25-f8", "resadapt-r0.5-f8", "resadapt-r0.25-f8"]
SLURM_LOCAL = ["--executor", "slurm", "--slurm-local", "--max-parallel", "2"]
TIMINGS = ("peak_memory_mb",)  # besides every `*_s` field: what differs between two runs of one cell


CLI = [sys.executable, "-m", "resadapt_eval.cli"]


def sweep_cmd(out, *extra, card=CARD, grid=GRID):
    return [*CLI, "sweep", "--card", str(card), *grid, "--output", str(out), *extra]


def run(cmd, timeout=600):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def in_process(capsys, *argv) -> subprocess.CompletedProcess:
    """`resadapt-eval ARGV` run in this process: its exit code and what it printed."""
    capsys.readouterr()
    code = main(list(argv))
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, printed.out, printed.err)


def status(run_dir, capsys) -> subprocess.CompletedProcess:
    return in_process(capsys, "sweep-status", str(run_dir))


def status_rows(text: str) -> dict[str, list[str]]:
    """cell -> its sweep-status table row (cell, method, R, frames, tasks, backbone, state, job, ...)."""
    rows = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {row[0]: row for row in rows[1:]}


def processes_under(out: Path) -> dict[int, list[bytes]]:
    """pid -> argv of every live process whose command line names `out` (the cell's lmms-eval run,
    its guard, submitit's job processes)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and any(str(out).encode() in arg for arg in argv):
            found[int(proc.name)] = argv
    return found


def lmms_eval_processes(out: Path) -> list[int]:
    """Live lmms-eval processes writing under `out` (not their guards)."""
    return [
        pid for pid, argv in processes_under(out).items() if b"lmms_eval" in argv and b"resadapt_eval.guard" not in argv
    ]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def comparable(cell_dir: Path) -> dict:
    """What a cell computed: its record's outcome and key, lmms-eval's scores, and every sidecar
    record without its timings."""
    record = json.loads((cell_dir / "cell.json").read_text())
    results = json.loads((cell_dir / record["results"]).read_text())["results"]
    sidecar = [
        {k: v for k, v in json.loads(line).items() if not k.endswith("_s") and k not in TIMINGS}
        for path in sorted(cell_dir.rglob("resadapt_samples_*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    outcome = {k: record[k] for k in ("status", "samples", "failed_samples", "key", "config", "error")}
    return dict(outcome=outcome, results=results, sidecar=sidecar)


def markdown_tables(run_dir) -> list[str]:
    return [to_markdown(table) for table in build_tables(collect(run_dir, include_failed=True))]


@pytest.fixture(scope="module")
def sequential(report_sweep, tmp_path_factory):
    """The 2 methods x 2 R grid run by the local executor, one cell after another: the report sweep's run
    of those cells, copied, in a sweep folder of this grid (the sweep finds them done and runs nothing)."""
    import shutil

    out = tmp_path_factory.mktemp("sequential")
    for name in CELLS:
        shutil.copytree(report_sweep / name, out / name)
    proc = run(sweep_cmd(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 cells, 4 already done, 0 to run" in proc.stdout
    return out


def test_slurm_local_runs_each_cell_as_its_own_process_and_resumes_only_a_killed_cell(sequential, tmp_path, capsys):
    """`--executor slurm --slurm-local`: the 4 cells run as submitit jobs, each a separate process;
    one cell's job killed (SIGKILL) mid-run shows failed, a re-run of the command runs only that
    cell, and the records and tables equal the sequential sweep's."""
    out = tmp_path / "jobs"
    sweep = subprocess.Popen(sweep_cmd(out, *SLURM_LOCAL), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    victim = CELLS[0]
    wait_for(lambda: lmms_eval_processes(out / victim), 300, f"{victim}'s lmms-eval run")
    # --max-parallel 2: the two cells after the first two are held back by the sweep, and show queued
    held = status_rows(status(out, capsys).stdout)
    assert [held[name][6] for name in CELLS[2:]] == ["queued", "queued"], held
    job_process = json.loads((out / victim / "started.json").read_text())["pid"]
    assert job_process != sweep.pid
    os.kill(job_process, signal.SIGKILL)
    stdout, stderr = (text.decode() for text in sweep.communicate(timeout=600))
    assert sweep.returncode == 1, stdout[-3000:] + stderr[-3000:]
    log = out / victim / "lmms_eval.log"
    assert f"failed cell {victim} (see {victim}/cell.json and {log})" in stdout

    shown = status(out, capsys)
    assert shown.returncode == 1  # a cell has failed for good (--retries 0)
    rows = status_rows(shown.stdout)
    assert sorted(rows) == sorted(CELLS)
    assert {name: row[6] for name, row in rows.items()} == {n: "failed" if n == victim else "complete" for n in CELLS}
    assert "] 3/4 (3 complete, 1 failed)" in shown.stdout
    killed = json.loads((out / victim / "cell.json").read_text())
    reason = killed["error"].splitlines()[0]
    assert killed["status"] == "failed" and "was killed by a signal: its process" in reason
    assert f"{victim} (failed): job {killed['job']['job_id']} was killed by a signal" in shown.stdout
    assert killed["log"] == str(log) and log.is_file() and log.stat().st_size > 0  # the cell's own log
    assert f"    log: {log}" in shown.stdout
    # the guard's last line there says which process ended, and --verbose shows it
    last = log.read_text().strip().splitlines()[-1]
    assert f"process {job_process} ended; ended the cell's process group" in last
    verbose = in_process(capsys, "sweep-status", str(out), "--verbose")
    assert verbose.returncode == 1 and f"    | {last}" in verbose.stdout
    assert lmms_eval_processes(out / victim) == []  # its lmms-eval run ended with its job
    # tables list it as missing, with the whole first line of why
    tables = in_process(capsys, "tables", str(out), "--out", str(tmp_path / "tables"))
    job_id = killed["job"]["job_id"]
    missing = f"- {victim} (fixed_scale, R=0.5, 8 frames): failed, job {job_id}: {reason} (log: {log})"
    assert missing in tables.stdout.splitlines()

    finished = {name: (out / name / "cell.json").stat().st_mtime for name in CELLS if name != victim}
    rerun = run(sweep_cmd(out, *SLURM_LOCAL))
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "4 cells, 3 already done, 0 still running, 1 to submit" in rerun.stdout
    assert [line.split(":")[0] for line in rerun.stdout.splitlines() if line.startswith("submitted ")] == [
        f"submitted {victim}"
    ]
    assert all(f"skipped {name}: complete" in rerun.stdout for name in finished)
    for name, mtime in finished.items():
        assert (out / name / "cell.json").stat().st_mtime == mtime  # not run again
    marker = json.loads((out / victim / "submitted.json").read_text())
    assert marker["executor"] == "slurm-local" and len(marker["history"]) == 1  # the killed job's marker

    shown = status(out, capsys)
    assert shown.returncode == 0 and "4/4" in shown.stdout
    assert [row[6] for row in status_rows(shown.stdout).values()] == ["complete"] * 4

    # every cell ran in a process of its own, under its own job, none in the sweep's process
    records = [json.loads((out / name / "cell.json").read_text()) for name in CELLS]
    assert len({r["job"]["pid"] for r in records}) == 4 and sweep.pid not in {r["job"]["pid"] for r in records}
    assert len({r["job"]["job_id"] for r in records}) == 4
    assert {r["job"]["executor"] for r in records} == {"slurm-local"}
    for name in CELLS:
        assert comparable(out / name) == comparable(sequential / name), name
    assert markdown_tables(out) == markdown_tables(sequential)
    assert len(markdown_tables(out)) == 1 and markdown_tables(out)[0].count("\n| ") == 1 + 4


@pytest.mark.parametrize("executor", ["local", "slurm-local"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=lambda sig: sig.name)
def test_an_interrupted_or_killed_sweep_leaves_no_lmms_eval_process(fixtures_dir, tmp_path, capsys, executor, sig):
    """Each cell's lmms-eval run is in its own process group, ended with the sweep: SIGINT (Ctrl-C)
    or SIGKILL (`kill -9`) to the sweep process leaves no lmms-eval process behind."""
    out = tmp_path / "run"
    extra = ["--executor", "slurm", "--slurm-local"] if executor == "slurm-local" else []
    grid = ["--methods", "fixed_scale", "--retention", "0.5", "--limit", "2"]
    sweep = subprocess.Popen(  # with Ctrl-C's default action, which pytest-xdist's workers ignore
        sweep_cmd(out, *extra, grid=grid),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's foreground group of its own: Ctrl-C reaches all of it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    (cell,) = wait_for(lambda: lmms_eval_processes(out), 300, "the cell's lmms-eval run")
    assert os.getpgid(cell) == cell != os.getpgid(sweep.pid)  # the leader of its own process group
    if sig == signal.SIGINT:  # Ctrl-C in a terminal: every process of the sweep's group gets it
        os.killpg(sweep.pid, sig)
    else:
        sweep.send_signal(sig)
    _, stderr = sweep.communicate(timeout=60)
    assert sweep.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL)
    if sig == signal.SIGINT:  # one line, and no job controller's traceback
        assert stderr.strip().splitlines() == [
            f"sweep: interrupted; the cells it ran were ended. Run the same command to resume: {out}"
        ], stderr
    wait_for(lambda: not processes_under(out), 30, "no process of the sweep left (lmms-eval, guard, submitit job)")
    with pytest.raises(ProcessLookupError):
        os.killpg(cell, 0)  # nothing left in its group either
    shown = status(out, capsys)
    assert status_rows(shown.stdout)["fixed_scale-r0.5-f8"][6] == "interrupted", shown.stdout
    assert shown.returncode == 1  # interrupted will not change by waiting: the same command resumes it


def missing_videos_card(fixtures_dir: Path, folder: Path) -> Path:
    """The tiny card on a copy of the smoke task whose rows point into a video folder that does not exist."""
    rows = [json.loads(line) for line in (fixtures_dir / "smoke_videoqa" / "test.jsonl").read_text().splitlines()]
    for row in rows:
        row["video_path"] = str(folder / "no-such-videos" / Path(row["video_path"]).name)
    (folder / "tasks").mkdir(parents=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = (REPO / "tasks" / "resadapt_smoke_videoqa" / "resadapt_smoke_videoqa.yaml").read_text()
    task = task.replace("task: resadapt_smoke_videoqa", "task: sweep_missing_videos")
    task = task.replace("test: ../../fixtures/smoke_videoqa/test.jsonl", f"test: {folder / 'rows.jsonl'}")
    assert "sweep_missing_videos" in task and str(folder) in task
    (folder / "tasks" / "sweep_missing_videos.yaml").write_text(task)
    card = yaml.safe_load(CARD.read_text())
    card.update(
        name="tiny-missing-videos",
        pretrained=str(fixtures_dir / "qwen25vl"),
        include_path=str(folder / "tasks"),
        tasks=["sweep_missing_videos"],
    )
    path = folder / "card.yaml"
    path.write_text(yaml.safe_dump(card))
    return path


def test_a_cell_that_always_fails_is_retried_then_failed_and_listed_missing_not_scored(
    fixtures_dir, sequential, tmp_path, capsys
):
    card = missing_videos_card(fixtures_dir, tmp_path / "data")
    out = tmp_path / "run"
    grid = ["--methods", "fixed_scale", "--retention", "0.5", "--limit", "1"]
    proc = run(sweep_cmd(out, *SLURM_LOCAL, "--retries", "1", card=card, grid=grid))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = "fixed_scale-r0.5-f8"
    assert f"{name}: failed (attempt 1 of 2), resubmitting" in proc.stdout
    assert proc.stdout.count(f"submitted {name}: job") == 2 and f"failed cell {name}" in proc.stdout
    marker = json.loads((out / name / "submitted.json").read_text())
    assert (marker["attempt"], marker["attempts"], len(marker["history"])) == (2, 2, 1)
    assert marker["job_id"] != marker["history"][0]["job_id"]
    record = json.loads((out / name / "cell.json").read_text())
    assert (record["status"], record["samples"], record["failed_samples"]) == ("failed", 1, 1)
    assert "1 of 1 samples failed" in record["error"] and "no-such-videos" in record["error"]

    shown = status(out, capsys)
    assert shown.returncode == 1
    assert status_rows(shown.stdout)[name][6:9] == ["failed", marker["job_id"], "2/2"]
    assert "1 of 1 samples failed" in shown.stdout and f"log: {out / name / 'lmms_eval.log'}" in shown.stdout

    # tables over the complete sweep and this one: the failed cell is listed missing, never a score
    tables = in_process(capsys, "tables", str(sequential), str(out), "--out", str(tmp_path))
    assert tables.returncode == 0, tables.stderr[-2000:]
    missing = f"- {name} (fixed_scale, R=0.5, 8 frames): failed, job {marker['job_id']}: 1 of 1 samples failed"
    assert "Missing cells (1; not complete, never shown as a score):" in tables.stdout and missing in tables.stdout
    (row,) = [line for line in tables.stdout.splitlines() if line.startswith("| tiny-missing-videos")]
    assert row.count("failed 1/1") == 2 and not any(c.strip()[:1].isdigit() for c in row.split("|")[6:-1])
    assert missing in (tmp_path / "video_qa.md").read_text()
    with (tmp_path / "video_qa.csv").open() as f:
        assert len(f.read().splitlines()) == 1 + 5  # the 4 complete cells and the failed one, whose scores are empty


def test_plots_and_tables_of_a_partial_sweep_list_the_cells_not_run(sequential, tmp_path, capsys):
    """A sweep folder whose plan has cells that never ran (here: one removed): the report shows the
    complete cells, lists the missing one, and draws no point for it."""
    import shutil

    from resadapt_eval.report.plots import pareto_lines

    partial = tmp_path / "partial"
    shutil.copytree(sequential, partial)
    shutil.rmtree(partial / "resadapt-r0.25-f8")
    assert main(["plots", str(partial), "--out", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out
    assert "- resadapt-r0.25-f8 (resadapt, R=0.25, 8 frames): not started" in printed
    assert len(pareto_lines(collect(partial), "resadapt_smoke_videoqa", 8)["resadapt"]) == 1
    assert main(["tables", str(partial), "--out", str(tmp_path / "tables")]) == 0
    assert "resadapt-r0.25-f8 (resadapt, R=0.25, 8 frames): not started" in capsys.readouterr().out


@pytest.mark.slow  # the retry loop is the slurm-local test's above (`make test-slow`); 2 lmms-eval runs, 38 s
def test_the_local_executor_retries_a_failing_cell(fixtures_dir, tmp_path):
    card = missing_videos_card(fixtures_dir, tmp_path / "data")
    grid = ["--methods", "fixed_scale", "--retention", "0.5", "--limit", "1"]
    proc = run(sweep_cmd(tmp_path / "run", "--retries", "1", card=card, grid=grid))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fixed_scale-r0.5-f8: failed (attempt 1 of 2), running it again: 1 of 1 samples failed" in proc.stdout
    marker = json.loads((tmp_path / "run" / "fixed_scale-r0.5-f8" / "submitted.json").read_text())
    assert (marker["executor"], marker["attempt"], marker["attempts"], len(marker["history"])) == ("local", 2, 2, 1)
    assert json.loads((tmp_path / "run" / "fixed_scale-r0.5-f8" / "cell.json").read_text())["status"] == "failed"


def test_sweep_status_watch_refreshes_until_no_cell_runs(sequential, tmp_path, capsys):
    """A cell whose sweep is still running shows `running`; `--watch` refreshes until that sweep has
    ended (the cell is then `interrupted`) and exits 1, as for a failed cell: waiting will not change it."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(sequential, run_dir)
    cell = run_dir / "resadapt-r0.25-f8"
    (cell / "cell.json").unlink()
    sweep = subprocess.Popen(["sleep", "2"])  # stands for the sweep process running the cell
    marker = json.loads((cell / "submitted.json").read_text())
    marker["sweep"] = {"pid": sweep.pid, "host": marker["sweep"]["host"]}
    (cell / "submitted.json").write_text(json.dumps(marker))
    assert main(["sweep-status", str(run_dir), "--watch", "0.5"]) == 1
    sweep.wait()
    printed = capsys.readouterr().out
    frames = printed.split(f"sweep {run_dir}: 4 cells")[1:]
    assert len(frames) >= 2  # refreshed
    assert "| resadapt-r0.25-f8 | resadapt | 0.25 | 8 |" in frames[0]
    assert status_rows(frames[0])["resadapt-r0.25-f8"][6] == "running"
    assert status_rows(frames[-1])["resadapt-r0.25-f8"][6] == "interrupted"
    assert "] 3/4 (3 complete, 1 interrupted)" in frames[-1]


def test_slurm_local_warns_once_about_each_slurm_only_setting_it_cannot_check(sequential, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(sequential, out)  # every cell complete: nothing runs
    settings = ["--slurm-partition", "gpu", "--slurm-account", "lab", "--slurm-qos", "high"]
    settings += ["--slurm-option", "constraint=a100", "--slurm-gpus-per-node", "1"]
    shown = in_process(capsys, "sweep", "--card", str(CARD), *GRID, "--output", str(out), *SLURM_LOCAL, *settings)
    assert shown.returncode == 0, shown.stderr
    warnings = [line for line in shown.stdout.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: {flag} (card slurm.{key}) {value}: SLURM only; --slurm-local neither checks nor applies it"
        for flag, key, value in (
            ("--slurm-partition", "partition", "gpu"),
            ("--slurm-account", "account", "lab"),
            ("--slurm-qos", "qos", "high"),
            ("--slurm-option", "options", "constraint=a100"),
        )
    ]
    assert "4 cells, 4 already done, 0 still running, 0 to submit" in shown.stdout


@pytest.mark.parametrize(
    "flags, named",
    [
        (
            ["--slurm-option", "partiton=gpu"],
            "--slurm-option (card slurm.options) partiton: not a SLURM parameter submitit knows; did you mean "
            "partition (set it with --slurm-partition)? Accepted: comment, constraint, cpus_per_gpu, dependency, "
            "exclude,",
        ),
        (
            ["--slurm-gpus-per-node", "-1"],
            "--slurm-gpus-per-node (card slurm.gpus_per_node) must be at least 0, got -1",
        ),
        (["--slurm-nodes", "2"], "--slurm-nodes (card slurm.nodes) must be 1, got 2"),
        (
            ["--slurm-option", "partition=gpu"],
            "--slurm-option (card slurm.options) partition: set it with --slurm-partition",
        ),
        (["--slurm-additional", "reservation"], "--slurm-additional takes KEY=VALUE, got 'reservation'"),
        (["--max-parallel", "0"], "--max-parallel must be at least 1, got 0"),
        (["--retries", "1"], "--retries needs --wait with --executor slurm"),
    ],
)
def test_a_bad_slurm_setting_stops_before_anything_is_submitted(fixtures_dir, tmp_path, capsys, flags, named):
    out = tmp_path / "run"
    argv = ["sweep", "--card", str(CARD), *GRID, "--output", str(out), "--executor", "slurm"]
    local = [] if "--retries" in flags else ["--slurm-local"]
    assert main(argv + local + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("sweep: ") and named in err, err
    assert not out.exists()  # no cell folder, marker or submitit job


def test_a_bad_slurm_setting_in_the_card_names_its_key(fixtures_dir, tmp_path, capsys):
    card = yaml.safe_load(CARD.read_text())
    card.update(pretrained=str(fixtures_dir / "qwen25vl"), include_path=str(REPO / "tasks"), slurm={"mem_gb": -4})
    path = tmp_path / "card.yaml"
    path.write_text(yaml.safe_dump(card))
    argv = ["sweep", "--card", str(path), *GRID, "--output", str(tmp_path / "run"), "--executor", "slurm"]
    assert main(argv + ["--slurm-local"]) == 2
    assert "--slurm-mem-gb (card slurm.mem_gb) must be a positive number of GB, got -4" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({**card, "slurm": {"gpus_per_nod": 8}}))
    assert main(argv + ["--slurm-local"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: slurm.gpus_per_nod is not a SLURM setting; did you mean gpus_per_node?" in err
    # slurm flags without --executor slurm are refused, naming the first
    assert main(["sweep", "--card", str(CARD), *GRID, "--output", str(tmp_path / "run"), "--slurm-qos", "high"]) == 2
    assert "--slurm-qos applies to --executor slurm" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# --- the real SLURM executor, against stub scheduler commands ------------------------------------

STUBS = {
    "srun": "exit 1\n",
    "sinfo": 'printf "gpu\\ncpu\\n"\n',
    # records each batch script, answers as sbatch does (job ids 4242, 4243, ...); refuses account "nope"
    "sbatch": 'if grep -q -- "--account=nope" "$1"; then echo "sbatch: error: Invalid account" >&2; exit 1; fi\n'
    'n=$(cat "$STUB_DIR/next_id"); echo $((n + 1)) > "$STUB_DIR/next_id"\n'
    'cp "$1" "$STUB_DIR/batch_$n.sh"\necho "Submitted batch job $n"\n',
    # sacct's --parsable2 answer: whatever the test put in sacct.txt
    "sacct": 'echo "JobID|State|NodeList"\ncat "$STUB_DIR/sacct.txt"\n',
}


@pytest.fixture
def stub_slurm(tmp_path, monkeypatch):
    """A PATH with stub srun, sinfo, sbatch and sacct (bash scripts under tmp_path/bin)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\nSTUB_DIR={tmp_path}\n{body}")
        path.chmod(0o755)
    (tmp_path / "next_id").write_text("4242\n")
    (tmp_path / "sacct.txt").write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_slurm_submits_a_job_array_returns_and_resubmits_only_cells_neither_complete_nor_running(
    fixtures_dir, stub_slurm, capsys
):
    out = stub_slurm / "run"
    settings = ["--slurm-partition", "gpu", "--slurm-gpus-per-node", "8", "--slurm-timeout-min", "90"]
    settings += [
        "--slurm-account",
        "lab",
        "--slurm-qos",
        "high",
        "--slurm-mem-gb",
        "200",
        "--slurm-cpus-per-task",
        "32",
    ]
    settings += ["--slurm-option", "constraint=a100", "--slurm-additional", "reservation=paper"]
    argv = ["sweep", "--card", str(CARD), *GRID, "--output", str(out), "--executor", "slurm", "--max-parallel", "2"]
    argv += ["--launcher", "accelerate launch --num_processes 8"]
    assert main(argv + settings) == 0
    printed = capsys.readouterr().out
    assert "4 cells, 0 already done, 0 still running, 4 to submit" in printed
    assert "job ids: 4242_0 4242_1 4242_2 4242_3" in printed and f"sweep folder: {out}" in printed
    script = (stub_slurm / "batch_4242.sh").read_text()
    for line in [
        "#SBATCH --array=0-3%2",
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=90",
        "#SBATCH --account=lab",
        "#SBATCH --qos=high",
        "#SBATCH --mem=200GB",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --constraint=a100",
        "#SBATCH --reservation=paper",
    ]:
        assert line in script.splitlines(), line
    markers = {name: json.loads((out / name / "submitted.json").read_text()) for name in CELLS}
    assert [m["job_id"] for m in markers.values()] == ["4242_0", "4242_1", "4242_2", "4242_3"]
    assert {m["executor"] for m in markers.values()} == {"slurm"}

    # the scheduler: 4242_0 runs, 4242_1 waits, 4242_2 failed, 4242_3 completed without a cell record (a crash)
    states = {"4242_0": "RUNNING", "4242_1": "PENDING", "4242_2": "NODE_FAIL", "4242_3": "CANCELLED by 0"}
    (stub_slurm / "sacct.txt").write_text("".join(f"{job}|{state}|node1\n" for job, state in states.items()))
    assert main(["sweep-status", str(out)]) == 1
    shown = capsys.readouterr().out
    rows = status_rows(shown)
    assert [rows[name][6] for name in CELLS] == ["running", "queued", "failed", "failed"]
    # a job that died says how, in the scheduler's words, and where its log is
    assert f"{CELLS[2]} (failed): job 4242_2 lost its node (node failure) (SLURM state NODE_FAIL)" in shown
    assert f"{CELLS[3]} (failed): job 4242_3 was cancelled (scancel, or the cluster's administrators)" in shown
    assert f"    log: {out / '.submitit' / '4242_2_0_log.err'}" in shown  # the job's: no lmms_eval.log was written
    assert main(argv + settings) == 0
    printed = capsys.readouterr().out
    assert "4 cells, 0 already done, 2 still running, 2 to submit" in printed
    assert "skipped fixed_scale-r0.5-f8: job 4242_0 is RUNNING" in printed
    assert "skipped fixed_scale-r0.25-f8: job 4242_1 is PENDING" in printed
    assert "job ids: 4243_0 4243_1" in printed
    resubmitted = {name: json.loads((out / name / "submitted.json").read_text()) for name in CELLS[2:]}
    assert [m["job_id"] for m in resubmitted.values()] == ["4243_0", "4243_1"]
    assert [m["history"][-1]["job_id"] for m in resubmitted.values()] == ["4242_2", "4242_3"]
    assert json.loads((out / CELLS[0] / "submitted.json").read_text())["job_id"] == "4242_0"
    assert not (stub_slurm / "batch_4244.sh").exists()


def test_an_unknown_partition_stops_before_sbatch_runs_and_a_refused_submission_says_why(
    fixtures_dir, stub_slurm, capsys
):
    out = stub_slurm / "run"
    argv = ["sweep", "--card", str(CARD), *GRID, "--output", str(out), "--executor", "slurm"]
    assert main(argv + ["--slurm-partition", "gpux"]) == 2
    err = capsys.readouterr().err
    assert (
        "--slurm-partition (card slurm.partition) 'gpux': the cluster has no such partition (sinfo lists cpu, gpu)"
        in err
    )
    assert not list(stub_slurm.glob("batch_*.sh")) and not out.exists()
    assert main(argv + ["--slurm-partition", "gpu", "--slurm-account", "nope"]) == 2
    err = capsys.readouterr().err
    assert f"sweep: the scheduler refused {', '.join(CELLS)}: sbatch: error: Invalid account" in err
    assert not list(stub_slurm.glob("batch_*.sh")) and not out.exists()  # a refused sweep leaves no folder


# --- docs/cluster.md, command by command, against the stub scheduler ---------------------------

CLUSTER_DOC = REPO / "docs" / "cluster.md"
CHECKOUT = "/shared/resadapt-eval"  # the page's stand-in for the checkout the compute nodes see


def doc_blocks(page: Path) -> list[tuple[str, str]]:
    """(info string, text) of every fenced code block of a Markdown page."""
    blocks, lines, fence = [], page.read_text().splitlines(), None
    for line in lines:
        if fence is None and line.startswith("```"):
            fence, body = line[3:].strip(), []
        elif fence is not None and line.startswith("```"):
            blocks.append((fence, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
    return blocks


def shell_commands(script: str) -> list[str]:
    """A bash block's commands: continuation lines joined, a `for ... done` loop kept whole."""
    commands, current = [], ""
    for line in script.replace("\\\n", " ").splitlines():
        current = f"{current}\n{line}" if current else line
        opened = current.lstrip().startswith(("for ", "while "))
        if not opened or line.strip() == "done":
            commands.append(current.strip())
            current = ""
    return [c for c in commands if c]


def test_every_command_of_the_cluster_page_runs_as_written_up_to_submission(stub_slurm, capsys, monkeypatch):
    """Each command of docs/cluster.md, run as the page writes it (its checkout path standing for
    this one): the paper grid's `for` loop through bash, its two sweeps submitting their job arrays
    to the stub sbatch; each `resadapt-eval` command after it, split as the shell splits it, through
    the CLI in this process (an interpreter start less each; `--watch` through bash): sweep-status
    follows the jobs, tables and plots list every cell as missing, and the `flops` block prints
    what the page shows."""
    work = stub_slurm / "checkout"
    work.mkdir()
    for name in (".venv", "model_cards", "configs", "tasks", "results"):
        (work / name).symlink_to(REPO / name)
    monkeypatch.chdir(work)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"  # `resadapt-eval`, after the stub bin

    def jobs_in(state: str) -> None:  # the stub sacct's answer for every submitted job
        markers = [json.loads(p.read_text()) for p in work.rglob("submitted.json")]
        (stub_slurm / "sacct.txt").write_text("".join(f"{m['job_id']}|{state}|node1\n" for m in markers))

    blocks = doc_blocks(CLUSTER_DOC)
    scripts = [text for info, text in blocks if info == "bash"]
    printed = [text for info, text in blocks if text.startswith("$ ")]
    assert scripts and printed
    ran = []
    for script in scripts:
        for command in shell_commands(script):
            if command.startswith("cd "):
                assert command.split("#")[0].strip() == f"cd {CHECKOUT}", command
                continue
            ran.append(command)
            if command.startswith("for "):  # the grid's sweeps, through bash as a user types them
                proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True)
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
                assert proc.stdout.count("job ids: ") == 2 and proc.stdout.count("26 to submit") == 2
                continue
            argv = shlex.split(command, comments=True)
            assert argv[0] == "resadapt-eval", command
            if argv[1] == "sweep-status" and "--watch" in argv:  # one screen: every job has ended (no record)
                jobs_in("COMPLETED")  # (in a process of its own: submitit caches an ended job's state)
                shown = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True)
                assert shown.returncode == 1 and "26 cells" in shown.stdout, shown.stdout[-2000:] + shown.stderr
                assert "finished without writing its cell's record" in shown.stdout
            elif argv[1] == "sweep-status":
                jobs_in("RUNNING")
                shown = in_process(capsys, *argv[1:])
                assert shown.returncode == 0 and status_rows(shown.stdout)["vanilla-f32"][6] == "running"
            elif argv[1] in ("tables", "plots"):  # no cell has finished: both cards' 52 cells listed missing
                shown = in_process(capsys, *argv[1:])
                assert shown.returncode == 1 and "no finished cells" in shown.stderr
                assert "Missing cells (52; not complete" in shown.stdout
            else:
                raise AssertionError(f"a command of {CLUSTER_DOC} this test does not know: {command}")
    assert [c.split()[1] for c in ran if not c.startswith("for ")] == [
        "sweep-status",
        "tables",
        "plots",
        "sweep-status",
        "sweep-status",
    ]
    for card in ("paper-qwen25vl-7b", "paper-qwen3vl-8b"):
        markers = list((work / "runs" / "paper-main" / card).glob("*/submitted.json"))
        assert len(markers) == 26
        resadapt = json.loads(
            (work / "runs" / "paper-main" / card / "resadapt-r0.25-f32" / "submitted.json").read_text()
        )
        assert resadapt["executor"] == "slurm"
    scripts_written = sorted(stub_slurm.glob("batch_*.sh"))
    assert len(scripts_written) == 2 and all("#SBATCH --array=0-25%8" in s.read_text() for s in scripts_written)
    for block in printed:
        command, *shown = block.splitlines()
        out = in_process(capsys, *shlex.split(command[2:])[1:])
        assert out.returncode == 0, out.stderr[-2000:]
        table = out.stdout.splitlines()[-len(shown) :]  # the page shows the table, not the line above it
        assert [line.split() for line in table] == [line.split() for line in shown], command
