"""`resadapt-eval needle train-allocator`: CAPO-train the Allocator on the frozen needle backbone.

The YAML is the `resadapt-eval train` layout (train/config.py); `configs/needle_allocator.yaml`
is the recipe behind the committed checkpoint. The trainer's checkpoints and `metrics.jsonl` go
to the YAML's `output_dir`; the final Allocator (`config.json`, `model.safetensors`: trainable
weights only; `budget.json`: the budget it was trained under; `backbone.json`: the backbone) is copied to `out` with a
`training.txt` (the YAML, seconds, last metrics).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from ..allocator import BACKBONE_FILE, BUDGET_FILE
from ..train.config import build_trainer
from ..train.trainer import CHECKPOINTS


def train_allocator(
    config: str | Path, out: str | Path | None = None, steps: int | None = None, progress: bool = True
) -> Path:
    """Train to the YAML's `train.steps` (or `steps`) and copy the final Allocator to `out`
    (default: `final/` in the config's `output_dir`)."""
    trainer = build_trainer(config, steps=steps)
    t0 = time.perf_counter()
    history = trainer.train(progress=progress)
    seconds = time.perf_counter() - t0
    final = trainer.output_dir / CHECKPOINTS / f"step-{trainer.step:06d}" / "allocator"
    out = Path(out) if out is not None else trainer.output_dir / "final"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", BUDGET_FILE, BACKBONE_FILE):
        if (final / name).is_file():
            shutil.copy2(final / name, out / name)
    tail = history[-10:]
    summary = (
        {k: float(np.mean([h[k] for h in tail])) for k in ("accuracy", "achieved_retention", "mean_scale", "gini")}
        if tail
        else {}
    )
    (out / "training.txt").write_text(
        f"resadapt-eval needle train-allocator --config {config} --out {out}\n"
        f"steps={trainer.step} seconds={seconds:.0f}\n"
        f"last {len(tail)} steps (means): {json.dumps(summary)}\n\n"
        f"{Path(config).read_text()}"
    )
    return out
