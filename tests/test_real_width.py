"""Qwen2.5-VL-7B and Qwen3-VL-8B at their real widths, reduced depth, random bfloat16 weights
(`fixtures.write_real_width`, nothing downloaded): every method the HF classes run goes through the
lmms-eval CLI on a short 640x360 video; each record reaches its target R within 0.01, and its FLOPs
are what `resadapt-eval flops` computes from the checkpoint's own config.json.

The CLI runs are slow (`make test-real-width`: one lmms-eval run per method and backbone, 28 in
all); the config checks are not."""

import re
import subprocess
from types import SimpleNamespace

import pytest
from safetensors import safe_open

from resadapt_eval.baselines import mustdrop
from resadapt_eval.compute.configs import KNOWN_CONFIGS
from resadapt_eval.compute.flops import (
    decode_flops,
    dims_from_config,
    load_dims,
    recomputed_attention,
    sample_flops,
)
from resadapt_eval.estimates import row_flops, stage_flops
from resadapt_eval.fixtures import REAL_WIDTH, REDUCED_DEPTH, build_tokenizer, ensure_real_width, real_width_config
from resadapt_eval.methods import AFTER_MERGER, BEFORE_ENCODER, INSIDE_LLM, METHODS, NO_RETENTION

from .helpers import FIXTURES, REPO, lmms_eval_command, run_manifest, sidecar_records

BACKBONES = {family: name for name, family in REAL_WIDTH.items()}  # qwen25vl -> qwen25vl-7b
HF_METHODS = [name for name, method in METHODS.items() if method.hf]  # all but vLLM's EVS
TASK = "resadapt_real_width"
SIZE, FRAMES = (640, 360), 4  # (width, height): 2 pairs of 13 x 23 tokens (Qwen2.5-VL), 11 x 20 (Qwen3-VL)
MAX_NEW_TOKENS = 3  # so that decode steps run (and are counted)
TARGET = 0.25
# Targets other than 0.25 on these 4-layer LLMs and 2-pair videos, and why:
TARGETS = {
    # FastV's and DART's default stage (layer 2; layer 3 on Qwen3-VL, after its deepstack layers)
    # leaves the layers before it every token: a layer-averaged floor of 2/4 and 3/4
    ("qwen25vl", "fastv"): 0.6,
    ("qwen3vl", "fastv"): 0.8,
    ("qwen25vl", "dart"): 0.6,
    ("qwen3vl", "dart"): 0.8,
    ("qwen3vl", "ipcv"): 0.8,  # its in-LLM stage is DART's
    ("qwen25vl", "sparsevlm"): 0.6,  # one stage on a 4-layer LLM (its three default layers collapse), as FastV's
    ("qwen3vl", "sparsevlm"): 0.8,
    ("qwen3vl", "mustdrop"): 0.8,  # its stage after the deepstack layers, and its window merge's floor (8 a window)
    # FrameFusion merges from layer 3 on Qwen3-VL (after its deepstack layers) and keeps a frame pair
    # there: a floor of (3 N + N / 2) / 4 N = 0.875 on 2 pairs
    ("qwen3vl", "framefusion"): 0.9,
    # PyramidDrop's default stages (layers 1, 2, 3; only 3 on Qwen3-VL) keep a token each at least:
    # floors just above 1/4 and 3/4
    ("qwen25vl", "pyramiddrop"): 0.3,
    ("qwen3vl", "pyramiddrop"): 0.8,
    # resizing moves in grid steps, 0.02-0.05 of R apart on 2 pairs: one scale for every frame reaches
    # 0.241 at 0.25 on 13 x 23 tokens, but 0.227 on 11 x 20 (the next step is 0.273); at 0.3 it is 0.300
    ("qwen3vl", "fixed_scale"): 0.3,
    # the untrained Allocator's allocation, kept under one global factor, reaches 0.221 at 0.25 on
    # Qwen2.5-VL and 0.293 at 0.3
    ("qwen25vl", "resadapt"): 0.3,
}
# Methods whose row `resadapt-eval flops` prints from configs alone (the others' compressors do work
# that depends on the features, and declare no `config_flops`): the row equals the record in every part
ROW_METHODS = [
    name
    for name, m in METHODS.items()
    if m.prune is None
    and m.adaptive_prune is None  # its layers' counts follow from the hidden states
    and m.decode_prune is None
    and (m.compressor is None or m.compressor.config_flops is not None)
] + [
    name
    for name, m in METHODS.items()
    if m.compressor is None
    and m.prune is not None
    and name != "sparsevlm"  # its raters are the prompt's text after the video; a row takes all its text as that
]
TWO_STAGE = [name for name, m in METHODS.items() if m.compress is not None and m.prune is not None]


def target_of(backbone: str, method: str) -> float | None:
    return None if METHODS[method].retention == NO_RETENTION else TARGETS.get((backbone, method), TARGET)


# ---------------------------------------------------------------------- the builder (fast)
@pytest.mark.parametrize("name", REAL_WIDTH)
def test_real_width_configs_keep_every_published_width(name):
    tok, published = build_tokenizer(), KNOWN_CONFIGS[name]
    text_layers, vision_blocks = REDUCED_DEPTH[name]
    reduced = real_width_config(name, tok, text_layers, vision_blocks).to_dict()
    depth_keys = {"num_hidden_layers", "depth", "fullatt_block_indexes", "deepstack_visual_indexes"}
    for part in ("text_config", "vision_config"):
        for key, value in published[part].items():
            if key not in depth_keys:
                assert reduced[part][key] == value, (part, key)
    assert reduced["tie_word_embeddings"] is False and reduced["text_config"]["vocab_size"] > 150_000
    assert (reduced["text_config"]["num_hidden_layers"], reduced["vision_config"]["depth"]) == (
        text_layers,
        vision_blocks,
    )
    # the special tokens are the byte-level tokenizer's
    assert reduced["video_token_id"] == tok.convert_tokens_to_ids("<|video_pad|>")
    # at full depth the built config counts as the published one
    assert dims_from_config(real_width_config(name, tok)) == load_dims(name)


def test_reduced_towers_keep_windowed_full_attention_and_deepstack_blocks():
    tok = build_tokenizer()
    qwen25 = real_width_config("qwen25vl-7b", tok, 4, 2).vision_config
    assert qwen25.fullatt_block_indexes == [1]  # block 0 windowed (112 px), block 1 full
    assert real_width_config("qwen25vl-7b", tok, 4, 10).vision_config.fullatt_block_indexes == [7, 9]
    assert real_width_config("qwen3vl-8b", tok, 4, 4).vision_config.deepstack_visual_indexes == [1, 2, 3]
    assert real_width_config("qwen3vl-8b", tok, 2, 2).vision_config.deepstack_visual_indexes == [0, 1]
    with pytest.raises(ValueError, match="at least 2 blocks"):
        real_width_config("qwen25vl-7b", tok, 4, 1)
    with pytest.raises(ValueError, match="give at least 3 text layers"):
        real_width_config("qwen3vl-8b", tok, 2, 4)
    with pytest.raises(ValueError, match="unknown real-width backbone"):
        real_width_config("qwen25vl-72b", tok, 4, 2)


def test_fixtures_command_refuses_a_depth_the_architecture_cannot_be_cut_to(tmp_path, capsys):
    from resadapt_eval.cli import main

    out = tmp_path / "rw"
    assert main(["fixtures", "--real-width", "qwen25vl-7b", "--vision-blocks", "1", "--out", str(out)]) == 2
    assert "at least 2 blocks" in capsys.readouterr().err and not out.exists()
    assert main(["fixtures", "--text-layers", "4", "--out", str(out)]) == 2
    assert "size a --real-width model" in capsys.readouterr().err and not out.exists()


# ---------------------------------------------------------------------- the lmms-eval CLI (slow)
@pytest.fixture(scope="session")
def real_width_models() -> dict:
    """The reduced-depth real-width checkpoints, written once under fixtures/real_width (about 4 GB each)."""
    return {
        family: ensure_real_width(FIXTURES / "real_width", name, *REDUCED_DEPTH[name])
        for family, name in BACKBONES.items()
    }


@pytest.fixture(scope="module")
def real_width_task(tmp_path_factory):
    """An --include_path folder with the smoke task on one 4-frame 640x360 video, MAX_NEW_TOKENS tokens."""
    import json

    from resadapt_eval.profile import synthetic_video

    folder = tmp_path_factory.mktemp("real_width_task")
    video = synthetic_video(folder / "video.mp4", SIZE, FRAMES)
    row = dict(
        question_id="rw-1",
        videoID="rw",
        video_path=str(video),
        duration="short",
        domain="Knowledge",
        sub_category="Humanity & History",
        task_type="Attribute Perception",
        question="What colour is the moving square?",
        options=["A. red", "B. green", "C. blue", "D. yellow"],
        answer="A",
    )
    (folder / "test.jsonl").write_text(json.dumps(row) + "\n")
    smoke = (REPO / "tasks" / "resadapt_smoke_videoqa" / "resadapt_smoke_videoqa.yaml").read_text()
    replaced = {
        "task: resadapt_smoke_videoqa": f"task: {TASK}",
        "test: ../../fixtures/smoke_videoqa/test.jsonl": f"test: {folder / 'test.jsonl'}",
        "max_new_tokens: 16": f"max_new_tokens: {MAX_NEW_TOKENS}",
    }
    for old, new in replaced.items():
        assert old in smoke
        smoke = smoke.replace(old, new)
    (folder / "tasks").mkdir()
    (folder / "tasks" / f"{TASK}.yaml").write_text(smoke)
    return folder / "tasks"


@pytest.mark.slow
def test_real_width_checkpoints_hold_bfloat16_weights_at_real_sizes(real_width_models):
    for family, folder in real_width_models.items():
        published = KNOWN_CONFIGS[BACKBONES[family]]["text_config"]
        with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
            names = list(weights.keys())

            def shape(suffix: str) -> list[int]:  # the saved names depend on the transformers version's layout
                (name,) = [n for n in names if n.endswith(suffix) and "visual" not in n]
                return weights.get_slice(name).get_shape()

            assert {weights.get_slice(n).get_dtype() for n in names} == {"BF16"}
            assert shape("embed_tokens.weight") == [published["vocab_size"], published["hidden_size"]]
            assert shape("lm_head.weight") == shape("embed_tokens.weight")  # untied, as published
            assert shape("layers.0.mlp.gate_proj.weight") == [published["intermediate_size"], published["hidden_size"]]


@pytest.mark.slow
@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", HF_METHODS)
def test_every_method_runs_through_the_cli_at_real_width(
    real_width_models, real_width_task, tmp_path, backbone, method
):
    folder, spec, target = real_width_models[backbone], METHODS[method], target_of(backbone, method)
    model_args = dict(pretrained=folder, method=method, max_num_frames=FRAMES, device="cpu", dtype="bfloat16")
    model_args["num_threads"] = 1  # one thread per process on these loaded 2 cores (DESIGN: 2 were ~10x slower)
    if target is not None:
        model_args["retention"] = target
    if spec.needs_allocator:
        model_args["allocator"] = "untrained"
    cmd = lmms_eval_command(f"{method}_{backbone}", model_args, TASK, str(real_width_task), tmp_path)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if backbone not in spec.kind.families:  # stops at start, naming why
        assert re.search(rf"ValueError: method={method} \w+ inside the vision tower on Qwen3-VL only", proc.stderr)
        assert not list(tmp_path.rglob("*.jsonl"))
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = sidecar_records(tmp_path)
    assert record["error"] is None, record["error"]
    assert record["method"] == method and record["num_frames"] == FRAMES and len(record["grids"]) == FRAMES // 2
    assert run_manifest(tmp_path)["failed_samples"] == 0
    if target is None:
        assert record["achieved_retention"] == 1.0 and record["visual_tokens"] == record["reference_tokens"]
    else:
        assert target - 0.01 <= record["achieved_retention"] <= target
    if spec.stage == BEFORE_ENCODER:
        assert record["visual_tokens"] == sum(t * h * w for t, h, w in record["grids"])
    if spec.prune is not None:  # R is the layer average
        layers = record["layer_visual_tokens"]
        assert record["achieved_retention"] == sum(layers) / len(layers) / record["reference_tokens"]
    assert record["output_tokens"] == MAX_NEW_TOKENS  # decode steps ran (a random model rarely stops)
    check_flops(record, folder, backbone, method, target)


def check_flops(record: dict, folder, backbone: str, method: str, target: float | None) -> None:
    """The record's FLOPs are `compute.flops.sample_flops` (what every `resadapt-eval flops` row runs)
    with the dimensions `resadapt-eval flops --backbone <folder>` reads from the checkpoint's
    config.json, on the record's own grids and token counts; where the flops command prints the
    method's row from configs alone, that row equals the record."""
    dims, spec = load_dims(str(folder)), METHODS[method]
    assert (dims.text.layers, dims.vision.depth) == REDUCED_DEPTH[BACKBONES[backbone]]
    grids = [tuple(g) for g in record["grids"]]
    text_tokens = record["input_tokens"] - record["visual_tokens"]
    layers = record["layer_visual_tokens"]
    prompt = record["input_tokens"] if layers is None else [text_tokens + n for n in layers]
    # the method's own work: computed from the config where the flops command can, else as counted in the run
    if spec.adaptive_prune is not None:  # its merges and ranking follow from the hidden states: as counted
        compressor = record["method_flops"]
    elif method == "sparsevlm":  # its raters' rows are the task prompt's text after the video: as counted
        compressor = record["method_flops"]  # (from configs on the tiny models: test_flops.py)
    elif spec.stage == INSIDE_LLM:  # each stage's ranking (`stage_flops`), in the layer before it
        stages = spec.prune(dims.text.layers, record["visual_tokens"], target, None, dims.vision.deepstack)
        assert [s.layer for s in stages] == [i for i in range(1, len(layers)) if layers[i] != layers[i - 1]]
        plan = SimpleNamespace(prompt=prompt, visual=record["visual_tokens"])
        compressor = sum(stage_flops(dims.text, s, plan, text_tokens, i == 0) for i, s in enumerate(stages))
    elif spec.stage == AFTER_MERGER and method not in ROW_METHODS:  # depends on the features
        compressor = record["method_flops"] - (recomputed_attention(dims.vision, grids) if spec.needs_attention else 0)
        assert compressor >= 0  # VidCom2's: 0 (elementwise distances, no matmul)
    else:
        compressor = None
    keys_dropped = 0
    if spec.decode_prune is not None:  # DyCoke's decode stage: whole key columns less than the unpruned steps
        unpruned = decode_flops(dims.text, prompt, record["output_tokens"])
        per_key = 4 * dims.text.heads * dims.text.head_dim
        keys_dropped, rest = divmod(unpruned - record["decode_flops"], per_key)
        assert rest == 0 and keys_dropped >= 0
    if spec.prune is not None:  # MustDrop's decoding stage: its cut caches' columns, in each step after the first
        stages = spec.prune(dims.text.layers, record["visual_tokens"], target, None, dims.vision.deepstack)
        final = text_tokens + (stages[-1].keep if stages else 0)
        steps = max(0, record["output_tokens"] - 1)
        keys_dropped = steps * sum(prompt[i] - final for i in mustdrop.cut_layers(stages))
    allocator = record["allocator_flops"]
    if spec.needs_allocator:  # the row of `resadapt-eval flops --allocator untrained --query-tokens <the query's>`
        from resadapt_eval.allocator import load_allocator

        untrained = load_allocator("untrained")
        assert any(untrained.flops(FRAMES, q) == allocator for q in range(1, 1024))
    else:
        assert allocator == 0
    tower = None
    if spec.tower_merge is not None or spec.tower_prune is not None:  # what each vision block ran
        tower = spec.kind.tower_counts(spec, dims, [t * h * w for t, h, w in grids], target)
        assert tower.tokens == record["tower_tokens"]
    expected = sample_flops(
        dims,
        spec,
        grids,
        target,
        prompt,
        record["output_tokens"],
        compressor,
        allocator=allocator,
        decode_keys_dropped=keys_dropped,
        tower=tower,
    )
    parts = ("vision", "vision_attention", "llm_prefill", "llm_attention", "decode", "method", "allocator")
    assert {p: record[f"{p}_flops"] for p in parts} == {p: getattr(expected, p) for p in parts}
    assert record["total_flops"] == expected.total
    if method in ROW_METHODS or method in TWO_STAGE:
        row, visual = row_flops(
            dims, method, FRAMES, SIZE[::-1], target, text_tokens=text_tokens, output_tokens=record["output_tokens"]
        )
        assert visual == record["visual_tokens"]
        # a two-stage method's row leaves out its compressor's work, which depends on the features
        same = parts if method in ROW_METHODS else tuple(p for p in parts if p != "method")
        assert {p: getattr(row, p) for p in same} == {p: record[f"{p}_flops"] for p in same}
    if method in ROW_METHODS:
        printed = flops_command_row(folder, method, target, text_tokens, record["output_tokens"])
        assert int(printed["visual_tokens"]) == record["visual_tokens"]
        assert float(printed["total"]) == round(record["total_flops"] / 1e12, 1)


def flops_command_row(folder, method: str, target: float | None, text_tokens: int, output_tokens: int) -> dict:
    """The row `resadapt-eval flops` prints for `method` on this checkpoint, video size and frames."""
    import contextlib
    import io

    from resadapt_eval.cli import main

    args = ["flops", "--backbone", str(folder), "--frames", str(FRAMES), "--size", "x".join(map(str, SIZE))]
    args += ["--methods", method, "--text-tokens", str(text_tokens), "--output-tokens", str(output_tokens)]
    if target is not None:
        args += ["--retention", str(target)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    lines = [line.split() for line in out.getvalue().splitlines()]
    (header,) = [line for line in lines if line[:2] == ["method", "frames"]]
    (row,) = [line for line in lines if line[:1] == [method]]
    return dict(zip(header, row))
