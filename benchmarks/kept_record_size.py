"""Bytes the kept-token field (`SampleRecord.kept`, `resadapt_eval/kept.py`) adds to a sidecar record
at a real size: 128 frames of Qwen2.5-VL-7B at 768 tokens per frame pair (a 4:3 896x672 source at the
default 602112 max_pixels), 64 pairs, 49152 planned tokens.

    .venv/bin/python benchmarks/kept_record_size.py [--frames 128] [--retention 0.25 0.1]

Each compressor runs on the same random features (width 64: the assignment's structure, not its
features, sets the size) with random last-block attention and keys; an in-LLM method is one stage
keeping R of the tokens at a layer. Prints the field's JSON bytes per method and R, beside the mask's
ceil(N / 8) bytes before base64.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from resadapt_eval.baselines.common import VisualTokens, kept_count
from resadapt_eval.kept import KeptTokens, encode
from resadapt_eval.methods import METHODS

GRID = (1, 24, 32)  # 768 tokens per pair: 672 x 896 px at 28 px per token
WIDTH = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=128)
    parser.add_argument("--retention", type=float, nargs="+", default=[0.25, 0.1])
    parser.add_argument("--methods", default="random_drop,visionzip,divprune,tome,fastvid,holitom")
    args = parser.parse_args()
    pairs = args.frames // 2
    n = pairs * math.prod(GRID)
    g = torch.Generator().manual_seed(0)
    tokens = VisualTokens(
        features=torch.randn(n, WIDTH, generator=g),
        pair_sizes=[math.prod(GRID)] * pairs,
        grids=[GRID] * pairs,
        received_attention=torch.rand(n, generator=g),
        keys=torch.randn(n, WIDTH, generator=g),
    )
    print(f"{args.frames} frames, {pairs} pairs, {n} planned tokens; mask {math.ceil(n / 8)} bytes before base64")
    print(f"{'method':<14}{'R':>6}{'kept':>8}{'merges':>8}{'field bytes':>13}")
    for retention in args.retention:
        keep = kept_count(retention, n, pairs)
        for name in args.methods.split(","):
            compression = METHODS[name].compress(tokens, keep, 0)
            kept = KeptTokens(compression.assignment.numpy())
            size = len(json.dumps(encode(kept, tokens.pair_sizes)))
            print(f"{name:<14}{retention:>6}{len(kept.kept):>8}{kept.merges!s:>8}{size:>13}")
        stage = torch.zeros(n, dtype=torch.bool)
        stage[torch.randperm(n, generator=g)[:keep]] = True
        size = len(json.dumps(encode(KeptTokens.everything(n, ((2, stage.numpy()),)), tokens.pair_sizes)))
        print(f"{'in-LLM stage':<14}{retention:>6}{n:>8}{'False':>8}{size:>13}")


if __name__ == "__main__":
    main()
