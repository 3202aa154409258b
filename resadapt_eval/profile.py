"""`resadapt-eval profile`: time every stage of a request on a card's backbone, for each method,
frame count and R, and print the paper's latency table (`report/latency.py`).

One video (given, or a synthetic one written at --size with as many frames as the largest count)
is answered `warmup` times untimed, then `runs` times, per configuration, through the same
`VideoPipeline` lmms-eval runs (HF adapter or the vLLM engine); every timed sample's sidecar
record goes to `records.jsonl`, the table to `latency.md` / `latency.csv`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .methods import get_method
from .report.latency import latency_rows, to_markdown, write_latency
from .sweep import ModelCard

LOADING_ARGS = ("device", "dtype", "attn_implementation")  # card model_args that load the backbone


@dataclass
class ProfileSettings:
    """methods / frames / retentions: the grid (a method without a target runs once per frame
    count); runs, warmup: timed and untimed requests per configuration; video: a video file, or
    None for a synthetic one of `size` (width, height) pixels; engine: hf | vllm, with
    `engine_args` for `VLLMBackbone`; max_new_tokens and query: the request."""

    methods: list[str]
    frames: list[int]
    retentions: list[float]
    runs: int = 5
    warmup: int = 1
    video: str | None = None
    size: tuple[int, int] = (640, 480)
    engine: str = "hf"
    engine_args: dict = field(default_factory=dict)
    max_new_tokens: int = 16
    query: str = "What happens in this video?"

    def __post_init__(self):
        for name in self.methods:
            get_method(name)  # an unknown method stops here, naming the known ones
        if self.runs < 1 or self.warmup < 0:
            raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={self.runs}, warmup={self.warmup}")
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"engine must be hf or vllm, got {self.engine!r}")
        if not self.frames or min(self.frames) < 1:
            raise ValueError(f"frames must be positive frame counts, got {self.frames}")

    def configurations(self) -> list[tuple[str, int, float | None]]:
        grid = []
        for frames in self.frames:
            for name in self.methods:
                targets = [None] if get_method(name).full_budget else self.retentions
                grid += [(name, frames, r) for r in targets]
        return list(dict.fromkeys(grid))


def synthetic_video(path: Path, size: tuple[int, int], num_frames: int) -> Path:
    """A moving-square video of `num_frames` frames at `size` (width, height), 2 fps."""
    from .fixtures import smoke_frames, write_video

    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        frames = smoke_frames(np.random.default_rng(0), size[0], size[1], num_frames, (220, 40, 40))
        write_video(path, frames, fps=2.0)
    return path


def build_backbone(card: ModelCard, settings: ProfileSettings):
    """The card's backbone on the chosen engine, loaded once for every configuration."""
    loading = {k: card.model_args[k] for k in LOADING_ARGS if k in card.model_args}
    if settings.engine == "vllm":
        from .backbones.vllm_engine import VLLMBackbone

        return VLLMBackbone(
            card.backbone,
            card.pretrained,
            max(settings.frames),
            dtype=loading.get("dtype", "auto"),
            allocator_device=loading.get("device"),
            **settings.engine_args,
        )
    from .backbones.qwen import ADAPTERS

    return ADAPTERS[card.backbone].from_pretrained(card.pretrained, **loading)


def profile(card: ModelCard, settings: ProfileSettings, out: Path) -> list[dict]:
    """Run the grid, write `records.jsonl`, `latency.md` and `latency.csv` into `out`; the rows."""
    from .pipeline import Request, VideoPipeline
    from .runspec import config_from_model_args

    out.mkdir(parents=True, exist_ok=True)
    video = settings.video or str(synthetic_video(out / "profile_video.mp4", settings.size, max(settings.frames)))
    pipeline_args = {k: v for k, v in card.model_args.items() if k not in LOADING_ARGS}
    configurations = settings.configurations()
    configs = {}  # every configuration validated before the backbone loads
    for method, frames, retention in configurations:
        allocator = card.allocator if get_method(method).needs_allocator else None
        configs[method, frames, retention] = config_from_model_args(
            **pipeline_args, method=method, max_num_frames=frames, retention=retention, allocator=allocator
        )
    backbone = build_backbone(card, settings)
    prompt = backbone.layout.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": settings.query}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    request = Request(
        prompt, video=video, query=settings.query, gen_kwargs=dict(max_new_tokens=settings.max_new_tokens)
    )
    groups = []
    with open(out / "records.jsonl", "w") as sink:
        for key in tqdm(configurations, desc="profile", unit="config"):
            pipeline = VideoPipeline(backbone, configs[key])
            for _ in range(settings.warmup):
                pipeline.run(request)
            records = []
            for _ in range(settings.runs):
                _, record = pipeline.run(request)
                records.append(record.to_dict())
                sink.write(json.dumps(records[-1], allow_nan=False) + "\n")
            failed = [r["error"] for r in records if r["error"]]
            if failed:
                tqdm.write(f"{key}: {len(failed)} of {settings.runs} requests failed: {failed[0]}")
            groups.append((*key, records))
    rows = latency_rows(groups)
    write_latency(rows, out)
    return rows


def print_rows(rows: list[dict]) -> None:
    print(to_markdown(rows))
