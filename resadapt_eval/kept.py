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
- `groups`: for merging methods only (some token merged into another; null otherwise), the merged
  members and their LLM tokens: `members`, a mask (as `mask`) of the tokens merged into another, and
  `offsets`, for each member in token order its LLM token's ordinal among the K destinations less the
  ordinal of the first destination in the member's own frame pair (a merge within the pair: 0 to the
  pair's destinations - 1), int16 little-endian (int32 when an offset leaves int16's range: `wide`
  true), LZMA-compressed, base64;
- `stages`: `[[layer, mask], ...]` for a method with stages inside the LLM, each mask (as `mask`)
  over the N tokens: those still held from decoder `layer` on; null otherwise.
"""

from __future__ import annotations

import base64
import lzma
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


def _first_destination(kept: np.ndarray, pair_sizes: list[int], n: int) -> np.ndarray:
    """(N,) for each token, the ordinal of the first destination in its frame pair."""
    starts = np.concatenate([[0], np.cumsum(pair_sizes)[:-1]]).astype(np.int64)
    pair_of = np.repeat(np.arange(len(pair_sizes)), pair_sizes)
    if len(pair_of) != n:
        raise ValueError(f"frame pairs of {sum(pair_sizes)} tokens do not cover the {n} kept-token entries")
    return np.searchsorted(kept, starts)[pair_of]


def encode(kept: KeptTokens, pair_sizes: list[int]) -> dict:
    """The record's `kept` field (see the module docstring); `pair_sizes`: tokens per frame pair (sum N)."""
    groups = None
    if kept.merges:
        n = len(kept.assignment)
        members = (kept.assignment != DROPPED) & ~kept.mask
        offsets = (kept.groups - _first_destination(kept.kept, pair_sizes, n))[members]
        wide = bool(len(offsets)) and not (-(2**15) <= offsets.min() and offsets.max() < 2**15)
        raw = offsets.astype("<i4" if wide else "<i2").tobytes()
        groups = dict(
            members=_bits(members),
            offsets=base64.b64encode(lzma.compress(raw, preset=9)).decode("ascii"),
            wide=wide,
        )
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
    groups = field.get("groups")
    if groups:
        members = _unbits(groups["members"], n)
        raw = lzma.decompress(base64.b64decode(groups["offsets"]))
        offsets = np.frombuffer(raw, dtype="<i4" if groups["wide"] else "<i2").astype(np.int64)
        if len(offsets) != members.sum():
            raise ValueError(f"kept-token groups hold {len(offsets)} offsets for {members.sum()} merged tokens")
        pair_sizes = [t * h * w for t, h, w in record["grids"]]
        ordinals = offsets + _first_destination(kept, pair_sizes, n)[members]
        assignment[members] = kept[ordinals]
    stages = tuple((int(layer), _unbits(text, n)) for layer, text in field.get("stages") or ())
    return KeptTokens(assignment, stages)


def pair_slices(grids: list) -> list[slice]:
    """Each frame pair's tokens among the N of a record with these (t, h, w) `grids`."""
    sizes = [t * h * w for t, h, w in grids]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
