"""`resadapt-eval` command line: fixtures | demo | train."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from .fixtures import ensure_fixtures, write_fixtures

DEMO_METHODS = ("vanilla", "fixed_scale")


def cmd_fixtures(args) -> int:
    paths = write_fixtures(Path(args.out), seed=args.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def lmms_eval_command(model: str, model_args: dict, tasks: str, include_path: str, output_path: Path, extra: list[str] = ()) -> list[str]:
    """The `lmms-eval` command line for one run, as a list of arguments."""
    arg_string = ",".join(f"{k}={v}" for k, v in model_args.items())
    return [
        sys.executable, "-m", "lmms_eval",
        "--model", model, "--model_args", arg_string,
        "--tasks", tasks, "--include_path", include_path,
        "--output_path", str(output_path), "--log_samples", *extra,
    ]  # fmt: skip


def read_run(output_path: Path, task: str) -> dict:
    """Score, achieved R, visual tokens and seconds of one finished lmms-eval run under `output_path`."""
    results = sorted(output_path.rglob("*_results.json"))
    sidecars = sorted(output_path.rglob("resadapt_samples_*.jsonl"))
    if not results or not sidecars:
        raise FileNotFoundError(f"no lmms-eval results or resadapt sidecar under {output_path}")
    scores = json.loads(results[-1].read_text())["results"][task]
    score = next(v for k, v in scores.items() if k.endswith(",none") and "stderr" not in k)
    records = [json.loads(line) for path in sidecars for line in path.read_text().splitlines()]
    done = [r for r in records if r["error"] is None]
    return dict(
        score=score,
        samples=len(records),
        failed=len(records) - len(done),
        retention=sum(r["achieved_retention"] for r in done) / max(len(done), 1),
        visual_tokens=sum(r["visual_tokens"] for r in done),
        seconds=sum(r["decode_s"] + r["preprocess_s"] + r["generate_s"] for r in records),
    )


def cmd_demo(args) -> int:
    root = Path(args.repo).resolve()
    out = Path(args.out).resolve()
    fixtures = ensure_fixtures(root / "fixtures")
    rows = []
    for method in DEMO_METHODS:
        model_args = dict(pretrained=fixtures / "qwen25vl", method=method, max_num_frames=args.frames, device="cpu", dtype="float32")
        if method != "vanilla":
            model_args["retention"] = args.retention
        run_dir = out / method
        cmd = lmms_eval_command("resadapt_qwen25vl", model_args, "resadapt_smoke_videoqa", str(root / "tasks"), run_dir)
        print(f"[demo] {method}: {' '.join(map(str, cmd[2:]))}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=root, capture_output=not args.verbose, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] if proc.stdout else "", proc.stderr[-3000:] if proc.stderr else "", file=sys.stderr)
            print(f"[demo] lmms-eval failed for {method} (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
        rows.append(dict(method=method, **read_run(run_dir, "resadapt_smoke_videoqa"), wall=time.perf_counter() - t0))
    print()
    print(f"{'method':<12} {'achieved R':>10} {'visual tokens':>13} {'accuracy':>8} {'model s':>8} {'wall s':>7}")
    for r in rows:
        print(f"{r['method']:<12} {r['retention']:>10.3f} {r['visual_tokens']:>13d} {r['score']:>8.1f} {r['seconds']:>8.2f} {r['wall']:>7.1f}")
    print()
    print("The tiny Qwen2.5-VL is random: its accuracy is noise. The token counts and R are exact.")
    print(f"Outputs (lmms-eval results, samples, resadapt sidecars): {out}")
    return 0


def cmd_train(args) -> int:
    from .train.config import build_trainer

    trainer = build_trainer(args.config, steps=args.steps)
    history = trainer.train(resume=args.resume)
    checkpoint = trainer.output_dir / "checkpoints" / f"step-{trainer.step:06d}" / "allocator"
    if history:
        last = history[-1]
        print(f"step {last['step']}: mean scale {last['mean_scale']:.3f}, R {last['achieved_retention']:.3f}, reward {last['reward']:.3f}, accuracy {last['accuracy']:.3f}")
    print(f"checkpoint: {checkpoint}  (use: method=resadapt,allocator={checkpoint})")
    print(f"metrics: {trainer.output_dir / 'metrics.jsonl'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="resadapt-eval", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fixtures", help="write tiny random Qwen2.5-VL/Qwen3-VL checkpoints and the smoke dataset")
    p.add_argument("--out", default="fixtures", help="output folder (default: fixtures, which the smoke task reads)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_fixtures)

    p = sub.add_parser("demo", help="vanilla vs fixed_scale on the tiny offline Qwen2.5-VL through the lmms-eval CLI")
    p.add_argument("--out", default="demo_out", help="output folder for the lmms-eval runs")
    p.add_argument("--repo", default=".", help="repository root (holds tasks/ and fixtures/)")
    p.add_argument("--retention", type=float, default=0.25, help="target retention R for fixed_scale")
    p.add_argument("--frames", type=int, default=8, help="max_num_frames")
    p.add_argument("--verbose", action="store_true", help="show lmms-eval's output")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("train", help="train the Allocator with CAPO (see resadapt_eval/train/config.py for the YAML)")
    p.add_argument("--config", required=True, help="training YAML")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument("--steps", type=int, default=None, help="override train.steps (total steps, counting resumed ones)")
    p.set_defaults(func=cmd_train)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
