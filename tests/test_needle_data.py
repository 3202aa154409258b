"""The needle benchmark's data generator (the first part of the needle benchmark)."""

import json

import numpy as np
import pytest

from resadapt_eval.needle.data import CLASSES, COLOURS, LONG_FRAMES, glyph_pattern, make_split
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
    assert len(rows_a) == 3
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
    else:  # 16 px patches, one deepstack feature, Qwen3-VL's own head size and rope
        assert config.vision_config.patch_size == 16 and config.vision_config.deepstack_visual_indexes == [0]
        rope = config.text_config.rope_parameters
        assert config.text_config.head_dim == 128 and rope["mrope_section"] == [24, 20, 20]
        assert rope["rope_theta"] == 5e6 and rope["mrope_interleaved"]
    assert (
        f"family={family} variant=single init=None seed=0 stage1_steps=2 stage2_steps=2"
        in (out / "training.txt").read_text()
    )
    # continuing from the saved model keeps its architecture and appends to the log
    train_backbone(out, stage1_steps=0, stage2_steps=1, batch=2, init=str(out), progress=False)
    assert len((out / "training.txt").read_text().splitlines()) == 2
    assert f"family={family} variant=single init={out}" in (out / "training.txt").read_text()
    # the query stage (attention-supervised) runs on the same model and leaves it loadable
    train_backbone(out, stage1_steps=0, stage2_steps=1, batch=2, init=str(out), progress=False, variant="query")
    assert f"family={family} variant=query init={out}" in (out / "training.txt").read_text().splitlines()[2]
    assert AutoConfig.from_pretrained(out).text_config.num_hidden_layers == 3


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


def alternation(frame):
    """Largest second difference along rows or columns: pixel-scale detail (the glyph)."""
    return max(np.abs(np.diff(frame.astype(int), n=2, axis=axis)).max() for axis in (0, 1))


def test_query_split_names_one_of_several_coloured_candidates(tmp_path):
    rows = [
        json.loads(line)
        for line in make_split(tmp_path, "test", 4, seed=3, variant="query", progress=False).read_text().splitlines()
    ]
    assert len(rows) == 4
    for row in rows:
        video = decode_video(row["video_path"], 16)
        pairs = row["candidate_pairs"]
        assert len(pairs) == len(set(pairs)) == 3 and row["evidence_pair"] in pairs
        assert f"with the {row['colour']} border" in row["question"] and row["variant"] == "query"
        assert row["question"].startswith("Which symbol appears in the video?")  # the single question, then the colour
        # the asked pair's frames carry the named colour as their border (8 px, lossless)
        frame = video.frames[2 * row["evidence_pair"]].astype(int)
        assert np.abs(frame[2, 100] - np.array(COLOURS[row["colour"]])).max() <= 3
        # the other pairs carry neither glyph nor card nor border (their soft shapes stay below 100)
        for pair in set(range(8)) - set(pairs):
            assert alternation(video.frames[2 * pair]) < 100 < alternation(video.frames[2 * pairs[0]])
        # the border colours of the three candidates differ
        borders = {tuple(video.frames[2 * p][2, 100] // 40) for p in pairs}
        assert len(borders) == 3
    with pytest.raises(ValueError, match="candidates must be in 2..4"):
        make_split(tmp_path, "bad", 1, seed=1, variant="query", candidates=5, progress=False)


def test_query_candidates_have_distinct_classes_and_each_its_glyph_on_its_card():
    from dataclasses import replace

    from resadapt_eval.needle.data import random_query, render_query_video

    rng = np.random.default_rng(0)
    for _ in range(50):
        specs, target = random_query(rng)
        assert (
            len({s.label for s in specs})
            == len({s.colour for s in specs})
            == len({s.evidence_pair for s in specs})
            == 3
        )
        assert 0 <= target < 3
    # a candidate rendered without its glyph (contrast 0: the backbone curriculum's distractor)
    # differs from the full video only inside that glyph's box, by its pattern
    with_glyph = render_query_video(np.random.default_rng(1), specs)
    blank = [replace(s, contrast=0.0) if k == 0 else s for k, s in enumerate(specs)]
    without = render_query_video(np.random.default_rng(1), blank)
    s = specs[0]
    changed = np.argwhere(np.any(with_glyph != without, axis=-1))
    assert set(changed[:, 0]) == {2 * s.evidence_pair, 2 * s.evidence_pair + 1}
    assert changed[:, 1].min() >= s.y and changed[:, 1].max() < s.y + s.glyph
    assert changed[:, 2].min() >= s.x and changed[:, 2].max() < s.x + s.glyph
    # on the card: the card colour plus the pattern, clipped to 0-255
    patch = with_glyph[2 * s.evidence_pair, s.y : s.y + s.glyph, s.x : s.x + s.glyph].astype(float)
    expected = np.clip(np.array(COLOURS[s.colour]) + 60.0 * glyph_pattern(s.label, s.glyph)[..., None], 0, 255)
    assert np.abs(patch - expected).max() <= 4  # pixel noise of standard deviation 1


def test_long_split_has_128_frames_and_one_evidence_pair_anywhere(tmp_path):
    rows = [
        json.loads(line)
        for line in make_split(tmp_path, "test", 2, seed=4, cue=True, variant="long", progress=False)
        .read_text()
        .splitlines()
    ]
    assert LONG_FRAMES == 128 and len(rows) == 2
    for row in rows:
        video = decode_video(row["video_path"], LONG_FRAMES)
        assert video.frames.shape == (128, 224, 224, 3) and row["variant"] == "long"
        first, second = row["evidence_frames"]
        assert second == first + 1 and 0 <= row["evidence_pair"] < 64
        detail = [t for t in range(128) if alternation(video.frames[t]) > 100]  # glyph and border edge
        white_border = [t for t in range(128) if video.frames[t][2, 100].min() >= 250]
        assert detail == white_border == [first, second]
    # the product's frame selection: 8 uniform frames of 128 rarely land on the pair
    from resadapt_eval.budget.plan import uniform_frame_indices

    indices = uniform_frame_indices(128, 8)
    hits = sum(bool({2 * p, 2 * p + 1} & set(indices)) for p in range(64))
    assert hits == 8  # 8 of the 64 pairs hold one sampled frame: vanilla at 8 frames sees 1 in 8


@pytest.mark.parametrize(
    "name, variant, folder",
    [
        ("needle-query-qwen25vl", "query", "needle-query"),
        ("needle-long-qwen25vl", "long", "needle-long"),
        ("needle-qwen3vl", "single", "needle"),
        ("needle-qwen25vl", "single", "needle"),
    ],
)
def test_needle_cards_write_their_test_split_on_demand(name, variant, folder, tmp_path):
    from dataclasses import replace
    from pathlib import Path

    from resadapt_eval.needle.data import ensure_needle_data
    from resadapt_eval.sweep import load_card

    cards = Path(__file__).resolve().parent.parent / "model_cards"
    card = load_card(cards / f"{name}.yaml")
    assert card.needle_data["variant"] == variant and card.needle_data["videos"] == 400
    assert card.needle_data["out"] == str((cards.parent / "fixtures" / folder).resolve())
    task = {"single": "resadapt_needle"}.get(variant, f"resadapt_needle_{variant}")
    assert card.tasks == [task] and (cards.parent / "tasks" / task / f"{task}.yaml").is_file()
    # a fresh clone: the folder is missing, the sweep writes the split (here 2 videos, into tmp_path)
    small = replace(card, needle_data={**card.needle_data, "out": str(tmp_path), "videos": 2})
    jsonl = ensure_needle_data(small.needle_data, echo=lambda *_: None)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rows) == 2 and {r["variant"] for r in rows} == {variant}
    written = jsonl.stat().st_mtime_ns
    again = ensure_needle_data(small.needle_data, echo=lambda *_: None)
    assert again == jsonl and jsonl.stat().st_mtime_ns == written  # kept
    bad = tmp_path / "bad.yaml"
    bad.write_text((cards / f"{name}.yaml").read_text().replace("needle_data: {", "needle_data: {frames: 3, "))
    with pytest.raises(ValueError, match="needle_data takes variant, out, videos, cue"):
        load_card(bad)


def test_glyph_tokens_cover_the_glyph_at_its_pair_s_size():
    from resadapt_eval.budget.plan import TokenGrid, plan_from_scales
    from resadapt_eval.needle.data import NeedleSpec
    from resadapt_eval.needle.train_backbone import glyph_tokens

    grid = TokenGrid(token_px=28)
    plan = plan_from_scales([1.0, 1.0, 0.5, 0.5], (224, 224), grid, min_tokens_per_pair=1)
    assert plan.pair_tokens == [64, 16]
    # pair 1 is 112 px: 4x4 tokens of 56 source px; glyph rows 100-115 -> token rows 1-2, columns 60-75 -> 1
    spec = NeedleSpec(label=0, evidence_pair=1, glyph=16, x=60, y=100)
    assert glyph_tokens(plan, spec).tolist() == [64 + 1 * 4 + 1, 64 + 2 * 4 + 1]
    # pair 0 at full size: 28 px tokens; rows 20-31 -> 0-1, columns 200-211 -> 7
    assert glyph_tokens(plan, NeedleSpec(0, 0, 12, x=200, y=20)).tolist() == [7, 15]


def test_binding_losses_by_hand():
    import math
    from types import SimpleNamespace

    import torch

    from resadapt_eval.budget.plan import TokenGrid, plan_from_scales
    from resadapt_eval.needle.data import NeedleSpec
    from resadapt_eval.needle.train_backbone import BindingHeads, binding_losses

    plan = plan_from_scales([1.0] * 6, (224, 224), TokenGrid(token_px=28), min_tokens_per_pair=1)
    specs = [NeedleSpec(k, k, 12, x=20, y=20, colour=c) for k, c in enumerate(("red", "green", "blue"))]
    specs[2] = NeedleSpec(2, 2, 12, x=20, y=20, colour="blue", contrast=0.0)  # a card without its glyph
    visual_at = torch.arange(10, 10 + 192)  # 3 pairs of 64 tokens after 10 text tokens
    answer_at, length, target = 209, 210, 1
    glyph = [visual_at[64 * k + torch.tensor([0, 1, 8, 9])] for k in range(3)]  # rows 0-1, columns 0-1
    weights = torch.zeros(1, 2, length, length)
    weights[0, 0, answer_at, glyph[1]] = 0.3 / 4  # head 0: 0.3 on the asked glyph, 0.1 on the others
    weights[0, 0, answer_at, torch.cat([glyph[0], glyph[2]])] = 0.1 / 8
    weights[0, 1, answer_at, glyph[1]] = 0.1 / 4  # head 1: 0.1 and 0.1
    weights[0, 1, answer_at, glyph[0]] = 0.1 / 4
    outputs = SimpleNamespace(
        attentions=[torch.rand(1, 2, length, length), weights],  # the first layer is not supervised
        hidden_states=[torch.zeros(1, length, 8)] * 2,
    )
    heads = BindingHeads(8)
    for head in (heads.asked_colour, heads.glyph, heads.card_colour):
        torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
    losses = {
        k: float(v.detach())
        for k, v in binding_losses(outputs, heads, plan, answer_at, visual_at, specs, target).items()
    }
    share = (0.3 / 0.4 + 0.1 / 0.2) / 2
    assert losses["attention"] == pytest.approx(-math.log(share) - math.log(0.3), abs=1e-4)
    assert losses["asked_colour"] == pytest.approx(math.log(4), abs=1e-6)  # uniform heads
    assert losses["card_colour"] == pytest.approx(3 * math.log(4), abs=1e-6)
    assert losses["glyph"] == pytest.approx(2 * math.log(4), abs=1e-6)  # the blank card has no class


def test_committed_query_backbone_answers_for_the_colour_the_question_names(tmp_path):
    """The same videos, asked for each candidate's colour in turn: the answer follows the colour."""
    import torch

    from resadapt_eval.backbones.qwen import Qwen25VLAdapter
    from resadapt_eval.budget.plan import plan_from_scales
    from resadapt_eval.needle.data import LETTERS, query_question
    from resadapt_eval.needle.train_backbone import chat_prompt

    from .helpers import REPO

    adapter = Qwen25VLAdapter.from_pretrained(str(REPO / "results" / "needle" / "backbone-query-qwen25vl"))
    letters = [adapter.tokenizer(letter)["input_ids"][0] for letter in LETTERS]
    rows = [
        json.loads(line)
        for line in make_split(tmp_path, "test", 4, seed=7, variant="query", progress=False).read_text().splitlines()
    ]
    correct = asked = 0
    for row in rows:
        video = decode_video(row["video_path"], 16)
        plan = plan_from_scales([1.0] * 16, (224, 224), adapter.grid, min_tokens_per_pair=1)
        for colour, label in zip(row["candidate_colours"], row["candidate_labels"]):
            inputs = adapter.build_inputs(chat_prompt(adapter, query_question(colour)), video, plan)
            with torch.no_grad():
                logits = adapter.model(**inputs).logits[0, -1, letters]
            correct += int(logits.argmax()) == label
            asked += 1
    assert asked == 12 and correct >= 10  # 98.5% on 200 test videos; chance: 1 in 4
