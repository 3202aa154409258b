"""CAPO reward-design ablation in simulation (paper Fig. reward_ablation and the L_sim study).

    .venv/bin/python benchmarks/capo_ablation.py [--steps 400] [--seed 0] [--out results/capo_ablation]

Trains four variants of the real Allocator + CAPO trainer against the simulated backbone
(`resadapt_eval.train.engines.SimulatedBackbone`), prints a table of the last 100 steps and
writes mean scale / accuracy / within-video scale std over training as PNG and PDF. A fifth
variant, N-CAPO (logit-normal policy instead of Beta, with L_sim), is the distribution-family ablation.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from resadapt_eval.train.simulation import N_CAPO, VARIANTS, run_ablation, summarize  # noqa: E402


def smooth(values, window=10):
    values = np.asarray(values, dtype=float)
    return np.convolve(values, np.ones(window) / window, mode="valid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/capo_ablation")
    args = parser.parse_args()

    t0 = time.perf_counter()
    histories = run_ablation(steps=args.steps, seed=args.seed, variants={**VARIANTS, **N_CAPO}, progress=True)
    table = summarize(histories)
    print(f"\nlast 100 of {args.steps} steps, seed {args.seed}, {time.perf_counter() - t0:.0f} s")
    print(
        f"{'variant':<15} {'mean scale':>10} {'scale std':>9} {'Gini':>6} "
        f"{'accuracy':>8} {'score':>6} {'R~mean s^2':>10}"
    )
    for name, row in table.items():
        print(
            f"{name:<15} {row['mean_scale']:>10.3f} {row['scale_std']:>9.3f} {row['gini']:>6.3f} "
            f"{row['accuracy']:>8.3f} {row['reward']:>6.3f} {row['achieved_retention']:>10.3f}"
        )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, history in histories.items():
        for ax, key in zip(axes, ("mean_scale", "accuracy", "scale_std")):
            ax.plot(smooth([m[key] for m in history]), label=name, linewidth=1.6)
    for ax, title in zip(axes, ("mean predicted scale", "accuracy (u)", "within-video scale std")):
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].axhline(0.2, color="grey", linestyle=":", linewidth=1)
    axes[0].axhline(1.8, color="grey", linestyle=":", linewidth=1)
    axes[1].legend(frameon=False, loc="center right")
    fig.tight_layout()
    for suffix in ("png", "pdf"):
        fig.savefig(out / f"capo_ablation.{suffix}", dpi=150)
    print(f"plots: {out / 'capo_ablation.png'}, {out / 'capo_ablation.pdf'}")


if __name__ == "__main__":
    main()
