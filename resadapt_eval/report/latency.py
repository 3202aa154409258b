"""The paper's latency table (Table `latency`) from sidecar records: per (method, frames, target R)
the means over successful samples of the Allocator's stages, generation and FLOPs, in the paper's
columns, with what the paper leaves out beside them.

Paper columns (ms unless TFLOPs): Scale TFLOPs (the Allocator's), Text Enc., Visual Enc., Scale
Pred. (prediction and projection), Scale Apply (resizing frames to the plan), Scale Time (their
sum), Inference TFLOPs (vision tower, LLM, a method's own work), TTFT (time to first token), Gen.
Time (the engine call), Total TFLOPs, E2E Time = Scale Time + Gen. Time. Beside them: Decode
(reading the video), Build (planning and building the model inputs, resizing excluded; a
compressor's encode included), Vision (the vision tower, where the engine exposes it), Compress (a
token compressor's own work, part of Build; empty for methods without one), Rank (an in-LLM
pruner's ranking and pruning, part of TTFT, or a decoding-time pruner's over its steps), Prefill
(the LLM's prefill alone: TTFT less the vision tower and the in-LLM ranking), per output
token, peak memory (MiB), and the samples averaged. The change against vanilla at the same frame
count is printed as in the paper (negative: faster or cheaper).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from ..methods import METHODS

MS = 1e3
TERA = 1e12
COLUMNS = (
    "method",
    "frames",
    "R",
    "scale_tflops",
    "text_enc_ms",
    "visual_enc_ms",
    "scale_pred_ms",
    "scale_apply_ms",
    "scale_time_ms",
    "inference_tflops",
    "ttft_ms",
    "gen_time_ms",
    "total_tflops",
    "e2e_ms",
    "decode_ms",
    "build_ms",
    "vision_ms",
    "compress_ms",
    "rank_ms",
    "prefill_ms",
    "per_token_ms",
    "peak_memory_mb",
    "samples",
)
AGAINST_VANILLA = ("inference_tflops", "ttft_ms", "gen_time_ms", "total_tflops", "e2e_ms")


def _mean(records: list[dict], key, scale: float = 1.0) -> float | None:
    values = [key(r) if callable(key) else r.get(key) for r in records]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) * scale if values else None


def latency_row(method: str, frames: int, records: list[dict]) -> dict:
    """One row from the sidecar records of one configuration (failed samples left out)."""
    done = [r for r in records if r.get("error") is None]
    row = dict(method=method, frames=frames, samples=len(done))
    row["R"] = _mean(done, "achieved_retention")
    row["scale_tflops"] = _mean(done, "allocator_flops", 1 / TERA)
    for column, key in (
        ("text_enc_ms", "allocator_text_s"),
        ("visual_enc_ms", "allocator_visual_s"),
        ("scale_pred_ms", "allocator_predict_s"),
        ("scale_apply_ms", "scale_apply_s"),
        ("ttft_ms", "first_token_s"),
        ("gen_time_ms", "generate_s"),
        ("decode_ms", "decode_s"),
        ("vision_ms", "vision_s"),
        ("compress_ms", "compress_s"),
        ("rank_ms", "rank_s"),
        ("prefill_ms", "prefill_s"),
        ("per_token_ms", "per_token_s"),
    ):
        row[column] = _mean(done, key, MS)
    row["build_ms"] = _mean(done, lambda r: r["preprocess_s"] - r["scale_apply_s"], MS)
    row["peak_memory_mb"] = max(
        (r["peak_memory_mb"] for r in done if r.get("peak_memory_mb") is not None), default=None
    )
    parts = ("text_enc_ms", "visual_enc_ms", "scale_pred_ms", "scale_apply_ms")
    row["scale_time_ms"] = sum(row[p] for p in parts) if done else None
    row["total_tflops"] = _mean(done, "total_flops", 1 / TERA)
    row["inference_tflops"] = _mean(done, lambda r: r["total_flops"] - r.get("allocator_flops", 0), 1 / TERA)
    row["e2e_ms"] = row["scale_time_ms"] + row["gen_time_ms"] if done else None
    return row


def latency_rows(groups: list[tuple[str, int, float | None, list[dict]]]) -> list[dict]:
    """Rows for (method, frames, target R, records) groups, in the paper's order (frames, then the
    registry's method order, then R from high to low), each with its change against vanilla at the
    same frame count (`<column>_vs_vanilla`, a fraction)."""
    order = list(METHODS)
    groups = sorted(groups, key=lambda g: (g[1], order.index(g[0]) if g[0] in order else len(order), -(g[2] or 2)))
    rows = [latency_row(method, frames, records) for method, frames, _, records in groups]
    vanilla = {row["frames"]: row for row in rows if is_reference(row) and row["samples"]}
    for row in rows:
        base = vanilla.get(row["frames"])
        for column in AGAINST_VANILLA:
            ours, theirs = row[column], base[column] if base else None
            row[f"{column}_vs_vanilla"] = ours / theirs - 1 if ours is not None and theirs else None
    return rows


def is_reference(row: dict) -> bool:
    """The row is the full-budget method's (vanilla, no retention target), which the others are compared to."""
    method = METHODS.get(row["method"])
    return method is not None and method.full_budget


def _cell(row: dict, column: str) -> str:
    value = row[column]
    if value is None:
        return "--"
    if column in ("method", "frames", "samples"):
        return str(value)
    if column == "R":
        return f"{100 * value:.1f}%"
    text = f"{value:.4g}" if "tflops" in column else f"{value:.1f}"
    change = row.get(f"{column}_vs_vanilla")
    if change is not None and not is_reference(row):
        text += f" ({100 * change:+.1f}%)"
    return text


def to_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row, c) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    extra = [f"{c}_vs_vanilla" for c in AGAINST_VANILLA]
    writer = csv.DictWriter(buffer, fieldnames=[*COLUMNS, *extra], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def write_latency(rows: list[dict], out: Path) -> list[Path]:
    """`latency.md` and `latency.csv` in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    md, table = out / "latency.md", out / "latency.csv"
    md.write_text(to_markdown(rows))
    table.write_text(to_csv(rows))
    return [md, table]
