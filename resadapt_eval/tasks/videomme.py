"""VideoMME-schema rows, checked before lmms-eval's own prompt and scoring see them.

lmms-eval builds every prompt before the first sample runs, so one malformed row (`options: null`,
a missing question) raises a TypeError inside its `videomme_doc_to_text` and ends the whole run.
Here such a row still gets a prompt, and `doc_to_visual` fails that one sample with its reason;
the model records it as failed and the run goes on. Well-formed rows get lmms-eval's own prompt,
unchanged.
"""

from __future__ import annotations

from lmms_eval.tasks.videomme import utils as videomme

from . import media


class MalformedRow(ValueError):
    """A dataset row that does not have the fields its task reads."""


def row_problem(doc: dict) -> str | None:
    """Why this row cannot be asked as a VideoMME question, or None when it can."""
    question, options = doc.get("question"), doc.get("options")
    if not isinstance(question, str) or not question.strip():
        return f"question is {question!r}; expected a non-empty string"
    if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) for o in options):
        return f"options is {options!r}; expected a list of strings such as ['A. red', 'B. blue']"
    return None


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """lmms-eval's VideoMME prompt; for a malformed row, the bare question (never asked: the row
    fails in `doc_to_visual`, before the model runs)."""
    if row_problem(doc) is not None:
        return str(doc.get("question") or "")
    return videomme.videomme_doc_to_text(doc, lmms_eval_specific_kwargs or {})


def doc_to_visual(doc: dict) -> list[str]:
    """The row's video path; a malformed row raises, naming its question_id and the field."""
    problem = row_problem(doc)
    if problem is not None:
        raise MalformedRow(f"row question_id={doc.get('question_id')!r} cannot be asked: {problem}")
    return media.video(doc)
