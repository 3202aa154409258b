"""Each token compressor's own work at a real model's size, beside the prefill it shortens.

    .venv/bin/python benchmarks/method_cost.py --backbone qwen25vl-7b --frames 128 --retention 0.25
    .venv/bin/python benchmarks/method_cost.py --frames 16 --retention 0.25 --input-side

For every registered method with a compressor (`Method.compress`; `--methods` to choose), on
synthetic merged tokens of the backbone's real shapes: the frames of a 1280x720 video planned as the
pipeline plans them (the default 768-token base size: 896x504 here, 576 tokens a pair), features of
the LLM's width, the vision tower's received attention and keys where the method reads them. Per
method and setting it prints:

- own_s: its `compress` call, median of `--repeats` after a warm-up (on CUDA, synchronised);
- extra_mb: peak memory above what was held before the call (CUDA: `max_memory_allocated`; CPU:
  the process's resident set sampled every 2 ms, so short peaks can be missed);
- gflops: its work as the run counts it (`measure.counting`);
- syncs: host-device synchronisations it asked for (`measure.syncs.counting_syncs`: a tensor read
  as a number, data-dependent output sizes such as `nonzero` or boolean-mask indexing, `.tolist()`,
  `.cpu()`): on CPU nothing waits, but each is a sync on a GPU;
- prefill_s: the vanilla LLM prefill at the same frames, estimated from its FLOPs
  (`estimates.row_flops`) at the matmul rate measured on this device (a 4096^3 float32 GEMM on CPU,
  bfloat16 on CUDA), and own/prefill, the method's cost as a share of it;
- kv_mb: the vanilla prefill's bfloat16 KV cache, and extra/kv.

`--input-side` adds decode, resize (exact and fast) and the Allocator (untrained, minilm-effnet)
for vanilla, fixed_scale and resadapt on a synthetic 1280x720 video of the same frame counts.

Not measured here yet (issue 40): the in-LLM ranking and merging, the decode-stage work, Python loop
iterations, and each reference's own syncs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from resadapt_eval.baselines.common import VisualTokens, kept_count
from resadapt_eval.compute.flops import TERA, load_dims
from resadapt_eval.compute.memory import kv_cache_bytes
from resadapt_eval.estimates import row_flops, row_plan
from resadapt_eval.measure.counting import counted_flops
from resadapt_eval.measure.syncs import counting_syncs
from resadapt_eval.methods import METHODS

SOURCE_HW = (720, 1280)  # a 720p video, (height, width) in pixels


@contextmanager
def peak_extra_bytes(device: torch.device):
    """The peak memory above the level at entry, in bytes (`result["bytes"]` after the block)."""
    result = {"bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["bytes"] = torch.cuda.max_memory_allocated(device) - before
        return
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    before, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        done.set()
        sampler.join()
        result["bytes"] = max(0, max(peak[0], rss()) - before)


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of a 4096^3 GEMM on `device` (float32 on CPU, bfloat16 on CUDA), median of 3."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(4096, 4096, device=device, dtype=dtype)
    times = []
    for _ in range(4):
        synchronize(device)
        t0 = time.perf_counter()
        a @ a
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * 4096**3 / statistics.median(times[1:])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_tokens(dims, grids, device: torch.device, seed: int = 0) -> VisualTokens:
    """Merged tokens of the planned `grids`: features of the LLM's width, received attention that
    sums to 1 per pair, and keys of the vision tower's head width."""
    g = torch.Generator().manual_seed(seed)
    sizes = [t * h * w for t, h, w in grids]
    n = sum(sizes)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    features = torch.randn(n, dims.vision.out_hidden, generator=g).to(device, dtype)
    attention = torch.rand(n, generator=g).to(device)
    head_dim = dims.vision.hidden // dims.vision.heads
    keys = torch.randn(n, head_dim, generator=g).to(device, dtype)
    return VisualTokens(features, sizes, [tuple(x) for x in grids], attention, keys)


def compressor_rows(args, dims, device, rate) -> list[dict]:
    rows = []
    names = (
        [m.strip() for m in args.methods.split(",")]
        if args.methods
        else [name for name, method in METHODS.items() if method.compress is not None]
    )
    for frames in args.frames:
        plan = row_plan(dims, "vanilla", frames, SOURCE_HW)
        vanilla, visual = row_flops(dims, "vanilla", frames, SOURCE_HW, None)
        prefill_s = (vanilla.llm_prefill + vanilla.llm_attention) / rate
        kv = kv_cache_bytes(dims.text, visual + 24, 0)
        tokens = synthetic_tokens(dims, plan.grids, device)
        for retention in args.retention:
            keep = kept_count(retention, len(tokens.features), len(tokens.pair_sizes))
            for name in names:
                compress = METHODS[name].compress

                def run():
                    out = compress(tokens, keep, 0)
                    synchronize(device)
                    return out

                run()  # warm-up
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - t0)
                with counting_syncs() as syncs, peak_extra_bytes(device) as extra:
                    _, flops = counted_flops(run)
                own = statistics.median(times)
                rows.append(
                    dict(
                        method=name,
                        frames=frames,
                        R=retention,
                        tokens=len(tokens.features),
                        keep=keep,
                        own_s=own,
                        extra_mb=extra["bytes"] / 2**20,
                        gflops=flops / 1e9,
                        syncs=syncs["n"],
                        prefill_s=prefill_s,
                        own_pct=100 * own / prefill_s,
                        kv_mb=kv / 2**20,
                        extra_pct=100 * extra["bytes"] / kv,
                    )
                )
                print(format_row(rows[-1]), flush=True)
    return rows


COLUMNS = (
    ("method", "{}"),
    ("frames", "{}"),
    ("R", "{:g}"),
    ("tokens", "{}"),
    ("keep", "{}"),
    ("own_s", "{:.3f}"),
    ("extra_mb", "{:.0f}"),
    ("gflops", "{:.1f}"),
    ("syncs", "{}"),
    ("prefill_s", "{:.1f}"),
    ("own_pct", "{:.2f}%"),
    ("kv_mb", "{:.0f}"),
    ("extra_pct", "{:.1f}%"),
)


def format_row(row: dict) -> str:
    return "| " + " | ".join(fmt.format(row[key]) for key, fmt in COLUMNS) + " |"


def input_side(args, dims, device) -> None:
    """Decode, resize and the Allocator for vanilla, fixed_scale and resadapt on a synthetic 720p video."""
    import av
    import numpy as np

    from resadapt_eval.allocator import AllocatorPolicy, load_allocator
    from resadapt_eval.backbones.layout import resize_frames
    from resadapt_eval.budget.plan import TokenGrid
    from resadapt_eval.budget.planner import Planner
    from resadapt_eval.budget.policies import BudgetSpec, fixed_scale
    from resadapt_eval.video import decode_video

    grid = TokenGrid(token_px=dims.token_px, temporal_patch=dims.vision.temporal_patch)
    planner = Planner(grid, BudgetSpec(retention=0.25))
    allocator = AllocatorPolicy(load_allocator("untrained", device=device))
    print(
        "\n| frames | decode_s | vanilla resize exact s | fixed_scale resize exact / fast s | resadapt allocator_s | "
        "resadapt resize exact / fast s | resadapt (fast resize + allocator) / exact resize |"
    )
    print("|---|---|---|---|---|---|---|")
    for frames in args.frames:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "video.mp4"
            with av.open(str(path), "w") as container:
                stream = container.add_stream("libx264", rate=8)
                stream.width, stream.height, stream.pix_fmt = 1280, 720, "yuv420p"
                rng = np.random.default_rng(0)
                base = rng.integers(0, 255, (720, 1280, 3), dtype=np.uint8)
                for t in range(frames):
                    frame = av.VideoFrame.from_ndarray(np.roll(base, 8 * t, axis=1), format="rgb24")
                    container.mux(stream.encode(frame))
                container.mux(stream.encode())
            t0 = time.perf_counter()
            video = decode_video(path, frames)
            decode_s = time.perf_counter() - t0
        base_hw = planner.base_hw(SOURCE_HW)

        def resize_all(plan, mode) -> float:
            t0 = time.perf_counter()
            for group, (h, w) in zip(plan.pair_frames, plan.pair_sizes):
                resize_frames(video.frames[list(group)], h, w, mode)
            return time.perf_counter() - t0

        vanilla = planner.plan([1.0] * frames, base_hw)
        fixed = planner.plan(fixed_scale(frames, base_hw, planner.grid, planner.spec), base_hw)
        t0 = time.perf_counter()
        raw, _ = allocator.raw_scales(video.frames, "What happens in the video?")
        allocator_s = time.perf_counter() - t0
        (scales,) = planner.fit([raw], [base_hw], 0.25)
        adapted = planner.plan(scales, base_hw)
        exact_r, fast_r = resize_all(adapted, "exact"), resize_all(adapted, "fast")
        print(
            f"| {frames} | {decode_s:.2f} | {resize_all(vanilla, 'exact'):.2f} | "
            f"{resize_all(fixed, 'exact'):.2f} / {resize_all(fixed, 'fast'):.2f} | {allocator_s:.2f} | "
            f"{exact_r:.2f} / {fast_r:.2f} | {(fast_r + allocator_s) / exact_r:.2f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="qwen25vl-7b", help="qwen25vl-7b or qwen3vl-8b (real widths)")
    parser.add_argument("--frames", type=lambda s: [int(f) for f in s.split(",")], default=[16, 32, 64, 128])
    parser.add_argument("--retention", type=lambda s: [float(r) for r in s.split(",")], default=[0.5, 0.25, 0.1])
    parser.add_argument("--methods", default=None, help="comma-separated compressors (default: every one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--input-side", action="store_true", help="also decode, resize and the Allocator")
    args = parser.parse_args()
    device = torch.device(args.device)
    dims = load_dims(args.backbone)
    rate = matmul_rate(device)
    print(
        f"{args.backbone} on {device} ({torch.get_num_threads()} threads), a {SOURCE_HW[1]}x{SOURCE_HW[0]} video; "
        f"matmul rate {rate / TERA:.3f} TFLOP/s; prefill estimated from its FLOPs at that rate"
    )
    print("| " + " | ".join(key for key, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    compressor_rows(args, dims, device, rate)
    if args.input_side:
        input_side(args, dims, device)


if __name__ == "__main__":
    main()
