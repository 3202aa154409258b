"""Helpers several test modules share (test modules import from here, never from each other).

Fixtures live in conftest.py; these are plain functions and constants."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"  # the folder the smoke task reads (written by conftest.py's `fixtures_dir`)
BACKBONES = ["qwen25vl", "qwen3vl"]
SMOKE_TASK = "resadapt_smoke_videoqa"


# ---------------------------------------------------------------- prompts, videos, inputs


def early_prune_layers(method, separator: str = ",") -> str:
    """`prune_layers` early enough for R=0.1 on the tiny 12-layer backbones: layer 1 for a one-stage
    method, layers 1, 2, 3 for one taking any number (`Method.prune_layer_count`)."""
    return separator.join(str(layer) for layer in range(1, (method.prune_layer_count or 3) + 1))


def chat_prompt(adapter, question="Which colour is the square?"):
    """The chat template's prompt for one video and `question`, as lmms-eval's chat tasks build it."""
    messages = [
        {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": question}]}
    ]
    return adapter.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def synthetic_video(num_frames, height=120, width=160, seed=0):
    """Random uint8 frames as a decoded video: frame indices 0, 3, 6, ... of a 6 fps file."""
    from resadapt_eval.video import DecodedVideo

    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    indices = list(range(0, 3 * num_frames, 3))
    return DecodedVideo(frames=frames, indices=indices, total_frames=3 * num_frames + 1, fps=6.0)


def drifting_video(num_frames=8, seed=0):
    """Random 160x120 frames drifting slowly from the first, so neighbouring pairs are similar
    (FlashVid segments and merges them); indices 0..T-1 of a 2 fps file."""
    from resadapt_eval.video import DecodedVideo

    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (num_frames, 120, 160, 3), dtype=np.uint8)
    frames[1:] = (0.7 * frames[:1] + 0.3 * frames[1:]).astype(np.uint8)
    return DecodedVideo(frames=frames, indices=list(range(num_frames)), total_frames=num_frames, fps=2.0)


def vanilla_setup(adapter, num_frames=8):
    """(prompt, drifting video, vanilla plan at a 4x6-token base): a compressor's test input."""
    from resadapt_eval.budget.plan import plan_from_scales

    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * num_frames, (4 * px, 6 * px), adapter.grid)
    return chat_prompt(adapter), drifting_video(num_frames), plan


def video_request(adapter, fixtures_dir):
    """A pipeline request on the first smoke video, 4 new tokens."""
    from resadapt_eval.pipeline import Request

    prompt = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    video = str(sorted((fixtures_dir / "smoke_videoqa" / "videos").glob("*.mp4"))[0])
    return Request(prompt, video=video, gen_kwargs=dict(max_new_tokens=4))


def text_after_video(adapter, prompt: str) -> int:
    """Tokens of `prompt` after its video (the text a stage inside the LLM never prunes)."""
    pad = adapter.processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    frames = torch.zeros(2, 3, 64, 64, dtype=torch.uint8)  # the text after the video is the same for any video
    ids = adapter.processor(text=[prompt], videos=[frames], return_tensors="pt").input_ids[0].tolist()
    return len(ids) - max(i for i, token in enumerate(ids) if token == pad) - 1


@torch.inference_mode()
def first_logits_and_text(adapter, inputs, steps=4):
    """Greedy generation of `steps` tokens: (first-token logits, generated ids)."""
    adapter.model.model.rope_deltas = None
    out = adapter.model.generate(
        **inputs,
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=adapter.tokenizer.pad_token_id,
    )
    return out.logits[0][0], out.sequences[0, inputs["input_ids"].shape[1] :]


def video_position_blocks(positions, mm_token_type_ids, grids):
    """Split the (3, L) positions of the video tokens into one (3, h*w) block per pair."""
    from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE

    video = positions[:, mm_token_type_ids[0] == VIDEO_TOKEN_TYPE]
    sizes = [t * h * w for t, h, w in grids]
    return list(torch.split(video, sizes, dim=1))


def attention_input(adapter, inputs, layer: int):
    """(hidden states, (cos, sin)) entering decoder layer `layer`'s attention in a plain forward of `inputs`."""
    captured = {}

    def capture(module, args, kwargs):
        captured["in"] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    attention = adapter.model.model.language_model.layers[layer].self_attn
    handle = attention.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        adapter.model.model.rope_deltas = None
        with torch.no_grad():
            adapter.model(**inputs)
    finally:
        handle.remove()
    return captured["in"]


# ---------------------------------------------------------------- the Allocator


def tiny_allocator_config(**overrides):
    """A small Allocator config on the seeded `tiny` encoders (width 32, 4 heads, 2 layers)."""
    from resadapt_eval.allocator.model import AllocatorConfig

    return AllocatorConfig(
        **{**dict(encoder="tiny", width=32, num_heads=4, num_layers=2, head_init_std=0.5), **overrides}
    )


def allocator_frames(num_frames=8, seed=0, height=48, width=64):
    """Random uint8 frames (T, H, W, 3) as the Allocator reads them."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8))


# ---------------------------------------------------------------- the lmms-eval CLI


def lmms_eval_command(model: str, model_args: dict, tasks: str, include_path: str, output_path) -> list[str]:
    """The `python -m lmms_eval` command line of one run, samples logged."""
    arg_string = ",".join(f"{k}={v}" for k, v in model_args.items())
    return [
        sys.executable,
        "-m",
        "lmms_eval",
        "--model",
        model,
        "--model_args",
        arg_string,
        "--tasks",
        tasks,
        "--include_path",
        include_path,
        "--output_path",
        str(output_path),
        "--log_samples",
    ]


def smoke_task(folder: Path, rows: list[dict]) -> Path:
    """An --include_path folder holding the smoke task (same name, prompt and scoring) over `rows` (dicts
    in the smoke JSONL's schema), written under `folder`: a test that needs other data than
    fixtures/smoke_videoqa leaves that shared folder as it is."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "test.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = (REPO / "tasks" / SMOKE_TASK / f"{SMOKE_TASK}.yaml").read_text()
    shared = "test: ../../fixtures/smoke_videoqa/test.jsonl"
    assert shared in task
    (folder / "tasks").mkdir(exist_ok=True)
    (folder / "tasks" / f"{SMOKE_TASK}.yaml").write_text(task.replace(shared, f"test: {data}"))
    return folder / "tasks"


def run_lmms_eval(model, model_args, out, include_path=None):
    """One lmms-eval run of the smoke task into `out` (a folder of its own: each test's tmp_path); the
    task from `include_path` (a `smoke_task` folder), else the repository's tasks/."""
    cmd = lmms_eval_command(model, model_args, SMOKE_TASK, str(include_path or REPO / "tasks"), out)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def sidecar_records(out):
    """The records of the one sidecar JSONL under `out`."""
    paths = sorted(Path(out).rglob("resadapt_samples_*.jsonl"))
    assert len(paths) == 1, paths
    return [json.loads(line) for line in paths[0].read_text().splitlines()]


def results_json(out):
    """lmms-eval's results JSON under `out`."""
    (path,) = sorted(Path(out).rglob("*_results.json"))
    return json.loads(path.read_text())


def run_manifest(out):
    """The run manifest, which sits beside lmms-eval's results JSON."""
    (path,) = sorted(Path(out).rglob("resadapt_run_*.json"))
    assert path.parent == sorted(Path(out).rglob("*_results.json"))[0].parent
    return json.loads(path.read_text())


def free_port() -> int:
    """A TCP port free on this machine now: `accelerate launch --main_process_port`, so that runs in
    parallel test workers do not meet on torch.distributed's default 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- fidelity: the stage inside the LLM


def scene_tokens(g: torch.Generator, grids: list[tuple], ties: bool = False, dim: int = 12):
    """Random merged visual tokens (`VisualTokens`) over scenes of static backgrounds: each position has a
    base vector and a noise level (low: static, high: dynamic), a new scene redraws them; with `ties`, a
    position repeats its neighbour's token and some pairs repeat the one before (letterboxes, frozen
    frames), so DPC-KNN meets equal densities and distances."""
    from resadapt_eval.baselines.common import VisualTokens

    sizes = [t * h * w for t, h, w in grids]
    width = max(sizes)
    feats, base, level = [], None, None
    for p, n in enumerate(sizes):
        if base is None or torch.rand((), generator=g) < 0.3:
            base = torch.randn(width, dim, generator=g, dtype=torch.float64)
            level = torch.where(
                torch.rand(width, generator=g) < 0.5,
                0.05 + 0.3 * torch.rand(width, generator=g),
                0.8 + 2 * torch.rand(width, generator=g),
            ).double()
        frame = base[:n] + level[:n, None] * torch.randn(n, dim, generator=g, dtype=torch.float64)
        if ties:
            frame[1:n:3] = frame[0 : n - 1 : 3][: len(frame[1:n:3])]
            if p > 0 and sizes[p - 1] == n and torch.rand((), generator=g) < 0.3:  # a nearly frozen frame
                frame = feats[-1] + 0.05 * torch.randn(n, dim, generator=g, dtype=torch.float64)
        feats.append(frame)
    return VisualTokens(torch.cat(feats), sizes, list(grids))


def build_text_models(fixtures_dir) -> dict:
    """Each tiny backbone's decoder stack with random float64 weights and eager attention (the reference reads the
    eager attention map), with the first layer a stage may start at."""
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    models = {}
    for name, cls in (("qwen25vl", Qwen2_5_VLTextModel), ("qwen3vl", Qwen3VLTextModel)):
        config = AutoConfig.from_pretrained(str(fixtures_dir / name))
        text = config.text_config
        text._attn_implementation = "eager"
        torch.manual_seed(0)
        first = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())
        models[name] = (cls(text).double().eval(), first)
    return models


class Reached(Exception):
    """Stops a forward at the layer under test (the later layers do not matter)."""


def plain_run(model, embeds: torch.Tensor, layer: int):
    """The unpruned forward: the eager attention map of layer `layer - 1` (1, H, L, L) and the hidden states
    entering layer `layer` (1, L, D), what the reference's stage reads."""
    seen = {}

    def attention(module, args, output):
        seen["attention"] = output[1]

    def reached(module, args, kwargs):
        seen["hidden"] = (args[0] if args else kwargs["hidden_states"]).clone()
        raise Reached

    handles = [
        model.layers[layer - 1].self_attn.register_forward_hook(attention),
        model.layers[layer].register_forward_pre_hook(reached, with_kwargs=True),
    ]
    try:
        with torch.no_grad(), pytest.raises(Reached):
            model(inputs_embeds=embeds)
    finally:
        for handle in handles:
            handle.remove()
    return seen["attention"], seen["hidden"]


def pruned_run(model, embeds: torch.Tensor, stage, visual: torch.Tensor):
    """Our `LayerPruner` on the same input (`stage`: an `inside_llm.Stage`): the prompt indices layer
    `stage.layer` sees and its input hidden states."""
    from resadapt_eval.backbones.layer_pruning import LayerPruner

    pruner, seen = LayerPruner(model, [stage], visual), {}

    def reached(module, args, kwargs):
        seen["hidden"] = (args[0] if args else kwargs["hidden_states"]).clone()
        raise Reached

    with torch.no_grad(), pruner.attached():  # registered after the pruner's hook: sees its output
        handle = model.layers[stage.layer].register_forward_pre_hook(reached, with_kwargs=True)
        try:
            with pytest.raises(Reached):
                model(inputs_embeds=embeds)
        finally:
            handle.remove()
    return pruner.kept_by_layer[stage.layer], seen["hidden"]


def random_prompt(g: torch.Generator, width: int, visual: int):
    """(1, L, width) random embeddings: a few text tokens, `visual` visual tokens, then the question's tokens."""
    before, after = int(torch.randint(1, 5, (), generator=g)), int(torch.randint(2, 7, (), generator=g))
    embeds = torch.randn(1, before + visual + after, width, generator=g, dtype=torch.float64)
    return embeds, torch.arange(before, before + visual)


# ---------------------------------------------------------------- training


def tiny_train_config(tmp_path, fixtures_dir, **train_overrides) -> Path:
    """configs/train_tiny.yaml on the offline fixtures, writing to tmp_path/run; train settings overridden."""
    import yaml

    config = yaml.safe_load((REPO / "configs" / "train_tiny.yaml").read_text())
    config["output_dir"] = str(tmp_path / "run")
    config["data"] = str(fixtures_dir / "smoke_videoqa" / "train.jsonl")
    config["backbone"]["pretrained"] = str(fixtures_dir / "qwen25vl")
    config["train"].update(train_overrides)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train_cli(*args, timeout: int = 900) -> subprocess.CompletedProcess:
    """`resadapt-eval train ARGS` in a fresh process, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "resadapt_eval.cli", "train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# the session's report sweep (conftest.report_sweep): tables, plots and the cluster tests read it
REPORT_GRID = dict(methods="vanilla,fixed_scale,resadapt", retention="0.5,0.25", limit=4)


def sweep_cmd(output, methods, retention="0.25", limit=3, card=None):
    """`resadapt-eval sweep` of `methods` x `retention` on the tiny Qwen2.5-VL card (or `card`)."""
    return [
        sys.executable,
        "-m",
        "resadapt_eval.cli",
        "sweep",
        "--card",
        str(card or REPO / "model_cards" / "tiny-qwen25vl.yaml"),
        "--methods",
        methods,
        "--retention",
        retention,
        "--output",
        str(output),
        "--limit",
        str(limit),
    ]


def check_kept(record: dict) -> None:
    """A successful record's kept tokens agree with its counts: the mask covers the plan's tokens and
    holds exactly `visual_tokens`; merged groups' sizes are `merged_sizes`; each in-LLM stage holds
    `layer_visual_tokens` at its layer, a subset of the stage before."""
    from resadapt_eval.kept import read_kept

    kept = read_kept(record)
    assert kept is not None, record["method"]
    assert len(kept.assignment) == sum(t * h * w for t, h, w in record["grids"])
    assert kept.mask.sum() == record["visual_tokens"] == len(kept.kept)
    groups = kept.groups
    if record["merged_sizes"] is not None:
        assert np.bincount(groups[groups >= 0], minlength=len(kept.kept)).tolist() == record["merged_sizes"]
    held = kept.mask
    for layer, mask in kept.stages:
        assert mask.sum() == record["layer_visual_tokens"][layer]
        assert not (mask & ~held).any()  # a later stage holds only tokens the earlier held
        held = mask
