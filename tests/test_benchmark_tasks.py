"""Benchmark wiring: real tasks' prompt and scoring functions on offline fixtures in the real
schemas, our NExT-GQA / ActivityNet grounding metrics by hand, images through the budget path."""

import json
import subprocess

import numpy as np
import pytest
from PIL import Image

from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig
from resadapt_eval.tasks import grounding

from .helpers import REPO, lmms_eval_command, sidecar_records

FIXTURE_TASKS = {
    "resadapt_fixture_videomme": ["videomme_perception_score,none"],
    "resadapt_fixture_lvbench": ["lvbench_score,none"],
    "resadapt_fixture_charades": [
        "charades_sta_IOU@3,none",
        "charades_sta_IOU@5,none",
        "charades_sta_IOU@7,none",
        "charades_sta_mIOU,none",
    ],
    "resadapt_fixture_nextgqa": ["acc,none", "miou,none"],
    "resadapt_fixture_activitynet_tg": ["r0.3,none", "r0.5,none", "r0.7,none", "miou,none"],
    "resadapt_fixture_chartqa": ["relaxed_overall,none"],
    # one sample per temporal aspect; no `action` sample, so no action_accuracy
    "resadapt_fixture_tempcompass": [
        "avg_accuracy,none",
        "speed_accuracy,none",
        "direction_accuracy,none",
        "order_accuracy,none",
        "attribute_change_accuracy,none",
    ],
}


def test_every_fixture_family_runs_the_real_task_functions_through_our_model(fixtures_dir, tmp_path):
    model_args = dict(
        pretrained=fixtures_dir / "qwen25vl", method="fixed_scale", retention=0.25, max_num_frames=8, device="cpu"
    )
    cmd = lmms_eval_command("resadapt_qwen25vl", model_args, ",".join(FIXTURE_TASKS), str(REPO / "tasks"), tmp_path)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_path,) = tmp_path.rglob("*_results.json")
    results = json.loads(results_path.read_text())["results"]
    for task, metrics in FIXTURE_TASKS.items():
        for metric in metrics:
            assert isinstance(results[task][metric], (int, float)), (task, metric)
    records = sidecar_records(tmp_path)
    by_task = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    assert {t: len(v) for t, v in by_task.items()} == {t: 4 for t in FIXTURE_TASKS}
    for r in records:
        assert r["error"] is None and r["achieved_retention"] <= 0.25
    for r in by_task["resadapt_fixture_chartqa"]:  # an image is one frame (a duplicated pair)
        assert (
            r["num_frames"] == 1 and len(r["grids"]) == 1 and r["visual_tokens"] == r["grids"][0][1] * r["grids"][0][2]
        )
    # a malformed grounding answer scores IoU 0 and says why, per sample
    (samples,) = tmp_path.rglob("*_samples_resadapt_fixture_nextgqa.jsonl")
    logged = [json.loads(line) for line in samples.read_text().splitlines()]
    malformed = [sample for sample in logged if sample["miou"]["segment"] is None]
    assert len(logged) == 4 and malformed  # the tiny random model's answers carry no segment
    for sample in malformed:
        assert sample["miou"]["iou"] == 0.0 and sample["miou"]["reason"].startswith("no segment in the answer")


def test_grounding_metrics_on_a_hand_made_prediction_file(tmp_path):
    reference = [1.0, 3.0]
    predictions = tmp_path / "predictions.jsonl"
    rows = [
        ("The event happens in the 0.5 - 2.5 seconds.", 1.5 / 2.5),  # overlap [1, 2.5] over [0.5, 3]
        ("from 1:00 to 1:02", 0.0),  # clock times, 60-62 s: no overlap
        ("[1, 3]", 1.0),
        ("somewhere in the middle", 0.0),  # malformed
        ("1.5 - 2.0 seconds", 0.5 / 2.0),
    ]
    predictions.write_text("".join(json.dumps({"prediction": p}) + "\n" for p, _ in rows))
    doc = {"caption": "x", "timestamp": reference}
    per_sample = [
        grounding.grounding_process_results(doc, [json.loads(line)["prediction"]])
        for line in predictions.read_text().splitlines()
    ]
    ious = [s["miou"]["iou"] for s in per_sample]
    assert ious == pytest.approx([iou for _, iou in rows])
    results = [s["r0.3"] for s in per_sample]
    assert grounding.aggregate_r03(results) == pytest.approx(40.0)  # 0.6, 1.0
    assert grounding.aggregate_r05(results) == pytest.approx(40.0)  # 0.6, 1.0
    assert grounding.aggregate_r07(results) == pytest.approx(20.0)  # 1.0
    assert grounding.aggregate_miou(results) == pytest.approx(100 * (0.6 + 1.0 + 0.25) / 5)
    assert per_sample[3]["miou"]["reason"] == "no segment in the answer: 'somewhere in the middle'"

    nextgqa_doc = {"question": "q", "options": list("vwxyz"), "answer": "B", "segments": [[0.0, 2.0], [5.0, 6.0]]}
    right = grounding.nextgqa_process_results(nextgqa_doc, ["B <> [5.0, 6.5]"])
    wrong = grounding.nextgqa_process_results(nextgqa_doc, ["C"])
    assert right["acc"] == 1.0 and right["miou"]["iou"] == pytest.approx(1.0 / 1.5)  # best reference segment
    assert wrong["acc"] == 0.0 and wrong["miou"]["iou"] == 0.0 and wrong["miou"]["reason"]
    assert grounding.aggregate_accuracy([right["acc"], wrong["acc"]]) == 50.0
    assert grounding.aggregate_miou([right["miou"], wrong["miou"]]) == pytest.approx(100 * (1 / 1.5) / 2)


def test_tempcompass_scores_a_hand_made_answer_with_lmms_evals_own_functions(monkeypatch):
    import importlib

    from resadapt_eval.tasks import tempcompass

    utils = importlib.import_module("lmms_eval.tasks.tempcompass.utils")  # after ours: it reads HF_HOME at import

    # the fixture task's prompt and aggregation are lmms-eval's own function objects
    assert tempcompass.doc_to_text is utils.tempcompass_doc_to_text_multi_choice
    assert tempcompass.aggregate_rating is utils.tempcompass_aggregate_rating
    doc = {
        "video_id": "v0",
        "question": "In which direction is the square moving?\nA. left\nB. right\nC. up\nD. down",
        "answer": "B. right",
        "dim": "direction",
    }
    kwargs = {"pre_prompt": "", "post_prompt": {"multi-choice": "\nPlease directly give the best option:"}}
    assert tempcompass.doc_to_text(doc, kwargs) == doc["question"] + "\nPlease directly give the best option:"

    asked = []  # the GPT judge must not be asked about answers the rules match, nor offline at all
    monkeypatch.setattr(utils, "get_llm_output", lambda *a, **k: asked.append(a) or "Correct")
    ratings = {}
    for answer in ("B. right", "B", "B) right", "A. left", "C", "D)"):
        scored = utils.tempcompass_process_results_multi_choice(doc, [answer])
        assert set(scored) == {"avg_accuracy", "direction_accuracy"} and scored["avg_accuracy"]["match_success"]
        ratings[answer] = scored["avg_accuracy"]["rating"]
    assert ratings == {"B. right": 1, "B": 1, "B) right": 1, "A. left": 0, "C": 0, "D)": 0}
    assert not asked
    # an answer the rules do not match: lmms-eval would ask its judge; the fixture's process_results
    # gives lmms-eval's own no-response result (rating 0) at once, and puts the judge back afterwards
    judge = utils.get_eval_result
    unmatched = tempcompass.process_results(doc, ["the square goes to the right"])
    assert unmatched["direction_accuracy"]["rating"] == 0 and not unmatched["direction_accuracy"]["match_success"]
    assert "chatgpt_response" not in unmatched["avg_accuracy"] and not asked
    assert utils.get_eval_result is judge
    right = tempcompass.process_results(doc, ["B"])
    assert right["avg_accuracy"]["rating"] == 1

    results = [
        right["avg_accuracy"],
        unmatched["avg_accuracy"],
        utils.tempcompass_process_results_multi_choice(doc, ["B. right"])["avg_accuracy"],
    ]
    assert utils.tempcompass_aggregate_rating(results, None) == pytest.approx(100 * 2 / 3)
    assert utils.tempcompass_aggregate_rating([unmatched["avg_accuracy"]], None) == 0.0


def test_images_take_the_same_budget_path(adapters):
    adapter = adapters["qwen25vl"]
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (240, 320, 3), dtype=np.uint8))
    prompt = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is shown?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    vanilla = VideoPipeline(adapter, VideoPipelineConfig(method="vanilla"))
    _, record = vanilla.run(Request(prompt, images=(image,)))
    # 240x320 -> 252x308 px base = 9x11 tokens; one image = one pair
    assert record.grids == [[1, 9, 11]] and record.visual_tokens == record.reference_tokens == 99
    fixed = VideoPipeline(adapter, VideoPipelineConfig(method="fixed_scale", budget=BudgetSpec(retention=0.25)))
    _, record = fixed.run(Request(prompt, images=(image,)))
    assert record.visual_tokens == 24 and record.achieved_retention == pytest.approx(24 / 99)  # s = 0.5 -> 4x6
    tome = VideoPipeline(adapter, VideoPipelineConfig(method="tome", budget=BudgetSpec(retention=0.25)))
    _, record = tome.run(Request(prompt, images=(image,)))
    assert (
        record.error.startswith("ValueError") and "works on videos only" in record.error and record.visual_tokens == 0
    )
