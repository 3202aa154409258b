"""The latency profiler: stage clocks in every record, the paper's latency table from records,
and `resadapt-eval profile` on the tiny card (HF engine; the vLLM engine in test_vllm.py)."""

import csv
import json

import pytest

from resadapt_eval.cli import main
from resadapt_eval.manifest import REPO
from resadapt_eval.report.latency import latency_row, latency_rows, to_markdown

REPO_CARD = str(REPO / "model_cards" / "tiny-qwen25vl.yaml")


def record(**values) -> dict:
    base = dict(
        error=None,
        achieved_retention=1.0,
        allocator_flops=0,
        total_flops=0,
        allocator_text_s=0.0,
        allocator_visual_s=0.0,
        allocator_predict_s=0.0,
        scale_apply_s=0.0,
        preprocess_s=0.0,
        generate_s=0.0,
        decode_s=0.0,
        first_token_s=None,
        per_token_s=None,
        vision_s=None,
        peak_memory_mb=None,
    )
    return {**base, **values}


def test_latency_columns_by_hand():
    ours = [
        record(
            achieved_retention=0.3,
            allocator_flops=2e12,
            total_flops=32e12,
            allocator_text_s=0.02,
            allocator_visual_s=0.10,
            allocator_predict_s=0.08,
            scale_apply_s=0.01,
            preprocess_s=0.03,
            generate_s=0.30,
            first_token_s=0.20,
        ),
        record(
            achieved_retention=0.2,
            allocator_flops=2e12,
            total_flops=22e12,
            allocator_text_s=0.04,
            allocator_visual_s=0.10,
            allocator_predict_s=0.06,
            scale_apply_s=0.03,
            preprocess_s=0.05,
            generate_s=0.20,
            first_token_s=0.10,
        ),
        record(error="VideoDecodeError: cannot decode video x.mp4", total_flops=0),
    ]
    row = latency_row("resadapt", 16, ours)
    assert row["samples"] == 2 and row["R"] == pytest.approx(0.25)
    assert row["scale_tflops"] == pytest.approx(2.0) and row["total_tflops"] == pytest.approx(27.0)
    assert row["inference_tflops"] == pytest.approx(25.0)
    # Scale Time = text + visual + predict + apply = 30 + 100 + 70 + 20 ms; E2E = Scale Time + Gen. Time (250 ms)
    assert row["scale_time_ms"] == pytest.approx(220.0) and row["e2e_ms"] == pytest.approx(470.0)
    assert row["ttft_ms"] == pytest.approx(150.0) and row["build_ms"] == pytest.approx(20.0)
    assert row["vision_ms"] is None  # no record has it (an engine that does not expose its tower)
    vanilla = [record(total_flops=100e12, generate_s=0.5, first_token_s=0.4)]
    rows = latency_rows([("resadapt", 16, 0.25, ours), ("vanilla", 16, None, vanilla)])
    assert [r["method"] for r in rows] == ["vanilla", "resadapt"]
    assert rows[1]["total_tflops_vs_vanilla"] == pytest.approx(27 / 100 - 1)
    assert rows[1]["e2e_ms_vs_vanilla"] == pytest.approx(470 / 500 - 1)
    assert "(-73.0%)" in to_markdown(rows)


def test_profile_times_every_stage_and_writes_the_latency_table(fixtures_dir, tmp_path, capsys):
    out = tmp_path / "profile"
    args = ["profile", "--card", REPO_CARD, "--methods", "vanilla,tome,fastv,resadapt", "--frames", "8,16"]
    assert main([*args, "--runs", "2", "--warmup", "1", "--max-new-tokens", "4", "--output", str(out)]) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4 * 2 * 2  # methods x frame counts x runs
    for r in records:
        assert r["error"] is None and r["num_frames"] in (8, 16)
        assert 0 < r["vision_s"] <= r["first_token_s"] + r["preprocess_s"]
        assert 0 < r["first_token_s"] <= r["generate_s"] and r["peak_memory_mb"] > 0
        assert (r["per_token_s"] > 0) == (r["output_tokens"] > 1)
        assert (r["allocator_visual_s"] > 0) == (r["allocator_flops"] > 0) == (r["method"] == "resadapt")
        if r["method"] == "tome":  # the tower runs while the inputs are built, not inside generate
            assert r["vision_s"] < r["preprocess_s"]
            # its own work, timed apart: inside the build, beside the tower
            assert 0 < r["compress_s"] and r["compress_s"] + r["vision_s"] < r["preprocess_s"]
            assert r["compress_s_reason"] is None
        else:
            assert r["compress_s"] is None and r["compress_s_reason"].startswith("no compressor stage")
        if r["method"] == "fastv":  # its ranking and pruning, timed apart inside the time to first token
            assert 0 < r["rank_s"] and r["rank_s_reason"] is None
            assert 0 < r["prefill_s"]
            assert r["prefill_s"] + r["rank_s"] + r["vision_s"] == pytest.approx(r["first_token_s"])
        else:
            assert r["rank_s"] is None and r["rank_s_reason"] == "no stage inside the LLM"
            in_generate = r["vision_s"] if r["method"] != "tome" else 0.0  # tome's tower ran in the build
            assert 0 < r["prefill_s"] and r["prefill_s"] + in_generate == pytest.approx(r["first_token_s"])
    rows = list(csv.DictReader((out / "latency.csv").open()))
    assert [(r["method"], r["frames"]) for r in rows] == [
        (m, f) for f in ("8", "16") for m in ("vanilla", "tome", "fastv", "resadapt")
    ]
    for row in rows:
        mine = [r for r in records if r["method"] == row["method"] and r["num_frames"] == int(row["frames"])]
        assert float(row["gen_time_ms"]) == pytest.approx(1e3 * sum(r["generate_s"] for r in mine) / 2)
        if row["method"] == "tome":
            assert float(row["compress_ms"]) == pytest.approx(1e3 * sum(r["compress_s"] for r in mine) / 2)
        else:
            assert row["compress_ms"] == ""
        if row["method"] == "fastv":
            assert float(row["rank_ms"]) == pytest.approx(1e3 * sum(r["rank_s"] for r in mine) / 2)
        else:
            assert row["rank_ms"] == ""
        assert float(row["total_tflops"]) == pytest.approx(sum(r["total_flops"] for r in mine) / 2 / 1e12)
    assert "| vanilla | 16 | 100.0% |" in capsys.readouterr().out
    assert (out / "latency.md").is_file() and (out / "profile_video.mp4").is_file()


def test_profile_refuses_bad_settings_before_loading(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'fastest'"):
        main(["profile", "--card", REPO_CARD, "--methods", "fastest", "--output", str(tmp_path)])
    with pytest.raises(ValueError, match="runs >= 1"):
        main(["profile", "--card", REPO_CARD, "--runs", "0", "--output", str(tmp_path)])
