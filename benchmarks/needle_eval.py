"""Needle backbone accuracy: vanilla, FixedScale and the oracle allocation at the same R.

    .venv/bin/python benchmarks/needle_eval.py [--backbone results/needle/backbone-qwen25vl (or -qwen3vl)]
        [--data fixtures/needle/test.jsonl] [--limit 400] [--retention 0.25] [--frames 16]
        [--vanilla-frames 8]

Each row's own question (the query variant names a colour). `--frames`: frames sampled uniformly
(the product's frame selection); `--vanilla-frames N` adds vanilla at N frames, and with
`--match-vanilla-frames` the target R becomes the tokens of vanilla at N frames (the long split's
budget). Oracle: the sampled frames of the evidence pair at full size, the others at --oracle-rest (0.3),
projected to the target R by the same global-factor projection `method=resadapt` uses; without
the question: the oracle of a query video's first candidate instead of the one asked about.
Accuracy with its binomial standard error.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from resadapt_eval.backbones.qwen import ADAPTERS, family_of
from resadapt_eval.budget.plan import fixed_scale_for_retention, plan_from_scales, project_to_retention
from resadapt_eval.needle.data import SIZE
from resadapt_eval.video import decode_video


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="results/needle/backbone-qwen25vl")
    parser.add_argument("--data", default="fixtures/needle/test.jsonl")
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--retention", type=float, default=0.25)
    parser.add_argument("--frames", type=int, default=16, help="frames sampled uniformly from each video")
    parser.add_argument("--vanilla-frames", type=int, default=None, help="also run vanilla at this many frames")
    parser.add_argument(
        "--match-vanilla-frames", action="store_true", help="target R = tokens of vanilla at --vanilla-frames"
    )
    parser.add_argument(
        "--skip", default="", help="comma-separated rows to leave out (e.g. vanilla: slow at 128 frames)"
    )
    parser.add_argument("--oracle-rest", type=float, default=0.3, help="the oracle's scale off the evidence pair")
    args = parser.parse_args()
    adapter = ADAPTERS[family_of(args.backbone)].from_pretrained(args.backbone, dtype="float32")
    base = (SIZE, SIZE)
    rows = [json.loads(line) for line in open(args.data)][: args.limit]
    retention = args.retention
    if args.match_vanilla_frames:
        full = plan_from_scales(np.ones(args.frames), base, adapter.grid).visual_tokens
        retention = plan_from_scales(np.ones(args.vanilla_frames), base, adapter.grid).visual_tokens / full
    fixed = fixed_scale_for_retention(retention, args.frames, base, adapter.grid, 0.05, 1.0)
    names = ["vanilla", "fixed_scale", "oracle"] + (["oracle_first_candidate"] if "candidate_pairs" in rows[0] else [])
    names += [f"vanilla_{args.vanilla_frames}f"] if args.vanilla_frames else []
    names = [n for n in names if n not in args.skip.split(",")]
    correct, achieved = {n: [] for n in names}, {n: [] for n in names}
    for row in rows:
        prompt = adapter.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video", "video": "v"}, {"type": "text", "text": row["question"]}]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        video = decode_video(row["video_path"], args.frames)
        runs = {
            "vanilla": (video, np.ones(len(video.indices))),
            "fixed_scale": (video, np.full(len(video.indices), fixed)),
        }
        pairs = {"oracle": row["evidence_frames"]}
        if "candidate_pairs" in row:
            pairs["oracle_first_candidate"] = [2 * row["candidate_pairs"][0], 2 * row["candidate_pairs"][0] + 1]
        for name, frames in pairs.items():
            oracle = np.array([1.0 if i in frames else args.oracle_rest for i in video.indices])
            runs[name] = (video, project_to_retention(oracle, retention, base, adapter.grid, 0.05, 1.0))
        if args.vanilla_frames:
            short = decode_video(row["video_path"], args.vanilla_frames)
            runs[f"vanilla_{args.vanilla_frames}f"] = (short, np.ones(len(short.indices)))
        for name, (clip, scales) in runs.items():
            if name not in names:
                continue
            plan = plan_from_scales(scales, base, adapter.grid)
            text, _ = adapter.generate(adapter.build_inputs(prompt, clip, plan), max_new_tokens=2)
            correct[name].append(float(text.strip()[:1] == row["answer"]))
            achieved[name].append(plan.visual_tokens)
    full = plan_from_scales(np.ones(args.frames), base, adapter.grid).visual_tokens
    print(f"{'method':<24} {'tokens':>7} {'R':>6} {'accuracy':>9} {'stderr':>7}  (n={len(rows)}, {args.frames} frames)")
    for name, values in correct.items():
        p = float(np.mean(values))
        stderr = np.sqrt(p * (1 - p) / len(values))
        tokens = float(np.mean(achieved[name]))
        print(f"{name:<24} {tokens:>7.1f} {tokens / full:>6.3f} {100 * p:>8.1f}% {100 * stderr:>6.1f}")


if __name__ == "__main__":
    main()
