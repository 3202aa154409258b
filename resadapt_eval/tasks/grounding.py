"""Temporal grounding (ActivityNet Captions) and grounded QA (NExT-GQA) scoring for lmms-eval.

Predicted segments are parsed from seconds ("12.5 - 20 seconds", "[12.5, 20]") or clock times
("1:05 to 1:20"); a response with no parsable segment scores IoU 0 and its per-sample record
says why. Recall@{0.3, 0.5, 0.7} and mIoU are reported in percent, as lmms-eval's Charades-STA.
"""

from __future__ import annotations

from ..capo.rewards import choice_letter, parse_segments, temporal_iou

THRESHOLDS = (0.3, 0.5, 0.7)


def grounding_doc_to_text(doc, lmms_eval_specific_kwargs=None):
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['caption']}. {kwargs.get('post_prompt', '')}"


def score_segment(prediction: str, reference) -> dict:
    """IoU of the first predicted segment with the reference [start, end] (seconds)."""
    segments = parse_segments(prediction)
    if not segments:
        return {"iou": 0.0, "segment": None, "reason": f"no segment in the answer: {prediction[:120]!r}"}
    iou = temporal_iou(segments[0], (float(reference[0]), float(reference[1])))
    return {"iou": iou, "segment": list(segments[0]), "reason": None}


def grounding_process_results(doc, results):
    scored = score_segment(results[0], doc["timestamp"])
    return {metric: scored for metric in ("r0.3", "r0.5", "r0.7", "miou")}


def _recall(results, threshold):
    return 100.0 * sum(r["iou"] >= threshold for r in results) / len(results) if results else 0.0


def aggregate_r03(results):
    return _recall(results, 0.3)


def aggregate_r05(results):
    return _recall(results, 0.5)


def aggregate_r07(results):
    return _recall(results, 0.7)


def aggregate_miou(results):
    return 100.0 * sum(r["iou"] for r in results) / len(results) if results else 0.0


# ---------------------------------------------------------------- NExT-GQA


def nextgqa_doc_to_text(doc, lmms_eval_specific_kwargs=None):
    kwargs = lmms_eval_specific_kwargs or {}
    options = "\n".join(f"{letter}. {text}" for letter, text in zip("ABCDE", doc["options"]))
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}\n{options}{kwargs.get('post_prompt', '')}"


def nextgqa_process_results(doc, results):
    """Accuracy of the option letter and IoU of the grounded segment (best over reference segments)."""
    prediction = results[0]
    correct = float(choice_letter(prediction) == doc["answer"])
    segments = parse_segments(prediction)
    references = [tuple(map(float, s)) for s in doc["segments"]]
    if segments:
        best = max(temporal_iou(segments[0], r) for r in references)
        grounding = {"iou": best, "segment": list(segments[0]), "reason": None}
    else:
        grounding = {"iou": 0.0, "segment": None, "reason": f"no segment in the answer: {prediction[:120]!r}"}
    return {"acc": correct, "miou": grounding}


def aggregate_accuracy(results):
    return 100.0 * sum(results) / len(results) if results else 0.0
