"""`resadapt-eval` command line: fixtures | demo | sweep | sweep-status | tables | plots | train | flops |
profile | needle (make-data | train-backbone | train-allocator | report)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

from .fixtures import REAL_WIDTH, write_fixtures
from .manifest import REPO
from .methods import METHODS
from .needle.data import CANDIDATES, EVIDENCE_PAIRS, LONG_FRAMES, VARIANTS

HF_METHODS = ",".join(name for name, method in METHODS.items() if method.hf)
PAPER_METHODS = ",".join(name for name, method in METHODS.items() if method.in_paper)


def cmd_fixtures(args) -> int:
    if args.real_width is not None:
        from .fixtures import real_width_folder, write_real_width

        depth = (args.text_layers, args.vision_blocks)
        out = (
            Path(args.out)
            if args.out
            else real_width_folder(Path("fixtures/real_width"), args.real_width, *depth, args.seed)
        )
        try:
            path = write_real_width(out, args.real_width, *depth, seed=args.seed)
        except ValueError as exc:  # a depth the architecture cannot be cut to
            print(f"fixtures: {exc}", file=sys.stderr)
            return 2
        print(f"{args.real_width}: {path}")
        return 0
    if args.text_layers is not None or args.vision_blocks is not None:
        print("fixtures: --text-layers and --vision-blocks size a --real-width model", file=sys.stderr)
        return 2
    paths = write_fixtures(Path(args.out or "fixtures"), seed=args.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def cmd_sweep(args) -> int:
    from .cluster.settings import (
        FLAGS,
        SCALAR_KEYS,
        check_card_section,
        parse_pairs,
        slurm_settings,
    )
    from .needle.data import ensure_needle_data
    from .sweep import check_cells, load_card, plan_cells, with_model_args

    try:
        card = load_card(args.card)
        if args.model_args:  # part of every cell's configuration, as the card's own model_args are
            card = with_model_args(card, args.model_args)
        try:
            frames = [int(f) for f in args.frames.split(",")] if args.frames else card.frames
            retentions = [float(r) for r in args.retention.split(",")]
        except ValueError:
            raise ValueError(
                f"--frames takes comma-separated integers and --retention numbers; got {args.frames!r}, "
                f"{args.retention!r}"
            ) from None
        tasks = args.tasks.split(",") if args.tasks else card.tasks
        check_card_section(card.slurm, args.card)  # whichever executor runs the sweep
        cells = plan_cells(args.methods.split(","), retentions, frames)
        check_cells(card, cells)  # every cell's model_args, as its model class checks them at start
        if args.retries < 0:
            raise ValueError(f"--retries must be at least 0, got {args.retries}")
        if args.max_parallel is not None and args.max_parallel < 1:
            raise ValueError(f"--max-parallel must be at least 1, got {args.max_parallel}")
        flags = {key: getattr(args, f"slurm_{key}") for key in SCALAR_KEYS}
        settings = None
        if args.executor == "slurm" and args.retries and not (args.wait or args.slurm_local):
            raise ValueError(
                "--retries needs --wait with --executor slurm: a sweep that watches its jobs resubmits them "
                "(without it, run the same command again to resubmit the failed cells)"
            )
        if args.executor == "slurm":
            flags["options"] = parse_pairs(args.slurm_option, "--slurm-option")
            flags["additional"] = parse_pairs(args.slurm_additional, "--slurm-additional")
            settings = slurm_settings(card.slurm, flags)
        else:
            given = [FLAGS[k] for k, v in flags.items() if v is not None]
            given += ["--slurm-option"] * bool(args.slurm_option) + ["--slurm-additional"] * bool(args.slurm_additional)
            given += ["--slurm-local"] * args.slurm_local + ["--wait"] * args.wait
            given += ["--max-parallel"] * (args.max_parallel is not None)
            if given:
                raise ValueError(
                    f"{given[0]} applies to --executor slurm (the local executor runs one cell after another; "
                    "--executor slurm --slurm-local runs them as separate processes here)"
                )
    except (ValueError, FileNotFoundError) as exc:  # a bad card, --model-args, cell or SLURM setting: stop first
        print(f"sweep: {exc}", file=sys.stderr)
        return 2
    ensure_needle_data(card.needle_data, args.limit)
    output = Path(args.output)
    new_folder = not output.exists()  # a refused sweep removes the folder it made, leaving nothing behind
    code = run_sweep_command(args, card, cells, tasks, settings)
    if code == 2 and new_folder:
        shutil.rmtree(output, ignore_errors=True)
    return code


def run_sweep_command(args, card, cells, tasks, settings) -> int:
    """The checked sweep, run here or submitted; its exit code (2: refused, nothing ran or was submitted)."""
    from .cluster.settings import BadSlurmSetting
    from .sweep import ChangedCells, run_sweep

    common = dict(
        launcher=args.launcher,
        limit=args.limit,
        max_failed_fraction=args.max_failed_fraction,
        rerun_changed=args.rerun_changed,
        retries=args.retries,
    )
    try:
        if args.executor == "local":
            records = run_sweep(card, cells, tasks, Path(args.output), **common)
        else:
            from .cluster.jobs import SubmissionFailed, submit_sweep

            try:
                records = submit_sweep(
                    card,
                    cells,
                    tasks,
                    Path(args.output).resolve(),
                    settings,
                    local=args.slurm_local,
                    wait=args.wait,
                    max_parallel=args.max_parallel or (1 if args.slurm_local else None),
                    **common,
                )
            except SubmissionFailed as exc:
                print(f"sweep: {exc}", file=sys.stderr)
                return 2
    except (ChangedCells, BadSlurmSetting) as exc:  # nothing was run or submitted
        print(f"sweep: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"sweep: interrupted; the cells it ran were ended. Run the same command to resume: {args.output}",
            file=sys.stderr,
        )
        return 130
    if records is None:  # submitted; the jobs run on
        return 0
    return 1 if any(r is None or r["status"] != "done" for r in records) else 0


def cmd_sweep_status(args) -> int:
    from .cluster.status import show_status

    if not Path(args.run_dir).is_dir():
        print(f"sweep-status: no sweep folder {args.run_dir}", file=sys.stderr)
        return 2
    if args.watch is not None and args.watch <= 0:
        print(f"sweep-status: --watch takes a positive number of seconds, got {args.watch}", file=sys.stderr)
        return 2
    try:
        return show_status(args.run_dir, args.watch, verbose=args.verbose)
    except KeyboardInterrupt:
        return 130


def collected(args, include_failed: bool = False):
    """The cells of every RUN_DIR, or None (after saying why) when there are none or two clash."""
    from .report.collect import collect_dirs

    try:
        runs = collect_dirs(args.run_dir, include_failed)
    except ValueError as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return None
    if not runs:
        print(f"no finished cells under {', '.join(args.run_dir)}", file=sys.stderr)
        return None
    return runs


def absent_folders(args) -> int:
    """2 after naming the first RUN_DIR that is not a folder (a typo, or a sweep not run yet), else 0."""
    for run_dir in args.run_dir:
        if not Path(run_dir).is_dir():
            what = "is a file, not a sweep folder" if Path(run_dir).exists() else "does not exist"
            print(f"{args.command}: {run_dir} {what}", file=sys.stderr)
            return 2
    return 0


def cmd_tables(args) -> int:
    from .report.collect import missing_cells
    from .report.tables import build_tables, missing_markdown, to_markdown, write_tables

    if absent_folders(args):
        return 2
    runs = collected(args, include_failed=True)
    missing = missing_cells(args.run_dir, runs or [])
    if runs is None:
        if missing:
            print(missing_markdown(missing))
        return 1
    hard = hard_subset_rows(args, runs)  # a reference not among the cells stops before anything is written
    if hard is None:
        return 2
    paper_dir = Path(args.paper_dir) if args.paper else None
    tables = build_tables(runs, paper_dir, missing)
    out = Path(args.out) if args.out else Path(args.run_dir[0]) / "tables"
    write_tables(tables, out, with_paper=args.paper)
    for table in tables:
        print(to_markdown(table, with_paper=args.paper))
    listed = {m.name for table in tables for m in table.missing}
    if any(m.name not in listed for m in missing):  # cells of tasks no table shows yet
        print(missing_markdown([m for m in missing if m.name not in listed]))
    from .report.kept_maps import bias_markdown, bias_rows, write_bias

    bias = bias_rows(runs)
    if bias:  # where the token-reducing methods keep their tokens, as a number
        write_bias(bias, out)
        print(bias_markdown(bias))
    if hard:
        from .report.hard_subset import hard_markdown, write_hard

        write_hard(hard, out)
        print(hard_markdown(hard))
    print(f"tables (md, tex, csv): {out}")
    if args.paper:  # the paper's CAPO ablation has no (backbone, frames, R) to match: side by side
        from .report.collect import capo_ablation_markdown, capo_ablation_rows, write_capo_ablation

        ablation = capo_ablation_rows(runs, paper_dir)
        write_capo_ablation(ablation, out)
        print(capo_ablation_markdown(ablation))
    timed = [run for run in runs if any("first_token_s" in r for r in run.records)]
    if timed:  # cells run by a version that times every stage: the paper's latency table
        from .report.latency import latency_rows, write_latency
        from .report.latency import to_markdown as latency_markdown

        rows = latency_rows([(run.method, run.frames, run.retention, run.records) for run in timed])
        write_latency(rows, out)
        print(latency_markdown(rows))
        print(f"latency table (md, csv): {out}")
    return 0


def hard_subset_rows(args, runs) -> list[dict] | None:
    """The `--hard-subset` rows of `tables` and `plots` ([] without the flag; None: a bad reference, said)."""
    if args.hard_subset is None:
        return []
    from .report.hard_subset import Reference, hard_rows

    try:
        return hard_rows(runs, Reference.parse(args.hard_subset))
    except ValueError as exc:
        print(f"resadapt-eval {args.command}: {exc}", file=sys.stderr)
        return None


def cmd_plots(args) -> int:
    from .report.collect import missing_cells
    from .report.plots import write_plots
    from .report.tables import missing_markdown

    if absent_folders(args):
        return 2
    runs = collected(args)
    missing = missing_cells(args.run_dir, runs or [])
    if missing:  # complete cells only are drawn
        print(missing_markdown(missing))
    if runs is None:
        return 1
    out = Path(args.out) if args.out else Path(args.run_dir[0]) / "plots"
    hard = hard_subset_rows(args, runs)
    if hard is None:
        return 2
    written = write_plots(runs, out)
    if hard:
        from .report.hard_subset import hard_plots
        from .report.plots import _save

        written += hard_plots(hard, out, _save)
    print(f"{len(written)} files (png, pdf): {out}")
    return 0


def cmd_show(args) -> int:
    """A contact sheet of one sample: one row per method (`report/show.py`)."""
    from .report.show import contact_sheet, describe, sample_rows

    methods = [m for m in args.methods.split(",") if m] if args.methods else None
    try:
        rows = sample_rows(args.run_dir, args.sample, args.task, methods)
        out = Path(args.out) if args.out else Path(args.run_dir) / "show" / f"sample_{args.sample}.png"
        sheet = contact_sheet(rows, out, args.video_root)
    except (FileNotFoundError, ValueError) as exc:
        print(f"resadapt-eval show: {exc}", file=sys.stderr)
        return 2
    print(describe(sheet))
    return 0


def demo_sheet(out: Path) -> None:
    """The contact sheet of the sample ResAdapt answered right with its most uneven scales (OUT/show/)."""
    from .report.show import contact_sheet, describe, sample_rows, uneven_sample

    doc = uneven_sample(out)
    if doc is not None:
        print(describe(contact_sheet(sample_rows(out, doc), out / "show" / f"sample_{doc}.png")))


def cmd_demo(args) -> int:
    """The needle benchmark end to end on the committed weights, card by card: cued test videos
    (written if missing), a sweep through the real lmms-eval CLI, tables, plots and the needle
    report, in OUT/<card>/."""
    from .needle.data import ensure_needle_data
    from .sweep import load_card

    root = Path(args.repo).resolve()
    status = 0
    for name in args.cards.split(","):
        card_path = root / "model_cards" / f"{name}.yaml"
        card = load_card(card_path)
        data = ensure_needle_data(card.needle_data, args.limit, echo=lambda *_: None)  # the sweep prints it
        if data is None:
            raise SystemExit(f"resadapt-eval demo: card {name} has no needle_data (the demo runs needle cards)")
        out = Path(args.out).resolve() / name
        print(f"== {name}: first {args.limit} test videos -> {out}")
        sweep = sweep_arguments(
            card=str(card_path), methods=args.methods, retention=args.retention, output=str(out), limit=args.limit
        )
        card_status = cmd_sweep(sweep)
        if card_status == 2:  # the output holds cells of another configuration: no tables of stale cells
            return card_status
        status = max(status, card_status)
        common = argparse.Namespace(
            command="demo",
            run_dir=[str(out)],
            out=None,
            paper=False,
            paper_dir=str(root / "results" / "paper"),
            hard_subset="fixed_scale" if "fixed_scale" in args.methods.split(",") else None,  # FixedScale's misses
        )
        cmd_tables(common)
        cmd_plots(common)
        demo_sheet(out)
        cmd_needle_report(argparse.Namespace(run_dir=[str(out)], data=str(data), out=None))
    print(
        f"Needle benchmark on the first {args.limit} cued test videos, cards {args.cards} "
        "(full benchmark: README, 'The needle benchmark')."
    )
    outputs = "cells with lmms-eval results and sidecars, tables/, plots/, needle/, show/"
    print(f"Outputs: {Path(args.out).resolve()}/<card> ({outputs})")
    return status


def cmd_train(args) -> int:
    from .train.config import build_trainer

    trainer = build_trainer(args.config, steps=args.steps)
    history = trainer.train(resume=args.resume)
    if not trainer.accelerator.is_main_process:  # under `accelerate launch`, process 0 reports
        return 0
    checkpoint = trainer.output_dir / "checkpoints" / f"step-{trainer.step:06d}" / "allocator"
    if history:
        last = history[-1]
        print(
            f"step {last['step']}: mean scale {last['mean_scale']:.3f}, R {last['achieved_retention']:.3f}, "
            f"reward {last['reward']:.3f}, accuracy {last['accuracy']:.3f}"
        )
    print(f"checkpoint: {checkpoint}  (use: method=resadapt,allocator={checkpoint})")
    print(f"metrics: {trainer.output_dir / 'metrics.jsonl'}")
    return 0


def cmd_needle_make_data(args) -> int:
    from .needle.data import make_data

    for split, path in make_data(
        args.out,
        train=args.train,
        val=args.val,
        test=args.test,
        seed=args.seed,
        cue=args.cue,
        evidence_pairs=args.evidence_pairs,
        variant=args.variant,
        candidates=args.candidates,
    ).items():
        print(f"{split}: {path}")
    return 0


def cmd_needle_train_backbone(args) -> int:
    from .needle.train_backbone import train_backbone

    out = train_backbone(
        args.out,
        stage1_steps=args.stage1_steps,
        stage2_steps=args.stage2_steps,
        batch=args.batch,
        seed=args.seed,
        init=args.init,
        lr=args.lr,
        cue_fraction=args.cue_fraction,
        family=args.family,
        variant=args.variant,
        vision_lr_scale=args.vision_lr_scale,
    )
    print(f"needle backbone: {out}")
    return 0


def cmd_needle_train_allocator(args) -> int:
    from .needle.train_allocator import train_allocator

    out = train_allocator(args.config, args.out, steps=args.steps)
    print(f"needle allocator: {out}")
    return 0


def cmd_needle_report(args) -> int:
    from .needle.report import to_markdown, write_report

    cells, written = write_report(args.run_dir, args.data, args.out)
    if not cells:
        print(f"no finished cells under {', '.join(map(str, args.run_dir))}", file=sys.stderr)
        return 1
    print(to_markdown(cells))
    print(f"needle report: {written[0].parent} ({len(written)} files)")
    return 0


def cmd_flops(args) -> int:
    """The latency table's TFLOPs per (method, frames) from configs alone: linear layers of the
    prefill (the paper's counting), then attention scores, the method's own work, the Allocator's
    and decode beside."""
    from .compute.flops import TERA
    from .estimates import row_flops

    try:
        dims, (width, height), frame_counts, methods, allocator = flops_settings(args)
        too_long = []  # (frames, tokens) whose vanilla sequence is beyond the LLM's context length
        for frames in frame_counts:  # what the vanilla rows cannot plan (an extreme aspect ratio) stops here
            try:
                _, visual = row_flops(dims, "vanilla", frames, (height, width), None, args.text_tokens)
            except ValueError as exc:
                raise ValueError(f"--size {args.size}: {exc}") from None
            tokens = visual + args.text_tokens + args.output_tokens
            if dims.text.context is not None and tokens > dims.text.context:
                too_long.append((frames, tokens))
        memory = memory_settings(args)
    except ValueError as exc:
        print(f"flops: {exc}", file=sys.stderr)
        return 2
    for frames, tokens in too_long:
        print(
            f"note: at {frames} frames vanilla's sequence is {tokens} tokens (visual, text and output), beyond "
            f"{args.backbone}'s context length of {dims.text.context} tokens (max_position_embeddings): the model "
            "cannot take it, and its rows count a sequence no run can have"
        )
    if memory is not None:
        return print_memory_plan(args, dims, (height, width), frame_counts, methods, allocator, *memory)
    print(
        f"{args.backbone}: {args.size} source, {args.text_tokens} text tokens, {args.output_tokens} output tokens, "
        f"R={args.retention}; TFLOPs (10^12, 2 per multiply-add); linear = vision + LLM prefill linear layers; "
        f"x_vanilla = (linear + allocator) / vanilla's linear, alloc_x_van = allocator / vanilla's linear"
    )
    if allocator is not None:
        print(
            f"allocator: {args.allocator} ({allocator.config.encoder} encoders, {args.query_tokens} query tokens); "
            "its rows use one scale for every frame at R (any allocation of those tokens has the same linear FLOPs)"
        )
    header = (
        "method",
        "frames",
        "visual_tokens",
        "linear",
        "x_vanilla",
        "attention",
        "method_extra",
        "allocator",
        "alloc_x_van",
        "decode",
        "total",
    )
    print("".join(f"{h:>14}" for h in header))
    for frames in frame_counts:
        vanilla, _ = row_flops(dims, "vanilla", frames, (height, width), None, args.text_tokens, args.output_tokens)
        for method in methods:
            retention = None if method.full_budget else args.retention
            try:
                flops, visual = row_flops(
                    dims,
                    method.name,
                    frames,
                    (height, width),
                    retention,
                    args.text_tokens,
                    args.output_tokens,
                    allocator,
                    args.query_tokens,
                )
            except ValueError as exc:  # a feature-dependent compressor, or a budget below the method's floor
                print(f"{method.name:>14}{frames:>14}  {exc}")
                continue
            cells = (
                method.name,
                frames,
                visual,
                f"{flops.linear / TERA:.1f}",
                f"{(flops.linear + flops.allocator) / vanilla.linear:.3f}",
                f"{flops.attention / TERA:.1f}",
                f"{flops.method / TERA:.3f}",
                f"{flops.allocator / TERA:.3f}",
                f"{flops.allocator / vanilla.linear:.2e}",
                f"{flops.decode / TERA:.2f}",
                f"{flops.total / TERA:.1f}",
            )
            print("".join(f"{c:>14}" for c in cells))
    return 0


MEMORY_UNITS = {"gb": 10**9, "gib": 2**30, "mb": 10**6, "mib": 2**20, "tb": 10**12, "tib": 2**40}


def memory_settings(args):
    """`resadapt-eval flops --memory` arguments checked: None without --memory or --gpu-memory, else
    (budget bytes, headroom, dtype, attention); a bad one is a ValueError naming the option."""
    import math
    import re

    from .compute.memory import ATTENTION, DTYPE_BYTES

    if not args.memory and args.gpu_memory is None:
        return None
    given = "80GB" if args.gpu_memory is None else args.gpu_memory
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*", given)
    if match is None or match.group(2).lower() not in MEMORY_UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"--gpu-memory takes a positive size with its unit (GB, GiB, MB, MiB, TB, TiB), e.g. 80GB, got {given!r}"
        )
    budget = float(match.group(1)) * MEMORY_UNITS[match.group(2).lower()]
    try:
        headroom = float(args.headroom)
    except ValueError:
        headroom = math.nan
    if not 0 <= headroom < 1:
        raise ValueError(f"--headroom takes a fraction in [0, 1) of --gpu-memory kept free, got {args.headroom!r}")
    if args.dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype takes one of {', '.join(DTYPE_BYTES)}, got {args.dtype!r}")
    if args.attention not in ATTENTION:
        raise ValueError(f"--attention takes one of {', '.join(ATTENTION)}, got {args.attention!r}")
    return budget, headroom, args.dtype, args.attention


def print_memory_plan(args, dims, size_hw, frame_counts, methods, allocator, budget, headroom, dtype, attention) -> int:
    """The memory plan per (method, frames): GiB of tensors at the sample's peak on the HF path,
    split into weights, KV cache, vision and LLM activations and the method's own, and whether it
    fits `budget` bytes less `headroom` (`compute/memory.py`)."""
    from .estimates import row_memory

    gib = 2**30
    usable = budget * (1 - headroom)
    print(
        f"{args.backbone}: {args.size} source, {args.text_tokens} text tokens, max_new_tokens={args.output_tokens}, "
        f"R={args.retention}, {dtype} weights and cache, {attention} attention; GiB (2^30 bytes) of tensors, what "
        "torch.cuda.max_memory_allocated counts; weights and kv exact, activations and extra estimated "
        "(resadapt_eval/compute/memory.py)"
    )
    print(
        "peak = weights + max(encoding: vision_act, or a compressor's extra; LLM: kv + llm_act + an in-LLM stage's "
        "extra); extra: a method's own (compressor work, recomputed ViT attention, ranking rows, the Allocator)"
    )
    print(
        f"fits: peak <= {args.gpu_memory or '80GB'} ({budget / gib:.2f} GiB) less {headroom:.0%} headroom "
        f"(CUDA context, allocator fragmentation) = {usable / gib:.2f} GiB"
    )
    header = ("method", "frames", "visual_tokens", "weights", "kv", "vision_act", "llm_act", "extra", "peak", "fits")
    print("".join(f"{h:>14}" for h in header))
    for frames in frame_counts:
        for method in methods:
            retention = None if method.full_budget else args.retention
            try:
                memory, visual = row_memory(
                    dims,
                    method.name,
                    frames,
                    size_hw,
                    retention,
                    args.text_tokens,
                    args.output_tokens,
                    dtype,
                    attention,
                    allocator,
                )
            except ValueError as exc:  # vLLM-only, or a budget below the method's floor
                print(f"{method.name:>14}{frames:>14}  {exc}")
                continue
            cells = (
                method.name,
                frames,
                visual,
                f"{memory.weights / gib:.2f}",
                f"{memory.kv / gib:.2f}",
                f"{(memory.inputs + memory.vision) / gib:.2f}",
                f"{memory.llm / gib:.2f}",
                f"{memory.extra / gib:.2f}",
                f"{memory.peak / gib:.2f}",
                "yes" if memory.peak <= usable else "NO",
            )
            print("".join(f"{c:>14}" for c in cells))
    return 0


def flops_settings(args):
    """`resadapt-eval flops` arguments checked: (dims, (width, height), frame counts, methods,
    Allocator or None); a bad one is a ValueError naming the option."""
    import math

    from .compute.flops import load_dims
    from .methods import get_method

    try:
        dims = load_dims(args.backbone)
    except (ValueError, OSError, KeyError) as exc:
        raise ValueError(f"--backbone {args.backbone}: {exc}") from None
    parts = args.size.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"--size takes WIDTHxHEIGHT in pixels, both at least 1 (e.g. 896x672), got {args.size!r}")
    size = tuple(int(p) for p in parts)
    try:
        frames = [int(f) for f in args.frames.split(",")]
    except ValueError:
        frames = []
    if not frames or min(frames) < 1:
        raise ValueError(f"--frames takes comma-separated frame counts, each at least 1, got {args.frames!r}")
    try:
        methods = [get_method(name.strip()) for name in args.methods.split(",")]
    except ValueError as exc:
        raise ValueError(f"--methods: {exc}") from None
    if not 0 < args.retention < math.inf:
        raise ValueError(f"--retention must be a finite positive number, got {args.retention}")
    for option in ("text_tokens", "output_tokens", "query_tokens"):
        if getattr(args, option) < 0:
            raise ValueError(f"--{option.replace('_', '-')} must be at least 0, got {getattr(args, option)}")
    allocator = None
    if any(m.needs_allocator for m in methods):
        from .allocator import load_allocator

        try:
            allocator = load_allocator(args.allocator)
        except (ValueError, OSError) as exc:
            raise ValueError(f"--allocator {args.allocator}: {exc}") from None
    return dims, size, frames, methods, allocator


def cmd_profile(args) -> int:
    from .profile import ProfileSettings, print_rows, profile
    from .sweep import load_card

    card = load_card(args.card)
    methods = args.methods or ",".join(["vanilla", "fixed_scale"] + (["resadapt"] if card.allocator else []))
    engine_args = {}
    for item in filter(None, args.engine_args.split(",")):
        key, _, value = item.partition("=")
        engine_args[key.strip()] = yaml.safe_load(value)
    width, height = (int(v) for v in args.size.lower().split("x"))
    settings = ProfileSettings(
        methods=methods.split(","),
        frames=[int(f) for f in (args.frames.split(",") if args.frames else card.frames)],
        retentions=[float(r) for r in args.retention.split(",")],
        runs=args.runs,
        warmup=args.warmup,
        video=args.video,
        size=(width, height),
        engine=args.engine,
        engine_args=engine_args,
        max_new_tokens=args.max_new_tokens,
        query=args.query,
    )
    out = Path(args.output)
    print_rows(profile(card, settings, out))
    print(f"records, latency table (md, csv): {out}")
    return 0


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """`resadapt-eval sweep`'s arguments (the demo's sweeps take their defaults from here too)."""
    from .cluster.settings import FLAGS, SCALAR_KEYS, SlurmSettings

    p.add_argument("--card", required=True, help="model card YAML (model_cards/)")
    p.add_argument(
        "--methods",
        default=HF_METHODS,
        help="comma-separated methods (default: every method of the HF classes; evs runs under .venv-vllm)",
    )
    p.add_argument("--retention", default="0.25,0.1", help="comma-separated target retentions")
    p.add_argument("--frames", default=None, help="comma-separated max_num_frames (default: the card's)")
    p.add_argument("--tasks", default=None, help="comma-separated lmms-eval tasks (default: the card's)")
    p.add_argument("--output", required=True, help="run directory (one folder per cell)")
    p.add_argument("--launcher", default=None, help='e.g. "accelerate launch --num_processes 8" for data parallel')
    p.add_argument(
        "--model-args",
        default=None,
        help="k=v,... added to the card's model_args for every cell (e.g. kv_cache_memory_bytes=67108864 for evs); "
        "allocator=PATH replaces the card's Allocator",
    )
    p.add_argument("--limit", type=int, default=None, help="lmms-eval --limit (samples per task; for testing)")
    p.add_argument(
        "--max-failed-fraction",
        type=float,
        default=0.0,
        help="a cell with more failed samples than this fraction is reported failed (default 0: any failure)",
    )
    p.add_argument(
        "--rerun-changed",
        action="store_true",
        help="recompute finished cells whose configuration changed (default: stop and name the change)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=0,
        help="run a cell that failed, or whose job died, again up to N times (default 0)",
    )
    p.add_argument(
        "--executor",
        choices=("local", "slurm"),
        default="local",
        help="local: one cell after another here (default); slurm: one submitit job per cell (docs/cluster.md)",
    )
    p.add_argument(
        "--slurm-local",
        action="store_true",
        help="with --executor slurm: run the same jobs with submitit's local executor, each cell a separate "
        "process here; the command waits, and ends them when it is interrupted",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="with --executor slurm: watch the jobs to the end, resubmitting failed cells up to --retries times "
        "(default: return once they are submitted)",
    )
    p.add_argument(
        "--max-parallel",
        type=int,
        default=None,
        help="with --executor slurm: at most N cells at once (default: no cap on SLURM, 1 with --slurm-local)",
    )
    defaults = SlurmSettings()
    helps = {
        "partition": "SLURM partition (several: comma-separated)",
        "gpus_per_node": f"GPUs of each cell's job (default {defaults.gpus_per_node}; --launcher spreads the cell "
        "over them)",
        "nodes": "nodes of each cell's job: 1 (one lmms-eval run spans one node)",
        "cpus_per_task": "CPUs of each cell's job",
        "mem_gb": "memory of each cell's job in GB",
        "timeout_min": f"time limit of each cell's job in minutes (default {defaults.timeout_min})",
        "account": "SLURM account",
        "qos": "SLURM quality of service",
    }
    types = {"gpus_per_node": int, "nodes": int, "cpus_per_task": int, "mem_gb": float, "timeout_min": int}
    for key in SCALAR_KEYS:
        p.add_argument(
            FLAGS[key],
            dest=f"slurm_{key}",
            type=types.get(key, str),
            default=None,
            help=f"{helps[key]} (overrides the card's slurm.{key})",
        )
    p.add_argument(
        "--slurm-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another submitit SLURM parameter, e.g. constraint=a100 or exclude=node7 (repeatable; card slurm.options)",
    )
    p.add_argument(
        "--slurm-additional",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="a raw sbatch flag submitit passes on unchecked, e.g. reservation=paper (repeatable; "
        "card slurm.additional)",
    )


def sweep_arguments(**values) -> argparse.Namespace:
    """`resadapt-eval sweep`'s arguments: its defaults with `values` on top."""
    parser = argparse.ArgumentParser()
    add_sweep_arguments(parser)
    args = parser.parse_args(["--card", str(values["card"]), "--output", str(values["output"])])
    for key, value in values.items():
        setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="resadapt-eval", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "fixtures",
        help="write tiny random Qwen2.5-VL/Qwen3-VL checkpoints and the smoke dataset, or with --real-width one "
        "published architecture at its real widths with random bfloat16 weights",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default: fixtures, which the smoke task reads; with --real-width: "
        "fixtures/real_width/<name>-t<layers>-v<blocks>)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--real-width",
        choices=list(REAL_WIDTH),
        default=None,
        help="instead: this published backbone at its real widths, random bfloat16 weights, nothing downloaded "
        "(a loadable pretrained= folder; the fixtures' byte-level tokenizer, the real vocabulary size)",
    )
    p.add_argument("--text-layers", type=int, default=None, help="with --real-width: decoder layers (default: all)")
    p.add_argument("--vision-blocks", type=int, default=None, help="with --real-width: vision blocks (default: all)")
    p.set_defaults(func=cmd_fixtures)

    p = sub.add_parser("demo", help="the needle benchmark on the committed weights: data, sweep, tables, plots, report")
    p.add_argument("--out", default="demo_out", help="output folder (one sweep run directory per card)")
    p.add_argument("--repo", default=".", help="repository root (holds model_cards/, tasks/, fixtures/)")
    p.add_argument(
        "--cards",
        default="needle-qwen25vl,needle-qwen3vl",
        help="comma-separated needle cards in model_cards/ (default: both backbones)",
    )
    p.add_argument("--methods", default=PAPER_METHODS, help="comma-separated methods (default: the paper's seven)")
    p.add_argument("--retention", default="0.25", help="comma-separated target retentions")
    p.add_argument(
        "--limit", type=int, default=100, help="needle test videos per cell (the card's split is written if missing)"
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "sweep",
        help="run a (method x retention x frames) grid through lmms-eval, one process per cell, resumable: here, "
        "or as SLURM jobs through submitit",
    )
    add_sweep_arguments(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser(
        "sweep-status",
        help="the state of every cell of a sweep folder (asking SLURM about submitted jobs) and a progress bar; "
        "exit 0 when no cell has failed or was interrupted, 1 while any has (2: no such folder or a bad flag)",
    )
    p.add_argument("run_dir", help="the sweep's --output")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=30.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 30) until no cell is queued, running or retrying",
    )
    p.add_argument(
        "--verbose", action="store_true", help="for each cell that stopped: its reason in full and its log's last lines"
    )
    p.set_defaults(func=cmd_sweep_status)

    for name, func, help_text in (
        ("tables", cmd_tables, "the paper's tables (md, tex, csv) from a run directory"),
        ("plots", cmd_plots, "Pareto frontiers and scale plots (png, pdf) from a run directory"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("run_dir", nargs="+", help="sweep folder(s): a sweep run in parts, read as one")
        p.add_argument("--out", default=None, help=f"output folder (default: the first RUN_DIR/{name})")
        p.add_argument(
            "--hard-subset",
            nargs="?",
            const="fixed_scale",
            default=None,
            metavar="METHOD[@R]",
            help="add each cell's score on the samples METHOD answered wrongly, at R or (no @R) at each cell's own R "
            "(the flag alone: fixed_scale at each cell's R, VTC-Bench's downsampling reference)",
        )
        if name == "tables":
            p.add_argument(
                "--paper",
                action="store_true",
                help="add the paper's numbers and deltas (results/paper/*.csv), and its CAPO ablation "
                "beside the ResAdapt cells (capo_dist_ablation.md/csv)",
            )
            p.add_argument("--paper-dir", default=str(REPO / "results" / "paper"))
        p.set_defaults(func=func)

    p = sub.add_parser(
        "show",
        help="a contact sheet of one sample (png): one row per method, the frames as the backbone received them, "
        "the tokens that did not enter the LLM dimmed, merged groups coloured; from the records and the video alone",
    )
    p.add_argument(
        "run_dir", help="a sweep folder (every cell holding the sample) or one lmms-eval run's output folder"
    )
    p.add_argument("--sample", type=int, required=True, metavar="DOC_ID", help="lmms-eval's doc id of the sample")
    p.add_argument("--task", default=None, help="the task, where several tasks in the folder have that doc id")
    p.add_argument("--methods", default=None, help="comma-separated methods, in row order (default: every one)")
    p.add_argument("--out", default=None, help="the PNG (default: RUN_DIR/show/sample_<DOC_ID>.png)")
    p.add_argument(
        "--video-root",
        default=None,
        help="the folder holding the videos, for a folder copied from another machine (the records' paths are "
        "matched by their longest tail under it)",
    )
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("train", help="train the Allocator with CAPO (see resadapt_eval/train/config.py for the YAML)")
    p.add_argument("--config", required=True, help="training YAML")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument("--steps", type=int, default=None, help="override train.steps (total steps, counting resumed ones)")
    p.set_defaults(func=cmd_train)

    needle = sub.add_parser("needle", help="the needle benchmark").add_subparsers(dest="needle_command", required=True)
    p = needle.add_parser("make-data", help="write seeded train/val/test needle videos and JSONL")
    p.add_argument(
        "--out",
        default="fixtures/needle",
        help="output folder (default: fixtures/needle, which the resadapt_needle task reads)",
    )
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--test", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cue", action="store_true", help="add a coarse bright border to the evidence frames")
    p.add_argument(
        "--evidence-pairs",
        type=int,
        default=None,
        help=f"the evidence pair is drawn from the first N pairs (default: single, {EVIDENCE_PAIRS} of 8, "
        f"the first half; long: anywhere)",
    )
    p.add_argument(
        "--variant",
        default="single",
        choices=VARIANTS,
        help="single: one glyph, 16 frames; query: k candidate glyphs in coloured borders, the question names one; "
        f"long: {LONG_FRAMES} frames, the evidence one pair",
    )
    p.add_argument("--candidates", type=int, default=CANDIDATES, help="query variant: candidate pairs a video (2-4)")
    p.set_defaults(func=cmd_needle_make_data)
    p = needle.add_parser(
        "train-backbone", help="train a tiny Qwen2.5-VL- or Qwen3-VL-architecture needle backbone (two stages, CPU)"
    )
    p.add_argument(
        "--out",
        default="runs/needle_backbone",
        help="output folder (the committed weights are rewritten only when named here)",
    )
    p.add_argument(
        "--family", default="qwen25vl", choices=["qwen25vl", "qwen3vl"], help="architecture of a new backbone"
    )
    p.add_argument("--stage1-steps", type=int, default=500)
    p.add_argument("--stage2-steps", type=int, default=700)
    p.add_argument(
        "--batch", type=int, default=16, help="stage-1 pairs per step (stage 2 uses half, one sample at a time)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, help="continue training this backbone folder (use --stage1-steps 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="stage-2 learning rate")
    p.add_argument(
        "--vision-lr-scale", type=float, default=0.2, help="stage-2 vision tower learning rate / --lr (0: frozen)"
    )
    p.add_argument(
        "--cue-fraction",
        type=float,
        default=0.0,
        help="share of training videos with the --cue border on their evidence frames",
    )
    p.add_argument(
        "--variant",
        default="single",
        choices=VARIANTS,
        help="the needle data stage 2 trains on (query: the question names one of several candidates; "
        "long: up to 64 pairs, mostly small)",
    )
    p.set_defaults(func=cmd_needle_train_backbone)
    p = needle.add_parser("train-allocator", help="CAPO-train the Allocator on the frozen needle backbone (CPU)")
    p.add_argument(
        "--config", default="configs/needle_allocator.yaml", help="training YAML (the `resadapt-eval train` layout)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for the final Allocator checkpoint (default: final/ in the config's output_dir; "
        "the committed weights are rewritten only when named here)",
    )
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.set_defaults(func=cmd_needle_train_allocator)
    p = sub.add_parser("flops", help="TFLOPs per sample from a backbone's config alone (the latency table's rows)")
    p.add_argument("--backbone", default="qwen25vl-7b", help="qwen25vl-7b, qwen3vl-8b, or a pretrained folder")
    p.add_argument("--frames", default="16,32,64,128")
    p.add_argument("--size", default="896x672", help="source WIDTHxHEIGHT in pixels")
    p.add_argument("--methods", default="vanilla", help="comma-separated methods (resadapt: with --allocator)")
    p.add_argument(
        "--allocator", default="untrained", help="the Allocator resadapt rows count: a checkpoint folder or untrained"
    )
    p.add_argument("--query-tokens", type=int, default=16, help="question tokens the Allocator's text encoder reads")
    p.add_argument("--retention", type=float, default=0.25, help="R of every method that takes one")
    p.add_argument("--text-tokens", type=int, default=24, help="prompt tokens besides the visual ones")
    p.add_argument(
        "--output-tokens",
        type=int,
        default=0,
        help="generated tokens (decode), 0: prefill only; with --memory: max_new_tokens, whose keys and values "
        "the cache holds",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="print the memory plan instead: GiB per method and frames (weights, KV cache, activations, the "
        "method's own) and whether it fits --gpu-memory",
    )
    p.add_argument("--gpu-memory", default=None, help="the GPU's memory with its unit, e.g. 80GB (implies --memory)")
    p.add_argument("--headroom", default="0.1", help="fraction of --gpu-memory kept free (CUDA context, fragmentation)")
    p.add_argument("--dtype", default="bfloat16", help="model dtype for --memory: bfloat16, float16 or float32")
    p.add_argument(
        "--attention", default="sdpa", help="attn_implementation for --memory: sdpa, eager or flash_attention_2"
    )
    p.set_defaults(func=cmd_flops)

    p = sub.add_parser(
        "profile", help="time every stage of a request per method, frames and R: the paper's latency table"
    )
    p.add_argument("--card", required=True, help="model card (backbone, pretrained, model_args, allocator)")
    p.add_argument("--methods", default=None, help="comma-separated (default: vanilla,fixed_scale and resadapt)")
    p.add_argument("--frames", default=None, help="comma-separated frame counts (default: the card's)")
    p.add_argument("--retention", default="0.25", help="comma-separated R of every method that takes one")
    p.add_argument("--runs", type=int, default=5, help="timed requests per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first, per configuration")
    p.add_argument("--video", default=None, help="video file (default: a synthetic one at --size)")
    p.add_argument("--size", default="640x480", help="WIDTHxHEIGHT of the synthetic video")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument(
        "--engine-args",
        default="",
        help="VLLMBackbone settings, e.g. tensor_parallel_size=4,gpu_memory_utilization=0.8 (vllm only)",
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--query", default="What happens in this video?")
    p.add_argument("--output", default="runs/profile", help="folder for records.jsonl and latency.md/csv")
    p.set_defaults(func=cmd_profile)

    p = needle.add_parser(
        "report",
        help="accuracy with standard errors and the evidence-pair fraction per cell of a needle sweep, "
        "an accuracy-TFLOPs plot and evidence plots",
    )
    p.add_argument("run_dir", nargs="+", help="sweep folder(s), e.g. a frame-selection sweep beside the main one")
    p.add_argument(
        "--data", default="fixtures/needle/test.jsonl", help="the needle rows the sweep read (for evidence_pair)"
    )
    p.add_argument("--out", default=None, help="output folder (default: the first RUN_DIR/needle)")
    p.set_defaults(func=cmd_needle_report)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
