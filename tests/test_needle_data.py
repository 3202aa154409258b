"""The needle benchmark's data generator (the first part of the needle benchmark)."""

import json

import numpy as np
import pytest

from resadapt_eval.needle.data import CLASSES, glyph_pattern, make_split
from resadapt_eval.video import decode_video


@pytest.mark.parametrize("label", range(4))
def test_glyphs_are_zero_mean_nyquist_patterns_that_differ(label):
    pattern = glyph_pattern(label, 16)
    assert abs(pattern.mean()) < 1e-9  # the glyph keeps the background's mean colour
    # a 2x2 average (what a 0.5x downscale does) leaves nothing of any pattern but the grid's
    pooled = pattern.reshape(8, 2, 8, 2).mean(axis=(1, 3))
    assert np.allclose(pooled, pooled.mean())
    others = [glyph_pattern(k, 16) for k in range(4) if k != label]
    assert all(not np.array_equal(pattern, o) for o in others)


def test_split_is_seeded_lossless_and_marks_the_evidence(tmp_path):
    a = make_split(tmp_path / "a", "test", 3, seed=5, progress=False)
    b = make_split(tmp_path / "b", "test", 3, seed=5, progress=False)
    rows_a = [json.loads(line) for line in a.read_text().splitlines()]
    rows_b = [json.loads(line) for line in b.read_text().splitlines()]
    assert [(r["answer"], r["evidence_pair"]) for r in rows_a] == [(r["answer"], r["evidence_pair"]) for r in rows_b]
    for row in rows_a:
        video = decode_video(row["video_path"], 16)
        assert video.frames.shape == (16, 224, 224, 3)
        assert row["answer"] in "ABCD" and CLASSES[row["label"]] in row["question"]
        assert (
            row["evidence_frames"] == [2 * row["evidence_pair"], 2 * row["evidence_pair"] + 1]
            and row["evidence_pair"] < 4
        )
        evidence, other = (
            video.frames[row["evidence_frames"][0]].astype(int),
            video.frames[row["evidence_frames"][0] + 4].astype(int),
        )

        def alternation(frame):  # largest second difference along rows or columns
            return max(np.abs(np.diff(frame, n=2, axis=axis)).max() for axis in (0, 1))

        # the evidence frame has pixel-scale alternation; frames without the glyph do not
        assert alternation(evidence) > alternation(other) + 50


@pytest.mark.parametrize("family", ["qwen25vl", "qwen3vl"])
def test_backbone_trainer_runs_both_stages_and_saves(tmp_path, family):
    from transformers import AutoConfig

    from resadapt_eval.needle.train_backbone import train_backbone

    out = train_backbone(tmp_path / "needle", stage1_steps=2, stage2_steps=2, batch=2, progress=False, family=family)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == {"qwen25vl": "qwen2_5_vl", "qwen3vl": "qwen3_vl"}[family]
    assert config.text_config.hidden_size == 128 and config.text_config.num_hidden_layers == 3
    if family == "qwen25vl":  # windowed attention only
        assert config.vision_config.fullatt_block_indexes == []
    else:  # 16 px patches, one deepstack feature
        assert config.vision_config.patch_size == 16 and config.vision_config.deepstack_visual_indexes == [0]
    assert f"family={family} init=None seed=0 stage1_steps=2 stage2_steps=2" in (out / "training.txt").read_text()
    # continuing from the saved model keeps its architecture and appends to the log
    train_backbone(out, stage1_steps=0, stage2_steps=1, batch=2, init=str(out), progress=False)
    assert len((out / "training.txt").read_text().splitlines()) == 2
    assert f"family={family} init={out}" in (out / "training.txt").read_text()


def test_evidence_pairs_widens_where_the_evidence_may_sit(tmp_path):
    rows = [
        json.loads(line)
        for line in make_split(tmp_path, "train", 40, seed=1, evidence_pairs=8, progress=False).read_text().splitlines()
    ]
    pairs = {r["evidence_pair"] for r in rows}
    assert pairs <= set(range(8)) and max(pairs) >= 4  # 40 draws from 8 pairs reach the second half
    with pytest.raises(ValueError, match="evidence_pairs must be in 1..8"):
        make_split(tmp_path, "bad", 1, seed=1, evidence_pairs=9, progress=False)


def test_make_data_skips_empty_splits(tmp_path):
    from resadapt_eval.needle.data import make_data

    written = make_data(tmp_path, train=0, val=0, test=2, seed=0)
    assert list(written) == ["test"] and not (tmp_path / "train.jsonl").exists()
    assert len(written["test"].read_text().splitlines()) == 2
