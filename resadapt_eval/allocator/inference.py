"""Allocator inference: policy mean / quantile / seeded sample -> per-frame scales.

`AllocatorPolicy` is the `method=resadapt` scale source: it runs the Allocator on the frames the
pipeline already decoded and the query, and reports its time per stage (text encode, visual
encode, scale prediction) in seconds, as the paper's latency table splits it (CUDA events on a
GPU, wall clocks on CPU).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch

from ..manifest import REPO
from ..measure.clock import Stopwatch
from .encoders import FRAME_CHUNK
from .model import CONFIG_NAME, INFERENCE_MODES, Allocator, AllocatorConfig, CheckpointError, load_config

UNTRAINED = "untrained"
BUDGET_FILE = "budget.json"  # beside an Allocator checkpoint's config.json: the budget it was trained with
BACKBONE_FILE = "backbone.json"  # beside it: the backbone it was trained with (family, pretrained)
BUDGET_MISSING = "missing"  # `budget_source` of a checkpoint saved without budget.json
BUDGET_KEYS = (
    "s_min",
    "s_max",
    "min_tokens_per_pair",
    "max_tokens_per_pair",
    "pair_reduction",
    "max_num_frames",
    "min_pixels",
    "max_pixels",
)


def load_allocator(spec: str, device: str | torch.device = "cpu") -> Allocator:
    """`untrained`: the untrained default, asked for on purpose (minilm-effnet encoders, seed 0,
    initial mean scale 1.0); otherwise a `save_pretrained` folder."""
    if spec == UNTRAINED:
        allocator = Allocator(AllocatorConfig())
    else:
        allocator = Allocator.from_pretrained(Path(spec))
    return allocator.to(device).eval()


def training_budget(spec: str | None) -> dict:
    """The budget settings an Allocator checkpoint was trained with, keyed as model_args (its
    `budget.json`); empty for `untrained` or a checkpoint saved without one."""
    if spec in (None, UNTRAINED):
        return {}
    path = Path(spec) / BUDGET_FILE
    if not path.is_file():
        return {}
    try:
        budget = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    unknown = sorted(set(budget) - set(BUDGET_KEYS))
    if unknown:
        raise CheckpointError(f"{path}: unknown budget settings {unknown}; known: {', '.join(BUDGET_KEYS)}")
    return budget


def check_checkpoint(spec: str | None) -> None:
    """Stop at start on an `allocator=` that is neither `untrained` nor an Allocator checkpoint
    folder: its config.json is read and checked (`load_config`), the weights are not loaded."""
    if spec not in (None, UNTRAINED):
        load_config(Path(spec) / CONFIG_NAME)


def budget_source(spec: str | None) -> str | None:
    """Where a run's budget settings stand against the Allocator's training, as every sidecar
    record states it (`allocator_budget`): `budget.json` (settings not given were taken from it),
    `missing` (a checkpoint saved without one: the budget it was trained under is unknown, and the
    run takes model_args and the defaults, s in [0.2, 1.8]); None without a checkpoint."""
    if spec in (None, UNTRAINED):
        return None
    return BUDGET_FILE if (Path(spec) / BUDGET_FILE).is_file() else BUDGET_MISSING


def backbone_identity(family: str, pretrained: str) -> dict:
    """How a backbone is recorded beside an Allocator checkpoint (`backbone.json`) and compared
    with the one running it: its family and `pretrained`, a local folder as its absolute path."""
    path = Path(pretrained).expanduser()
    return dict(family=family, pretrained=str(path.resolve()) if path.exists() else str(pretrained))


def training_backbone(spec: str | None) -> dict:
    """The backbone an Allocator checkpoint was trained with (its `backbone.json`: family,
    pretrained; a relative `pretrained` that names a folder beside the checkpoint, as in a shipped
    checkpoint, is that folder's absolute path); empty for `untrained` or a checkpoint saved without one."""
    if spec in (None, UNTRAINED):
        return {}
    path = Path(spec) / BACKBONE_FILE
    if not path.is_file():
        return {}
    try:
        trained = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(trained, dict) or set(trained) != {"family", "pretrained"}:
        raise CheckpointError(f"{path}: expected an object with family and pretrained")
    beside = Path(spec) / str(trained["pretrained"])
    if not Path(str(trained["pretrained"])).is_absolute() and beside.is_dir():
        trained["pretrained"] = str(beside.resolve())
    return trained


def backbone_differences(spec: str | None, family: str, pretrained: str) -> list[str]:
    """`family X (trained with Y)`, `pretrained ...` for each way the backbone running the
    Allocator `spec` differs from the one it was trained with; empty when it was recorded as the same
    or not recorded."""
    trained, running = training_backbone(spec), backbone_identity(family, pretrained)
    return [f"{key} {running[key]} (trained with {trained[key]})" for key in trained if trained[key] != running[key]]


def check_backbone(spec: str | None, family: str, pretrained: str, transfer: bool) -> list[str]:
    """ValueError when the Allocator `spec` was trained with another backbone than the one running
    it (`backbone_differences`), unless `transfer` (model_args allocator_transfer=true: run it on
    another backbone on purpose, as the paper transfers its Qwen2.5-VL Allocator to Qwen3-VL);
    returns the differences (empty when none, or none recorded)."""
    differences = backbone_differences(spec, family, pretrained)
    if differences and not transfer:
        raise ValueError(
            f"allocator={spec} was trained with another backbone: {'; '.join(differences)}. Its scales were "
            "learned for that backbone's answers: give an Allocator trained with this backbone (resadapt-eval "
            "train), or model_args allocator_transfer=true to run this one on it on purpose"
        )
    return differences


def known_allocators(family: str, pretrained: str) -> list[str]:
    """Allocator checkpoints committed in this repository (`results/**/config.json` of an
    Allocator) trained with this backbone (their `backbone.json`), for error messages; empty when
    installed without the repository or when none was."""
    return [
        str(p.parent.relative_to(REPO))
        for p in sorted(REPO.glob("results/**/allocator*/config.json"))
        if (p.parent / "model.safetensors").is_file()
        and training_backbone(str(p.parent))
        and not backbone_differences(str(p.parent), family, pretrained)
    ]


class AllocatorPolicy:
    """The Allocator as the `method=resadapt` scale source: raw per-frame scales s_t for decoded
    frames and a query (projection onto a retention is the pipeline's planning stage).
    frame_chunk: frames per visual encode call (features do not depend on it); resize: how frames
    are brought to the encoders' square input (`encoders.coarse_frames`: exact, or fast)."""

    def __init__(
        self,
        allocator: Allocator,
        mode: str = "mean",
        quantile: float = 0.5,
        seed: int = 0,
        frame_chunk: int = FRAME_CHUNK,
        resize: str = "exact",
    ):
        if mode not in INFERENCE_MODES:
            raise ValueError(f"allocator inference must be one of {INFERENCE_MODES}, got {mode!r}")
        if frame_chunk < 1:
            raise ValueError(f"frame_chunk must be at least 1, got {frame_chunk}")
        self.allocator, self.mode, self.quantile, self.seed = allocator, mode, quantile, seed
        self.frame_chunk, self.resize = frame_chunk, resize

    def flops(self, num_frames: int, query: str) -> int:
        """The Allocator's FLOPs on `num_frames` frames and `query` (`Allocator.flops`)."""
        return self.allocator.flops(num_frames, self.allocator.encoders.text_tokens(query))

    def raw_scales(self, frames: np.ndarray, query: str) -> tuple[np.ndarray, dict]:
        """The Allocator's scales s_t (T,) for uint8 frames (T, H, W, 3) and a query, and the
        stage seconds (`allocator_text_s`, `allocator_visual_s`, `allocator_predict_s`)."""
        (scales,), seconds = self.raw_scales_batch([[frames]], [query])
        return scales, seconds

    @torch.no_grad()
    def raw_scales_batch(self, sequences: list[list[np.ndarray]], queries: list[str]) -> tuple[list[np.ndarray], dict]:
        """`raw_scales` for several sequences in one pass: one text encode, one visual encode per
        frame size, one Allocator forward over the padded batch. A sequence is a list of uint8 frame
        arrays (T_k, H_k, W_k, 3), taken in order as one sequence (a video is one array; the
        images of one request are one array each). Returns the scales per sequence and the stage seconds
        divided equally among the sequences."""
        enc = self.allocator.encoders
        segments = [list(seq) for seq in sequences]
        clock = Stopwatch(enc.device)
        t0 = clock.mark()
        text, text_mask = enc.encode_text(list(queries))
        t1 = clock.mark()
        flat = [(i, j) for i, parts in enumerate(segments) for j in range(len(parts))]
        encoded = {}
        by_shape = {}  # segments of one frame size are encoded in one call
        for key in flat:
            by_shape.setdefault(segments[key[0]][key[1]].shape[1:], []).append(key)
        for group in by_shape.values():
            parts = [segments[i][j] for i, j in group]
            joined = np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts))  # a video: no copy
            with warnings.catch_warnings():  # decoded frames may be read-only; the encoders only read them
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                features = enc.encode_frames(torch.from_numpy(joined), self.frame_chunk, self.resize)
            for key, chunk in zip(group, features.split([len(p) for p in parts])):
                encoded[key] = chunk
        per_sequence = [torch.cat([encoded[(i, j)] for j in range(len(parts))]) for i, parts in enumerate(segments)]
        t2 = clock.mark()
        lengths = [len(f) for f in per_sequence]
        feats = per_sequence[0].new_zeros(len(per_sequence), max(lengths), per_sequence[0].shape[-1])
        mask = torch.zeros(feats.shape[:2], dtype=torch.bool, device=feats.device)
        for i, chunk in enumerate(per_sequence):
            feats[i, : len(chunk)], mask[i, : len(chunk)] = chunk, True
        p1, p2 = self.allocator(feats, mask, text, text_mask)
        scales = []
        for i, n in enumerate(lengths):
            a = self.allocator.latent_actions(p1[i, :n], p2[i, :n], self.mode, self.quantile, self.seed)
            scales.append(self.allocator.to_scale(a).double().cpu().numpy())
        t3, n = clock.mark(), len(per_sequence)
        seconds = dict(
            allocator_text_s=clock.seconds(t0, t1) / n,
            allocator_visual_s=clock.seconds(t1, t2) / n,
            allocator_predict_s=clock.seconds(t2, t3) / n,
        )
        return scales, seconds
