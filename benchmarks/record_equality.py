"""Capture the per-sample sidecar records of a fixed set of lmms-eval runs, and compare two captures.

Used to prove that a refactor of the request path (pipeline, backbones, lmms model classes) leaves
behaviour unchanged: capture once on the old code, once on the new, compare.

Usage (offline: the children get HF_HUB_OFFLINE=1, TOKENIZERS_PARALLELISM=false, cwd=REPO and
PYTHONPATH=REPO, so neither the shell's cwd nor its PYTHONPATH decides which code runs):

    # BEFORE: the old commit, checked out in a worktree beside this checkout
    git worktree add --detach ../base OLD_COMMIT
    .venv/bin/python benchmarks/record_equality.py capture --repo ../base --out runs/records_before
    # AFTER: this working tree
    .venv/bin/python benchmarks/record_equality.py capture --repo . --out runs/records_after
    .venv/bin/python benchmarks/record_equality.py compare runs/records_before runs/records_after

capture --repo REPO --out DIR [--data DATA] [--needle-limit N] [--parts smoke,methods,needle,chartqa,select]
    Runs through the real CLIs (`resadapt-eval sweep`, as `python -m resadapt_eval.cli sweep`, and
    `python -m lmms_eval` for the one cell a sweep cannot express), every child with cwd=REPO and
    PYTHONPATH=REPO, so `resadapt_eval` is imported from REPO even though the venv's editable install
    points at this checkout. Every python process that imports resadapt_eval logs the file it came from
    (a sitecustomize hook in DIR/_inputs/hook); the capture fails if any came from outside REPO.

      DIR/smoke-qwen25vl/<cell>   tiny-qwen25vl card, resadapt_smoke_videoqa, 7 methods at R=0.25
      DIR/smoke-qwen3vl/<cell>    tiny-qwen3vl card, same
      DIR/methods-<backbone>/<cell>  both tiny cards, resadapt_smoke_videoqa, every other HF method: the
                                  compressors, the two-stage and decode-time ones and FastV at R=0.25,
                                  PyramidDrop at R=0.5 (its default quarters cannot reach 0.25 on 12
                                  layers): every method REPO's registry runs on the HF classes and the
                                  smoke part leaves out
      DIR/needle-qwen25vl/<cell>  needle card, resadapt_needle, 7 methods at R=0.25, --limit N (100)
      DIR/chartqa-qwen25vl/<cell> tiny-qwen25vl, resadapt_fixture_chartqa: vanilla, fixed_scale R=0.25,
                                  resadapt R=0.25 (sweep) and resadapt without R (lmms-eval directly)
      DIR/select-qwen25vl/<cell>  tiny-qwen25vl smoke, resadapt operator=select_resize,candidates=8,
                                  top_k=4, R=0.5

    Cards and task YAMLs are read from REPO; each card is re-written to DIR/_inputs/cards/ with its
    weights (`pretrained`, `allocator`) and `include_path` made absolute, pointing at DATA and at a
    verbatim copy of REPO/tasks in DIR/_inputs/tasks (whose `../../fixtures/...` data paths reach
    DATA through the symlink DIR/_inputs/fixtures).

    DATA (default /tmp/resadapt_record_data) is one frozen input snapshot shared by both captures, so
    both read byte-identical videos, images, JSONL and weights, and a test run that rewrites
    REPO/fixtures (tests/conftest.py calls ensure_fixtures) cannot change or race them. It is
    written by the first capture (with the code that capture imports: use the BEFORE one) from
    REPO's generated fixtures (`resadapt-eval fixtures`): fixtures/qwen25vl, fixtures/qwen3vl,
    fixtures/smoke_videoqa (video paths in its JSONL re-pointed at DATA),
    results/needle/{backbone,allocator}-qwen25vl; plus
    `write_benchmark_fixtures` (ChartQA etc.) and `ensure_test_split(DATA/needle, N)`, as `cmd_demo`
    does for REPO/fixtures/needle. Its sha256 manifest (DATA/manifest.json) is checked by every later
    capture and copied to DIR/capture.json, where `compare` checks that both captures read the same.

compare A B [--only PREFIX,...]
    Matches sidecar records (`resadapt_samples_*_rank*.jsonl`) by (cell folder relative to the
    capture, task, doc_id); drops measurements (time fields, every key ending in `_s`, and
    `peak_memory_mb`, on CPU the process's peak RSS); compares everything else exactly (floats as
    written, types included). Also compares each cell's status, the `results`
    section and the `avg_resadapt_*` throughput totals (time totals excluded) of lmms-eval's
    `*_results.json`, and lmms-eval's logged samples (`*_samples_<task>.jsonl`: the answer in
    `filtered_resps`, `token_counts`, the metric's per-sample value, `input`, `doc_hash`, ...).
    Prints every difference and exits 1, else prints
    `identical: N records in M cells` and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SCRIPT_REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path("/tmp/resadapt_record_data")
METHODS = "vanilla,fixed_scale,random_drop,tome,visionzip,flashvid,resadapt"
# The `methods` part: every other HF method of REPO's registry at R = 0.25, but those listed here (PyramidDrop's
# default stages need R above 0.25 on 12 layers).
OTHER_RETENTION = {"pyramiddrop": "0.5"}
PARTS = ("smoke", "methods", "needle", "chartqa", "select")
SIDECAR_GLOB = "resadapt_samples_*_rank*.jsonl"
CELL_FILE = "cell.json"
IMPORT_LOG = "imports.jsonl"

# Written to DIR/_inputs/hook/sitecustomize.py and put first on every child's PYTHONPATH: a process
# that imported resadapt_eval logs, at exit, the file of every resadapt_eval module it loaded.
# Nothing else.
HOOK = """\
import atexit, json, os, sys


def _log_resadapt_import():
    files = sorted({str(getattr(m, "__file__", None)) for name, m in list(sys.modules.items())
                    if name == "resadapt_eval" or name.startswith("resadapt_eval.")})
    if files:
        with open(os.environ["RECORD_EQUALITY_IMPORT_LOG"], "a") as f:
            f.write(json.dumps(dict(pid=os.getpid(), argv=sys.argv[:3], files=files)) + "\\n")


atexit.register(_log_resadapt_import)
"""


# ---------------------------------------------------------------------------------------- capture
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def data_manifest(data: Path) -> dict[str, str]:
    return {
        str(p.relative_to(data)): sha256(p)
        for p in sorted(data.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def child_env(repo: Path, out: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=f"{out / '_inputs' / 'hook'}{os.pathsep}{repo}",
        RECORD_EQUALITY_IMPORT_LOG=str(out / "_inputs" / IMPORT_LOG),
    )
    return env


def run_child(cmd: list[str], repo: Path, env: dict, log: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    return proc


def ensure_data(data: Path, repo: Path, out: Path, needle_limit: int, need_needle: bool) -> dict[str, str]:
    """The frozen input snapshot (see the module docstring); returns its manifest."""
    manifest_file = data / "manifest.json"
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        current = data_manifest(data)
        if current != manifest:
            changed = sorted(k for k in set(manifest) | set(current) if manifest.get(k) != current.get(k))
            sys.exit(
                f"{data} no longer matches its manifest ({len(changed)} files, e.g. {changed[:5]}); "
                "delete it and capture BEFORE again"
            )
        if need_needle:
            rows = (data / "needle" / "test.jsonl").read_text().splitlines()
            if len(rows) < needle_limit:
                sys.exit(
                    f"{data}/needle/test.jsonl has {len(rows)} rows < --needle-limit {needle_limit}; "
                    "rebuild the snapshot with a larger limit"
                )
        print(f"data snapshot: {data} ({len(manifest)} files, manifest verified)")
        return manifest

    print(f"writing data snapshot {data} from {repo} (code imported from {repo}) ...")
    if data.exists():
        shutil.rmtree(data)  # a snapshot without its manifest was interrupted
    data.mkdir(parents=True)
    for name in ("qwen25vl", "qwen3vl"):
        shutil.copytree(repo / "fixtures" / name, data / name)
    smoke = data / "smoke_videoqa"
    shutil.copytree(repo / "fixtures" / "smoke_videoqa" / "videos", smoke / "videos")
    rows = [
        json.loads(line)
        for line in (repo / "fixtures" / "smoke_videoqa" / "test.jsonl").read_text().splitlines()
        if line.strip()
    ]
    for row in rows:
        row["video_path"] = str(smoke / "videos" / Path(row["video_path"]).name)
    (smoke / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("backbone-qwen25vl", "allocator-qwen25vl"):
        shutil.copytree(repo / "results" / "needle" / name, data / "needle-weights" / name)
    # Generated by the project's own code, in a child that imports it from REPO.
    script = (
        "import sys; from pathlib import Path\n"
        "from resadapt_eval.fixtures import write_benchmark_fixtures\n"
        "from resadapt_eval.needle.data import ensure_test_split\n"
        "d = Path(sys.argv[1]); n = int(sys.argv[2])\n"
        "write_benchmark_fixtures(d / 'benchmarks', d / 'smoke_videoqa', seed=0)\n"
        "print(ensure_test_split(d / 'needle', n))\n"
    )
    (out / "_inputs").mkdir(parents=True, exist_ok=True)
    proc = run_child(
        [sys.executable, "-c", script, str(data), str(needle_limit)],
        repo,
        child_env(repo, out),
        out / "_inputs" / "data_snapshot.log",
    )
    if proc.returncode != 0:
        sys.exit(f"writing the data snapshot failed:\n{proc.stdout}{proc.stderr}")
    for p in data.rglob("*"):  # frozen: nothing may rewrite it
        if p.is_file():
            p.chmod(0o444)
    manifest = data_manifest(data)
    manifest_file.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"data snapshot: {data} ({len(manifest)} files)")
    return manifest


def derive_card(
    repo: Path, inputs: Path, data: Path, card_name: str, name: str, model_args: dict | None = None
) -> Path:
    """REPO's card with weights and include_path made absolute (DATA, the copied tasks)."""
    import yaml

    raw = yaml.safe_load((repo / "model_cards" / f"{card_name}.yaml").read_text())
    if card_name.startswith("tiny-"):
        raw["pretrained"] = str(data / raw["backbone"])
    else:  # needle
        raw["pretrained"] = str(data / "needle-weights" / Path(raw["pretrained"]).name)
        raw["allocator"] = str(data / "needle-weights" / Path(raw["allocator"]).name)
    raw["include_path"] = str(inputs / "tasks")
    raw["name"] = name
    raw.setdefault("model_args", {}).update(model_args or {})
    path = inputs / "cards" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def sweep(
    card: Path,
    out: Path,
    repo: Path,
    env: dict,
    methods: str,
    retention: str,
    tasks: str | None = None,
    limit: int | None = None,
) -> bool:
    cmd = [
        sys.executable,
        "-u",  # the sweep's progress lines as they come (the lmms-eval children are not affected)
        "-m",
        "resadapt_eval.cli",
        "sweep",
        "--card",
        str(card),
        "--methods",
        methods,
        "--retention",
        retention,
        "--output",
        str(out),
    ]
    if tasks:
        cmd += ["--tasks", tasks]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print("  " + line, end="", flush=True)
    return proc.wait() == 0


def lmms_cell(
    cell_dir: Path, repo: Path, env: dict, model: str, model_args: dict, tasks: str, include_path: Path
) -> bool:
    """One cell outside a sweep, in the sweep's layout (cell.json written last, status done|failed)."""
    previous = cell_dir / CELL_FILE
    if previous.is_file() and json.loads(previous.read_text()).get("status") == "done":
        print(f"  {cell_dir.name}: already done")
        return True
    if cell_dir.exists():
        shutil.rmtree(cell_dir)
    cell_dir.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "lmms_eval",
        "--model",
        model,
        "--model_args",
        ",".join(f"{k}={v}" for k, v in model_args.items()),
        "--tasks",
        tasks,
        "--output_path",
        str(cell_dir),
        "--log_samples",
        "--include_path",
        str(include_path),
    ]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = run_child(cmd, repo, env, cell_dir / "lmms_eval.log")
    results = sorted(cell_dir.rglob("*_results.json"))
    done = proc.returncode == 0 and bool(results)
    record = dict(
        cell=cell_dir.name,
        status="done" if done else "failed",
        seconds=round(time.perf_counter() - t0, 2),
        command=cmd,
        results=str(results[-1].relative_to(cell_dir)) if results else None,
    )
    previous.write_text(json.dumps(record, indent=2) + "\n")
    print(f"  {cell_dir.name}: {record['status']} in {record['seconds']:.0f} s", flush=True)
    return done


def check_imports(out: Path, repo: Path) -> list[dict]:
    """Every resadapt_eval module a child loaded must come from REPO, and lmms-eval processes must
    have logged (else the hook did not load and nothing was checked)."""
    log = out / "_inputs" / IMPORT_LOG
    entries = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    outside = sorted({f for e in entries for f in e["files"] if not f.startswith(f"{repo}/")})
    if outside:
        sys.exit(f"resadapt_eval modules loaded from outside {repo}: {outside[:5]}")
    if not any("lmms_eval" in str(e["argv"][:1]) for e in entries):
        sys.exit(f"no lmms-eval process reported its imports to {log}: the sitecustomize hook did not load")
    return entries


def cmd_capture(args) -> int:
    repo, out, data = Path(args.repo).resolve(), Path(args.out).resolve(), Path(args.data).resolve()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        sys.exit(f"unknown parts {sorted(unknown)}; available: {','.join(PARTS)}")
    inputs = out / "_inputs"
    (inputs / "hook").mkdir(parents=True, exist_ok=True)
    (inputs / "hook" / "sitecustomize.py").write_text(HOOK)
    env = child_env(repo, out)

    # Which resadapt_eval the children import: same interpreter, cwd, PYTHONPATH as the sweeps.
    probe = run_child(
        [
            sys.executable,
            "-c",
            "import resadapt_eval, resadapt_eval.cli as m; print(resadapt_eval.__file__); print(m.__file__)",
        ],
        repo,
        env,
    )
    imported = probe.stdout.split()
    if probe.returncode != 0 or not imported or not all(p.startswith(f"{repo}/") for p in imported):
        sys.exit(f"children would not import resadapt_eval from {repo}: {probe.stdout}{probe.stderr}")
    print(f"children import resadapt_eval from {imported[0]}")
    registry = run_child(
        [
            sys.executable,
            "-c",
            "from resadapt_eval.methods import METHODS; print(*(n for n, m in METHODS.items() if m.hf))",
        ],
        repo,
        env,
    )
    if registry.returncode != 0:
        sys.exit(f"could not read the registry of {repo}: {registry.stderr}")
    other_methods = {}  # the `methods` part: target R -> the HF methods of REPO not in the smoke part
    for name in registry.stdout.split():
        if name not in METHODS.split(","):
            other_methods.setdefault(OTHER_RETENTION.get(name, "0.25"), []).append(name)

    manifest = ensure_data(data, repo, out, args.needle_limit, "needle" in parts)
    fixtures_link = inputs / "fixtures"
    if fixtures_link.is_symlink() or fixtures_link.exists():
        fixtures_link.unlink()
    fixtures_link.symlink_to(data, target_is_directory=True)
    if (inputs / "tasks").exists():
        shutil.rmtree(inputs / "tasks")
    shutil.copytree(repo / "tasks", inputs / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    # The needle card's tasks read fixtures/needle/test.jsonl, the benchmark fixtures fixtures/benchmarks/...:
    # both under DATA through the symlink.

    started, ok, timings = time.perf_counter(), True, {}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True
    ).stdout.splitlines()
    print(
        f"capturing {repo} (HEAD {head[:10]}"
        f"{f', uncommitted changes in {len(dirty)} tracked files' if dirty else ''}) -> {out}"
    )

    def timed(part, fn):
        nonlocal ok
        t0 = time.perf_counter()
        ok = fn() and ok
        timings[part] = round(time.perf_counter() - t0, 1)

    if "smoke" in parts:
        for backbone in ("qwen25vl", "qwen3vl"):
            card = derive_card(repo, inputs, data, f"tiny-{backbone}", f"smoke-{backbone}")
            timed(f"smoke-{backbone}", lambda: sweep(card, out / f"smoke-{backbone}", repo, env, METHODS, "0.25"))
    if "methods" in parts:
        for backbone in ("qwen25vl", "qwen3vl"):
            card = derive_card(repo, inputs, data, f"tiny-{backbone}", f"methods-{backbone}")
            timed(
                f"methods-{backbone}",
                lambda: all(
                    [
                        sweep(card, out / f"methods-{backbone}", repo, env, ",".join(names), r)
                        for r, names in other_methods.items()
                    ]
                ),
            )
    if "needle" in parts:
        card = derive_card(repo, inputs, data, "needle-qwen25vl", "needle-qwen25vl")
        timed(
            "needle-qwen25vl",
            lambda: sweep(card, out / "needle-qwen25vl", repo, env, METHODS, "0.25", limit=args.needle_limit),
        )
    if "chartqa" in parts:
        card = derive_card(repo, inputs, data, "tiny-qwen25vl", "chartqa-qwen25vl")

        def chartqa():
            swept = sweep(
                card,
                out / "chartqa-qwen25vl",
                repo,
                env,
                "vanilla,fixed_scale,resadapt",
                "0.25",
                tasks="resadapt_fixture_chartqa",
            )
            import yaml

            raw = yaml.safe_load(card.read_text())
            model_args = dict(
                pretrained=raw["pretrained"],
                method="resadapt",
                allocator=raw["allocator"],
                max_num_frames=raw["frames"][0],
                **raw["model_args"],
            )
            direct = lmms_cell(
                out / "chartqa-qwen25vl" / f"resadapt-f{raw['frames'][0]}",
                repo,
                env,
                f"resadapt_{raw['backbone']}",
                model_args,
                "resadapt_fixture_chartqa",
                inputs / "tasks",
            )
            return swept and direct

        timed("chartqa-qwen25vl", chartqa)
    if "select" in parts:
        card = derive_card(
            repo,
            inputs,
            data,
            "tiny-qwen25vl",
            "select-qwen25vl",
            dict(operator="select_resize", candidates=8, top_k=4),
        )
        timed("select-qwen25vl", lambda: sweep(card, out / "select-qwen25vl", repo, env, "resadapt", "0.5"))

    cells = sorted(p.parent for p in out.rglob(CELL_FILE) if "_inputs" not in p.parts)
    statuses = {str(c.relative_to(out)): json.loads((c / CELL_FILE).read_text())["status"] for c in cells}
    records = sum(len(f.read_text().splitlines()) for c in cells for f in c.rglob(SIDECAR_GLOB))
    imports = check_imports(out, repo)
    summary = dict(
        repo=str(repo),
        head=head,
        dirty_tracked_files=dirty,
        data=str(data),
        data_manifest=manifest,
        parts=parts,
        needle_limit=args.needle_limit,
        seconds=round(time.perf_counter() - started, 1),
        part_seconds=timings,
        cells=statuses,
        records=records,
        resadapt_eval_files_loaded=sorted({f for e in imports for f in e["files"]}),  # all under repo (checked)
        python_processes_logged=len(imports),
    )
    (out / "capture.json").write_text(json.dumps(summary, indent=1) + "\n")
    failed = [c for c, s in statuses.items() if s != "done"]
    print(
        f"{len(cells)} cells ({len(cells) - len(failed)} done), {records} sidecar records, {summary['seconds']:.0f} s; "
        f"{len(imports)} python processes imported resadapt_eval, all from {repo}"
    )
    if failed or not ok:
        print(
            f"FAILED cells (see <cell>/cell.json and lmms_eval.log): {', '.join(failed) or '(a sweep exited non-zero)'}"
        )
        return 1
    return 0


# ---------------------------------------------------------------------------------------- compare
def is_time_field(key: str) -> bool:
    """A measurement of this machine's state, not of the code: seconds (`*_s`), and `peak_memory_mb`
    (on CPU the process's peak resident set, which moves with whatever else the process loaded)."""
    return key.endswith("_s") or key == "peak_memory_mb"


def same(a, b) -> bool:
    """Exact equality, types included (1 != 1.0, True != 1); NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def show(value, limit: int = 300) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def load_capture(root: Path) -> dict:
    """{cell: {status, records: {(task, doc_id): record}, duplicates, results, throughput, samples}}."""
    cells = {}
    for cell_file in sorted(root.rglob(CELL_FILE)):
        cell_dir = cell_file.parent
        if "_inputs" in cell_dir.relative_to(root).parts:
            continue
        cell = dict(
            status=json.loads(cell_file.read_text()).get("status"),
            records={},
            duplicates=[],
            results={},
            throughput={},
            samples={},
        )
        for sidecar in sorted(cell_dir.rglob(SIDECAR_GLOB)):
            for line in sidecar.read_text().splitlines():
                if not line.strip():
                    continue
                record = {k: v for k, v in json.loads(line).items() if not is_time_field(k)}
                key = (record.get("task"), record.get("doc_id"))
                if key in cell["records"]:
                    cell["duplicates"].append(key)
                cell["records"][key] = record
        for results_file in sorted(cell_dir.rglob("*_results.json")):
            data = json.loads(results_file.read_text())
            cell["results"].update(data.get("results", {}))
            throughput = data.get("throughput", {})
            cell["throughput"].update({k: v for k, v in throughput.items() if "resadapt" in k})
        for samples_file in sorted(cell_dir.rglob("*_samples_*.jsonl")):
            if samples_file.name.startswith("resadapt_samples_"):
                continue
            for line in samples_file.read_text().splitlines():
                if line.strip():
                    sample = json.loads(line)
                    task = samples_file.stem.split("_samples_", 1)[1]
                    cell["samples"][(task, sample.get("doc_id"))] = {
                        k: v for k, v in sample.items() if not is_time_field(k)
                    }
        cells[str(cell_dir.relative_to(root))] = cell
    return cells


def diff_maps(label: str, a: dict, b: dict, diffs: list[str]) -> None:
    for key in sorted(set(a) | set(b), key=str):
        if key not in b:
            diffs.append(f"{label} {key}: only in A")
        elif key not in a:
            diffs.append(f"{label} {key}: only in B")
        elif not same(a[key], b[key]):
            if isinstance(a[key], dict) and isinstance(b[key], dict):
                for field in sorted(set(a[key]) | set(b[key])):
                    va, vb = a[key].get(field, "<missing>"), b[key].get(field, "<missing>")
                    if not same(va, vb):
                        diffs.append(f"{label} {key} {field}: A={show(va)} B={show(vb)}")
            else:
                diffs.append(f"{label} {key}: A={show(a[key])} B={show(b[key])}")


def cmd_compare(args) -> int:
    root_a, root_b = Path(args.a), Path(args.b)
    a, b = load_capture(root_a), load_capture(root_b)
    if args.only:  # e.g. --only smoke-,select- after a partial capture
        prefixes = tuple(args.only.split(","))
        a, b = ({k: v for k, v in c.items() if k.startswith(prefixes)} for c in (a, b))
    diffs: list[str] = []
    if not a:
        diffs.append(f"no cells under {root_a}")
    if not b:
        diffs.append(f"no cells under {root_b}")
    for side, root in (("A", root_a), ("B", root_b)):  # both must have read the same inputs
        info = root / "capture.json"
        if not info.is_file():
            print(f"warning: {info} missing; cannot check that both captures read the same data")
    info_a, info_b = (
        json.loads((r / "capture.json").read_text()) if (r / "capture.json").is_file() else {} for r in (root_a, root_b)
    )
    if info_a and info_b and info_a.get("data_manifest") != info_b.get("data_manifest"):
        diffs.append(f"input data differ: A read {info_a.get('data')}, B read {info_b.get('data')} (manifests differ)")
    for name in sorted(set(a) | set(b)):
        if name not in b:
            diffs.append(f"cell {name}: only in A")
            continue
        if name not in a:
            diffs.append(f"cell {name}: only in B")
            continue
        ca, cb = a[name], b[name]
        for side, c in (("A", ca), ("B", cb)):
            if c["status"] != "done":
                diffs.append(f"cell {name}: status {c['status']!r} in {side}")
            if c["duplicates"]:
                diffs.append(f"cell {name}: duplicate (task, doc_id) in {side}: {c['duplicates'][:5]}")
        if len(ca["records"]) != len(cb["records"]):
            diffs.append(f"cell {name}: {len(ca['records'])} records in A, {len(cb['records'])} in B")
        diff_maps(f"record {name}", ca["records"], cb["records"], diffs)
        diff_maps(f"results {name}", ca["results"], cb["results"], diffs)
        diff_maps(f"throughput {name}", {"avg_resadapt": ca["throughput"]}, {"avg_resadapt": cb["throughput"]}, diffs)
        diff_maps(f"sample {name}", ca["samples"], cb["samples"], diffs)
    if diffs:
        for line in diffs[: args.max_lines]:
            print(line)
        if len(diffs) > args.max_lines:
            print(f"... {len(diffs) - args.max_lines} more")
        changed = sorted(
            {
                d.split(" ")[1].rstrip(":")
                for d in diffs
                if d.startswith(("record ", "results ", "sample ", "throughput ", "cell "))
            }
        )
        where = f" in {len(changed)} cells: {', '.join(changed)}" if changed else ""
        print(f"DIFFERENT: {len(diffs)} differences{where}")
        return 1
    total = sum(len(c["records"]) for c in a.values())
    print(f"identical: {total} records in {len(a)} cells")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("capture", help="run the fixed lmms-eval cells against --repo and keep their outputs in --out")
    p.add_argument("--out", required=True, help="capture folder (cells are kept; a re-run skips done cells)")
    p.add_argument(
        "--repo",
        default=str(SCRIPT_REPO),
        help="repository whose resadapt_eval, cards and tasks are used (default: %(default)s)",
    )
    p.add_argument(
        "--data", default=str(DEFAULT_DATA), help="frozen input snapshot shared by both captures (default: %(default)s)"
    )
    p.add_argument(
        "--needle-limit", type=int, default=100, help="needle test videos (lmms-eval --limit; default: %(default)s)"
    )
    p.add_argument("--parts", default=",".join(PARTS), help="subset of %(default)s")
    p.set_defaults(func=cmd_capture)
    p = sub.add_parser("compare", help="compare two captures; exit 1 on any difference")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument(
        "--only", default=None, help="compare only cells whose folder starts with one of these comma-separated prefixes"
    )
    p.add_argument("--max-lines", type=int, default=200, help="differences printed at most (default: %(default)s)")
    p.set_defaults(func=cmd_compare)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
