"""Needle backbone accuracy: vanilla, FixedScale and the oracle allocation at the same R.

    .venv/bin/python benchmarks/needle_eval.py [--backbone results/needle/backbone-qwen25vl (or -qwen3vl)]
        [--data fixtures/needle/test.jsonl] [--limit 400] [--retention 0.25]

Oracle: the evidence pair at full size, the other pairs at 0.3, projected to the target R by the
same global-factor projection `method=resadapt` uses. Accuracy with its binomial standard error.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from resadapt_eval.backbones.qwen import ADAPTERS, family_of
from resadapt_eval.budget.plan import fixed_scale_for_retention, plan_from_scales, project_to_retention
from resadapt_eval.needle.data import FRAMES, QUESTION, SIZE
from resadapt_eval.video import decode_video


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="results/needle/backbone-qwen25vl")
    parser.add_argument("--data", default="fixtures/needle/test.jsonl")
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--retention", type=float, default=0.25)
    args = parser.parse_args()
    adapter = ADAPTERS[family_of(args.backbone)].from_pretrained(args.backbone, dtype="float32")
    prompt = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video", "video": "v"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    rows = [json.loads(line) for line in open(args.data)][: args.limit]
    base = (SIZE, SIZE)
    fixed = np.full(FRAMES, fixed_scale_for_retention(args.retention, FRAMES, base, adapter.grid, 0.05, 1.0))
    correct, retention = (
        {"vanilla": [], "fixed_scale": [], "oracle": []},
        {"vanilla": [], "fixed_scale": [], "oracle": []},
    )
    for row in rows:
        video = decode_video(row["video_path"], FRAMES)
        oracle = np.full(FRAMES, 0.3)
        oracle[row["evidence_frames"]] = 1.0
        oracle = project_to_retention(oracle, args.retention, base, adapter.grid, 0.05, 1.0)
        for name, scales in (("vanilla", np.ones(FRAMES)), ("fixed_scale", fixed), ("oracle", oracle)):
            plan = plan_from_scales(scales, base, adapter.grid)
            text, _ = adapter.generate(adapter.build_inputs(prompt, video, plan), max_new_tokens=2)
            correct[name].append(float(text.strip()[:1] == row["answer"]))
            retention[name].append(plan.retention)
    print(f"{'method':<12} {'R':>6} {'accuracy':>9} {'stderr':>7}  (n={len(rows)})")
    for name, values in correct.items():
        p = float(np.mean(values))
        stderr = np.sqrt(p * (1 - p) / len(values))
        print(f"{name:<12} {np.mean(retention[name]):>6.3f} {100 * p:>8.1f}% {100 * stderr:>6.1f}")


if __name__ == "__main__":
    main()
