"""Checks on the paper reference tables transcribed into results/paper/*.csv.

The expected values below were read by hand from the paper's LaTeX source (tables named by
their labels); the test does not read the LaTeX itself. The last test checks how
`resadapt-eval tables --paper` uses the CAPO ablation table.
"""

import csv
from pathlib import Path

import pytest

PAPER = Path(__file__).resolve().parents[1] / "results" / "paper"

LEADING = {"backbone", "frames", "method", "retention", "reasoning"}

# file -> (number of numeric rows in the paper table, expected header)
TABLES = {
    "video_qa.csv": (
        51,
        [
            "backbone",
            "frames",
            "method",
            "retention",
            "reasoning",
            "videomme",
            "longvideobench",
            "mmvu",
            "mlvu",
            "videommmu",
            "lvbench",
        ],
    ),
    "temporal_grounding.csv": (
        45,
        [
            "backbone",
            "frames",
            "method",
            "retention",
            "reasoning",
            "charades_r0.3",
            "charades_r0.5",
            "charades_r0.7",
            "charades_miou",
            "activitynet_r0.3",
            "activitynet_r0.5",
            "activitynet_r0.7",
            "activitynet_miou",
            "nextgqa_acc",
            "nextgqa_miou",
        ],
    ),
    "image.csv": (
        11,
        [
            "backbone",
            "method",
            "mathvista_testmini",
            "mathvista_testmini_retention",
            "mmmu_val",
            "mmmu_val_retention",
            "ocrbench",
            "ocrbench_retention",
            "chartqa",
            "chartqa_retention",
            "ai2d",
            "ai2d_retention",
            "textvqa_val",
            "textvqa_val_retention",
        ],
    ),
    "frame_selection.csv": (
        8,
        [
            "frames",
            "method",
            "videomme",
            "longvideobench",
            "lvbench",
            "mmvu",
            "videomme_avg_frames",
            "videomme_retention",
            "longvideobench_avg_frames",
            "longvideobench_retention",
            "lvbench_avg_frames",
            "lvbench_retention",
            "mmvu_avg_frames",
            "mmvu_retention",
        ],
    ),
    "latency.csv": (
        16,
        [
            "method",
            "frames",
            "retention",
            "scale_tflops",
            "scale_text_enc_ms",
            "scale_visual_enc_ms",
            "scale_pred_ms",
            "scale_apply_ms",
            "scale_time_ms",
            "inference_tflops",
            "ttft_ms",
            "gen_time_ms",
            "total_tflops",
            "e2e_time_ms",
        ],
    ),
    "capo_dist_ablation.csv": (
        2,
        [
            "method",
            "mean_scale",
            "videomme",
            "longvideobench",
            "mmvu",
            "videommmu_perception",
            "videommmu_comprehension",
            "videommmu_adaptation",
            "lvbench",
        ],
    ),
}


def load(name):
    with open(PAPER / name, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def cell(name, column, **key):
    """The value of `column` in the single row of `name` whose columns equal `key`."""
    _, rows = load(name)
    matches = [r for r in rows if all(r[k] == str(v) for k, v in key.items())]
    assert len(matches) == 1, f"{name}: {len(matches)} rows match {key}"
    return matches[0][column]


@pytest.mark.parametrize("name", sorted(TABLES))
def test_header_and_row_count(name):
    n_rows, header = TABLES[name]
    fieldnames, rows = load(name)
    assert fieldnames == header
    assert len(rows) == n_rows


@pytest.mark.parametrize("name", sorted(TABLES))
def test_metric_cells_are_empty_or_float(name):
    fieldnames, rows = load(name)
    assert len(rows) == TABLES[name][0]
    for row in rows:
        assert row["method"].strip() == row["method"] and row["method"]
        if "frames" in row:
            assert int(row["frames"]) > 0
        if "retention" in row:
            float(row["retention"])
        if "reasoning" in row:
            assert row["reasoning"] in ("true", "false")
        for col in fieldnames:
            if col in LEADING:
                continue
            v = row[col]
            if v != "":
                float(v)  # raises if not a number


def test_methods_are_plain_text():
    for name in TABLES:
        _, rows = load(name)
        assert len(rows) == TABLES[name][0], name
        for row in rows:
            assert "\\" not in row["method"] and "{" not in row["method"], row["method"]
            assert "Ours" not in row["method"]


# --- table:benchmark_qa -------------------------------------------------------------------

QA = "video_qa.csv"


def test_video_qa_cells():
    # Table benchmark_qa, Qwen2.5-VL-7B, 32 frames, Random Drop at 25.0%: VideoMME 58.9
    assert cell(QA, "videomme", backbone="Qwen2.5-VL-7B", frames=32, method="Random Drop", retention="25.0") == "58.9"
    # Table benchmark_qa, Qwen2.5-VL-7B, 32 frames, Vanilla at 100%: VideoMME 62.0, LVBench 38.6
    assert cell(QA, "videomme", backbone="Qwen2.5-VL-7B", frames=32, method="Vanilla") == "62.0"
    assert cell(QA, "lvbench", backbone="Qwen2.5-VL-7B", frames=32, method="Vanilla") == "38.6"
    # Table benchmark_qa, Qwen2.5-VL-7B, 32 frames, ResAdapt at 11.4%: VideoMMMU 45.7
    assert cell(QA, "videommmu", backbone="Qwen2.5-VL-7B", frames=32, method="ResAdapt", retention="11.4") == "45.7"
    # Table benchmark_qa, Qwen2.5-VL-7B, 32 frames, FlashVid at 29.3%: LongVideoBench 58.6
    assert (
        cell(QA, "longvideobench", backbone="Qwen2.5-VL-7B", frames=32, method="FlashVid", retention="29.3") == "58.6"
    )
    # Table benchmark_qa, Qwen2.5-VL-7B, 128 frames, ResAdapt at 22.9%: VideoMMMU 51.1
    assert cell(QA, "videommmu", backbone="Qwen2.5-VL-7B", frames=128, method="ResAdapt", retention="22.9") == "51.1"
    # Table benchmark_qa, Qwen2.5-VL-7B, 128 frames, VideoAuto-R1 + ResAdapt at 23.8% (reasoning): MLVU 66.0
    assert (
        cell(QA, "mlvu", backbone="Qwen2.5-VL-7B", frames=128, method="VideoAuto-R1 + ResAdapt", retention="23.8")
        == "66.0"
    )
    assert (
        cell(QA, "reasoning", backbone="Qwen2.5-VL-7B", frames=128, method="VideoAuto-R1 + ResAdapt", retention="23.8")
        == "true"
    )
    # Table benchmark_qa, Qwen3-VL-8B, 32 frames, FlashVid at 30.0%: VideoMME 63.9
    assert cell(QA, "videomme", backbone="Qwen3-VL-8B", frames=32, method="FlashVid", retention="30.0") == "63.9"
    # Table benchmark_qa, Qwen3-VL-8B, 128 frames, ResAdapt at 11.1%: MLVU 69.4, MMVU 55.4
    assert cell(QA, "mlvu", backbone="Qwen3-VL-8B", frames=128, method="ResAdapt", retention="11.1") == "69.4"
    assert cell(QA, "mmvu", backbone="Qwen3-VL-8B", frames=128, method="ResAdapt", retention="11.1") == "55.4"


# --- table:benchmark_grounding ------------------------------------------------------------

TG = "temporal_grounding.csv"


def test_temporal_grounding_cells():
    # Table benchmark_grounding, Qwen2.5-VL-7B, 32 frames, Vanilla at 100%: Charades mIoU 47.3
    assert cell(TG, "charades_miou", backbone="Qwen2.5-VL-7B", frames=32, method="Vanilla") == "47.3"
    # Table benchmark_grounding, Qwen2.5-VL-7B, 32 frames, ResAdapt at 16.2%: Charades mIoU 35.6, R@0.3 53.8
    assert cell(TG, "charades_miou", backbone="Qwen2.5-VL-7B", frames=32, method="ResAdapt", retention="16.2") == "35.6"
    assert cell(TG, "charades_r0.3", backbone="Qwen2.5-VL-7B", frames=32, method="ResAdapt", retention="16.2") == "53.8"
    # Table benchmark_grounding, Qwen2.5-VL-7B, 32 frames, FixedScale at 6.3%: ActivityNet R@0.7 3.9
    assert (
        cell(TG, "activitynet_r0.7", backbone="Qwen2.5-VL-7B", frames=32, method="FixedScale", retention="6.3") == "3.9"
    )
    # Table benchmark_grounding, Qwen2.5-VL-7B, 128 frames, VideoAuto-R1 at 100%: Charades mIoU 28.9
    assert cell(TG, "charades_miou", backbone="Qwen2.5-VL-7B", frames=128, method="VideoAuto-R1") == "28.9"
    # Table benchmark_grounding, Qwen2.5-VL-7B, 128 frames, VideoAuto-R1 + ResAdapt at 16.1%: Charades mIoU 49.1
    assert (
        cell(
            TG,
            "charades_miou",
            backbone="Qwen2.5-VL-7B",
            frames=128,
            method="VideoAuto-R1 + ResAdapt",
            retention="16.1",
        )
        == "49.1"
    )
    # Table benchmark_grounding, Qwen3-VL-8B, 32 frames, Random Drop at 10.0%: Charades R@0.7 0.7, NExT-GQA Acc 74.3
    assert cell(TG, "charades_r0.7", backbone="Qwen3-VL-8B", frames=32, method="Random Drop", retention="10.0") == "0.7"
    assert cell(TG, "nextgqa_acc", backbone="Qwen3-VL-8B", frames=32, method="Random Drop", retention="10.0") == "74.3"
    # Table benchmark_grounding, Qwen3-VL-8B, 128 frames, Vanilla at 100%: NExT-GQA mIoU 36.6
    assert cell(TG, "nextgqa_miou", backbone="Qwen3-VL-8B", frames=128, method="Vanilla") == "36.6"
    # Table benchmark_grounding, Qwen3-VL-8B, 128 frames, ResAdapt at 6.8%: NExT-GQA mIoU 43.9, ActivityNet mIoU 28.4
    assert cell(TG, "nextgqa_miou", backbone="Qwen3-VL-8B", frames=128, method="ResAdapt", retention="6.8") == "43.9"
    assert (
        cell(TG, "activitynet_miou", backbone="Qwen3-VL-8B", frames=128, method="ResAdapt", retention="6.8") == "28.4"
    )


# --- table:benchmark_image ----------------------------------------------------------------

IMG = "image.csv"


def test_image_cells():
    # Table benchmark_image, Qwen2.5-VL-7B (vanilla row): MathVista 49.1 (100%)
    assert cell(IMG, "mathvista_testmini", backbone="Qwen2.5-VL-7B", method="Vanilla") == "49.1"
    assert cell(IMG, "mathvista_testmini_retention", backbone="Qwen2.5-VL-7B", method="Vanilla") == "100"
    # Table benchmark_image, ResAdapt (Qwen2.5-VL-7B): ChartQA 85.9 (105%)
    assert cell(IMG, "chartqa", backbone="Qwen2.5-VL-7B", method="ResAdapt") == "85.9"
    assert cell(IMG, "chartqa_retention", backbone="Qwen2.5-VL-7B", method="ResAdapt") == "105"
    # Table benchmark_image, ResAdapt-RL (Qwen2.5-VL-7B): TextVQA 70.1 (30%)
    assert cell(IMG, "textvqa_val", backbone="Qwen2.5-VL-7B", method="ResAdapt-RL") == "70.1"
    assert cell(IMG, "textvqa_val_retention", backbone="Qwen2.5-VL-7B", method="ResAdapt-RL") == "30"
    # Table benchmark_image, Qwen2.5-VL-7B group, ToMe (50%): OCRBench 79.3
    assert cell(IMG, "ocrbench", backbone="Qwen2.5-VL-7B", method="ToMe") == "79.3"
    # Table benchmark_image, Qwen3-VL-8B group, Random Drop (50%): OCRBench 62.9
    assert cell(IMG, "ocrbench", backbone="Qwen3-VL-8B", method="Random Drop") == "62.9"
    # Table benchmark_image, ResAdapt (Qwen3-VL-8B): MMMU 50.9 (29%), AI2D 81.2
    assert cell(IMG, "mmmu_val", backbone="Qwen3-VL-8B", method="ResAdapt") == "50.9"
    assert cell(IMG, "mmmu_val_retention", backbone="Qwen3-VL-8B", method="ResAdapt") == "29"
    assert cell(IMG, "ai2d", backbone="Qwen3-VL-8B", method="ResAdapt") == "81.2"


# --- tab:frame_select ---------------------------------------------------------------------

FS = "frame_selection.csv"


def test_frame_selection_cells():
    # Table frame_select, budget 8 frames, Vanilla: VideoMME 54.0
    assert cell(FS, "videomme", frames=8, method="Vanilla") == "54.0"
    # Table frame_select, budget 8 frames, Top-8 Select: MMVU 49.2
    assert cell(FS, "mmvu", frames=8, method="Top-8 Select") == "49.2"
    # Table frame_select, budget 16 frames, Threshold Select: LongVideoBench 57.4, avg budget 23.2f (18.1%)
    assert cell(FS, "longvideobench", frames=16, method="Threshold Select") == "57.4"
    assert cell(FS, "longvideobench_avg_frames", frames=16, method="Threshold Select") == "23.2"
    assert cell(FS, "longvideobench_retention", frames=16, method="Threshold Select") == "18.1"
    # Table frame_select, budget 16 frames, Top-32 Select + Resize: VideoMME 60.6, avg budget 11.7f (9.1%)
    assert cell(FS, "videomme", frames=16, method="Top-32 Select + Resize") == "60.6"
    assert cell(FS, "videomme_avg_frames", frames=16, method="Top-32 Select + Resize") == "11.7"
    assert cell(FS, "videomme_retention", frames=16, method="Top-32 Select + Resize") == "9.1"
    # Table frame_select, budget 32 frames, Top-64 Select + Resize: LVBench 40.0, MMVU avg budget 32.5f (25.4%)
    assert cell(FS, "lvbench", frames=32, method="Top-64 Select + Resize") == "40.0"
    assert cell(FS, "mmvu_avg_frames", frames=32, method="Top-64 Select + Resize") == "32.5"
    assert cell(FS, "mmvu_retention", frames=32, method="Top-64 Select + Resize") == "25.4"
    # Table frame_select, budget 32 frames, Vanilla: no avg-budget annotation
    assert cell(FS, "videomme_avg_frames", frames=32, method="Vanilla") == ""


# --- table:latency ------------------------------------------------------------------------

LAT = "latency.csv"


def test_latency_cells():
    # Table latency, Vanilla, 16 frames, 100%: Scale columns printed "--", E2E time 527.9
    assert cell(LAT, "scale_time_ms", method="Vanilla", frames=16) == ""
    assert cell(LAT, "scale_tflops", method="Vanilla", frames=16) == ""
    assert cell(LAT, "e2e_time_ms", method="Vanilla", frames=16) == "527.9"
    # Table latency, ResAdapt, 16 frames, 76.3%: inference TFLOPs 77.2 (annotation dropped), E2E 576.5
    assert cell(LAT, "inference_tflops", method="ResAdapt", frames=16, retention="76.3") == "77.2"
    assert cell(LAT, "e2e_time_ms", method="ResAdapt", frames=16, retention="76.3") == "576.5"
    # Table latency, ResAdapt, 32 frames, 51.5%: visual enc. 193.2, E2E 788.5
    assert cell(LAT, "scale_visual_enc_ms", method="ResAdapt", frames=32, retention="51.5") == "193.2"
    assert cell(LAT, "e2e_time_ms", method="ResAdapt", frames=32, retention="51.5") == "788.5"
    # Table latency, ResAdapt, 64 frames, 27.8%: scale apply 34.8, TTFT 899.2
    assert cell(LAT, "scale_apply_ms", method="ResAdapt", frames=64, retention="27.8") == "34.8"
    assert cell(LAT, "ttft_ms", method="ResAdapt", frames=64, retention="27.8") == "899.2"
    # Table latency, Vanilla, 128 frames, 100%: TTFT 2936.3, gen. time 4877.0
    assert cell(LAT, "ttft_ms", method="Vanilla", frames=128) == "2936.3"
    assert cell(LAT, "gen_time_ms", method="Vanilla", frames=128) == "4877.0"
    # Table latency, ResAdapt, 128 frames, 28.2%: scale TFLOPs 11.6, text enc. 20.4, total TFLOPs 267.1, E2E 1977.3
    assert cell(LAT, "scale_tflops", method="ResAdapt", frames=128, retention="28.2") == "11.6"
    assert cell(LAT, "scale_text_enc_ms", method="ResAdapt", frames=128, retention="28.2") == "20.4"
    assert cell(LAT, "total_tflops", method="ResAdapt", frames=128, retention="28.2") == "267.1"
    assert cell(LAT, "e2e_time_ms", method="ResAdapt", frames=128, retention="28.2") == "1977.3"


# --- table:capo_dist_ablation -------------------------------------------------------------

CAPO = "capo_dist_ablation.csv"

# Both rows in full, as printed: s-bar, VideoMME, LongVideoBench, MMVU, VideoMMMU Per./Comp./Adap., LVBench
CAPO_ROWS = {
    "beta-CAPO": ["0.54", "60.3", "58.2", "51.2", "65.0", "54.3", "28.7", "37.6"],  # $\beta$-CAPO
    "N-CAPO": ["0.60", "61.0", "57.4", "51.8", "66.0", "50.0", "30.3", "37.2"],  # $\mathcal{N}$-CAPO
}


def test_capo_dist_ablation_cells():
    header, _ = load(CAPO)
    for method, values in CAPO_ROWS.items():
        assert [cell(CAPO, column, method=method) for column in header[1:]] == values


def write_cell(run_dir, name, method, allocator, scores, raw_scales):
    """A finished sweep cell as `sweep` leaves it: cell.json, lmms-eval's results, our sidecar."""
    import json

    cell_dir = run_dir / name
    (cell_dir / "out").mkdir(parents=True)
    results = {task: {f"{metric},none": value} for task, (metric, value) in scores.items()}
    (cell_dir / "out" / "x_results.json").write_text(json.dumps({"results": results}))
    records = [
        dict(
            task=task, error=None, achieved_retention=0.25, scales=[0.5] * 4, raw_scales=raw_scales, allocator=allocator
        )
        for task in scores
    ]
    (cell_dir / "out" / "resadapt_samples_x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = dict(
        card="qwen25vl-7b-32f",
        backbone="qwen25vl",
        paper_backbone="Qwen2.5-VL-7B",
        method=method,
        retention=0.25,
        frames=32,
        status="done",
        samples=len(scores),
        failed_samples=0,
        results="out/x_results.json",
    )
    (cell_dir / "cell.json").write_text(json.dumps(meta))


def test_tables_paper_writes_the_capo_ablation_beside_resadapt_cells(tmp_path, capsys):
    import json

    from resadapt_eval.cli import main

    # An N-CAPO Allocator checkpoint: only its config.json is read (the policy family).
    checkpoint = tmp_path / "allocator-ncapo"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"policy": "logit_normal"}))
    run_dir = tmp_path / "sweep"
    scores = {
        "videomme": ("videomme_perception_score", 60.0),
        "video_mmmu_perception": ("mmmu_acc", 64.0),
        "video_mmmu_adaptation": ("mmmu_acc", 31.0),
    }
    write_cell(run_dir, "resadapt-r0.25-f32", "resadapt", str(checkpoint), scores, [0.4, 0.6, 0.7, 0.7])
    write_cell(run_dir, "vanilla-f32", "vanilla", None, {"videomme": ("videomme_perception_score", 62.0)}, None)

    assert main(["tables", str(run_dir)]) == 0  # without --paper: no ablation table
    assert not (run_dir / "tables" / "capo_dist_ablation.md").exists()
    assert "CAPO distribution family" not in capsys.readouterr().out

    assert main(["tables", str(run_dir), "--paper"]) == 0
    printed = capsys.readouterr().out
    md = (run_dir / "tables" / "capo_dist_ablation.md").read_text()
    assert md in printed
    # the paper's two rows as printed (s-bar to 2 decimals), then our N-CAPO cell; vanilla has no row
    assert "| paper | beta-CAPO | — | — | — | 0.54 | 60.3 | 58.2 | 51.2 | 65.0 | 54.3 | 28.7 | 37.6 |" in md
    assert "| paper | N-CAPO | — | — | — | 0.60 | 61.0 | 57.4 | 51.8 | 66.0 | 50.0 | 30.3 | 37.2 |" in md
    # ours: R from the sidecar, s-bar from the Allocator's raw scales (0.6), VideoMMMU tracks by name
    assert "| ours | N-CAPO | qwen25vl-7b-32f | 32 | 25.0% | 0.60 | 60.0 | — | — | 64.0 | — | 31.0 | — |" in md
    rows = list(csv.DictReader((run_dir / "tables" / "capo_dist_ablation.csv").open()))
    assert [(r["source"], r["variant"]) for r in rows] == [
        ("paper", "beta-CAPO"),
        ("paper", "N-CAPO"),
        ("ours", "N-CAPO"),
    ]
    assert float(rows[2]["mean_scale"]) == pytest.approx(0.6) and float(rows[2]["R"]) == 0.25
    # the VideoMMMU tracks also reach the video QA table under the paper's column names
    assert "videommmu_perception" in (run_dir / "tables" / "video_qa.csv").read_text().splitlines()[0]
