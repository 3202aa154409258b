"""The same smoke samples through the HF path and the vLLM engine: seconds per request side by side.

    make test-vllm   # builds .venv-vllm once
    .venv-vllm/bin/python benchmarks/vllm_vs_hf.py [--methods vanilla fixed_scale] [--frames 8] [--repeats 3]

For each backbone and method, every smoke video is answered (greedy, --max-new-tokens tokens) by
`VideoPipeline.run` on the HF adapter and by `VideoPipeline.run_batch` on `VLLMBackbone`, first one
request per call (latency), then all requests in one call (throughput, seconds per request).
Seconds run from the video path to the answer (decode, plan, resize, model). Medians over
--repeats after a warm-up; ratios are vLLM / HF in the same run. vLLM start-up is reported apart.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from timing import median_seconds

from resadapt_eval.backbones.qwen import ADAPTERS
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.fixtures import ensure_fixtures
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig

REPO = Path(__file__).resolve().parents[1]
KV_CACHE_BYTES = 256 << 20


def main() -> None:
    from resadapt_eval.backbones.vllm_engine import VLLMBackbone

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["vanilla", "fixed_scale"])
    parser.add_argument("--retention", type=float, default=0.25, help="target R for fixed_scale")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    fixtures = ensure_fixtures(REPO / "fixtures")
    videos = [str(p) for p in sorted((fixtures / "smoke_videoqa" / "videos").glob("*.mp4"))]
    gen = dict(max_new_tokens=args.max_new_tokens)
    print(
        f"tiny random backbones, fp32 on CPU ({torch.get_num_threads()} threads), {len(videos)} smoke videos, "
        f"T={args.frames}, {args.max_new_tokens} new tokens, medians of {args.repeats}"
    )
    print(
        f"{'backbone':<9} {'method':<12} {'HF s/req':>9} {'vLLM s/req':>10} {'vLLM/HF':>8} "
        f"{'vLLM batched s/req':>18} {'batched/HF':>10}"
    )
    for family, cls in ADAPTERS.items():
        path = str(fixtures / family)
        adapter = cls.from_pretrained(path, dtype="float32")
        engine = VLLMBackbone(
            family, path, max_num_frames=args.frames, dtype="float32", kv_cache_memory_bytes=KV_CACHE_BYTES
        )
        prompt = adapter.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What colour is the square?"}]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for method in args.methods:
            config = VideoPipelineConfig(
                method=method,
                max_num_frames=args.frames,
                budget=BudgetSpec(retention=args.retention if method != "vanilla" else None),
            )
            hf, vllm = VideoPipeline(adapter, config), VideoPipeline(engine, config)

            def job(video):
                return Request(prompt, video=video, query="What colour is the square?", gen_kwargs=gen)

            def check(results):
                for _, record in results:
                    if record.error:
                        raise RuntimeError(record.error)

            hf_s = median_seconds(lambda: [check(hf.run_batch([job(v)])) for v in videos], args.repeats) / len(videos)
            one_s = median_seconds(lambda: [check(vllm.run_batch([job(v)])) for v in videos], args.repeats) / len(
                videos
            )
            batch_s = median_seconds(lambda: check(vllm.run_batch([job(v) for v in videos])), args.repeats) / len(
                videos
            )
            print(
                f"{family:<9} {method:<12} {hf_s:>9.3f} {one_s:>10.3f} {one_s / hf_s:>8.2f} "
                f"{batch_s:>18.3f} {batch_s / hf_s:>10.2f}"
            )
        print(f"{family:<9} vLLM start-up {engine.startup_s:.1f} s")
        del engine


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
