"""Train a needle backbone: a tiny Qwen2.5-VL- or Qwen3-VL-architecture model that reads the needle glyph.

Two stages (the answer-token loss alone stays at chance on this task):
1. the vision tower + merger with a max-pooled linear head on single evidence pairs at full
   resolution, the glyph shrinking from 40-48 px to 12-20 px;
2. the whole model on the answer token through `backbones/` inputs (per-pair sizes), vision lr
   x0.2, a curriculum from 1-2 pairs to all 8, and mixed resolutions so the model also reads
   downscaled pairs when it can (45% all full; 35% evidence pair at 0.75-1.0 with the rest at
   0.125-0.5; 20% one uniform scale in 0.25-0.875).
Videos are rendered in memory from seeded specs (no files); `cue_fraction` of them carry the
`--cue` border on their evidence frames. `variant="query"` replaces stage 2 with
`train_query_stage` (k candidates in coloured borders, the question names one; the answer loss
plus the attention-supervised `binding_losses`); `variant="long"` trains stage 2 on up to 64
pairs, mostly small (the budget of vanilla at 8 frames), the evidence pair at full size.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..backbones.qwen import ADAPTERS, QwenVideoAdapter, family_of
from ..budget.plan import plan_from_scales
from ..fixtures import CHAT_TEMPLATE, IMAGE_MEAN, IMAGE_STD, _token_ids, build_tokenizer
from ..video import DecodedVideo
from .data import (
    CANDIDATES,
    CLASSES,
    COLOURS,
    FPS,
    FRAMES,
    LETTERS,
    LONG_FRAMES,
    QUESTION,
    SIZE,
    NeedleSpec,
    query_question,
    random_query,
    random_spec,
    render_query_video,
    render_video,
)

PAIRS = FRAMES // 2


def build_needle_backbone(seed: int = 0, family: str = "qwen25vl"):
    """A model of `family`'s architecture: text hidden 128, 4 heads, 3 layers; vision hidden 96,
    depth 2. Qwen2.5-VL (1.0M parameters): heads of 32, 14 px patches, windowed attention only,
    no full-attention block, like the local attention of real towers. Qwen3-VL (1.7M): heads of
    128 with Qwen3-VL's rope (theta 5e6, interleaved sections 24/20/20), 16 px patches, its
    deepstack feature added at the first LLM layer. Returns (model, processor)."""
    from transformers import Qwen2VLImageProcessor

    tok = build_tokenizer()
    text = dict(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(depth=2, hidden_size=96, intermediate_size=192, num_heads=2, spatial_merge_size=2)
    vision.update(temporal_patch_size=2, out_hidden_size=128)
    if family == "qwen25vl":
        from transformers import (
            Qwen2_5_VLConfig,
            Qwen2_5_VLForConditionalGeneration,
            Qwen2_5_VLProcessor,
            Qwen2VLVideoProcessor,
        )

        text.update(
            bos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        )
        vision.update(patch_size=14, window_size=112, fullatt_block_indexes=[], tokens_per_second=2)
        classes = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor
    elif family == "qwen3vl":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor

        # Qwen3-VL's own head size and rope (QK-norm bounds an attention logit by about sqrt(head_dim)
        # times the norm weights; at head_dim 32 the first layer cannot single out the glyph tokens)
        rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
        text.update(head_dim=128, rope_parameters=rope)
        vision.update(patch_size=16, num_position_embeddings=256, deepstack_visual_indexes=[0])
        classes = Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor
    else:
        raise ValueError(f"needle backbones are qwen25vl or qwen3vl, got {family!r}")
    config_cls, model_cls, processor_cls, video_processor_cls = classes
    config = config_cls(text_config=text, vision_config=vision, **_token_ids(tok))
    torch.manual_seed(seed)
    model = model_cls(config)
    patch = vision["patch_size"]
    common = dict(patch_size=patch, merge_size=2, temporal_patch_size=2, image_mean=IMAGE_MEAN, image_std=IMAGE_STD)
    processor = processor_cls(
        image_processor=Qwen2VLImageProcessor(**common),
        video_processor=video_processor_cls(**common),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )
    return model, processor


def train_vision_stage(
    model, processor, rng, steps: int, batch: int, lr: float, progress: bool, cue_fraction: float = 0.0
) -> list[float]:
    """Stage 1: the vision tower and merger learn the glyph classes on single full-size pairs."""
    head = nn.Linear(model.config.vision_config.out_hidden_size, 4)
    params = list(model.model.visual.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    history = []
    bar = tqdm(range(steps), desc="needle stage 1 (vision)", disable=not progress)
    for step in bar:
        shrink = min(1.0, step / (0.6 * steps))
        lo, hi = round(40 - 28 * shrink), round(48 - 28 * shrink)
        specs = [random_spec(rng, 1, (lo, hi)) for _ in range(batch)]
        pairs = [
            torch.from_numpy(
                render_video(rng, s, cue=bool(cue_fraction and rng.random() < cue_fraction), num_frames=2)
            ).permute(0, 3, 1, 2)
            for s in specs
        ]
        video = processor.video_processor(videos=pairs, do_resize=False, do_sample_frames=False, return_tensors="pt")
        features = model.model.get_video_features(video["pixel_values_videos"], video["video_grid_thw"]).pooler_output
        logits = head(torch.stack([f.max(dim=0).values for f in features]))
        labels = torch.tensor([s.label for s in specs])
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(float((logits.argmax(1) == labels).float().mean()))
        bar.set_postfix(glyph=f"{lo}-{hi}", acc=f"{np.mean(history[-20:]):.2f}")
    return history


def training_sample(rng: np.random.Generator, variant: str, max_pairs: int, cue_fraction: float):
    """One stage-2 video of the single or long variant: uint8 frames, its question, the answer's
    class and the evidence pair."""
    pairs = int(rng.integers(1, max_pairs + 1))
    spec = random_spec(rng, pairs if variant == "long" else min(pairs, PAIRS // 2))  # long: anywhere
    cue = bool(cue_fraction and rng.random() < cue_fraction)
    frames = render_video(rng, spec, cue=cue, num_frames=2 * pairs, noise=variant != "long")
    return frames, QUESTION, spec.label, spec.evidence_pair


def sample_scales(rng: np.random.Generator, pairs: int, evidence: int, variant: str = "single") -> np.ndarray:
    """Per-frame scales of a stage-2 sample (the mixed-resolution recipe; `long`: all full only
    up to 8 pairs, else the evidence pair at 0.75-1.0 and the rest at 0.1-0.3, or all at 0.1-0.35)."""
    if variant == "long" and pairs > PAIRS:
        pair_scales = rng.uniform(0.1, 0.3, pairs) if rng.random() < 0.7 else np.full(pairs, rng.uniform(0.1, 0.35))
        if rng.random() < 0.7:
            pair_scales[evidence] = rng.uniform(0.75, 1.0)
        return np.repeat(pair_scales, 2)
    u = rng.random()
    if u < 0.45:
        pair_scales = np.ones(pairs)
    elif u < 0.80:
        pair_scales = rng.uniform(0.125, 0.5, pairs)
        pair_scales[evidence] = rng.uniform(0.75, 1.0)
    else:
        pair_scales = np.full(pairs, rng.uniform(0.25, 0.875))
    return np.repeat(pair_scales, 2)


def chat_prompt(adapter: QwenVideoAdapter, question: str) -> str:
    """The chat-formatted prompt of one needle video and its question, ready for the answer."""
    return adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video", "video": "needle"}, {"type": "text", "text": question}]}],
        tokenize=False,
        add_generation_prompt=True,
    )


def answer_inputs(adapter: QwenVideoAdapter, frames: np.ndarray, scales: np.ndarray, question: str, label: int):
    """One in-memory stage-2 video (uint8 frames (2 P, H, W, 3)) at per-frame `scales`: the
    backbone inputs, the plan, and the answer's ids (the option letter, then <|im_end|>)."""
    video = DecodedVideo(frames=frames, indices=list(range(len(frames))), total_frames=len(frames), fps=float(FPS))
    plan = plan_from_scales(scales, (SIZE, SIZE), adapter.grid, min_tokens_per_pair=1)
    inputs = adapter.build_inputs(chat_prompt(adapter, question), video, plan)
    tok = adapter.tokenizer
    answer = torch.tensor([tok(LETTERS[label])["input_ids"][0], tok.convert_tokens_to_ids("<|im_end|>")])
    return inputs, plan, answer


def answer_optimizer(model, lr: float, vision_lr_scale: float, heads: nn.Module | None = None):
    """AdamW for stage 2: the LLM at `lr`, the vision tower at `lr * vision_lr_scale`, and any
    training-only `heads` at 1e-3."""
    vision = set(id(p) for p in model.model.visual.parameters())
    groups = [
        {"params": [p for p in model.parameters() if id(p) in vision], "lr": lr * vision_lr_scale},
        {"params": [p for p in model.parameters() if id(p) not in vision], "lr": lr},
    ]
    if heads is not None:
        groups.append({"params": list(heads.parameters()), "lr": 1e-3})
    return torch.optim.AdamW(groups, weight_decay=0.01)


def train_answer_stage(
    adapter: QwenVideoAdapter,
    rng,
    steps: int,
    batch: int,
    lr: float,
    progress: bool,
    full_curriculum: bool = False,
    cue_fraction: float = 0.0,
    variant: str = "single",
    vision_lr_scale: float = 0.2,
) -> list[float]:
    """Stage 2: the whole model on the answer letter, through per-pair inputs (`full_curriculum`:
    up to all pairs from the first step, when continuing a trained model). Returns each step's
    share of samples given the answer letter with probability > 0.5; the bar also shows the
    answer letter's loss (nats; chance over 4 letters: 1.386)."""
    most_pairs = LONG_FRAMES // 2 if variant == "long" else PAIRS
    model = adapter.model
    optimizer = answer_optimizer(model, lr, vision_lr_scale)
    history, losses = [], []
    bar = tqdm(range(steps), desc="needle stage 2 (answer)", disable=not progress)
    for step in bar:
        max_pairs = most_pairs if full_curriculum else min(most_pairs, 2 + int(step / (0.5 * steps) * (most_pairs - 2)))
        optimizer.zero_grad()
        correct, loss = 0, 0.0
        for _ in range(batch):
            frames, question, label, evidence = training_sample(rng, variant, max_pairs, cue_fraction)
            scales = sample_scales(rng, len(frames) // 2, evidence, variant)
            inputs, _, answer = answer_inputs(adapter, frames, scales, question, label)
            logprobs = adapter.sequence_logprobs(inputs, answer)
            (-logprobs.sum() / batch).backward()
            correct += int(logprobs[0].exp() > 0.5)
            loss -= float(logprobs[0].detach()) / batch
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        history.append(correct / batch)
        losses.append(loss)
        bar.set_postfix(pairs=max_pairs, acc=f"{np.mean(history[-20:]):.2f}", loss=f"{np.mean(losses[-20:]):.3f}")
    return history


def glyph_tokens(plan, spec: NeedleSpec) -> torch.Tensor:
    """Indices, among a video's visual tokens (pairs in order, each row-major on its merged grid),
    of the tokens that cover `spec`'s glyph in its pair at the plan's size for that pair."""
    pair = spec.evidence_pair
    height, width = plan.pair_sizes[pair]
    rows, cols = height // plan.grid.token_px, width // plan.grid.token_px
    row_px, col_px = SIZE / rows, SIZE / cols  # source pixels per token
    first = sum(plan.pair_tokens[:pair])
    return torch.tensor(
        [
            first + r * cols + c
            for r in range(int(spec.y // row_px), int((spec.y + spec.glyph - 1) // row_px) + 1)
            for c in range(int(spec.x // col_px), int((spec.x + spec.glyph - 1) // col_px) + 1)
        ]
    )


class BindingHeads(nn.Module):
    """Training-only linear heads of the query stage (dropped after training, like stage 1's):
    the asked colour from the answer position's state after the first layer; each candidate's glyph
    class and card colour from its glyph tokens as they enter the LLM."""

    def __init__(self, hidden: int):
        super().__init__()
        self.asked_colour = nn.Linear(hidden, len(COLOURS))
        self.glyph = nn.Linear(hidden, len(CLASSES))
        self.card_colour = nn.Linear(hidden, len(COLOURS))


def binding_losses(outputs, heads: BindingHeads, plan, answer_at: int, visual_at, specs, target: int) -> dict:
    """The query stage's auxiliary losses (nats) for one video (`outputs` with attentions and
    hidden states; `visual_at` the visual tokens' sequence positions):
    - attention: for every LLM layer after the first, -log of the share the asked candidate's
      glyph tokens take of the attention the answer position gives all candidates' glyph tokens
      (mean over heads), and -log of the largest attention mass one head gives them;
    - asked_colour: the colour named in the question, read at the answer position after layer 1;
    - glyph, card_colour: each candidate's class (where drawn) and colour from its glyph tokens."""
    colour_index = {c: i for i, c in enumerate(COLOURS)}
    tokens = [visual_at[glyph_tokens(plan, s)] for s in specs]
    asked, every = tokens[target], torch.cat(tokens)
    attention = 0.0
    for layer in outputs.attentions[1:]:
        weights = layer[0, :, answer_at]  # (heads, keys)
        mass = weights[:, asked].sum(-1)
        share = mass / weights[:, every].sum(-1).clamp_min(1e-6)
        attention = attention - torch.log(share.mean() + 1e-6) - torch.log(mass.max() + 1e-6)
    state = outputs.hidden_states[1][0, answer_at]
    asked_colour = -torch.log_softmax(heads.asked_colour(state), -1)[colour_index[specs[target].colour]]
    glyph, card = 0.0, 0.0
    for spec, positions in zip(specs, tokens):
        features = outputs.hidden_states[0][0, positions]
        card = card - torch.log_softmax(heads.card_colour(features.mean(0)), -1)[colour_index[spec.colour]]
        if spec.contrast > 0:
            glyph = glyph - torch.log_softmax(heads.glyph(features.max(0).values), -1)[spec.label]
    return dict(attention=attention, asked_colour=asked_colour, glyph=glyph, card_colour=card)


def train_query_stage(
    adapter: QwenVideoAdapter,
    rng,
    steps: int,
    batch: int,
    lr: float,
    progress: bool,
    vision_lr_scale: float = 0.2,
    single_fraction: float = 0.3,
) -> list[float]:
    """Stage 2 on the query variant: the answer letter plus `binding_losses` (the answer loss alone
    stays at chance: the answer position must first find the named colour in the question, then
    attend to the glyph of that colour, and neither step pays before the other exists). Videos
    hold 3-8 pairs with `CANDIDATES` candidates; in `single_fraction` of them only the asked
    candidate carries its glyph (the others their cards and borders), which keeps the glyph
    readout alive while the binding forms. Scales: `sample_scales`, the asked candidate as the
    evidence pair. Returns each step's share of samples given the answer
    letter with probability > 0.5; the bar shows the answer loss on videos with every glyph."""
    model = adapter.model
    attn_implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")  # attention weights for the binding loss
    heads = BindingHeads(model.config.text_config.hidden_size)
    optimizer = answer_optimizer(model, lr, vision_lr_scale, heads)
    history, losses = [], []
    bar = tqdm(range(steps), desc="needle stage 2 (query)", disable=not progress)
    for step in bar:
        optimizer.zero_grad()
        correct = 0
        for _ in range(batch):
            pairs = int(rng.integers(CANDIDATES, PAIRS + 1))
            specs, target = random_query(rng, pairs)
            if rng.random() < single_fraction:
                specs = [s if k == target else replace(s, contrast=0.0) for k, s in enumerate(specs)]
            frames = render_query_video(rng, specs, 2 * pairs)
            scales = sample_scales(rng, pairs, specs[target].evidence_pair)
            question = query_question(specs[target].colour)
            inputs, plan, answer = answer_inputs(adapter, frames, scales, question, specs[target].label)
            logprobs, outputs = adapter.sequence_outputs(
                inputs, answer, output_attentions=True, output_hidden_states=True
            )
            visual_at = torch.nonzero(inputs["input_ids"][0] == adapter.processor.video_token_id).flatten()
            aux = binding_losses(outputs, heads, plan, inputs["input_ids"].shape[1] - 1, visual_at, specs, target)
            (-logprobs.sum() + sum(aux.values())).div(batch).backward()
            correct += int(logprobs[0].exp() > 0.5)
            if all(s.contrast > 0 for s in specs):
                losses.append(-float(logprobs[0].detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        history.append(correct / batch)
        bar.set_postfix(acc=f"{np.mean(history[-20:]):.2f}", loss=f"{np.mean(losses[-100:]) if losses else 0:.3f}")
    model.set_attn_implementation(attn_implementation)
    return history


def train_backbone(
    out: str | Path,
    stage1_steps: int = 500,
    stage2_steps: int = 700,
    batch: int = 16,
    seed: int = 0,
    init: str | None = None,
    lr: float = 1e-3,
    cue_fraction: float = 0.0,
    progress: bool = True,
    family: str = "qwen25vl",
    variant: str = "single",
    vision_lr_scale: float = 0.2,
) -> Path:
    """Train both stages (or continue from the `init` folder) and `save_pretrained` model and
    processor to `out`; `cue_fraction`: share of training videos rendered with the cue; `family`:
    qwen25vl or qwen3vl (a new backbone's architecture; `init` keeps its own); `variant`: the
    data stage 2 trains on (single, query or long); vision_lr_scale: the vision tower's stage-2
    learning rate relative to `lr` (0 keeps it frozen)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    if init:
        family = family_of(init)
        adapter = ADAPTERS[family].from_pretrained(init, dtype="float32")
        model, processor = adapter.model, adapter.processor
    else:
        model, processor = build_needle_backbone(seed, family)
    model.train()
    t0 = time.perf_counter()
    train_vision_stage(model, processor, rng, stage1_steps, batch, 2e-3, progress, cue_fraction)
    adapter = ADAPTERS[family](model, processor)
    if variant == "query":
        train_query_stage(adapter, rng, stage2_steps, max(1, batch // 2), lr, progress, vision_lr_scale)
    else:
        train_answer_stage(
            adapter,
            rng,
            stage2_steps,
            max(1, batch // 2),
            lr,
            progress,
            full_curriculum=bool(init),
            cue_fraction=cue_fraction,
            variant=variant,
            vision_lr_scale=vision_lr_scale,
        )
    model.eval()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    with open(out / "training.txt", "a") as log:
        log.write(
            f"family={family} variant={variant} init={init} seed={seed} stage1_steps={stage1_steps} "
            f"stage2_steps={stage2_steps} batch={batch} lr={lr} vision_lr_scale={vision_lr_scale} "
            f"cue_fraction={cue_fraction} seconds={time.perf_counter() - t0:.0f}\n"
        )
    return out
