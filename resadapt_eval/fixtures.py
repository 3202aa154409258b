"""Offline fixtures: tiny random Qwen2.5-VL / Qwen3-VL checkpoints and a smoke video-QA set.

Everything is built in code from a seed (no hub access), saved with `save_pretrained`, and loads
back through the same `from_pretrained` calls that load a real 7B checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen's chat layout, reduced to what the fixtures need: text, image and video content parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Same normalisation for images and videos (the real checkpoints differ per family; the
# fixtures keep one set so image and video paths are comparable).
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

BACKBONES = ("qwen25vl", "qwen3vl")


def build_tokenizer():
    """Byte-level BPE tokenizer (256 byte symbols, no merges) with Qwen's special tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _token_ids(tok) -> dict:
    ids = tok.convert_tokens_to_ids
    return dict(
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
    )


def build_qwen25vl(tok, seed: int = 0):
    """Tiny random Qwen2.5-VL (text hidden 64, 2 heads of 32, 12 layers, deep enough for pruning inside
    the LLM at R=0.1; vision depth 2) and processor."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab_size = len(tok)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=12,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
        **_token_ids(tok),
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    return model, qwen25vl_processor(tok)


def qwen25vl_processor(tok):
    """Qwen2.5-VL's processor (14 px patches, 2 x 2 merge, temporal patch 2) around `tok`."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    common = dict(patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=IMAGE_MEAN, image_std=IMAGE_STD)
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        video_processor=Qwen2VLVideoProcessor(**common),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )


def build_qwen3vl(tok, seed: int = 0):
    """Tiny random Qwen3-VL (text hidden 64, 2 heads of 32, 12 layers; vision depth 2 with deepstack) and processor."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=12,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=8192,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=256,
            deepstack_visual_indexes=[0],
        ),
        **_token_ids(tok),
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    return model, qwen3vl_processor(tok)


def qwen3vl_processor(tok):
    """Qwen3-VL's processor (16 px patches, 2 x 2 merge, temporal patch 2) around `tok`."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    common = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=IMAGE_MEAN, image_std=IMAGE_STD)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        video_processor=Qwen3VLVideoProcessor(**common),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )


def build_smolvlm(tok, seed: int = 0):
    """Tiny random SmolVLM (SigLIP vision on 64x64 images, 16 px patches; Llama text hidden 48)
    and its image processor: the architecture of the paper's Allocator encoders."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessor

    config = SmolVLMConfig(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=16,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=len(tok),
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
        ),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
    )
    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(config).eval()
    return model, SmolVLMImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3)


BUILDERS = {"qwen25vl": build_qwen25vl, "qwen3vl": build_qwen3vl, "smolvlm": build_smolvlm}


def write_backbone(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny `name` model and save model, tokenizer and processor to `out_dir`."""
    tok = build_tokenizer()
    model, processor = BUILDERS[name](tok, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------- real-width random checkpoints

# The published configs a real-width model is built from (`compute.configs.KNOWN_CONFIGS`), and
# the backbone family (`backbones.qwen.ADAPTERS`) each belongs to.
REAL_WIDTH = {"qwen25vl-7b": "qwen25vl", "qwen3vl-8b": "qwen3vl"}
REAL_WIDTH_VERSION = 1  # bump when the real-width builder changes, so cached folders are rewritten
# (text layers, vision blocks) of the reduced-depth models CPU checks run: 4 decoder layers; Qwen2.5-VL
# keeps a windowed block and a full-attention one, Qwen3-VL 4 blocks so that its 3 deepstack mergers
# stay (blocks 1, 2, 3, added after decoder layers 0-2, which leaves layer 3 to prune at).
REDUCED_DEPTH = {"qwen25vl-7b": (4, 2), "qwen3vl-8b": (4, 4)}


def reduced_full_attention(blocks: list[int], depth: int, reduced: int) -> list[int]:
    """Qwen2.5-VL's full-attention blocks in its `depth`-block tower cut to `reduced` blocks: the
    published ones below the new last block, and the last block (the published tower ends in
    one), so a cut tower of at least 2 blocks keeps windowed and full-attention blocks (32 blocks
    with 7, 15, 23, 31 cut to 2: [1]; to 10: [7, 9]); at full depth the published ones."""
    if reduced == depth:
        return list(blocks)
    if reduced < 2:
        raise ValueError(f"a Qwen2.5-VL vision tower needs at least 2 blocks (one windowed, one full), not {reduced}")
    return sorted({b for b in blocks if b < reduced - 1} | {reduced - 1})


def reduced_deepstack(indexes: list[int], depth: int, reduced: int) -> list[int]:
    """Qwen3-VL's deepstack blocks at the same relative depth of its `depth`-block tower cut to
    `reduced` blocks, round(i (reduced - 1) / (depth - 1)) without repeats (8, 16, 24 of 27 blocks:
    1, 2, 3 of 4; 0, 1 of 2); at full depth the published ones."""
    if reduced == depth:
        return list(indexes)
    return sorted({round(i * (reduced - 1) / (depth - 1)) for i in indexes})


def real_width_config(name: str, tok, text_layers: int | None = None, vision_blocks: int | None = None):
    """The transformers config of the published backbone `name` (`REAL_WIDTH`) at its real widths
    (hidden sizes, heads, KV heads, intermediate sizes, vocabulary, patch, window, rope sections),
    with `text_layers` decoder layers and `vision_blocks` vision blocks (None: the published depth;
    `reduced_full_attention`, `reduced_deepstack`) and `tok`'s special token ids."""
    import copy

    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    from .compute.configs import KNOWN_CONFIGS

    if name not in REAL_WIDTH:
        raise ValueError(f"unknown real-width backbone {name!r}; known: {', '.join(REAL_WIDTH)}")
    published = copy.deepcopy(KNOWN_CONFIGS[name])
    text, vision = published["text_config"], published["vision_config"]
    text_layers = text["num_hidden_layers"] if text_layers is None else text_layers
    vision_blocks = vision["depth"] if vision_blocks is None else vision_blocks
    if text_layers < 1 or vision_blocks < 1:
        raise ValueError(f"need at least 1 text layer and 1 vision block, got {text_layers} and {vision_blocks}")
    if "fullatt_block_indexes" in vision:
        vision["fullatt_block_indexes"] = reduced_full_attention(
            vision["fullatt_block_indexes"], vision["depth"], vision_blocks
        )
    if "deepstack_visual_indexes" in vision:
        deepstack = reduced_deepstack(vision["deepstack_visual_indexes"], vision["depth"], vision_blocks)
        if len(deepstack) > text_layers:
            raise ValueError(
                f"{name} with {vision_blocks} vision blocks adds deepstack features after {len(deepstack)} decoder "
                f"layers; give at least {len(deepstack)} text layers, not {text_layers}"
            )
        vision["deepstack_visual_indexes"] = deepstack
    text["num_hidden_layers"], vision["depth"] = text_layers, vision_blocks
    text.update(bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config_cls = Qwen2_5_VLConfig if published.pop("model_type") == "qwen2_5_vl" else Qwen3VLConfig
    return config_cls(**published, **_token_ids(tok))


def build_real_width(
    name: str,
    text_layers: int | None = None,
    vision_blocks: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    attn_implementation: str | None = None,
):
    """(model, processor): the published backbone `name` at its real widths and the given depth
    (`real_width_config`), random bfloat16 weights (transformers' initialisation, seeded) made on
    `device`, nothing downloaded. The processor wraps the fixtures' byte-level tokenizer (263
    tokens); the config keeps the published vocabulary size, so the embeddings and lm_head have
    their real size (generated ids the tokenizer lacks decode to nothing)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    tok = build_tokenizer()
    config = real_width_config(name, tok, text_layers, vision_blocks)
    family = REAL_WIDTH[name]
    model_cls = Qwen2_5_VLForConditionalGeneration if family == "qwen25vl" else Qwen3VLForConditionalGeneration
    extra = {} if attn_implementation is None else dict(attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=torch.bfloat16, **extra).eval()
    processor = qwen25vl_processor(tok) if family == "qwen25vl" else qwen3vl_processor(tok)
    return model, processor


def write_real_width(
    out: Path, name: str, text_layers: int | None = None, vision_blocks: int | None = None, seed: int = 0
) -> Path:
    """Save `build_real_width(name, text_layers, vision_blocks, seed)` (config, bfloat16
    safetensors, tokenizer, processor) to `out`, loadable as `pretrained=out` by the lmms-eval
    classes and `resadapt-eval flops --backbone out`; returns `out`."""
    out = Path(out)
    model, processor = build_real_width(name, text_layers, vision_blocks, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    processor.tokenizer.save_pretrained(out)
    del model
    (out / COMPLETE_MARKER).write_text(_real_width_marker(name, text_layers, vision_blocks, seed))
    return out


def _real_width_marker(name: str, text_layers: int | None, vision_blocks: int | None, seed: int) -> str:
    return f"version={REAL_WIDTH_VERSION} {name} text_layers={text_layers} vision_blocks={vision_blocks} seed={seed}\n"


def real_width_folder(
    root: Path, name: str, text_layers: int | None = None, vision_blocks: int | None = None, seed: int = 0
) -> Path:
    """`root/<name>-t<text_layers>-v<vision_blocks>` (`full` for the published depth), `-seed<seed>` added
    for a seed other than 0."""
    seeded = "" if seed == 0 else f"-seed{seed}"
    return Path(root) / f"{name}-t{text_layers or 'full'}-v{vision_blocks or 'full'}{seeded}"


def ensure_real_width(
    root: Path, name: str, text_layers: int | None = None, vision_blocks: int | None = None, seed: int = 0
) -> Path:
    """`write_real_width` into `real_width_folder(root, ...)` unless a complete folder of the same
    settings is already there; returns the folder."""
    out = real_width_folder(root, name, text_layers, vision_blocks, seed)
    marker = out / COMPLETE_MARKER
    if not marker.exists() or marker.read_text() != _real_width_marker(name, text_layers, vision_blocks, seed):
        write_real_width(out, name, text_layers, vision_blocks, seed)
    return out


# ---------------------------------------------------------------- smoke video-QA dataset

SMOKE_COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
# (width, height) per video: wide, tall and square frames, so budgets are exercised on each shape.
SMOKE_SHAPES = [(320, 240), (240, 320), (400, 400), (480, 270)]
SMOKE_DIR = "smoke_videoqa"
COMPLETE_MARKER = ".complete"  # written last, so a half-written folder is rewritten
FIXTURES_VERSION = 6  # bump when the fixtures change, so old folders are rewritten


def write_video(path: Path, frames: np.ndarray, fps: float, lossless: bool = False) -> None:
    """Write uint8 frames (T, H, W, 3) with PyAV: H.264 (crf 18, yuv420p), or with `lossless`
    RGB H.264 at qp 0 (libx264rgb; use a .mkv path), which decodes back exactly."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264rgb" if lossless else "libx264", rate=int(round(fps)))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "rgb24" if lossless else "yuv420p"
        stream.options = {"qp": "0", "preset": "ultrafast"} if lossless else {"crf": "18", "g": "8"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def smoke_frames(rng: np.random.Generator, width: int, height: int, num_frames: int, colour: tuple) -> np.ndarray:
    """A gradient background with a moving square of `colour` in the middle third of the clip."""
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx / width * 120 + 40, yy / height * 120 + 40, np.full_like(xx, 90.0)], axis=-1)
    frames = np.repeat(base[None], num_frames, axis=0)
    side = max(16, min(width, height) // 5)
    x0, y0 = rng.integers(0, width - side), rng.integers(0, height - side)
    for t in range(num_frames // 3, 2 * num_frames // 3):
        x = (x0 + 4 * t) % (width - side)
        frames[t, y0 : y0 + side, x : x + side] = colour
    frames += rng.normal(0, 3, frames.shape)
    return frames.clip(0, 255).astype(np.uint8)


def write_smoke_dataset(
    out_dir: Path, num_videos: int = 8, num_frames: int = 32, fps: float = 8.0, seed: int = 0
) -> Path:
    """Synthetic multiple-choice video QA in VideoMME's schema; returns the JSONL path.

    Each video shows a square of one colour; the question asks for the colour (A-D). Video paths
    in the JSONL are absolute.
    """
    rng = np.random.default_rng(seed)
    names = list(SMOKE_COLOURS)
    records = []
    for i in range(num_videos):
        width, height = SMOKE_SHAPES[i % len(SMOKE_SHAPES)]
        answer = int(rng.integers(0, 4))
        video_id = f"smoke_{i:03d}"
        write_video(
            out_dir / "videos" / f"{video_id}.mp4",
            smoke_frames(rng, width, height, num_frames, SMOKE_COLOURS[names[answer]]),
            fps,
        )
        records.append(
            dict(
                question_id=f"{video_id}-1",
                videoID=video_id,
                video_path=str((out_dir / "videos" / f"{video_id}.mp4").resolve()),
                duration="short",
                domain="Knowledge",
                sub_category="Humanity & History",
                task_type="Attribute Perception",
                question="What colour is the moving square?",
                options=[f"{letter}. {name}" for letter, name in zip("ABCD", names)],
                answer="ABCD"[answer],
            )
        )
    path = out_dir / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    # The same clips in the trainer's format (train/data.py), for `resadapt-eval train`.
    train = [
        dict(
            video=r["video_path"],
            question=r["question"]
            + "\n"
            + "\n".join(r["options"])
            + "\nAnswer with the option's letter from the given choices directly.",
            answer=r["answer"],
            task_type="multiple_choice",
        )
        for r in records
    ]
    (out_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    return path


def write_fixtures(out: Path, seed: int = 0) -> dict[str, Path]:
    """Write both tiny backbones, the tiny SmolVLM (Allocator encoders) and the smoke dataset
    under `out`; returns their paths."""
    out = Path(out)
    paths = {name: write_backbone(name, out / name, seed=seed) for name in BUILDERS}
    paths["smoke_videoqa"] = write_smoke_dataset(out / SMOKE_DIR, seed=seed)
    paths.update(write_benchmark_fixtures(out / "benchmarks", out / SMOKE_DIR, seed=seed))
    (out / COMPLETE_MARKER).write_text(_marker(seed))
    return paths


def write_benchmark_fixtures(out_dir: Path, smoke_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Tiny test splits with the columns of the real datasets (VideoMME, LVBench, Charades-STA,
    NExT-GQA, ActivityNet Captions grounding, ChartQA, TempCompass multi-choice), over the smoke
    clips and generated charts, so the real tasks' prompt and scoring functions run offline
    (tasks/resadapt_fixtures/).
    `video_path` / `image_path` hold absolute paths to the local media."""
    rng = np.random.default_rng(seed)
    smoke = [json.loads(line) for line in (smoke_dir / "test.jsonl").read_text().splitlines()]
    duration = 4.0  # seconds: 32 frames at 8 fps
    rows: dict[str, list[dict]] = {
        "videomme": [],
        "lvbench": [],
        "charades": [],
        "nextgqa": [],
        "activitynet": [],
        "chartqa": [],
        "tempcompass": [],
    }
    for i, clip in enumerate(smoke[:4]):
        path, vid = clip["video_path"], clip["videoID"]
        rows["videomme"].append(
            {
                **{
                    k: clip[k]
                    for k in (
                        "question_id",
                        "videoID",
                        "duration",
                        "domain",
                        "sub_category",
                        "task_type",
                        "question",
                        "options",
                        "answer",
                    )
                },
                "video_id": f"{i:03d}",
                "url": f"https://www.youtube.com/watch?v={vid}",
                "video_path": path,
            }
        )
        options = [o.split(". ", 1)[1] for o in clip["options"]]
        rows["lvbench"].append(
            dict(
                uid=i,
                key=vid,
                type=["entity recognition"],
                time_reference="00:01-00:03",
                video_path=path,
                question=clip["question"],
                options=options,
                answer=clip["answer"],
            )
        )
        start = round(float(rng.uniform(0.5, 1.5)), 1)
        segment = [start, round(start + float(rng.uniform(1.0, 2.0)), 1)]
        caption = "a coloured square moves across the frame"
        rows["charades"].append(
            dict(video=f"{vid}.mp4", caption=caption, timestamp=segment, duration=duration, video_path=path)
        )
        rows["activitynet"].append(
            dict(video=vid, caption=caption, timestamp=segment, duration=duration, video_path=path)
        )
        rows["nextgqa"].append(
            dict(
                video=vid,
                qid=i,
                question="What moves across the frame while the square is visible?",
                options=["a square", "a dog", "a car", "nothing", "a person"],
                answer="A",
                segments=[segment],
                duration=duration,
                video_path=path,
            )
        )
        chart = smoke_frames(rng, 224, 168, 1, (40, 80, 220))[0]
        image_path = out_dir / "chartqa" / "images" / f"chart_{i:03d}.png"
        image_path.parent.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        Image.fromarray(chart).save(image_path)
        rows["chartqa"].append(
            dict(
                question="What is the largest value?",
                answer=str(10 * (i + 1)),
                type="human_test",
                image_path=str(image_path.resolve()),
            )
        )
    # TempCompass multi-choice (lmms-lab/TempCompass, config multi-choice): the options are lines of
    # the question, the answer is the whole option line, dim is the temporal aspect asked about. The
    # smoke clips' square moves right at 4 px a frame in the clip's middle third, in one colour.
    tempcompass = [
        ("direction", "In which direction is the square moving?", ["left", "right", "up", "down"], 1),
        (
            "speed",
            "How fast does the square move?",
            ["at a constant speed", "faster and faster", "slower and slower"],
            0,
        ),
        (
            "order",
            "In what order do these happen in the video?",
            [
                "the square moves, then stops",
                "the square spins, then moves",
                "the square appears, moves, then disappears",
            ],
            2,
        ),
        (
            "attribute_change",
            "How does the colour of the square change?",
            ["it stays the same", "it turns red", "it turns blue", "it fades to white"],
            0,
        ),
    ]
    for clip, (dim, question, options, answer) in zip(smoke[:4], tempcompass):
        lines = [f"{letter}. {option}" for letter, option in zip("ABCD", options)]
        rows["tempcompass"].append(
            dict(
                video_id=clip["videoID"],
                question="\n".join([question, *lines]),
                answer=lines[answer],
                dim=dim,
                video_path=clip["video_path"],
            )
        )
    paths = {}
    for name, records in rows.items():
        path = out_dir / name / "test.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths[f"benchmark_{name}"] = path
    return paths


def _marker(seed: int) -> str:
    return f"version={FIXTURES_VERSION} seed={seed}\n"


def ensure_fixtures(out: Path, seed: int = 0) -> Path:
    """Write the fixtures under `out` unless a complete set is already there; returns `out`."""
    out = Path(out)
    marker = out / COMPLETE_MARKER
    if not marker.exists() or marker.read_text() != _marker(seed):
        write_fixtures(out, seed=seed)
    return out
