"""Every method's own work at a real model's size, beside the prefill it shortens.

    .venv/bin/python benchmarks/method_cost.py --backbone qwen25vl-7b --frames 128 --retention 0.25
    .venv/bin/python benchmarks/method_cost.py --frames 16 --retention 0.25 --input-side

On synthetic tensors of the backbone's real shapes, for the frames of a 1280x720 video planned as the
pipeline plans them (`estimates.row_plan`: the default 768-token base size, the method's own token
budget), each method's work without the backbone:
- compress: a compressor's `compress` call (`Method.compress`) on merged tokens of the LLM's width,
  with the vision tower's received attention and keys where it reads them, keeping the tokens its
  token budget lets enter the LLM;
- in-LLM: the ranking and pruning of every stage of its schedule (FastV, PyramidDrop, the second
  stages of PruneVid and HoliTom), through the same `LayerPruner` hooks a run uses, on one decoder
  layer of the real width (random weights) and hidden states of the real prompt length;
- decode step: DyCoke's per-step ranking and selection (`DecodePruner`) over the prompt's cached keys;
- tower: a method's work between vision-tower blocks (Qwen3-VL), on one vision block's attention at the
  real width (random weights) and hidden states of every patch: iLLaVA's first merge (the block's
  attention recomputed, the units merged; `TowerReducer`), IPCV's pruning (the change norms, the kept
  patches, the neighbour search) and one restoration (`TowerPruner`).

Per method, stage and setting it prints:
- own_s: the median of `--repeats` after a warm-up (on CUDA, synchronised; a first call above 10 s
  is timed as it is);
- extra_mb: peak memory above what was held before the call (CUDA: `max_memory_allocated`; CPU:
  the process's resident set sampled every 2 ms, so short peaks can be missed);
- gflops: its work as the run counts it (`measure.counting`);
- syncs: host-device synchronisations it asked for (`measure.syncs.counting_syncs`: a tensor read
  as a number, data-dependent output sizes such as `nonzero` or boolean-mask indexing, `.tolist()`,
  `.cpu()`): on CPU nothing waits, but each is a sync on a GPU; on this CPU the count includes
  bookkeeping on tensors meant to stay on the CPU (the in-LLM pruner's text positions, DyCoke's
  selection), which on a GPU is no sync;
- loops: Python loop iterations in the package's own code during the call (backward jumps of its
  bytecode, comprehensions included): an upper bound on the iterations touching tensors;
  gflops, syncs, extra_mb and loops come from one more call, untimed (the opcode trace slows it);
- prefill_s: the vanilla LLM prefill at the same frames, estimated from its FLOPs
  (`estimates.row_flops`) at the matmul rate measured on this device (a 4096^3 float32 GEMM on CPU,
  bfloat16 on CUDA), and own/prefill, the method's cost as a share of it;
- kv_mb: the vanilla prefill's bfloat16 KV cache, and extra/kv.

`--input-side` adds (`--only-input-side`: runs only) decode, resize and the Allocator (untrained,
minilm-effnet) for vanilla, fixed_scale and resadapt on a synthetic 1280x720 video of the same frame
counts, on the device: each resize exact and fast (`resize_pairs`, pairs of one size in one batch),
the Allocator with its coarse frames exact and fast, and the fast resize's pixel difference.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

import resadapt_eval
from resadapt_eval.backbones.decode_pruning import DecodePruner
from resadapt_eval.backbones.layer_pruning import LayerPruner
from resadapt_eval.baselines.common import VisualTokens
from resadapt_eval.budget.plan import InfeasibleBudget
from resadapt_eval.compute.configs import KNOWN_CONFIGS
from resadapt_eval.compute.flops import TERA, load_dims
from resadapt_eval.compute.memory import kv_cache_bytes
from resadapt_eval.estimates import row_flops, row_plan
from resadapt_eval.measure.counting import counted_flops
from resadapt_eval.measure.syncs import counting_syncs
from resadapt_eval.methods import METHODS

SOURCE_HW = (720, 1280)  # a 720p video, (height, width) in pixels
TEXT_BEFORE, TEXT_AFTER = 14, 10  # prompt tokens before and after the video (the estimates' 24 text tokens)
PACKAGE = str(Path(resadapt_eval.__file__).parent)
LONG_CALL_S = 10.0  # a first call this long is timed as it is (no separate warm-up)


@contextmanager
def counting_loop_iterations():
    """Backward bytecode jumps (Python loop and comprehension iterations) in the package's own code
    during the block: `counts["n"]` after it. Traces every opcode: slow, so run once, untimed."""
    counts = {"n": 0}

    def calls(frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        frame.f_trace_opcodes = True
        last = [frame.f_lasti]

        def opcodes(frame, event, arg):
            if event == "opcode":
                if frame.f_lasti < last[0]:
                    counts["n"] += 1
                last[0] = frame.f_lasti
            return opcodes

        return opcodes

    saved = sys.gettrace()
    sys.settrace(calls)
    try:
        yield counts
    finally:
        sys.settrace(saved)


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


QUERY_TOKENS = 24  # a typical video question's tokens


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_tokens(dims, grids, device: torch.device, seed: int = 0) -> VisualTokens:
    """Merged tokens of the planned `grids`: features of the LLM's width, received attention that
    sums to 1 per pair, keys of the vision tower's head width, and a question of QUERY_TOKENS tokens
    of the LLM's width (for a compressor that reads it)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [t * h * w for t, h, w in grids]
    n = sum(sizes)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    features = torch.randn(n, dims.vision.out_hidden, generator=g).to(device, dtype)
    attention = torch.rand(n, generator=g).to(device)
    head_dim = dims.vision.hidden // dims.vision.heads
    keys = torch.randn(n, head_dim, generator=g).to(device, dtype)
    query = torch.randn(QUERY_TOKENS, dims.vision.out_hidden, generator=g).to(device, dtype)
    return VisualTokens(features, sizes, [tuple(x) for x in grids], attention, keys, query)


def measure(name: str, work: str, setting: dict, run, device, prefill_s: float, kv: int, repeats: int) -> dict:
    """One row: `run()` (a fresh call of the method's work each time) timed, the median of `repeats`
    after a warm-up (a first call above LONG_CALL_S is its own warm-up), then run once more counted:
    FLOPs, host syncs, peak extra memory and Python loop iterations."""
    times = []
    synchronize(device)
    t0 = time.perf_counter()
    run()
    synchronize(device)
    first = time.perf_counter() - t0
    if first > LONG_CALL_S:
        times.append(first)
    while len(times) < repeats:
        synchronize(device)
        t0 = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    with counting_syncs() as syncs, peak_extra_bytes(device) as extra, counting_loop_iterations() as loops:
        _, flops = counted_flops(run)
    own = statistics.median(times)
    return dict(
        method=name,
        work=work,
        **setting,
        own_s=own,
        extra_mb=extra["bytes"] / 2**20,
        gflops=flops / 1e9,
        syncs=syncs["n"],
        loops=loops["n"],
        prefill_s=prefill_s,
        own_pct=100 * own / prefill_s,
        kv_mb=kv / 2**20,
        extra_pct=100 * extra["bytes"] / kv,
    )


def decoder_layer(backbone: str, device: torch.device, dtype: torch.dtype):
    """One decoder layer of `backbone`'s LLM at its real width (random weights, SDPA) and its rotary
    embedding module."""
    published = KNOWN_CONFIGS[backbone]
    if published["model_type"] == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLDecoderLayer as Layer
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding as Rotary
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer as Layer
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary
    config = Config(**published["text_config"])
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return Layer(config, 0).to(dtype).eval(), Rotary(config)


def in_llm_run(layer, rotary, stages, visual: int, num_layers: int, device, dtype):
    """A function running `stages` of a `LayerPruner` as the decoder layers' hooks do in a prefill of
    `visual` tokens between TEXT_BEFORE and TEXT_AFTER text tokens: the ranking in the layer before
    (or the stage's own input), then the stage layer's input pruned, each on the tokens left (after the
    first layer's input hook, where SparseVLM chooses its raters)."""
    length = TEXT_BEFORE + visual + TEXT_AFTER
    hidden = torch.randn(1, length, layer.hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    positions = torch.arange(length, device=device).expand(3, 1, length)
    full = rotary(hidden, positions)
    layers = SimpleNamespace(layers=[layer] * num_layers, norm=layer.input_layernorm)  # norm: a stand-in final norm
    visual_positions = torch.arange(TEXT_BEFORE, TEXT_BEFORE + visual, device=device)

    @torch.inference_mode()
    def run():
        pruner = LayerPruner(layers, list(stages), visual_positions)
        with pruner.attached():
            states, cos_sin = hidden, full
            pruner._layer_input(0)(layer, (states,), {"position_embeddings": full})  # SparseVLM's raters, at the input
            for stage in stages:
                pruner._ranker(stage)(layer.self_attn, (states,), {"position_embeddings": cos_sin})
                (states, *_), kwargs = pruner._layer_input(stage.layer)(layer, (states,), {"position_embeddings": full})
                cos_sin = kwargs["position_embeddings"]
        return pruner

    return run


def decode_step_run(layer, rotary, stage, visual: int, num_layers: int, device, dtype):
    """A function running one re-selecting decoding step of a `DecodePruner` at `stage` over the
    cached keys of a prompt of `visual` tokens between TEXT_BEFORE and TEXT_AFTER text tokens."""
    length = TEXT_BEFORE + visual + TEXT_AFTER + 1  # the prompt and this step's token
    attention = layer.self_attn
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, attention.config.num_key_value_heads, length, attention.head_dim, generator=g)
    keys = keys.to(device, dtype)
    step = torch.randn(1, 1, layer.hidden_size, generator=g).to(device, dtype)
    cos_sin = rotary(step, torch.full((3, 1, 1), length - 1, device=device))
    visual_positions = torch.arange(TEXT_BEFORE, TEXT_BEFORE + visual, device=device)
    layers = SimpleNamespace(layers=[layer] * num_layers)

    @torch.inference_mode()
    def run():
        pruner = DecodePruner(layers, stage, visual_positions)
        pruner.cache.layers = [SimpleNamespace(keys=keys)] * stage.layer  # what the prefill cached
        with pruner.attached():
            pruner.query = (attention, step, cos_sin)  # the layer before the stage, this step
            pruner._select(layer, (), {})
        return pruner

    return run


def vision_block_attention(backbone: str, device: torch.device, dtype: torch.dtype):
    """One vision block's attention of `backbone`'s tower at its real width (random weights)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention

    config = Qwen3VLVisionConfig(**KNOWN_CONFIGS[backbone]["vision_config"])
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return Qwen3VLVisionAttention(config).to(dtype).eval()


def tower_run(method, budget, dims, attention, device, dtype):
    """A function running `method`'s work between vision blocks as the tower's hooks do, on hidden
    states of every patch of the planned pairs (`budget.tower`), at the first block it acts after."""
    from resadapt_eval.backbones.qwen import ADAPTERS
    from resadapt_eval.backbones.tower_reduction import TowerPruner, TowerReducer

    vision, tower = dims.vision, budget.tower
    unit, segments = vision.merge**2, list(tower.blocks[0])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(sum(segments), vision.hidden, generator=g).to(device, dtype)
    head = vision.hidden // vision.heads
    rotary = torch.randn(sum(segments), head, generator=g).to(device, dtype)
    cu_seqlens = torch.tensor([0, *segments], device=device).cumsum(0).to(torch.int32)
    visual = SimpleNamespace(
        blocks=[None] * vision.depth,
        spatial_merge_size=vision.merge,
        deepstack_visual_indexes=list(vision.deepstack_taps),
    )
    if method.tower_merge is not None:
        merging_block = next(b for b in range(len(tower.blocks) - 1) if tower.blocks[b + 1] != tower.blocks[b])
        after = [n // unit for n in tower.blocks[merging_block + 1]]

        def run():
            rotate, merge = ADAPTERS["qwen3vl"].vision_rotary, method.tower_merge.merge
            reducer = TowerReducer(visual, {merging_block: after}, [n // unit for n in segments], rotate, merge,
                                   lambda fn: fn)  # fmt: skip
            reducer.origin = torch.arange(sum(segments) // unit, device=device)
            reducer.sizes = torch.ones_like(reducer.origin)
            reducer._captured = dict(module=attention, hidden_states=hidden, cu_seqlens=cu_seqlens,
                                     position_embeddings=(rotary.cos(), rotary.sin()))  # fmt: skip
            return reducer.work(merging_block, hidden)

        return run
    keeps = list(tower.blocks[-1])
    previous = hidden + torch.randn(hidden.shape, generator=g).to(device, dtype)

    def run():
        pruner = TowerPruner(visual, method.tower_prune, segments, keeps, lambda fn: fn)
        pruner._previous = previous
        pruner.work(hidden, dict(cu_seqlens=cu_seqlens, position_embeddings=(rotary.cos(), rotary.sin())))
        return pruner.restored(hidden[pruner._state["kept"]])

    return run


def method_rows(args, dims, device, rate) -> list[dict]:
    family = "qwen25vl" if dims.model_type == "qwen2_5_vl" else "qwen3vl"
    names = (
        [m.strip() for m in args.methods.split(",")]
        if args.methods
        else [
            n
            for n, m in METHODS.items()
            if (m.compress is not None or m.prune is not None or m.tower_merge is not None)
            and family in m.kind.families
        ]
    )
    needs_layer = any(METHODS[n].prune is not None or METHODS[n].decode_prune is not None for n in names)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer, rotary = decoder_layer(args.backbone, device, dtype) if needs_layer else (None, None)
    in_tower = any(METHODS[n].tower_merge is not None or METHODS[n].tower_prune is not None for n in names)
    attention = vision_block_attention(args.backbone, device, dtype) if in_tower else None
    rows = []
    for frames in args.frames:
        vanilla_plan = row_plan(dims, "vanilla", frames, SOURCE_HW)
        vanilla, visual = row_flops(dims, "vanilla", frames, SOURCE_HW, None)
        prefill_s = (vanilla.llm_prefill + vanilla.llm_attention) / rate
        kv = kv_cache_bytes(dims.text, visual + TEXT_BEFORE + TEXT_AFTER, 0)
        tokens = synthetic_tokens(dims, vanilla_plan.grids, device)
        for retention in args.retention:
            for name in names:
                method = METHODS[name]
                used = retention
                try:
                    budget = row_plan(dims, name, frames, SOURCE_HW, retention).budget
                except InfeasibleBudget as exc:  # PyramidDrop's default stages stop just above 0.25
                    used = math.ceil(exc.floor * 20) / 20
                    print(f"{name} cannot reach R = {retention} (its floor: {exc.floor:.4f}); run at R = {used}")
                    budget = row_plan(dims, name, frames, SOURCE_HW, used).budget
                setting = dict(frames=frames, R=used, tokens=len(tokens.features), entering=budget.entering)
                measured = []
                if method.compress is not None:

                    def compress(compress=method.compress, keep=budget.entering):
                        return compress(tokens, keep, 0)

                    measured.append(("compress", compress))
                if budget.stages:
                    run = in_llm_run(layer, rotary, budget.stages, budget.entering, dims.text.layers, device, dtype)
                    measured.append(
                        (f"in-LLM ({len(budget.stages)} stage{'s' if len(budget.stages) > 1 else ''})", run)
                    )
                if budget.tower is not None:
                    measured.append(("tower", tower_run(method, budget, dims, attention, device, dtype)))
                if budget.decode_stage is not None:
                    step = decode_step_run(
                        layer, rotary, budget.decode_stage, budget.entering, dims.text.layers, device, dtype
                    )
                    measured.append(("decode step", step))
                for work, run in measured:
                    rows.append(measure(name, work, setting, run, device, prefill_s, kv, args.repeats))
                    print(format_row(rows[-1]), flush=True)
    return rows


COLUMNS = (
    ("method", "{}"),
    ("work", "{}"),
    ("frames", "{}"),
    ("R", "{:g}"),
    ("tokens", "{}"),
    ("entering", "{}"),
    ("own_s", "{:.3f}"),
    ("extra_mb", "{:.0f}"),
    ("gflops", "{:.1f}"),
    ("syncs", "{}"),
    ("loops", "{}"),
    ("prefill_s", "{:.1f}"),
    ("own_pct", "{:.2f}%"),
    ("kv_mb", "{:.0f}"),
    ("extra_pct", "{:.1f}%"),
)


def format_row(row: dict) -> str:
    return "| " + " | ".join(fmt.format(row[key]) for key, fmt in COLUMNS) + " |"


def input_side(args, dims, device) -> None:
    """Decode, resize and the Allocator for vanilla, fixed_scale and resadapt on a synthetic 720p
    video, each resize and the Allocator's coarse frames exact and fast, on `device`."""
    import av
    import numpy as np

    from resadapt_eval.allocator import AllocatorPolicy, load_allocator
    from resadapt_eval.backbones.layout import resize_pairs
    from resadapt_eval.budget.plan import TokenGrid
    from resadapt_eval.budget.planner import Planner
    from resadapt_eval.budget.policies import BudgetSpec, fixed_scale
    from resadapt_eval.video import decode_video

    grid = TokenGrid(token_px=dims.token_px, temporal_patch=dims.vision.temporal_patch)
    planner = Planner(grid, BudgetSpec(retention=0.25))
    allocator = load_allocator("untrained", device=device)
    policies = {mode: AllocatorPolicy(allocator, resize=mode) for mode in ("exact", "fast")}
    query = "What happens in the video?"
    print(
        "\n| frames | decode_s | vanilla resize exact / fast s | fixed_scale resize exact / fast s | "
        "resadapt Allocator exact / fast s | resadapt resize exact / fast s | "
        "resadapt fast (resize + Allocator) / exact resize | fast resize's pixels vs exact: max / mean levels |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for frames in args.frames:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "video.mp4"
            with av.open(str(path), "w") as container:
                stream = container.add_stream("libx264", rate=8)
                stream.width, stream.height, stream.pix_fmt = 1280, 720, "yuv420p"
                rng = np.random.default_rng(0)
                x, y = np.linspace(0, 1, 1280)[None, :, None], np.linspace(0, 1, 720)[:, None, None]
                base = (127 + 60 * np.sin(20 * x + 7 * y) + rng.normal(0, 20, (720, 1280, 3))).clip(0, 255)
                base = base.astype(np.uint8)
                for t in range(frames):
                    frame = av.VideoFrame.from_ndarray(np.roll(base, 8 * t, axis=1), format="rgb24")
                    container.mux(stream.encode(frame))
                container.mux(stream.encode())
            t0 = time.perf_counter()
            video = decode_video(path, frames)
            decode_s = time.perf_counter() - t0
        base_hw = planner.base_hw(SOURCE_HW)

        def resized(plan, mode) -> tuple[float, list[torch.Tensor]]:
            synchronize(device)
            t0 = time.perf_counter()
            pairs = resize_pairs(video, plan, mode, device)
            return time.perf_counter() - t0, pairs

        def allocated(mode) -> tuple[float, np.ndarray]:
            policies[mode].raw_scales(video.frames[:2], query)  # warm-up
            t0 = time.perf_counter()
            raw, _ = policies[mode].raw_scales(video.frames, query)
            return time.perf_counter() - t0, raw

        vanilla = planner.plan([1.0] * frames, base_hw)
        fixed = planner.plan(fixed_scale(frames, base_hw, planner.grid, planner.spec), base_hw)
        (allocator_exact, raw), (allocator_fast, _) = allocated("exact"), allocated("fast")
        (scales,) = planner.fit([raw], [base_hw], 0.25)
        adapted = planner.plan(scales, base_hw)
        (exact_s, exact), (fast_s, fast) = resized(adapted, "exact"), resized(adapted, "fast")
        levels = torch.cat([(a.int() - b.int()).abs().flatten() for a, b in zip(exact, fast)])
        print(
            f"| {frames} | {decode_s:.2f} | {resized(vanilla, 'exact')[0]:.2f} / {resized(vanilla, 'fast')[0]:.2f} | "
            f"{resized(fixed, 'exact')[0]:.2f} / {resized(fixed, 'fast')[0]:.2f} | "
            f"{allocator_exact:.2f} / {allocator_fast:.2f} | {exact_s:.2f} / {fast_s:.2f} | "
            f"{(fast_s + allocator_fast) / exact_s:.2f} | {int(levels.max())} / {float(levels.float().mean()):.2f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="qwen25vl-7b", help="qwen25vl-7b or qwen3vl-8b (real widths)")
    parser.add_argument("--frames", type=lambda s: [int(f) for f in s.split(",")], default=[16, 32, 64, 128])
    parser.add_argument("--retention", type=lambda s: [float(r) for r in s.split(",")], default=[0.5, 0.25, 0.1])
    parser.add_argument(
        "--methods", default=None, help="comma-separated methods (default: every one with its own work)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--input-side", action="store_true", help="also decode, resize and the Allocator")
    parser.add_argument("--only-input-side", action="store_true", help="decode, resize and the Allocator alone")
    args = parser.parse_args()
    device = torch.device(args.device)
    dims = load_dims(args.backbone)
    rate = matmul_rate(device)
    print(
        f"{args.backbone} on {device} ({torch.get_num_threads()} threads), a {SOURCE_HW[1]}x{SOURCE_HW[0]} video; "
        f"matmul rate {rate / TERA:.3f} TFLOP/s; prefill estimated from its FLOPs at that rate"
    )
    if not args.only_input_side:
        print("| " + " | ".join(key for key, _ in COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
        method_rows(args, dims, device, rate)
    if args.input_side or args.only_input_side:
        input_side(args, dims, device)


if __name__ == "__main__":
    main()
