import hashlib
import json

import pytest
from transformers import AutoConfig, AutoProcessor

from resadapt_eval.fixtures import BACKBONES, SPECIAL_TOKENS, write_backbone
from resadapt_eval.video import VideoDecodeError, decode_video


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("backbone", BACKBONES)
def test_fixture_backbones_are_deterministic_and_reload(fixtures_dir, tmp_path, backbone):
    again = write_backbone(backbone, tmp_path / backbone)
    assert digest(again / "model.safetensors") == digest(fixtures_dir / backbone / "model.safetensors")

    config = AutoConfig.from_pretrained(fixtures_dir / backbone)
    text = config.text_config
    assert text.hidden_size // text.num_attention_heads == 32

    processor = AutoProcessor.from_pretrained(fixtures_dir / backbone)
    assert processor.image_processor.image_mean == processor.video_processor.image_mean
    assert processor.image_processor.image_std == processor.video_processor.image_std
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    # Byte-level: any text round-trips.
    assert tok.decode(tok("Zürich, 3.5 s — ok?")["input_ids"]) == "Zürich, 3.5 s — ok?"


def test_smoke_dataset_has_videomme_columns_and_decodable_videos(fixtures_dir):
    lines = (fixtures_dir / "smoke_videoqa" / "test.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 8
    for r in records:
        for column in (
            "question_id",
            "videoID",
            "duration",
            "domain",
            "sub_category",
            "task_type",
            "question",
            "options",
            "answer",
        ):
            assert column in r
        assert r["answer"] in "ABCD" and len(r["options"]) == 4
    video = decode_video(records[0]["video_path"], max_num_frames=8)
    assert video.frames.shape == (8, 240, 320, 3)
    assert video.indices == [0, 4, 9, 13, 18, 22, 27, 31]
    assert video.total_frames == 32 and video.fps == pytest.approx(8.0)
    assert video.sampled_fps == pytest.approx(2.0)


def test_missing_and_corrupt_videos_name_the_path(tmp_path):
    missing = tmp_path / "nope.mp4"
    with pytest.raises(VideoDecodeError, match=f"video not found: {missing}"):
        decode_video(missing, 8)
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00not a video" * 100)
    with pytest.raises(VideoDecodeError, match=f"cannot decode video {corrupt}"):
        decode_video(corrupt, 8)
