"""Allocator front-end time vs backbone prefill and generate time, side by side on the same inputs.

    .venv/bin/python benchmarks/allocator_overhead.py [--backbone qwen25vl] [--frames 8 16 32]

For each T: one smoke video decoded once; the Allocator (minilm-effnet encoders, the untrained
untrained weights, D=1024) predicts and projects scales to --retention; then the backbone's prefill
(one forward pass) and a full greedy generate run on the ResAdapt plan and on the vanilla plan.
Medians over --repeats runs after one warm-up. Ratios are to vanilla prefill / vanilla generate.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="qwen25vl", choices=sorted(ADAPTERS))
    parser.add_argument("--frames", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--retention", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    fixtures = ensure_fixtures(REPO / "fixtures")
    adapter = ADAPTERS[args.backbone].from_pretrained(str(fixtures / args.backbone), dtype="float32")
    spec = BudgetSpec(retention=args.retention)
    video_path = fixtures / "smoke_videoqa" / "videos" / "smoke_000.mp4"
    query = "What colour is the moving square?"
    prompt = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video", "video": str(video_path)}, {"type": "text", "text": query}]}],
        tokenize=False,
        add_generation_prompt=True,
    )

    header = (
        f"{'T':>3} {'R':>6} {'alloc ms':>9} {'text':>6} {'visual':>7} {'predict':>8} {'apply':>6} "
        f"{'prefill ms':>10} {'van prefill':>11} {'gen ms':>7} {'van gen':>8} "
        f"{'alloc/van prefill':>17} {'alloc/van gen':>13} {'E2E/van gen':>11}"
    )
    print(
        f"backbone={args.backbone} (tiny random, CPU, {torch.get_num_threads()} threads), "
        f"allocator=untrained minilm-effnet D=1024, target R={args.retention}"
    )
    print(header)
    for T in args.frames:
        request = Request(prompt, video=str(video_path), query=query)
        config = dict(max_num_frames=T)
        resadapt = VideoPipeline(
            adapter, VideoPipelineConfig(method="resadapt", allocator="untrained", budget=spec, **config)
        )
        vanilla = VideoPipeline(adapter, VideoPipelineConfig(method="vanilla", **config))
        decoded = resadapt.decode(request)
        stage = {}

        def allocate():  # the pipeline's stages after decoding: Allocator, plan (projection), resize + inputs
            (scores,) = resadapt.score([request], {0: decoded}, {}).values()
            planned = resadapt.plan(decoded, scores)
            built = resadapt.build(request, decoded, planned)
            stage.update(
                allocator_text_s=scores.text_s,
                allocator_visual_s=scores.visual_s,
                scale_apply_s=built.resize_s,
                allocator_predict_s=scores.predict_s + planned.projection_s,
                plan=planned.plans[0],
                inputs=built.request,
            )

        alloc_s = median_seconds(allocate, args.repeats)
        (vanilla_scores,) = vanilla.score([request], {0: decoded}, {}).values()
        vanilla_inputs = vanilla.build(request, decoded, vanilla.plan(decoded, vanilla_scores)).request

        def prefill(inputs):
            def run():
                adapter.model.model.rope_deltas = None
                with torch.inference_mode():
                    adapter.model(**inputs)

            return run

        def generate(inputs):
            return lambda: adapter.generate(inputs, max_new_tokens=args.max_new_tokens)

        prefill_s = median_seconds(prefill(stage["inputs"]), args.repeats)
        van_prefill_s = median_seconds(prefill(vanilla_inputs), args.repeats)
        gen_s = median_seconds(generate(stage["inputs"]), args.repeats)
        van_gen_s = median_seconds(generate(vanilla_inputs), args.repeats)
        ms = 1000.0
        print(
            f"{T:>3} {stage['plan'].retention:>6.3f} {alloc_s * ms:>9.1f} {stage['allocator_text_s'] * ms:>6.1f} "
            f"{stage['allocator_visual_s'] * ms:>7.1f} {stage['allocator_predict_s'] * ms:>8.1f} "
            f"{stage['scale_apply_s'] * ms:>6.1f} {prefill_s * ms:>10.1f} {van_prefill_s * ms:>11.1f} "
            f"{gen_s * ms:>7.1f} {van_gen_s * ms:>8.1f} {alloc_s / van_prefill_s:>17.2f} "
            f"{alloc_s / van_gen_s:>13.2f} {(alloc_s + gen_s) / van_gen_s:>11.2f}"
        )


if __name__ == "__main__":
    main()
