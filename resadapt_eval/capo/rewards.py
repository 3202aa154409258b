"""Task rewards R^task (paper appendix "Reward Design") and the correctness indicator u.

QA: exact match after case-folding and whitespace normalisation; multiple choice by the parsed
option letter; numeric answers within 1e-2. Free-form: ROUGE-L F1 (rouge-score). Temporal
grounding: the highest temporal IoU over predicted x reference segments, 0 when nothing parses.
Grounding QA: QA + TG. Format: exactly one <think>...</think> and one <answer>...</answer> with a
\\boxed{...} inside the answer; weight 0.2 when enabled.
"""

from __future__ import annotations

import re

TASK_TYPES = ("qa", "multiple_choice", "numeric", "free_form", "temporal_grounding", "grounding_qa")
FORMAT_WEIGHT = 0.2

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?")
_TIME = r"(\d+(?::\d{1,2}){0,2}(?:\.\d+)?)"
_SEGMENT = re.compile(_TIME + r"\s*(?:s|sec|seconds)?\s*(?:-|–|to|,)\s*" + _TIME)


def final_answer(text: str) -> str:
    """The answer part of a response: the \\boxed{} content, else the <answer> block, else the text."""
    block = _ANSWER.search(text)
    inner = block.group(1) if block else text
    boxed = _BOXED.search(inner)
    return (boxed.group(1) if boxed else inner).strip()


def normalize(text: str) -> str:
    return " ".join(text.casefold().split()).strip(" .")


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize(final_answer(prediction)) == normalize(reference))


def choice_letter(text: str, choices: str = "ABCDEFGH") -> str | None:
    """The option letter a response picks: 'B', '(B)', 'B.', 'Answer: B', 'The answer is B'."""
    answer = final_answer(text).strip()
    match = re.match(rf"^\(?([{choices}])\)?(?:[.,:)\s]|$)", answer)
    if match:
        return match.group(1)
    match = re.search(rf"(?:answer|option)\s*(?:is|:)?\s*\(?([{choices}])\)?\b", answer, re.I)
    return match.group(1).upper() if match else None


def multiple_choice(prediction: str, reference: str) -> float:
    return float(choice_letter(prediction) == reference.strip().upper()[:1])


def numeric(prediction: str, reference: str, tolerance: float = 1e-2) -> float:
    found = _NUMBER.findall(final_answer(prediction).replace(",", ""))
    if not found:
        return 0.0
    return float(abs(float(found[-1]) - float(reference)) <= tolerance)


def rouge_l(prediction: str, reference: str) -> float:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"]).score(reference, final_answer(prediction))["rougeL"].fmeasure


def seconds(stamp: str) -> float:
    """'75', '75.5', '1:15', '0:01:15' -> seconds."""
    total = 0.0
    for part in stamp.split(":"):
        total = total * 60 + float(part)
    return total


def parse_segments(text: str) -> list[tuple[float, float]]:
    """Segments like '12.5 - 20', '[1:05, 1:20]', '3 to 7 seconds' in a response, in seconds."""
    segments = []
    for start, end in _SEGMENT.findall(final_answer(text)):
        s, e = seconds(start), seconds(end)
        if e > s:
            segments.append((s, e))
    return segments


def temporal_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    union = max(a[1], b[1]) - min(a[0], b[0])
    return inter / union if union > 0 else 0.0


def temporal_grounding(prediction: str, references: list[tuple[float, float]]) -> float:
    """max over predicted x reference segments of tIoU; 0 when no segment parses."""
    predicted = parse_segments(prediction)
    return max((temporal_iou(p, r) for p in predicted for r in references), default=0.0)


def format_ok(text: str) -> float:
    """1 when the response has exactly one <think> block and one <answer> block holding \\boxed{}."""
    think = re.findall(r"<think>.*?</think>", text, re.S)
    answers = _ANSWER.findall(text)
    return float(len(think) == 1 and len(answers) == 1 and bool(_BOXED.search(answers[0])))


def task_score(task_type: str, prediction: str, answer, segments: list[tuple[float, float]] | None = None) -> float:
    """The task metric of one rollout (the part the correctness indicator u reads)."""
    if task_type == "qa":
        score = exact_match(prediction, answer)
    elif task_type == "multiple_choice":
        score = multiple_choice(prediction, answer)
    elif task_type == "numeric":
        score = numeric(prediction, answer)
    elif task_type == "free_form":
        score = rouge_l(prediction, answer)
    elif task_type == "temporal_grounding":
        score = temporal_grounding(prediction, segments or [])
    elif task_type == "grounding_qa":
        score = multiple_choice(prediction, answer) + temporal_grounding(prediction, segments or [])
    else:
        raise ValueError(f"unknown task type {task_type!r}; one of {TASK_TYPES}")
    return score


def task_reward(score: float, prediction: str, check_format: bool = False) -> float:
    """R^task: the task metric, minus 0.2 when format checking is on and the format is wrong."""
    return score + (FORMAT_WEIGHT * (format_ok(prediction) - 1.0) if check_format else 0.0)


def is_correct(task_type: str, score: float, threshold: float = 0.35) -> float:
    """u: the binary outcome for exact-match QA, `score > threshold` for continuous metrics."""
    if task_type in ("qa", "multiple_choice", "numeric"):
        return float(score >= 1.0)
    return float(score > threshold)
