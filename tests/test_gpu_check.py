"""`benchmarks/gpu_check.py` on CPU, small: the reduced-depth real-width Qwen2.5-VL-7B at 4 frames of
320x180, three methods; the markdown report and the exit code."""

import importlib.util
import json
import sys

from .helpers import FIXTURES, REPO


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def table_rows(text: str, heading: str) -> dict:
    """The rows of the table under `heading`, by method."""
    lines = text.split(f"{heading}\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return {
        row[0]: dict(zip(header, row))
        for row in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    }


def test_gpu_check_on_cpu_writes_the_report_and_exits_0_only_when_every_check_holds(tmp_path):
    script = gpu_check()
    common = ["--device", "cpu", "--frames", "4", "--size", "320x180", "--backbones", "qwen25vl-7b"]
    common += ["--max-new-tokens", "2", "--checkpoints", str(FIXTURES / "real_width")]
    assert script.main([*common, "--methods", "vanilla,random_drop,fastv", "--out", str(tmp_path / "ok")]) == 0
    (report,) = (tmp_path / "ok").glob("*.md")
    text = report.read_text()
    assert "**PASS**: 3 of 3 configurations" in text and "## Failures" not in text
    rows = table_rows(text, "## qwen25vl-7b, sdpa")
    assert list(rows) == ["vanilla", "random_drop", "fastv"]
    assert rows["vanilla"]["R"] == "1.0000" and rows["random_drop"]["target R"] == "0.25"
    # FastV's default stage (layer 2 of these 4) leaves it a floor of 0.5: it runs at the next 0.05 above
    assert rows["fastv"]["target R"] == "0.55" and 0.54 <= float(rows["fastv"]["R"]) <= 0.55
    for row in rows.values():
        assert row["check"] == "ok"
        assert all(
            float(row[c].split()[0]) > 0 for c in ("vision ms", "prefill ms", "decode ms", "e2e ms (vs vanilla)")
        )
    # the method's own work: none for vanilla, the compressor's and FastV's ranking timed apart
    assert rows["vanilla"]["own ms"] == "--" and float(rows["fastv"]["own ms"]) > 0
    assert float(rows["random_drop"]["own ms"]) >= 0
    assert "frames resized on cpu to 896x504 (4 frames): exact: max 0, mean 0.000 uint8 levels" in text
    # random_drop: the whole tower, a quarter of the tokens in the LLM
    assert 0.3 < float(rows["random_drop"]["TFLOPs (x vanilla)"].split("(")[1].rstrip("x)")) < 1
    assert "## The paper's latency columns" in text
    records = [json.loads(line) for line in report.with_suffix(".jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["vanilla", "random_drop", "fastv"]
    assert all(r["error"] is None and r["backbone"] == "qwen25vl-7b" and r["attn"] == "sdpa" for r in records)

    # a method that fails (a target below every plan of this video, above every video's floor) makes the
    # run exit 1, and the report says why
    bad = ["--methods", "fixed_scale", "--retention", "0.01", "--out", str(tmp_path / "bad")]
    assert script.main([*common, *bad]) == 1
    (report,) = (tmp_path / "bad").glob("*.md")
    text = report.read_text()
    assert "**FAIL**: 1 of 2 configurations" in text
    assert "- qwen25vl-7b sdpa fixed_scale at 4 frames: failed: InfeasibleBudget" in text
