"""Requests per second and time to first token on the vLLM engine with 1, 4, 16 and 32 requests in flight.

    make test-vllm   # builds .venv-vllm once
    .venv-vllm/bin/python benchmarks/vllm_throughput.py                       # tiny backbones, this machine
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --backbone qwen25vl-7b --frames 32   # on a GPU

Methods: vanilla, fixed_scale and resadapt (the untrained Allocator) on the per-pair engine, vLLM's EVS
(Qwen2.5-VL) on its own engine, and every compressor vLLM runs (`methods.vllm_compressors`) on
one engine started for compression, all at R = --retention. At concurrency c, waves of c requests (smoke
videos, repeated) go to `VideoPipeline.run_batch` together: vLLM has all c in flight. Requests per second
run from the video path to the answer (decode, plan, the engine); time to first token is vLLM's own,
from a request's arrival in the engine. Each method's requests per second over vanilla's (on the per-pair
engine, as a lab serves it) at the same concurrency is printed beside it. A first wave per method and
concurrency warms the engine and is not counted. --backbone qwen25vl-7b / qwen3vl-8b writes a checkpoint
at the published widths with random weights (`fixtures.ensure_real_width`, its depth from --text-layers /
--vision-blocks) and serves it, for a GPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.fixtures import REAL_WIDTH, ensure_fixtures, ensure_real_width
from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig

REPO = Path(__file__).resolve().parents[1]
QUESTION = "What colour is the square?"


def requests(engine, videos: list[str], count: int, new_tokens: int) -> list[Request]:
    prompt = engine.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    gen = dict(max_new_tokens=new_tokens)
    return [Request(prompt, video=videos[i % len(videos)], query=QUESTION, gen_kwargs=gen) for i in range(count)]


def measure(pipeline: VideoPipeline, videos, concurrency: int, waves: int, new_tokens: int) -> tuple[float, float]:
    """(requests per second, mean time to first token in seconds) over `waves` waves of `concurrency`."""
    pipeline.run_batch(requests(pipeline.backbone, videos, concurrency, new_tokens))  # warm-up
    ttft, t0 = [], time.perf_counter()
    for _ in range(waves):
        for _, record in pipeline.run_batch(requests(pipeline.backbone, videos, concurrency, new_tokens)):
            if record.error:
                raise RuntimeError(f"{record.method}: {record.error}")
            ttft.append(record.first_token_s)
    return waves * concurrency / (time.perf_counter() - t0), statistics.mean(ttft)


def engines(family: str, path: str, args) -> list[tuple[str, dict, list[str]]]:
    """(engine label, VLLMBackbone arguments, methods it serves), vanilla first on each."""
    from resadapt_eval.methods import get_method, vllm_compressors

    plain = ("per-pair", {}, ["vanilla", "fixed_scale", "resadapt"])
    evs_rate = get_method("evs").pruning_rate(args.retention)
    evs = ("evs", dict(video_pruning_method="evs", video_pruning_rate=evs_rate), ["evs"])
    compressors = vllm_compressors()
    compressing = ("compressing", dict(token_compression=compressors), sorted(compressors))
    chosen = [plain, compressing] if family == "qwen3vl" else [plain, evs, compressing]  # no EVS on Qwen3-VL here
    if args.methods:
        chosen = [(label, kw, [m for m in ms if m == "vanilla" or m in args.methods]) for label, kw, ms in chosen]
    return [(label, kw, ms) for label, kw, ms in chosen if ms]


def main() -> None:
    from resadapt_eval.backbones.vllm_engine import VLLMBackbone

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", nargs="+", default=["qwen25vl", "qwen3vl"], help=f"tiny, or {list(REAL_WIDTH)}")
    parser.add_argument("--methods", nargs="+", default=None, help="a subset of the methods (vanilla always runs)")
    parser.add_argument("--retention", type=float, default=0.25)
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4, 16, 32])
    parser.add_argument("--waves", type=int, default=2, help="counted waves per concurrency")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="float32" if not torch.cuda.is_available() else "bfloat16")
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="vLLM's KV cache (on CPU)")
    parser.add_argument("--text-layers", type=int, default=None, help="real-width backbones: LLM depth")
    parser.add_argument("--vision-blocks", type=int, default=None, help="real-width backbones: tower depth")
    args = parser.parse_args()
    fixtures = ensure_fixtures(REPO / "fixtures")
    videos = [str(p) for p in sorted((fixtures / "smoke_videoqa" / "videos").glob("*.mp4"))]
    device = "cuda" if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{device}, {args.dtype}, T={args.frames}, R={args.retention}, {args.new_tokens} new tokens")
    header = "| backbone | engine | method | " + " | ".join(
        f"c={c} req/s | ttft ms | x vanilla" for c in args.concurrency
    )
    print(header + " |")
    print("|" + "---|" * (3 + 3 * len(args.concurrency)))
    for name in args.backbone:
        vanilla = None
        family = REAL_WIDTH.get(name, name)
        path = str(
            fixtures / name
            if name not in REAL_WIDTH
            else ensure_real_width(fixtures / "real_width", name, args.text_layers, args.vision_blocks)
        )
        for label, engine_args, methods in engines(family, path, args):
            engine = VLLMBackbone(
                family,
                path,
                max_num_frames=args.frames,
                dtype=args.dtype,
                kv_cache_memory_bytes=args.kv_cache_bytes if not torch.cuda.is_available() else None,
                **engine_args,
            )
            for method in methods:
                retention = None if method == "vanilla" else args.retention
                config = VideoPipelineConfig(
                    method=method,
                    max_num_frames=args.frames,
                    allocator="untrained" if method == "resadapt" else None,
                    budget=BudgetSpec(retention=retention),
                )
                pipeline = VideoPipeline(engine, config)
                rows = [measure(pipeline, videos, c, args.waves, args.new_tokens) for c in args.concurrency]
                vanilla = rows if method == "vanilla" else vanilla  # the per-pair engine runs first
                cells = " | ".join(
                    f"{rps:.2f} | {ttft * 1e3:.0f} | {rps / base:.2f}" for (rps, ttft), (base, _) in zip(rows, vanilla)
                )
                print(f"| {name} | {label} | {method} | {cells} |", flush=True)
            del engine, pipeline  # vLLM shuts the engine down when it is collected
            gc.collect()


if __name__ == "__main__":
    main()
