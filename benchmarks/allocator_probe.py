"""Can the Allocator single out the candidate a question asks about? A supervised probe, not a recipe.

Fits the Allocator's decoder (the architecture CAPO trains, on the same frozen encoders) by
weighted binary cross-entropy on the needle query split's labels: the asked candidate's two frames
high (policy mean a_t -> 1), every other frame low. It measures what the decoder can represent from
an encoder pair and how many labelled videos it takes, apart from CAPO's exploration, which gets a
far noisier signal per video. Every --every steps it prints, on the test videos:

- asked on top: the asked pair's mean a_t is above each other candidate pair's (chance 1/3);
- candidates on top: every candidate pair is above every pair without a candidate.

--query picks what the Allocator reads: the whole question (as in the benchmark), only the colour
word the question names, or "" (then asked on top cannot beat chance). docs/needle.md, "The query
split", has the numbers:

  resadapt-eval needle make-data --variant query --out fixtures/needle-query --train 800 --val 0 --test 400
  .venv/bin/python benchmarks/allocator_probe.py --encoder tiny-colour --query question
  .venv/bin/python benchmarks/allocator_probe.py --encoder tiny-colour --query colour
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from tqdm import tqdm

from resadapt_eval.allocator import Allocator, AllocatorConfig
from resadapt_eval.video import decode_video

QUERIES = ("question", "colour", "empty")


def load(path: str, allocator: Allocator, query: str, frames: int) -> dict:
    """Frozen features of every video in a query-split JSONL: frame features (N, T, d), query token
    states (N, L, d) with their mask, the label (N, T) and each video's candidate pairs."""
    rows = [json.loads(line) for line in open(path)]
    texts = {
        "question": [r["question"] for r in rows],
        "colour": [r["colour"] for r in rows],
        "empty": [""] * len(rows),
    }
    features = []
    for row in tqdm(rows, desc=f"encoding {path}"):
        clip = decode_video(row["video"], frames).frames
        features.append(allocator.encoders.encode_frames(torch.from_numpy(np.ascontiguousarray(clip))))
    with torch.no_grad():
        text, text_mask = allocator.encoders.encode_text(texts[query])
    label = torch.zeros(len(rows), frames)
    for i, row in enumerate(rows):
        label[i, row["evidence_frames"]] = 1.0
    return dict(frames=torch.stack(features), text=text, text_mask=text_mask, label=label, rows=rows, pairs=frames // 2)


def policy_mean(allocator: Allocator, data: dict, index: torch.Tensor) -> torch.Tensor:
    """The policy's mean latent a_t, (len(index), T)."""
    frames, text, text_mask = data["frames"][index], data["text"][index], data["text_mask"][index]
    alpha, beta = allocator(frames, torch.ones(frames.shape[:2], dtype=torch.bool), text, text_mask)
    return alpha / (alpha + beta)


def scores(allocator: Allocator, data: dict) -> tuple[float, float]:
    """(asked on top, candidates on top) over every video in `data`, as shares."""
    with torch.no_grad():
        pair_mean = (
            policy_mean(allocator, data, torch.arange(len(data["rows"]))).view(len(data["rows"]), -1, 2).mean(-1)
        )
    asked = candidates = 0
    for means, row in zip(pair_mean, data["rows"]):
        others = [p for p in row["candidate_pairs"] if p != row["evidence_pair"]]
        rest = [p for p in range(data["pairs"]) if p not in row["candidate_pairs"]]
        asked += bool(all(means[row["evidence_pair"]] > means[p] for p in others))
        candidates += bool(min(means[p] for p in row["candidate_pairs"]) > max(means[p] for p in rest))
    return asked / len(data["rows"]), candidates / len(data["rows"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", default="fixtures/needle-query/train.jsonl")
    parser.add_argument("--test", default="fixtures/needle-query/test.jsonl")
    parser.add_argument("--encoder", default="tiny-colour", help="frozen encoders (AllocatorConfig.encoder)")
    parser.add_argument("--query", choices=QUERIES, default="question", help="what the Allocator reads")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-text-positions", action="store_true", help="leave text_positions off")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32, help="videos a step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    config = AllocatorConfig(
        encoder=args.encoder,
        width=args.width,
        num_heads=args.heads,
        num_layers=args.layers,
        frame_norm=True,
        text_positions=not args.no_text_positions,
        s_min=0.1,
        s_max=1.9,
        init_concentration=2.5,
        seed=args.seed,
    )  # configs/needle_allocator_query.yaml's shape
    allocator = Allocator(config)
    train, test = (load(path, allocator, args.query, args.frames) for path in (args.train, args.test))
    weights = [p for name, p in allocator.named_parameters() if not name.startswith("encoders.")]
    optimizer = torch.optim.AdamW(weights, lr=args.lr)
    positive_weight = (args.frames - 2) / 2  # two asked frames against T - 2 others
    generator = torch.Generator().manual_seed(args.seed)
    reached, last_loss = None, float("nan")
    print(
        f"{'step':>6} {'loss':>7} {'asked on top':>13} {'candidates on top':>18}  ({args.encoder}, query={args.query})"
    )
    for step in range(args.steps + 1):
        if step % args.every == 0:
            asked, candidates = scores(allocator, test)
            print(f"{step:>6} {last_loss:>7.3f} {100 * asked:>12.1f}% {100 * candidates:>17.1f}%")
            if reached is None and asked >= 0.9:
                reached = step
        if step == args.steps:
            break
        index = torch.randint(0, len(train["rows"]), (args.batch,), generator=generator)
        mean = policy_mean(allocator, train, index).clamp(1e-4, 1 - 1e-4)
        label = train["label"][index]
        loss = -(positive_weight * label * mean.log() + (1 - label) * (1 - mean).log()).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        last_loss = loss.item()
    print(
        f"asked on top >= 90% first at step {reached} ({args.batch} videos a step)"
        if reached is not None
        else f"asked on top never reached 90% in {args.steps} steps"
    )


if __name__ == "__main__":
    main()
