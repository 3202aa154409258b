"""The run manifest written beside lmms-eval's results JSON: what was asked (resolved model_args),
what ran it (package versions, git revision) and what came out (sample and failure counts, tokens,
retention), so a table row can be reproduced and a run that failed cannot pass for a result."""

from __future__ import annotations

import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root when run from a checkout
PACKAGES = (
    "resadapt-eval",
    "lmms-eval",
    "transformers",
    "torch",
    "accelerate",
    "qwen-vl-utils",
    "decord",
    "av",
    "vllm",
)
MANIFEST_GLOB = "resadapt_run_*.json"
FIRST_ERRORS = 5  # failed samples quoted in a manifest


def versions() -> dict[str, str | None]:
    """Installed version of each package the numbers depend on (None: not installed), and Python's."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_revision() -> str | None:
    """The commit of the repository this package runs from (`+dirty` with uncommitted changes),
    or None when it is installed without one."""
    if not (REPO / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def sample_totals(records: list) -> dict:
    """Counts and sums over sidecar records (SampleRecord), mergeable across processes with `merge_totals`."""
    done = [r for r in records if r.error is None]
    return dict(
        samples=len(records),
        failed=len(records) - len(done),
        visual_tokens=sum(r.visual_tokens for r in done),
        reference_tokens=sum(r.reference_tokens for r in done),
        retention_sum=sum(r.achieved_retention for r in done),
        generate_s=sum(r.generate_s for r in done),
        output_tokens=sum(r.output_tokens for r in done),
        total_flops=sum(r.total_flops for r in done),
        first_errors=[dict(task=r.task, doc_id=r.doc_id, error=r.error) for r in records if r.error][:FIRST_ERRORS],
    )


def merge_totals(parts: list[dict]) -> dict:
    """`sample_totals` of several processes (or calls) as one."""
    merged = {key: sum(p[key] for p in parts) for key in parts[0] if key != "first_errors"}
    merged["first_errors"] = [e for p in parts for e in p["first_errors"]][:FIRST_ERRORS]
    return merged


def run_summary(totals: dict) -> dict:
    """The run's outcome: counts, tokens, retention (None when every sample failed: no retention
    was achieved) and total_tflops (10^12 FLOPs, `SampleRecord.total_flops`) over successful samples."""
    done = totals["samples"] - totals["failed"]
    return dict(
        samples=totals["samples"],
        failed_samples=totals["failed"],
        visual_tokens=totals["visual_tokens"],
        reference_tokens=totals["reference_tokens"],
        mean_retention=totals["retention_sum"] / done if done else None,
        pooled_retention=totals["visual_tokens"] / totals["reference_tokens"] if totals["reference_tokens"] else None,
        total_tflops=totals["total_flops"] / 1e12,
        first_errors=totals["first_errors"],
    )


def write_json(path: Path, payload) -> None:
    """JSON with no NaN or Infinity (a non-finite number is an error here, not invalid JSON later)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")


def read_manifests(folder: Path) -> list[dict]:
    """Every run manifest under `folder` (a sweep cell), oldest first."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).rglob(MANIFEST_GLOB))]
