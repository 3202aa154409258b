"""Qwen2.5-VL M-RoPE positions for prompts whose video arrives as one item per frame pair.

One rule, used by the HF adapter (explicit `position_ids`) and by the vLLM model class (its
`get_mrope_input_positions`), so both engines place every token at the same position.

A *run* is a stretch of vision items laid back to back in the prompt (our per-pair items of one
video; a lone image or stock video is a run of one item). Text positions count on from the previous
token on all three axes. Inside a run starting at position s, temporal group k of the run (a
pair) gets t = s + its temporal index (`temporal_indices`) and h / w = s + its row / column in its
own merged grid; the text after the run continues from s + max over groups of max(h, w). With one
item this is exactly transformers' stock `get_rope_index` (5.x), so equal-size pairs reproduce
the stock single-video positions. A video compressed inside vLLM holds fewer placeholders than its grid
(`VisionRun.placeholders`); the text after it keeps the uncompressed video's positions, as on the HF path.

Positions are built on the CPU from Python ints (vLLM takes CPU positions; the HF adapter moves them
to the prompt's device in one transfer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VisionRun:
    """Vision items back to back in the prompt.

    offset: index of the run's first placeholder token; grids: merged-token grid (t, h, w) per
    item; second_per_grid_ts: seconds per temporal group of each item (the processor's value;
    anything for images, whose single group sits at temporal index 0).
    """

    offset: int
    grids: list[tuple[int, int, int]]
    second_per_grid_ts: list[float]
    placeholders: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    @property
    def prompt_tokens(self) -> int:
        """Placeholders the run holds in the prompt: its tokens, or fewer for a compressed video
        (`placeholders`: they take the first positions, which the engine overwrites with the kept tokens')."""
        return self.num_tokens if self.placeholders is None else self.placeholders


def temporal_indices(group_seconds: list[float], tokens_per_second: float) -> torch.Tensor:
    """Temporal index (G,) of each temporal group of a run relative to the run's start.

    group_seconds: seconds each group covers (up to the next group's start), as the processor's
    float32 `second_per_grid_ts`. Equal durations (uniformly spaced frames): the stock rule
    int(k * tokens_per_second * d) in float32. Unequal ones (after frame selection): floor of
    tokens_per_second x the seconds since the run's first group, summed in float64 and rounded
    to 1e-3 of a position so float32 durations cannot flip a whole second.
    """
    durations = torch.tensor(group_seconds, dtype=torch.float32)  # cpu: positions are built on the CPU
    if len(group_seconds) <= 1 or bool((durations == durations[0]).all()):
        return (torch.arange(len(group_seconds)) * (tokens_per_second * durations[0])).long()  # cpu: as durations
    elapsed = torch.cat([torch.zeros(1, dtype=torch.float64), durations.double().cumsum(0)[:-1]])  # cpu: as durations
    return torch.floor(torch.round(elapsed * tokens_per_second, decimals=3)).long()


def qwen25_mrope_positions(length: int, runs: list[VisionRun], tokens_per_second: float) -> torch.Tensor:
    """M-RoPE positions (3, length) of a prompt of `length` tokens holding `runs` (see module doc)."""
    parts, cursor, position = [], 0, 0
    for run in sorted(runs, key=lambda r: r.offset):
        text = run.offset - cursor
        parts.append(torch.arange(text).expand(3, -1) + position)  # cpu: positions are built on the CPU
        start = position + text
        groups = [(h, w) for t, h, w in run.grids for _ in range(t)]
        seconds = [s for (t, _, _), s in zip(run.grids, run.second_per_grid_ts) for _ in range(t)]
        times = temporal_indices(seconds, tokens_per_second)
        video = []
        for (h, w), t in zip(groups, times.tolist()):
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")  # cpu: positions, as above
            video.append(torch.stack([torch.full((h * w,), t), hh.flatten(), ww.flatten()]) + start)  # cpu: as above
        parts.append(torch.cat(video, dim=1)[:, : run.prompt_tokens])
        position = start + max(max(h, w) for h, w in groups)
        cursor = run.offset + run.prompt_tokens
    if cursor > length:
        raise ValueError(f"vision runs reach token {cursor}, beyond the prompt's {length}")
    parts.append(torch.arange(length - cursor).expand(3, -1) + position)  # cpu: positions, as above
    return torch.cat(parts, dim=1)
