"""Every HF method on Qwen2.5-VL-7B and Qwen3-VL-8B built from their published configs with random
bfloat16 weights (nothing downloaded), checked and timed against vanilla in the same run.

On a CUDA device the models have their full depth and are built on the GPU (`fixtures.build_real_width`);
every method runs at 16 / 32 / 64 / 128 frames of a synthetic 1280x720 video, with SDPA and, when
flash_attn is installed, FlashAttention 2. On CPU the reduced-depth real-width models
(`fixtures.REDUCED_DEPTH`, written once under --checkpoints and loaded as `pretrained=` would load
them) run at 8 frames, one intra-op thread.

Each request goes through `VideoPipeline` in process, as the lmms-eval classes run it. Checked per
record: no error; R within 0.01 below its target (1.0 for vanilla); the visual tokens the method
reports (grids, kept tokens, per-layer counts); FLOPs parts summing to the total and, where
`resadapt-eval flops` prints the method's row from configs alone, equal to that row. A method that
prunes only inside the LLM and cannot reach --retention on this LLM (the layers before its first
default stage see every token: PyramidDrop's default stages stop just above 0.25) runs at the next
0.05 above its floor; the table says so. Measured against vanilla at the same frame count: vision
tower, the method's own work (`compress_s` + `rank_s`), prefill (the LLM's prefill alone: `prefill_s`),
decode (every token after the first), end to end (the pipeline's whole request: decoding the video, planning,
resizing, any compressor, generation) and peak memory (CUDA: allocated during the request; CPU: the
process's peak RSS so far). First, the frames resized on the device (`resize_frames(device=...)`)
against the same frames resized on the CPU: the exact path must agree within one uint8 level.

    python benchmarks/gpu_check.py                       # CUDA: writes results/gpu/<gpu-name>.md
    python benchmarks/gpu_check.py --device cpu          # the reduced-depth models at 8 frames
    python benchmarks/gpu_check.py --frames 16 --methods vanilla,fixed_scale,fastv --attn sdpa

Writes <out>/<device-name>.md (the tables, then every failure) and <out>/<device-name>.jsonl (every
timed record); exits 1 when any run failed or any check did not hold, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from resadapt_eval.backbones.layout import RESIZES, resize_frames
from resadapt_eval.backbones.qwen import ADAPTERS
from resadapt_eval.budget.plan import InfeasibleBudget
from resadapt_eval.compute.flops import dims_from_config
from resadapt_eval.estimates import row_flops
from resadapt_eval.fixtures import REAL_WIDTH, REDUCED_DEPTH, build_real_width, ensure_real_width
from resadapt_eval.measure.clock import peak_memory_mb, reset_peak_memory
from resadapt_eval.methods import AFTER_MERGER, BEFORE_ENCODER, INSIDE_LLM, METHODS, NO_RETENTION
from resadapt_eval.pipeline import FLOOR_PROBE_TOKENS, Request, VideoPipeline
from resadapt_eval.profile import synthetic_video
from resadapt_eval.report.latency import latency_rows, to_markdown
from resadapt_eval.runspec import config_from_model_args
from resadapt_eval.video import decode_video

REPO = Path(__file__).resolve().parents[1]
HF_METHODS = [name for name, method in METHODS.items() if method.hf]
QUERY = "What happens in this video?"
PARTS = ("vision", "vision_attention", "llm_prefill", "llm_attention", "decode", "method", "allocator")
DEFAULTS = {  # per device: frame counts, generated tokens, untimed and timed requests per configuration
    "cuda": dict(frames="16,32,64,128", max_new_tokens=16, warmup=1, runs=1),
    "cpu": dict(frames="8", max_new_tokens=4, warmup=0, runs=1),
}


@dataclass
class Run:
    """One configuration's outcome: its timed records, wall seconds and peak memory per request,
    and what went wrong."""

    backbone: str
    attn: str
    method: str
    frames: int
    target: float | None
    records: list[dict] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    peak_mb: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--frames", default=None, help="comma-separated frame counts (cuda: 16,32,64,128; cpu: 8)")
    p.add_argument("--methods", default=",".join(HF_METHODS), help="comma-separated methods (default: every HF one)")
    p.add_argument("--backbones", default=",".join(REAL_WIDTH), help=f"comma-separated, of {', '.join(REAL_WIDTH)}")
    p.add_argument("--attn", default=None, help="sdpa and/or flash_attention_2 (default: sdpa, and FA2 if installed)")
    p.add_argument("--retention", type=float, default=0.25, help="target R of every method that takes one")
    p.add_argument("--size", default="1280x720", help="synthetic source WIDTHxHEIGHT (default 720p)")
    p.add_argument("--depth", choices=("full", "reduced"), default=None, help="cuda: full, cpu: reduced")
    p.add_argument(
        "--checkpoints",
        default=None,
        help="folder to write the models to once and load them from (cpu default: fixtures/real_width); "
        "none: build them in memory on the device (cuda default)",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="generated tokens (cuda 16, cpu 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed requests per configuration (cuda 1, cpu 0)")
    p.add_argument("--runs", type=int, default=None, help="timed requests per configuration (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on cpu (default 1)")
    p.add_argument("--out", default=str(REPO / "results" / "gpu"), help="output folder (default results/gpu)")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.depth = args.depth or ("full" if args.device == "cuda" else "reduced")
    if args.checkpoints is None:
        args.checkpoints = str(REPO / "fixtures" / "real_width") if args.device == "cpu" else "none"
    try:
        args.frames = [int(f) for f in str(args.frames).split(",")]
        args.size = tuple(int(v) for v in args.size.lower().split("x"))
    except ValueError:
        p.error(f"--frames takes comma-separated integers and --size WIDTHxHEIGHT, got {args.frames!r}, {args.size!r}")
    if min(args.frames) < 1 or len(args.size) != 2 or min(args.runs, args.max_new_tokens) < 1 or args.warmup < 0:
        p.error("frames, sizes, --runs and --max-new-tokens must be at least 1, --warmup at least 0")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.backbones = [b.strip() for b in args.backbones.split(",") if b.strip()]
    for name in args.methods:
        if name not in METHODS or not METHODS[name].hf:
            p.error(f"--methods: {name!r} is not a method the HF classes run ({', '.join(HF_METHODS)})")
    for name in args.backbones:
        if name not in REAL_WIDTH:
            p.error(f"--backbones: unknown {name!r}; known: {', '.join(REAL_WIDTH)}")
    flash = args.device == "cuda" and importlib.util.find_spec("flash_attn") is not None
    args.attn = args.attn.split(",") if args.attn else ["sdpa"] + (["flash_attention_2"] if flash else [])
    if "flash_attention_2" in args.attn and not flash:
        p.error("--attn flash_attention_2 needs a CUDA device and the flash_attn package")
    return args


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu {platform.processor() or platform.machine()}".strip()


def file_stem(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def load_backbone(name: str, args, attn: str):
    """The HF adapter of `name` at the chosen depth: loaded from a folder written once under
    --checkpoints, or built in memory on the device."""
    text_layers, vision_blocks = REDUCED_DEPTH[name] if args.depth == "reduced" else (None, None)
    adapter_cls = ADAPTERS[REAL_WIDTH[name]]
    if args.checkpoints != "none":
        folder = ensure_real_width(Path(args.checkpoints), name, text_layers, vision_blocks)
        return adapter_cls.from_pretrained(str(folder), device=args.device, dtype="bfloat16", attn_implementation=attn)
    model, processor = build_real_width(name, text_layers, vision_blocks, device=args.device, attn_implementation=attn)
    return adapter_cls(model, processor)


def reachable_target(method: str, retention: float, layers: int, first_layer: int) -> float | None:
    """`retention` (None for vanilla), or, for a method that prunes only inside the LLM and cannot
    reach it on this LLM with its default stages, the next 0.05 above its floor."""
    spec = METHODS[method]
    if spec.retention == NO_RETENTION:
        return None
    if spec.stage != INSIDE_LLM:
        return retention
    try:
        spec.prune(layers, FLOOR_PROBE_TOKENS, retention, None, first_layer)
        return retention
    except InfeasibleBudget as exc:
        return math.floor(exc.floor * 20 + 1) / 20


def check_record(record: dict, method: str, target: float | None, dims, frames: int, size_hw) -> list[str]:
    """What does not hold for one record (empty: all holds)."""
    if record["error"] is not None:
        return [f"failed: {record['error']}"]
    spec, problems = METHODS[method], []
    r, visual, reference = record["achieved_retention"], record["visual_tokens"], record["reference_tokens"]
    if target is None and (r != 1.0 or visual != reference):
        problems.append(f"vanilla R={r} with {visual} of {reference} tokens")
    if target is not None and not target - 0.01 <= r <= target:
        problems.append(f"R={r:.4f} not within 0.01 below the target {target}")
    if record["num_frames"] != frames:
        problems.append(f"{record['num_frames']} frames, not {frames}")
    grids = sum(t * h * w for t, h, w in record["grids"])
    layers = record["layer_visual_tokens"]
    if spec.stage == BEFORE_ENCODER and visual != grids:
        problems.append(f"{visual} visual tokens, the grids hold {grids}")
    if spec.stage == AFTER_MERGER and visual != len(record["merged_sizes"] or ()):
        problems.append(f"{visual} visual tokens, {len(record['merged_sizes'] or ())} kept groups")
    if spec.stage == INSIDE_LLM and not (layers and layers[0] == visual == reference == grids):
        problems.append(f"pruned inside the LLM, but {visual} visual tokens entered ({layers})")
    if spec.prune is not None and layers and abs(r - sum(layers) / len(layers) / reference) > 1e-12:
        problems.append("R is not the layer average")
    if record["total_flops"] != sum(record[f"{p}_flops"] for p in PARTS):
        problems.append("FLOPs parts do not sum to the total")
    if not spec.needs_allocator:  # the row `resadapt-eval flops` prints from configs alone, where it can
        text_tokens = record["input_tokens"] - visual
        try:
            row, row_visual = row_flops(dims, method, frames, size_hw, target, text_tokens, record["output_tokens"])
        except ValueError:  # a compressor whose work depends on the features
            row = None
        if row is not None:
            two_stage = spec.compress is not None and spec.prune is not None  # its row leaves out the compressor
            compared = [p for p in PARTS if not (two_stage and p == "method")]
            differ = [p for p in compared if getattr(row, p) != record[f"{p}_flops"]]
            if row_visual != visual or differ:
                problems.append(f"record differs from the `resadapt-eval flops` row in {differ or 'visual tokens'}")
    return problems


def run_configuration(backbone, name: str, attn: str, method: str, frames: int, args, video: str) -> Run:
    dims = dims_from_config(backbone.model.config)
    first_layer = backbone.first_prunable_layer
    target = reachable_target(method, args.retention, backbone.num_text_layers, first_layer)
    run = Run(name, attn, method, frames, target)
    model_args = dict(method=method, max_num_frames=frames)
    if target is not None:
        model_args["retention"] = target
    if METHODS[method].needs_allocator:
        model_args["allocator"] = "untrained"
    try:
        pipeline = VideoPipeline(backbone, config_from_model_args(**model_args))
    except Exception as exc:  # a configuration the pipeline refuses at start is a failure of this run
        run.problems.append(f"refused at start: {type(exc).__name__}: {exc}")
        return run
    prompt = backbone.layout.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUERY}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    request = Request(prompt, video=video, query=QUERY, gen_kwargs=dict(max_new_tokens=args.max_new_tokens))
    for _ in range(args.warmup):
        pipeline.run(request)
    device = backbone.device
    for _ in range(args.runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        reset_peak_memory(device)
        start = time.perf_counter()
        _, record = pipeline.run(request)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        run.e2e_s.append(time.perf_counter() - start)
        run.peak_mb.append(peak_memory_mb(device))
        run.records.append(record.to_dict())
        size_hw = (args.size[1], args.size[0])
        run.problems += check_record(run.records[-1], method, target, dims, frames, size_hw)
    return run


# ---------------------------------------------------------------------- the report
def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def measures(run: Run) -> dict | None:
    """Means over the run's successful records: R, visual tokens, TFLOPs and the stage times (ms)."""
    done = [r for r in run.records if r["error"] is None]
    if not done:
        return None
    own = [
        1e3 * ((r["compress_s"] or 0) + (r["rank_s"] or 0))
        for r in done
        if r["compress_s"] is not None or r["rank_s"] is not None
    ]
    return dict(
        R=_mean([r["achieved_retention"] for r in done]),
        visual=_mean([r["visual_tokens"] for r in done]),
        tflops=_mean([r["total_flops"] / 1e12 for r in done]),
        vision=_mean([1e3 * r["vision_s"] for r in done if r["vision_s"] is not None]),
        own=_mean(own),
        prefill=_mean([1e3 * r["prefill_s"] for r in done]),
        decode=_mean([1e3 * r["per_token_s"] * max(0, r["output_tokens"] - 1) for r in done]),
        e2e=_mean([1e3 * s for s, r in zip(run.e2e_s, run.records) if r["error"] is None]),
        peak=max(run.peak_mb),
    )


def _fmt(value, spec: str = ".1f") -> str:
    return "--" if value is None else format(value, spec)


def _vs(ours, theirs) -> str:
    return "" if ours is None or not theirs else f" ({100 * (ours / theirs - 1):+.0f}%)"


def table(runs: list[Run]) -> str:
    header = (
        "| method | frames | target R | R | visual tokens | TFLOPs (x vanilla) | vision ms | own ms | prefill ms "
        "| decode ms | e2e ms (vs vanilla) | peak MiB (vs vanilla) | check |"
    )
    lines = [header, "|" + "---|" * 13]
    vanilla = {run.frames: measures(run) for run in runs if run.method == "vanilla"}
    for run in runs:
        m, base = measures(run), vanilla.get(run.frames) or {}
        check = "ok" if not run.problems else "FAIL"
        if m is None:
            lines.append(f"| {run.method} | {run.frames} | {_fmt(run.target, 'g')} |" + " -- |" * 9 + f" {check} |")
            continue
        ratio = f" ({m['tflops'] / base['tflops']:.3f}x)" if base.get("tflops") else ""
        cells = (
            run.method,
            run.frames,
            _fmt(run.target, "g"),
            f"{m['R']:.4f}",
            f"{m['visual']:.0f}",
            f"{m['tflops']:.2f}{ratio}",
            _fmt(m["vision"]),
            _fmt(m["own"]),
            _fmt(m["prefill"]),
            _fmt(m["decode"]),
            f"{m['e2e']:.1f}{_vs(m['e2e'], base.get('e2e'))}",
            f"{m['peak']:.0f}{_vs(m['peak'], base.get('peak'))}",
            check,
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def report(args, runs: list[Run], name: str, notes: list[str]) -> str:
    failed = [run for run in runs if run.problems]
    import transformers

    flash = importlib.util.find_spec("flash_attn") is not None
    depth = (
        "full depth"
        if args.depth == "full"
        else "reduced depth "
        + ", ".join(
            f"{b}: {t} LLM layers, {v} vision blocks" for b, (t, v) in REDUCED_DEPTH.items() if b in args.backbones
        )
    )
    lines = [
        f"# GPU check: {name}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"flash_attn {'installed' if flash else 'not installed'}; device {args.device}"
        + (f", {torch.get_num_threads()} thread(s)" if args.device == "cpu" else "")
        + ".",
        f"Qwen2.5-VL-7B / Qwen3-VL-8B at their published widths, {depth}, random bfloat16 weights "
        "(the timings and memory are the architectures'; the answers mean nothing). "
        f"Source: a synthetic {args.size[0]}x{args.size[1]} video; {args.max_new_tokens} generated tokens; "
        f"{args.warmup} untimed and {args.runs} timed request(s) per row; target R {args.retention} "
        "(a method pruning only inside the LLM that cannot reach it runs at the next 0.05 above its floor).",
        "Columns: vision = the vision tower; own = the method's own work (a compressor's `compress_s` plus an "
        "in-LLM or decoding pruner's `rank_s`; -- where it has none); prefill = the LLM's prefill alone (time to "
        "first token less the tower where it runs inside generate and the in-LLM ranking, `prefill_s`); "
        "decode = every token after the first; e2e = the whole request (video decode, planning, "
        "resizing, any compressor, generation); peak = "
        + ("CUDA memory allocated during the request." if args.device == "cuda" else "the process's peak RSS so far."),
        "",
        f"**{'FAIL' if failed else 'PASS'}**: {len(runs) - len(failed)} of {len(runs)} configurations ran and held "
        "every check.",
        *[f"- {note}" for note in notes],
        "",
    ]
    for backbone in args.backbones:
        for attn in args.attn:
            group = [run for run in runs if run.backbone == backbone and run.attn == attn]
            if group:
                lines += [f"## {backbone}, {attn}", "", table(group)]
    if failed:
        lines += ["## Failures", ""]
        lines += [f"- {r.backbone} {r.attn} {r.method} at {r.frames} frames: {'; '.join(r.problems)}" for r in failed]
        lines.append("")
    lines += ["## The paper's latency columns (`report.latency`)", ""]
    for backbone in args.backbones:
        for attn in args.attn:
            groups = [
                (r.method, r.frames, r.target, r.records)
                for r in runs
                if r.backbone == backbone and r.attn == attn and r.records
            ]
            if groups:
                lines += [f"### {backbone}, {attn}", "", to_markdown(latency_rows(groups))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = device_name(args.device)
    with tempfile.TemporaryDirectory() as scratch:  # the synthetic video is not a result
        video = str(synthetic_video(Path(scratch) / "video.mp4", args.size, max(args.frames)))
        runs, notes = check_all(args, video)
    stem = file_stem(name)
    (out / f"{stem}.md").write_text(report(args, runs, name, notes))
    with open(out / f"{stem}.jsonl", "w") as sink:
        for run in runs:
            for record, e2e, peak in zip(run.records, run.e2e_s, run.peak_mb):
                extra = dict(backbone=run.backbone, attn=run.attn, target=run.target, e2e_s=e2e, request_peak_mb=peak)
                sink.write(json.dumps({**extra, **record}) + "\n")
    print(f"report: {out / f'{stem}.md'}")
    return 1 if any(run.problems for run in runs) else 0


def resize_check(args, video: str) -> tuple[Run, str]:
    """The video's frames resized to a 7B plan's 896x504 on `args.device` and on the CPU (exact and
    fast): a run whose problem is an exact difference above one uint8 level, and a note of both."""
    frames = decode_video(video, min(args.frames)).frames
    run, parts = Run("(all)", "-", "resize on the device", len(frames), None), []
    for mode in RESIZES:
        t0 = time.perf_counter()
        here = resize_frames(frames, 504, 896, mode, args.device)
        seconds = time.perf_counter() - t0
        difference = (here.int() - resize_frames(frames, 504, 896, mode).int()).abs()
        parts.append(
            f"{mode}: max {int(difference.max())}, mean {float(difference.float().mean()):.3f} uint8 levels from the "
            f"CPU's, {1e3 * seconds / len(frames):.1f} ms a frame"
        )
        if mode == "exact" and difference.max() > 1:
            run.problems.append(f"exact resize on {args.device} is {int(difference.max())} uint8 levels off the CPU's")
    return run, f"frames resized on {args.device} to 896x504 ({len(frames)} frames): " + "; ".join(parts)


def check_all(args, video: str) -> tuple[list[Run], list[str]]:
    """The resize check, then every configuration, backbone by backbone and attention by attention: the
    runs and notes."""
    methods = ["vanilla"] + [m for m in args.methods if m != "vanilla"]  # vanilla first: the baseline of each row
    resized, note = resize_check(args, video)
    runs, notes = ([resized] if resized.problems else []), [note]
    for backbone_name in args.backbones:
        for attn in args.attn:
            start = time.perf_counter()
            try:
                backbone = load_backbone(backbone_name, args, attn)
                # one untimed vanilla request first, so that no row pays for first use (weights paged in, kernels)
                warm = argparse.Namespace(**{**vars(args), "warmup": 0, "runs": 1})
                run_configuration(backbone, backbone_name, attn, "vanilla", min(args.frames), warm, video)
            except Exception as exc:
                runs.append(Run(backbone_name, attn, "(load)", 0, None, problems=[f"{type(exc).__name__}: {exc}"]))
                print(f"{backbone_name} {attn}: FAIL at load or warm-up: {type(exc).__name__}: {exc}", flush=True)
                backbone = None  # a model that loaded but failed its warm-up goes too
                release(args.device)
                continue
            notes.append(
                f"{backbone_name}, {attn}: model built or loaded and warmed up in {time.perf_counter() - start:.0f} s"
            )
            family = REAL_WIDTH[backbone_name]
            skipped = [m for m in methods if family not in METHODS[m].kind.families]
            if skipped:
                notes.append(f"{backbone_name}: {', '.join(skipped)} not run (they stop at start on {family})")
            for frames in args.frames:
                for method in (m for m in methods if m not in skipped):
                    try:
                        run = run_configuration(backbone, backbone_name, attn, method, frames, args, video)
                    except Exception as exc:  # e.g. CUDA out of memory: this row fails, the others go on
                        run = Run(backbone_name, attn, method, frames, None, problems=[f"{type(exc).__name__}: {exc}"])
                    runs.append(run)
                    status = "ok" if not run.problems else "FAIL: " + "; ".join(run.problems)
                    print(f"{backbone_name} {attn} {method} {frames} frames: {status}", flush=True)
            del backbone
            release(args.device)
    return runs, notes


def release(device: str) -> None:
    """Free what a backbone no longer referenced held, before the next one is built."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
