"""TempCompass multi-choice (lmms-eval's `tempcompass_multi_choice`) for the offline fixture task.

A thin wrapper is needed for two reasons, both in lmms-eval 0.7.3's `tasks/tempcompass/utils.py`:

- the module reads `os.environ["HF_HOME"]` at import, so importing it without HF_HOME set raises
  KeyError and the task cannot even load. Importing it through this module first sets HF_HOME's
  default, huggingface_hub's own (`~/.cache/huggingface` unless XDG_CACHE_HOME says otherwise), which
  is what the Hugging Face libraries use anyway when it is unset. The fixture YAML therefore names
  lmms-eval's functions through this module: `doc_to_text` and `aggregate_rating` below ARE
  lmms-eval's function objects, re-exported, not copies;
- its `tempcompass_process_results_multi_choice` scores by rules (the answer itself, a bare option
  letter, `A.` or `A)`), and asks a GPT judge over HTTP about any other answer, ten retries with
  1-2 s sleeps. Offline the judge never answers and lmms-eval scores the answer 0 (rating 0, no
  judge response), after about 15 s per sample. `process_results` runs lmms-eval's own function
  with that judge call answering "no response" at once, which is lmms-eval's own offline result
  without the network attempts and the wait. Rule-matched answers are scored exactly as lmms-eval
  scores them; unmatched ones carry `match_success: False`.

The real task (`--tasks tempcompass_multi_choice`) is untouched: it uses lmms-eval's YAML and its
judge, which needs HF_HOME set and, for answers the rules do not match, `OPENAI_API_KEY`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from huggingface_hub import constants as _hf_constants

os.environ.setdefault("HF_HOME", _hf_constants.HF_HOME)

from lmms_eval.tasks.tempcompass import utils as _utils  # noqa: E402  (needs HF_HOME, set above)

doc_to_text = _utils.tempcompass_doc_to_text_multi_choice
doc_to_answer = _utils.tempcompass_doc_to_answer
aggregate_rating = _utils.tempcompass_aggregate_rating


def _no_judge(prompt, maxtry=10, sys_prompt=None):
    """lmms-eval's `get_eval_result` when its judge never answers: no response, rating 0."""
    return None, 0


@contextmanager
def _judge_offline():
    judge = _utils.get_eval_result
    _utils.get_eval_result = _no_judge
    try:
        yield
    finally:
        _utils.get_eval_result = judge


def process_results(doc, results):
    """lmms-eval's `tempcompass_process_results_multi_choice`, its GPT judge offline (see above)."""
    with _judge_offline():
        return _utils.tempcompass_process_results_multi_choice(doc, results)
