"""Read a sweep's run directory: per cell, lmms-eval's scores, our sidecars and per-sample outcomes."""

from __future__ import annotations

import csv
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..cells import CELL_FILE

# task -> (metric key in lmms-eval's results, column name); column names match results/paper/*.csv.
# Unknown tasks use their first metric, named after the task.
TASK_METRICS = {
    "videomme": [("videomme_perception_score", "videomme")],
    "longvideobench_val_v": [("lvb_acc", "longvideobench")],
    "mmvu_val": [("accuracy", "mmvu")],
    "mlvu_dev": [("mlvu_percetion_score", "mlvu")],
    "video_mmmu": [("mmmu_acc", "videommmu")],
    # the group's three tracks (table:capo_dist_ablation prints them as Per./Comp./Adap.)
    "video_mmmu_perception": [("mmmu_acc", "videommmu_perception")],
    "video_mmmu_comprehension": [("mmmu_acc", "videommmu_comprehension")],
    "video_mmmu_adaptation": [("mmmu_acc", "videommmu_adaptation")],
    "lvbench": [("lvbench_score", "lvbench")],
    # fine-grained temporal perception (speed, direction, order, attribute change); the fixture task
    # is scored by lmms-eval's own tempcompass_multi_choice functions
    "tempcompass_multi_choice": [("avg_accuracy", "tempcompass")],
    "resadapt_fixture_tempcompass": [("avg_accuracy", "tempcompass")],
    "resadapt_activitynet_tg": [
        ("r0.3", "activitynet_r0.3"),
        ("r0.5", "activitynet_r0.5"),
        ("r0.7", "activitynet_r0.7"),
        ("miou", "activitynet_miou"),
    ],
    "resadapt_nextgqa": [("acc", "nextgqa_acc"), ("miou", "nextgqa_miou")],
    "temporal_grounding_charades": [
        ("charades_sta_IOU@3", "charades_r0.3"),
        ("charades_sta_IOU@5", "charades_r0.5"),
        ("charades_sta_IOU@7", "charades_r0.7"),
        ("charades_sta_mIOU", "charades_miou"),
    ],
    "mmmu_val": [("mmmu_acc", "mmmu_val")],
    "ocrbench": [("ocrbench_accuracy", "ocrbench")],
    "chartqa": [("relaxed_overall", "chartqa")],
    "ai2d": [("exact_match", "ai2d")],
    "textvqa_val": [("exact_match", "textvqa_val")],
}
GROUNDING_TASKS = {"temporal_grounding_charades", "resadapt_activitynet_tg", "resadapt_nextgqa"}
IMAGE_TASKS = {"mmmu_val", "ocrbench", "chartqa", "ai2d", "textvqa_val", "mathvista_testmini"}


def table_of(task: str) -> str:
    """Which paper table a task belongs to: temporal_grounding, image or video_qa (the default)."""
    if task in GROUNDING_TASKS or "grounding" in task:
        return "temporal_grounding"
    if task in IMAGE_TASKS:
        return "image"
    return "video_qa"


def task_scores(task: str, results: dict) -> dict[str, float]:
    """Column name -> score for one task from lmms-eval's `results[task]`."""
    found = {}
    entries = TASK_METRICS.get(task)
    if entries is None:  # a task we do not know: its first reported metric, named after the task
        metric = next(k.split(",")[0] for k in results if "," in k and "stderr" not in k)
        entries = [(metric, task)]
    for metric, column in entries:
        value = results.get(f"{metric},none")
        if isinstance(value, (int, float)):
            found[column] = float(value)
    return found


@dataclass
class CellRun:
    """One finished cell: its grid point, scores per column, and sidecar records per task."""

    card: str
    backbone: str
    paper_backbone: str | None
    method: str
    retention: float | None
    frames: int
    path: Path
    status: str = "done"  # or "failed": more samples failed than the sweep allowed
    samples: int = 0
    failed_samples: int = 0
    scores: dict[str, float] = field(default_factory=dict)  # column -> score
    columns_by_table: dict[str, list[str]] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)  # sidecar lines
    outcomes: dict[tuple[str, int], float] = field(default_factory=dict)  # (task, doc_id) -> sample score

    def achieved_retention(self, table: str | None = None) -> float | None:
        """Mean sidecar R over the cell's successful samples (of one table's tasks)."""
        rs = [
            r["achieved_retention"]
            for r in self.records
            if r["error"] is None and (table is None or table_of(r["task"]) == table)
        ]
        return sum(rs) / len(rs) if rs else None

    def tflops(self, table: str | None = None) -> float | None:
        """Mean TFLOPs per successful sample (of one table's tasks), from the sidecar's
        `total_flops`; None when no record carries FLOPs (runs made before they were counted)."""
        flops = [
            r["total_flops"]
            for r in self.records
            if r["error"] is None and "total_flops" in r and (table is None or table_of(r["task"]) == table)
        ]
        return sum(flops) / len(flops) / 1e12 if flops else None

    def vision_tflops(self) -> float | None:
        """Mean TFLOPs of the vision tower's own layers (blocks, attention and mergers) per successful
        sample, from the sidecar's `vision_flops` and `vision_attention_flops`; None without them."""
        flops = [
            r["vision_flops"] + r["vision_attention_flops"]
            for r in self.records
            if r["error"] is None and "vision_flops" in r and "vision_attention_flops" in r
        ]
        return sum(flops) / len(flops) / 1e12 if flops else None

    @property
    def untrained(self) -> bool:
        """The cell ran the untrained Allocator (`allocator=untrained`)."""
        return any(r.get("allocator") == "untrained" for r in self.records)

    def mean_scale(self) -> float | None:
        """Mean per-frame scale the Allocator predicted (before any projection to the target R:
        the sidecar's `raw_scales`, else `scales`) over the successful samples; the paper's s-bar."""
        scales = [s for r in self.records if r["error"] is None for s in (r.get("raw_scales") or r.get("scales") or [])]
        return sum(scales) / len(scales) if scales else None

    def capo_variant(self) -> str | None:
        """`beta-CAPO` / `N-CAPO` (table:capo_dist_ablation's names) for a cell whose records name one
        Allocator checkpoint (only a method the Allocator scores takes one), by its policy family;
        None otherwise (other methods, `untrained`)."""
        checkpoints = {r.get("allocator") for r in self.records} - {None, "untrained"}
        if len(checkpoints) != 1:
            return None
        config = Path(checkpoints.pop()) / "config.json"  # allocator.model.CONFIG_NAME (not imported: no torch here)
        if not config.is_file():
            return None
        return CAPO_VARIANTS.get(json.loads(config.read_text()).get("policy", "beta"))


def sample_score(sample: dict) -> float | None:
    """A logged sample's score: the first metric value that is a number or holds a `score`."""
    for key, value in sample.items():
        if key in (
            "doc_id",
            "doc",
            "target",
            "arguments",
            "resps",
            "filtered_resps",
            "token_counts",
            "doc_hash",
            "input",
            "input_media",
        ):
            continue
        if isinstance(value, dict) and isinstance(value.get("score"), (int, float)):
            return float(value["score"])
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def read_jsonl(path: Path, skipped: str) -> tuple[list[dict], int]:
    """The JSON objects of a JSONL file and how many lines could not be read: a broken line (a
    record cut short when a run was killed mid-write, say) is skipped with a warning naming the
    file, the line and `skipped` (what becomes of it), and the rest is read."""
    rows, broken = [], 0
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except ValueError as exc:  # json.JSONDecodeError included
            warnings.warn(f"{path}, line {number}: unreadable {skipped} ({exc})", stacklevel=2)
            broken += 1
            continue
        rows.append(row)
    return rows, broken


def collect(run_dir: str | Path, include_failed: bool = False) -> list[CellRun]:
    """Every `done` cell under `run_dir` (a sweep's --output); with `include_failed`, also the
    cells that ran to the end but had more failed samples than allowed (status `failed`)."""
    runs = []
    for cell_file in sorted(Path(run_dir).glob(f"*/{CELL_FILE}")):
        meta = json.loads(cell_file.read_text())
        finished = meta.get("status") == "done" or (include_failed and meta.get("results") and "samples" in meta)
        if not finished:
            continue
        cell_dir = cell_file.parent
        results = json.loads((cell_dir / meta["results"]).read_text())
        run = CellRun(
            card=meta["card"],
            backbone=meta["backbone"],
            paper_backbone=meta.get("paper_backbone"),
            method=meta["method"],
            retention=meta["retention"],
            frames=meta["frames"],
            path=cell_dir,
            status=meta["status"],
            samples=meta.get("samples", 0),
            failed_samples=meta.get("failed_samples", 0),
        )
        for task, values in results["results"].items():
            scores = task_scores(task, values)
            run.scores.update(scores)
            run.columns_by_table.setdefault(table_of(task), []).extend(scores)
        for sidecar in sorted(cell_dir.rglob("resadapt_samples_*.jsonl")):
            records, broken = read_jsonl(sidecar, "sidecar record; skipped, its sample counted as failed")
            run.records += records
            run.failed_samples += broken
            run.samples = max(run.samples, run.failed_samples)
        for samples in sorted(cell_dir.rglob("*_samples_*.jsonl")):
            if samples.name.startswith("resadapt_samples_"):
                continue
            task = samples.stem.split("_samples_", 1)[1]
            for sample in read_jsonl(samples, "lmms-eval sample; skipped, its score left out")[0]:
                score = sample_score(sample)
                if score is not None:
                    run.outcomes[(task, int(sample["doc_id"]))] = score
        runs.append(run)
    return runs


def collect_dirs(run_dirs: list[str | Path], include_failed: bool = False) -> list[CellRun]:
    """The cells of several sweep folders together (`collect` on each, in order), for one set of
    tables or plots over sweeps run in parts. Two cells of the same card, method, frame count and
    target R would be drawn as one method's point twice, or as one line through two settings (an
    `allocator_query=empty` ablation beside the question cell): that stops with both folders named."""
    runs, seen = [], {}
    for run_dir in run_dirs:
        for run in collect(run_dir, include_failed):
            key = (run.card, run.method, run.frames, run.retention)
            if key in seen:
                raise ValueError(
                    f"{seen[key]} and {run.path} are both {run.method} on card {run.card} at {run.frames} frames, "
                    f"R={run.retention}: leave one of their sweep folders out, or report them separately"
                )
            seen[key] = run.path
            runs.append(run)
    return runs


def missing_cells(run_dirs: list[str | Path], runs: list[CellRun] = ()) -> list:
    """The cells these sweep folders asked for (`sweep.json`) or hold that are not complete, from
    their files alone (`cluster.status.CellState`: failed with its reason, submitted, not started,
    ...), less those complete in another of the folders (`runs`, a sweep run in parts): what a
    report lists under its tables, never draws."""
    from ..cluster.status import COMPLETE, cell_states

    complete = {(r.card, r.method, r.frames, r.retention) for r in runs if r.status == "done"}
    return [
        state
        for run_dir in run_dirs
        for state in cell_states(run_dir, ask_scheduler=False)
        if state.state != COMPLETE and (state.card, state.method, state.frames, state.retention) not in complete
    ]


# --- table:capo_dist_ablation (`tables --paper`) -----------------------------------------------
# The paper states no backbone, frames or R for it, so a cell is not matched to a paper row: the
# paper's two rows and every ResAdapt cell with a known policy family sit side by side, no deltas.

CAPO_ABLATION = "capo_dist_ablation"
CAPO_VARIANTS = {"beta": "beta-CAPO", "logit_normal": "N-CAPO"}  # the Allocator's policy family -> the paper's name
CAPO_ABLATION_COLUMNS = [
    "videomme",
    "longvideobench",
    "mmvu",
    "videommmu_perception",
    "videommmu_comprehension",
    "videommmu_adaptation",
    "lvbench",
]


def capo_ablation_rows(runs: list[CellRun], paper_dir: Path) -> list[dict]:
    """The paper's rows (`results/paper/capo_dist_ablation.csv`), then one row per done ResAdapt
    cell whose Allocator's policy family is known: source, variant, card, frames, target, R,
    mean_scale and the CAPO_ABLATION_COLUMNS (None where not run / not printed)."""
    rows = []
    path = Path(paper_dir) / f"{CAPO_ABLATION}.csv"
    if path.is_file():
        with open(path, newline="") as f:
            for paper in csv.DictReader(f):
                row = dict(source="paper", variant=paper["method"], card=None, frames=None, target=None, R=None)
                row.update({c: _float(paper.get(c)) for c in ["mean_scale", *CAPO_ABLATION_COLUMNS]})
                rows.append(row)
    for run in runs:
        variant = run.capo_variant() if run.status == "done" else None
        if variant is None:
            continue
        row = dict(source="ours", variant=variant, card=run.card, frames=run.frames, target=run.retention)
        row.update(R=run.achieved_retention(), mean_scale=run.mean_scale())
        row.update({c: run.scores.get(c) for c in CAPO_ABLATION_COLUMNS})
        rows.append(row)
    return rows


def capo_ablation_markdown(rows: list[dict]) -> str:
    """Scores to 1 decimal, the mean scale to 2 (as printed), R in percent; — where missing."""

    def fmt(value, digits=1):
        return "—" if value is None else f"{value:.{digits}f}"

    head = ["source", "variant", "card", "frames", "R", "mean_scale", *CAPO_ABLATION_COLUMNS]
    lines = [
        "### CAPO distribution family (paper table:capo_dist_ablation; its backbone, frames and R are not stated)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in rows:
        frames = "—" if row["frames"] is None else str(row["frames"])
        cells = [row["source"], row["variant"], row["card"] or "—", frames]
        cells += ["—" if row["R"] is None else f"{100 * row['R']:.1f}%", fmt(row["mean_scale"], 2)]
        cells += [fmt(row[c]) for c in CAPO_ABLATION_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_capo_ablation(rows: list[dict], out: Path) -> list[Path]:
    """`capo_dist_ablation.md` and `.csv` (full precision, R as a fraction) in `out`."""
    fields = ["source", "variant", "card", "frames", "target", "R", "mean_scale", *CAPO_ABLATION_COLUMNS]
    return write_markdown_and_csv(out, CAPO_ABLATION, capo_ablation_markdown(rows), rows, fields)


def write_markdown_and_csv(
    out: Path, stem: str, markdown: str, rows: list[dict], fields: list[str] | None = None
) -> list[Path]:
    """OUT/STEM.md holding `markdown` and OUT/STEM.csv holding `rows` (columns `fields`, default the
    first row's keys, at full precision)."""
    out.mkdir(parents=True, exist_ok=True)
    md, table = out / f"{stem}.md", out / f"{stem}.csv"
    md.write_text(markdown)
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return [md, table]


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
