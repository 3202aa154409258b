"""Training data: one record per (video, question), from JSONL or Parquet.

Columns: `video` (path; relative paths resolve against the data file's folder), `question` (the
full text shown to the model, options included), `answer`, `task_type` (one of
`capo.rewards.TASK_TYPES`), and for grounding tasks `segments` ([[start, end], ...] in seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..capo.rewards import TASK_TYPES

REQUIRED = ("video", "question", "answer", "task_type")


@dataclass
class TrainSample:
    video: str
    question: str
    answer: str
    task_type: str
    segments: list[tuple[float, float]] = field(default_factory=list)


def load_samples(path: str | Path) -> list[TrainSample]:
    """Read and validate a training file; errors name the file and the row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training data not found: {path}")
    if path.suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        frame = pd.read_json(path, lines=path.suffix == ".jsonl", dtype=False)
    else:
        raise ValueError(f"{path}: training data must be .jsonl or .parquet")
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; required: {list(REQUIRED)}")
    samples = []
    for i, row in enumerate(frame.to_dict("records")):
        if row["task_type"] not in TASK_TYPES:
            raise ValueError(f"{path} row {i}: task_type {row['task_type']!r} is not one of {TASK_TYPES}")
        video = Path(row["video"])
        video = video if video.is_absolute() else path.parent / video
        segments = row.get("segments")
        segments = (
            []
            if segments is None or (isinstance(segments, float) and pd.isna(segments))
            else [tuple(map(float, s)) for s in segments]
        )
        samples.append(
            TrainSample(
                video=str(video),
                question=str(row["question"]),
                answer=str(row["answer"]),
                task_type=row["task_type"],
                segments=segments,
            )
        )
    if not samples:
        raise ValueError(f"{path}: no training samples")
    return samples
