"""The resadapt front end per frame as T grows: before (one batch of all frames) and after (chunks), in one run.

    .venv/bin/python benchmarks/frontend_scaling.py [--frames 8 16 32 64 128] [--height 480 --width 640] [--threads 1]

One smoke video is decoded once (its 32 frames, resized once to --height x --width and repeated to
the largest T). For each T the untrained Allocator (minilm-effnet encoders, D=1024) scores the
first T frames through `AllocatorPolicy.raw_scales` with `frame_chunk=T` (before: one EfficientNet
batch of all frames, all of them converted to float at full resolution at once) and with
`frame_chunk=16` (after), the two taking turns; the max difference of their scales is printed. The
fixed-scale search for --retention is timed uncached (`fixed_scale_for_retention`) and as the
`fixed_scale` policy runs it now (cached per frames, base size and budget; a repeated request is a
cache hit). Medians over --repeats runs (one warm-up at the smallest T); the visual stage and the
search are per frame, text (one query per request, independent of T) and predict per request. The
ratio line is T=max / T=min of the per-frame times; the last lines run T=16 on 1 thread and on
torch's default thread count (--threads sets the table's).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from timing import median_seconds

from resadapt_eval.allocator import AllocatorPolicy, load_allocator
from resadapt_eval.allocator.encoders import FRAME_CHUNK
from resadapt_eval.budget.plan import QWEN25VL_GRID, fixed_scale_for_retention
from resadapt_eval.budget.planner import Planner
from resadapt_eval.budget.policies import BudgetSpec, fixed_scale
from resadapt_eval.fixtures import ensure_fixtures
from resadapt_eval.video import decode_video

REPO = Path(__file__).resolve().parents[1]
QUERY = "What colour is the moving square?"


def frames_of(path: Path, num_frames: int, height: int, width: int) -> np.ndarray:
    """uint8 (num_frames, height, width, 3): the video's frames, resized once, repeated in order."""
    decoded = torch.from_numpy(decode_video(path, 1 << 16).frames).permute(0, 3, 1, 2).float()
    resized = F.interpolate(decoded, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    resized = resized.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return np.ascontiguousarray(np.resize(resized, (num_frames, height, width, 3)))


def stage_medians(policies: list[AllocatorPolicy], frames: np.ndarray, repeats: int) -> list[tuple[np.ndarray, dict]]:
    """Per policy: the scales of `raw_scales` and its median stage seconds over `repeats` runs, the
    policies taking turns within each repeat (so a change in machine load hits all alike)."""
    runs = [[policy.raw_scales(frames, QUERY) for policy in policies] for _ in range(repeats)]
    return [
        (by_run[0][0], {key: statistics.median(run[1][key] for run in by_run) for key in by_run[0][1]})
        for by_run in zip(*runs)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--retention", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the num_threads model_arg)")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)

    fixtures = ensure_fixtures(REPO / "fixtures")
    video = frames_of(
        fixtures / "smoke_videoqa" / "videos" / "smoke_000.mp4", max(args.frames), args.height, args.width
    )
    allocator = load_allocator("untrained")
    spec = BudgetSpec(retention=args.retention)
    planner = Planner(QWEN25VL_GRID, spec)
    base_hw = planner.base_hw((args.height, args.width))
    print(
        f"front end per frame: untrained Allocator (minilm-effnet, D=1024), CPU, {torch.get_num_threads()} threads; "
        f"frames {args.height}x{args.width}, base {base_hw[0]}x{base_hw[1]} ({QWEN25VL_GRID.token_px} px tokens), "
        f"R={args.retention}; before: one batch of T frames, after: chunks of {FRAME_CHUNK}; ms, medians of "
        f"{args.repeats}"
    )
    header = (
        f"{'T':>5} | {'visual/frame':>12} {'after':>6} {'after/before':>12} | {'text/req':>8} {'after':>6} | "
        f"{'predict/req':>11} {'after':>6} | {'search/frame':>12} {'cached':>7} {'cached/uncached':>15}"
    )
    AllocatorPolicy(allocator).raw_scales(video[: min(args.frames)], QUERY)  # warm-up
    print(header)
    per_frame = {}
    for T in args.frames:
        frames = video[:T]
        policies = [AllocatorPolicy(allocator, frame_chunk=T), AllocatorPolicy(allocator, frame_chunk=FRAME_CHUNK)]
        (scales_before, before), (scales_after, after) = stage_medians(policies, frames, args.repeats)
        difference = np.abs(scales_before - scales_after).max()
        uncached = median_seconds(
            lambda: fixed_scale_for_retention(args.retention, T, base_hw, QWEN25VL_GRID, spec.s_min, spec.s_max),
            args.repeats,
        )
        cached = median_seconds(lambda: fixed_scale(T, base_hw, QWEN25VL_GRID, spec), args.repeats)
        visual = (before["allocator_visual_s"] / T, after["allocator_visual_s"] / T)
        search = (uncached / T, cached / T)
        per_frame[T] = visual + search
        print(
            f"{T:>5} | {1e3 * visual[0]:>12.1f} {1e3 * visual[1]:>6.1f} {visual[1] / visual[0]:>12.2f} | "
            f"{1e3 * before['allocator_text_s']:>8.1f} {1e3 * after['allocator_text_s']:>6.1f} | "
            f"{1e3 * before['allocator_predict_s']:>11.1f} {1e3 * after['allocator_predict_s']:>6.1f} | "
            f"{1e3 * search[0]:>12.4f} {1e3 * search[1]:>7.4f} {search[1] / search[0]:>15.4f}"
            f"   (scales: max |before - after| = {difference:.1e})"
        )
    lo, hi = min(args.frames), max(args.frames)
    ratio = [h / low for h, low in zip(per_frame[hi], per_frame[lo])]
    print(
        f"per-frame ratio T={hi}/T={lo}: visual before {ratio[0]:.2f}, after {ratio[1]:.2f}; "
        f"search uncached {ratio[2]:.2f}, cached {ratio[3]:.2f}"
    )
    for threads in sorted({1, default_threads}):  # the same request on 1 thread and on torch's default
        torch.set_num_threads(threads)
        ((_, seconds),) = stage_medians([AllocatorPolicy(allocator)], video[:FRAME_CHUNK], args.repeats)
        print(
            f"T={FRAME_CHUNK} on {threads} thread(s): text {1e3 * seconds['allocator_text_s']:.1f} ms, visual "
            f"{1e3 * seconds['allocator_visual_s'] / FRAME_CHUNK:.1f} ms/frame, "
            f"predict {1e3 * seconds['allocator_predict_s']:.1f} ms"
        )


if __name__ == "__main__":
    main()
