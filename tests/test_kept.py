"""The kept-token encoding of a record (`resadapt_eval/kept.py`): written by hand, read back exactly."""

import base64
import json
import lzma

import numpy as np
import pytest
import torch

from resadapt_eval.baselines.common import VisualTokens, kept_count
from resadapt_eval.kept import KeptTokens, encode, pair_slices, read_kept
from resadapt_eval.methods import METHODS


def test_a_pruned_mask_is_packed_little_endian_by_hand():
    # 10 tokens; kept 0, 3, 8 -> bits 0b00001001, 0b00000001
    assignment = np.array([0, -1, -1, 3, -1, -1, -1, -1, 8, -1])
    field = encode(KeptTokens(assignment), [10])
    assert field["tokens"] == 10 and field["groups"] is None and field["stages"] is None
    assert base64.b64decode(field["mask"]) == bytes([0b00001001, 0b00000001])
    back = read_kept(dict(kept=field, grids=[[1, 2, 5]]))
    assert back.kept.tolist() == [0, 3, 8] and back.assignment.tolist() == assignment.tolist()


def test_merged_groups_and_stages_round_trip():
    # pair 1 (tokens 0-5): 1 merged into 0, 2 and 5 into 4, 3 dropped; pair 2 (tokens 6-9): 7 into 6, 9 into 8
    # LLM tokens 0, 4, 6, 8 (ordinals 0-3); pair 2's first destination is ordinal 2
    assignment = np.array([0, 0, 4, -1, 4, 4, 6, 6, 8, 8])
    stage = np.array([False, False, False, False, True, False, True, False, False, False])
    field = encode(KeptTokens(assignment, ((2, stage),)), [6, 4])
    members = np.unpackbits(np.frombuffer(base64.b64decode(field["groups"]["members"]), np.uint8), bitorder="little")
    assert members[:10].tolist() == [0, 1, 1, 0, 0, 1, 0, 1, 0, 1]
    offsets = np.frombuffer(lzma.decompress(base64.b64decode(field["groups"]["offsets"])), dtype="<i2")
    assert offsets.tolist() == [0, 1, 1, 0, 1] and field["groups"]["wide"] is False
    back = read_kept(dict(kept=field, grids=[[1, 2, 3], [1, 2, 2]]))
    assert back.assignment.tolist() == assignment.tolist()
    assert back.groups.tolist() == [0, 0, 1, -1, 1, 1, 2, 2, 3, 3]
    ((layer, mask),) = back.stages
    assert layer == 2 and mask.tolist() == stage.tolist()
    assert KeptTokens(assignment).stage_from_entering(5, [1, 2])[1].tolist() == stage.tolist()


def test_a_record_without_kept_tokens_reads_none_and_a_short_mask_is_an_error():
    assert read_kept(dict(kept=None)) is None and read_kept({}) is None
    field = encode(KeptTokens.everything(16), [16])
    with pytest.raises(ValueError, match="does not cover 17 tokens"):
        read_kept(dict(kept={**field, "tokens": 17}))


def test_pair_slices_follow_the_grids():
    assert pair_slices([[1, 2, 3], [1, 1, 2]]) == [slice(0, 6), slice(6, 8)]


def test_a_128_frame_7b_record_stays_within_the_stated_sizes():
    """128 frames of Qwen2.5-VL-7B at 768 tokens per pair (49152 tokens): a pruning method's field is
    the mask, ceil(N / 8) = 6144 bytes, 8.2 KB in base64 JSON; each in-LLM stage adds another; a merging
    method adds its members' groups: ToMe on random features (merges without structure, near their
    entropy bound: 36864 members x log2(192 destinations per pair) bits = 35 KB, 47 KB in base64) stays
    under 65 KB (docs/records.md)."""
    pairs, per_pair = 64, 768
    n = pairs * per_pair
    g = torch.Generator().manual_seed(0)
    tokens = VisualTokens(torch.randn(n, 16, generator=g), [per_pair] * pairs, [(1, 24, 32)] * pairs)
    keep = kept_count(0.25, n, pairs)
    merged = KeptTokens(METHODS["tome"].compress(tokens, keep, 0).assignment.numpy())
    pruned = KeptTokens(METHODS["random_drop"].compress(tokens, keep, 0).assignment.numpy())
    assert merged.merges and not pruned.merges
    assert len(json.dumps(encode(pruned, tokens.pair_sizes))) < 8_300
    assert len(json.dumps(encode(merged, tokens.pair_sizes))) < 65_000
    stage = KeptTokens.everything(n, ((2, pruned.mask),))
    assert len(json.dumps(encode(stage, tokens.pair_sizes))) < 2 * 8_300
    record = dict(kept=encode(merged, tokens.pair_sizes), grids=[[1, 24, 32]] * pairs)
    assert (read_kept(record).assignment == merged.assignment).all()
