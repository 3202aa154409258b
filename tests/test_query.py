"""The question reaches a compressor that reads it (CDPruner, `TokenCompressor.reads_query`): the
LLM's input embeddings of the request's question text (`VisualTokens.query`), counted in the record."""

import pytest
import torch

from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.methods import METHODS
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig

from .helpers import BACKBONES, chat_prompt, vanilla_setup

QUESTIONS = ("Which colour is the square?", "How many people dance in the rain at night?")


def kept_positions(adapter, question: str, retention: float = 0.25) -> torch.Tensor:
    """M-RoPE positions (3, K) of the video tokens CDPruner keeps for `question` on one video."""
    prompt, video, plan = vanilla_setup(adapter)
    inputs, _ = adapter.build_compressed_inputs(
        prompt, video, plan, METHODS["cdpruner"].compress, retention, query=adapter.question_embeddings(question)
    )
    return inputs["position_ids"][:, 0, inputs["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE]


@pytest.mark.parametrize("backbone", BACKBONES)
def test_cdpruner_keeps_other_tokens_for_another_question_and_the_same_for_the_same(adapters, backbone):
    adapter = adapters[backbone]
    first, again, other = (kept_positions(adapter, q) for q in (QUESTIONS[0], QUESTIONS[0], QUESTIONS[1]))
    assert torch.equal(first, again)
    assert first.shape == other.shape and not torch.equal(first, other)


def test_the_question_is_embedded_as_the_llm_reads_it(adapters):
    adapter = adapters["qwen25vl"]
    embedded = adapter.question_embeddings(QUESTIONS[0])
    ids = adapter.tokenizer(QUESTIONS[0], add_special_tokens=False)["input_ids"]
    assert embedded.shape == (len(ids), adapter.model.config.text_config.hidden_size)
    torch.testing.assert_close(embedded, adapter.model.get_input_embeddings().weight[ids], atol=0, rtol=0)
    assert adapter.question_embeddings("").shape == (0, embedded.shape[1])


def run_record(adapter, method: str, question: str, fixtures_dir):
    pipeline = VideoPipeline(
        adapter, VideoPipelineConfig(method=method, budget=BudgetSpec(retention=0.25), max_num_frames=8, strict=True)
    )
    video = str(sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[0])
    _, record = pipeline.run(
        Request(chat_prompt(adapter, question), video=video, query=question, gen_kwargs=dict(max_new_tokens=2))
    )
    assert record.error is None, record.error
    return record


def test_the_record_counts_the_question_tokens_and_says_when_there_were_none(adapters, fixtures_dir):
    adapter = adapters["qwen3vl"]
    asked = run_record(adapter, "cdpruner", QUESTIONS[1], fixtures_dir)
    assert asked.query_tokens == len(adapter.tokenizer(QUESTIONS[1], add_special_tokens=False)["input_ids"]) > 0
    assert asked.query_tokens_reason is None
    empty = run_record(adapter, "cdpruner", "", fixtures_dir)
    assert empty.query_tokens == 0 and "no question text" in empty.query_tokens_reason
    assert empty.visual_tokens == asked.visual_tokens  # the same budget, without relevance
    other = run_record(adapter, "tome", QUESTIONS[1], fixtures_dir)
    assert other.query_tokens is None and other.query_tokens_reason is None
