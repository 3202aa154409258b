"""Every method side by side on the same inputs: visual tokens, prefill and generate time vs vanilla.

    .venv/bin/python benchmarks/baselines.py [--frames 8 32] [--retention 0.25] [--repeats 5]

For each backbone and T: one smoke video decoded once. Prefill = from decoded frames to the
first-token logits (resize, processor, vision encoder, compression where the method has one, one
LLM forward, pruned inside it for FastV / PyramidDrop, whose R is layer-averaged); generate = the
same through a greedy generate of --max-new-tokens tokens. Medians over --repeats runs after a
warm-up; ratios are to vanilla in the same run.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

import torch
from timing import median_seconds

from resadapt_eval.backbones.qwen import ADAPTERS, PrunedInputs
from resadapt_eval.budget.plan import base_size, plan_from_scales
from resadapt_eval.budget.policies import BudgetSpec, fixed_scale
from resadapt_eval.fixtures import ensure_fixtures
from resadapt_eval.methods import AFTER_MERGER, INSIDE_LLM, METHODS
from resadapt_eval.video import decode_video

REPO = Path(__file__).resolve().parents[1]
EARLY_STAGES = {"pyramiddrop": [1, 4, 8]}  # its default quarters cannot reach R=0.25 on 12 layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--retention", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    fixtures = ensure_fixtures(REPO / "fixtures")
    video_path = fixtures / "smoke_videoqa" / "videos" / "smoke_000.mp4"
    print(
        f"tiny random backbones on CPU ({torch.get_num_threads()} threads), target R={args.retention}, "
        f"{args.max_new_tokens} new tokens, medians of {args.repeats}"
    )
    print(
        f"{'backbone':<9} {'T':>3} {'method':<12} {'tokens':>6} {'R':>6} {'prefill ms':>10} {'gen ms':>7} "
        f"{'tokens/van':>10} {'prefill/van':>11} {'gen/van':>8}"
    )
    for name, cls in ADAPTERS.items():
        adapter = cls.from_pretrained(str(fixtures / name), dtype="float32")
        px = adapter.grid.token_px
        prompt = adapter.processor.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "video", "video": str(video_path)},
                        {"type": "text", "text": "What colour is the square?"},
                    ],
                }
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        for T in args.frames:
            video = decode_video(video_path, T)
            base = base_size(*video.frames.shape[1:3], adapter.grid, 4 * px * px, 768 * px * px)
            vanilla_plan = plan_from_scales([1.0] * len(video.indices), base, adapter.grid)
            spec = BudgetSpec(retention=args.retention, s_min=0.05, s_max=1.0)
            fixed_plan = plan_from_scales(fixed_scale(len(video.indices), base, adapter.grid, spec), base, adapter.grid)

            def plain(plan):
                return lambda: adapter.build_inputs(prompt, video, plan)

            def compressed(method):
                return lambda: adapter.build_compressed_inputs(
                    prompt,
                    video,
                    vanilla_plan,
                    METHODS[method].compress,
                    args.retention,
                    needs_attention=METHODS[method].needs_attention,
                )[0]

            def pruned(method):
                layers = EARLY_STAGES.get(method)
                return lambda: adapter.build_pruned_inputs(
                    adapter.build_inputs(prompt, video, vanilla_plan), METHODS[method].prune, args.retention, layers
                )

            builders = {
                "vanilla": plain(vanilla_plan),
                "fixed_scale": plain(fixed_plan),
                **{name: compressed(name) for name, method in METHODS.items() if method.stage == AFTER_MERGER},
                **{name: pruned(name) for name, method in METHODS.items() if method.stage == INSIDE_LLM},
            }
            rows = {}
            for method, build in builders.items():

                def prefill():
                    inputs = build()
                    attached = inputs.pruner.attached() if isinstance(inputs, PrunedInputs) else nullcontext()
                    adapter.model.model.rope_deltas = None
                    with torch.inference_mode(), attached:
                        adapter.model(**(inputs.inputs if isinstance(inputs, PrunedInputs) else inputs))

                def generate():
                    adapter.generate_batch([build()], [dict(max_new_tokens=args.max_new_tokens)])

                inputs = build()
                if isinstance(inputs, PrunedInputs):  # layer-averaged visual tokens
                    tokens = sum(inputs.pruner.layer_tokens) / len(inputs.pruner.layer_tokens)
                else:
                    tokens = int((inputs["mm_token_type_ids"] == 2).sum())
                rows[method] = (tokens, median_seconds(prefill, args.repeats), median_seconds(generate, args.repeats))
            van_tokens, van_prefill, van_gen = rows["vanilla"]
            for method, (tokens, pre, gen) in rows.items():
                print(
                    f"{name:<9} {T:>3} {method:<12} {tokens:>6.0f} {tokens / vanilla_plan.visual_tokens:>6.3f} "
                    f"{pre * 1000:>10.1f} {gen * 1000:>7.1f} "
                    f"{tokens / van_tokens:>10.3f} {pre / van_prefill:>11.2f} {gen / van_gen:>8.2f}"
                )


if __name__ == "__main__":
    main()
