"""Which visual tokens a method kept, compactly, in the sidecar record (`SampleRecord.kept`).

The tokens are the N merged visual tokens of the sample's plan (the record's `grids`), in the
order the vision tower emits them: pair by pair, row-major on each pair's merged grid (one token
covers 2x2 patches of both frames of its pair). A method's work is one assignment over them: each
token's destination, the token whose LLM token it is part of (itself when it entered the LLM as its
own token, another for a merged member, -1 when dropped). In-LLM methods add their stages: the
tokens still held from a decoder layer on.

Encoding (`encode`, read back by `read_kept`), JSON:
- `tokens`: N;
- `mask`: the tokens that entered the LLM at their own place (destinations), N bits packed
  little-endian (`numpy.packbits(bitorder="little")`), base64: ceil(N / 8) bytes before base64;
- `groups`: for merging methods only (some token merged into another), each token's LLM token as its
  ordinal among the K destinations (K for a dropped token), uint16 when K < 65535 else uint32,
  little-endian, zlib-compressed, base64; null when no token merged;
- `stages`: `[[layer, mask], ...]` for a method with stages inside the LLM, each mask (as `mask`)
  over the N tokens: those still held from decoder `layer` on; null otherwise.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass

import numpy as np

DROPPED = -1


@dataclass(frozen=True)
class KeptTokens:
    """assignment: (N,) int64, each plan token's destination token index (itself: it entered the LLM
    as its own token; another: merged into it; -1: dropped); stages: ((layer, (N,) bool), ...) the
    tokens still held from decoder `layer` on (in-LLM stages, in layer order)."""

    assignment: np.ndarray
    stages: tuple[tuple[int, np.ndarray], ...] = ()

    @classmethod
    def everything(cls, n: int, stages=()) -> KeptTokens:
        """All n tokens entered the LLM, each as its own token."""
        return cls(np.arange(n, dtype=np.int64), tuple(stages))

    @property
    def mask(self) -> np.ndarray:
        """(N,) bool: the tokens that entered the LLM at their own place."""
        return self.assignment == np.arange(len(self.assignment))

    @property
    def kept(self) -> np.ndarray:
        """Sorted indices of the tokens that entered the LLM (the LLM's visual tokens, in order)."""
        return np.flatnonzero(self.mask)

    @property
    def groups(self) -> np.ndarray:
        """(N,) each token's LLM token as its ordinal among the kept ones; -1 for a dropped token."""
        ordinal = np.full(len(self.assignment) + 1, DROPPED, dtype=np.int64)
        ordinal[self.kept] = np.arange(len(self.kept))
        return ordinal[self.assignment]  # a dropped token's -1 reads the last slot, DROPPED

    @property
    def merges(self) -> bool:
        """Some token was merged into another."""
        return bool(((self.assignment != DROPPED) & ~self.mask).any())

    def stage_from_entering(self, layer: int, entering: np.ndarray) -> tuple[int, np.ndarray]:
        """A stage given as ordinals among the tokens that entered the LLM -> (layer, (N,) bool mask)."""
        mask = np.zeros(len(self.assignment), dtype=bool)
        mask[self.kept[np.asarray(entering, dtype=np.int64)]] = True
        return layer, mask


def _bits(mask: np.ndarray) -> str:
    return base64.b64encode(np.packbits(mask.astype(bool), bitorder="little").tobytes()).decode("ascii")


def _unbits(text: str, n: int) -> np.ndarray:
    packed = np.frombuffer(base64.b64decode(text), dtype=np.uint8)
    if len(packed) != (n + 7) // 8:
        raise ValueError(f"a kept-token mask of {len(packed)} bytes does not cover {n} tokens")
    return np.unpackbits(packed, bitorder="little")[:n].astype(bool)


def _group_dtype(kept: int) -> np.dtype:
    return np.dtype("<u2") if kept < np.iinfo(np.uint16).max else np.dtype("<u4")


def encode(kept: KeptTokens) -> dict:
    """The record's `kept` field (see the module docstring)."""
    groups = None
    if kept.merges:
        ordinals = kept.groups
        count = int(kept.mask.sum())
        ordinals = np.where(ordinals == DROPPED, count, ordinals).astype(_group_dtype(count))
        groups = base64.b64encode(zlib.compress(ordinals.tobytes(), 9)).decode("ascii")
    return dict(
        tokens=len(kept.assignment),
        mask=_bits(kept.mask),
        groups=groups,
        stages=[[layer, _bits(mask)] for layer, mask in kept.stages] if kept.stages else None,
    )


def read_kept(record: dict) -> KeptTokens | None:
    """The kept tokens of a sidecar record (None: the record holds none, a failed sample or a run
    made before they were recorded)."""
    field = record.get("kept")
    if not field:
        return None
    n = field["tokens"]
    mask = _unbits(field["mask"], n)
    kept = np.flatnonzero(mask)
    assignment = np.where(mask, np.arange(n), DROPPED).astype(np.int64)
    if field.get("groups"):
        raw = zlib.decompress(base64.b64decode(field["groups"]))
        ordinals = np.frombuffer(raw, dtype=_group_dtype(len(kept))).astype(np.int64)
        if len(ordinals) != n:
            raise ValueError(f"kept-token groups hold {len(ordinals)} tokens, not {n}")
        members = ordinals < len(kept)
        assignment[members] = kept[ordinals[members]]
    stages = tuple((int(layer), _unbits(text, n)) for layer, text in field.get("stages") or ())
    return KeptTokens(assignment, stages)


def pair_slices(grids: list) -> list[slice]:
    """Each frame pair's tokens among the N of a record with these (t, h, w) `grids`."""
    sizes = [t * h * w for t, h, w in grids]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
