"""Fidelity of the in-LLM pruning baselines to their authors' code (issue 30).

Each reference's ranking rule is written out here by hand, independently of `inside_llm`, with the
lines of the authors' code it follows, and run on the same tensors as our stage (random hidden
states through the tiny fixtures' real decoder layers, and one real forward per backbone): the
kept visual tokens must be identical. The keep counts are checked against the references' own
formulas. Everything runs in float32, where the scores have no ties (with ties the references'
`topk` leaves the order unspecified; ours takes the earlier token).

References:
- FastV: pkunlp-icler/FastV@d1659729b5bf1be225e99ee15783deeea80f63b1,
  src/FastV/llava-hf/transformers/src/transformers/models/llama/modeling_llama.py
- PyramidDrop: Cooperx521/PyramidDrop@6444f304aee4b7edcb022839fb9e8cd07859704a,
  llava/model/modeling_llama_pdrop.py
"""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from resadapt_eval.backbones.layer_pruning import LayerPruner
from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE
from resadapt_eval.baselines import fastv, pyramiddrop
from resadapt_eval.baselines.inside_llm import LAST_TOKEN, STAGE_INPUT, layer_average
from resadapt_eval.budget.plan import plan_from_scales

from .helpers import chat_prompt, synthetic_video

BACKBONES = ["qwen25vl", "qwen3vl"]


# ------------------------------------------------------------------ the references, by hand
def rotate_half(x):
    # PyramidDrop modeling_llama_pdrop.py:205-209 (LLaMA's rotate_half)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_qk(attention, normed, cos, sin):
    """(heads, L, d) queries and keys of every token, as the references form them: q_proj / k_proj,
    (Qwen3-VL's per-head q/k norms, part of that model's projections), rotary q cos + rotate_half(q)
    sin (PyramidDrop modeling_llama_pdrop.py:1331-1342 and :212-235; FastV modeling_llama.py's
    LlamaAttention.forward), each key head repeated for its group of query heads (`repeat_kv`, as
    LLaMA's attention does; LLaVA-1.5's LLaMA has one key head per query head)."""
    d, length = attention.head_dim, normed.shape[1]
    q = attention.q_proj(normed).view(length, -1, d)
    k = attention.k_proj(normed).view(length, -1, d)
    if hasattr(attention, "q_norm"):
        q, k = attention.q_norm(q), attention.k_norm(k)
    q, k = q.transpose(0, 1), k.transpose(0, 1)  # (heads, L, d), (kv_heads, L, d)
    c, s = cos[0][None], sin[0][None]  # (1, L, d)
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    return q, k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)


def causal_mask(length, dtype):
    # _prepare_4d_causal_attention_mask: 0 on and below the diagonal, the dtype's minimum above it
    return torch.full((length, length), torch.finfo(dtype).min, dtype=dtype).triu(1)


def fastv_reference(layer, hidden, cos, sin, image_start, image_length, keep):
    """FastV's in-place ranking at layer K from decoder layer K - 1 (= `layer`, entered by `hidden`):
    - modeling_llama.py:1105-1108: layer K - 1 runs with output_attentions=True, so its eager map
      is kept (:371-380: q k^T / sqrt(d) + causal mask, softmax in float32 cast to the model dtype),
      computed on that layer's attention input, input_layernorm(hidden) (LlamaDecoderLayer);
    - :1040-1044: mean over heads (dim=1) of batch 0, then the last token's row ([-1]);
    - :1046-1052: sliced to the image tokens, topk(keep) + the image start, sorted."""
    attention = layer.self_attn
    q, k = eager_qk(attention, layer.input_layernorm(hidden), cos, sin)
    weights = q @ k.transpose(-1, -2) / math.sqrt(attention.head_dim) + causal_mask(hidden.shape[1], q.dtype)
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)[None]  # (1, heads, L, L)
    last_row = torch.mean(weights, dim=1)[0][-1]
    image = last_row[image_start : image_start + image_length]
    return (image.topk(keep).indices + image_start).sort().values.tolist()


def pdrop_reference(layer, hidden, cos, sin, visual, keep):
    """PyramidDrop's ranking at boundary layer b (= `layer`, entered by `hidden`), `visual` the
    image tokens' positions in the current sequence (the reference's contiguous block
    image_index:image_index + image_tokens; here any set, as our port ranks every visual token):
    - modeling_llama_pdrop.py:1222-1224: after layer b - 1, in prefill, for b in layer_list;
    - :1321-1323: layer b's own input_layernorm on (a detached copy of) the hidden states;
    - :1331-1342: layer b's q_proj / k_proj and rotary at the current positions;
    - :1390-1391: the query is the last instruction token, prompt_len + image_tokens - 1, at
      inference the prompt's last token;
    - :1395-1397: q k^T / sqrt(head_dim) + causal mask, softmax in float32 cast to the model dtype;
    - :1399-1401: mean over heads, the image tokens as keys, mean over the (one) query;
    - :1405-1407: topk(keep_length) of them, in their original order."""
    attention = layer.self_attn
    q, k = eager_qk(attention, layer.input_layernorm(hidden.clone().detach()), cos, sin)
    length = hidden.shape[1]
    query = q[:, length - 1, :].unsqueeze(1)  # (heads, 1, d)
    mask = causal_mask(length, q.dtype)[length - 1].unsqueeze(0)  # (1, L)
    weights = torch.matmul(query, k.transpose(1, 2)) / math.sqrt(attention.head_dim) + mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)  # (heads, 1, L)
    per_token = torch.mean(torch.mean(weights, dim=0)[:, visual], dim=0)
    return visual[per_token.topk(keep).indices].sort().values.tolist()


# ------------------------------------------------------------------ random prompts through real layers
def random_prompt(language_model, prefix, visual, suffix, seed):
    """(1, L, H) random hidden states of `prefix` text, `visual` video and `suffix` text tokens, their
    M-RoPE cos/sin (text on a line; the video on a T x 2 x 3 grid, as Qwen lays out a video) and the
    visual positions."""
    generator = torch.Generator().manual_seed(seed)
    length = prefix + visual + suffix
    hidden = torch.randn(1, length, language_model.config.hidden_size, generator=generator) * 2
    grid = np.stack(np.unravel_index(np.arange(visual), (math.ceil(visual / 6), 2, 3)))  # (3, N): t, h, w
    positions = np.concatenate(
        [
            np.tile(np.arange(prefix), (3, 1)),
            prefix + grid,
            np.tile(prefix + grid.max() + 1 + np.arange(suffix), (3, 1)),
        ],
        axis=1,
    )
    position_ids = torch.from_numpy(positions)[:, None]  # (3, 1, L)
    cos, sin = language_model.rotary_emb(hidden, position_ids)
    return hidden, (cos, sin), torch.arange(prefix, prefix + visual)


def kept_visual(pruner, layer, visual):
    kept = pruner.kept_by_layer[layer]
    return kept[torch.isin(kept, visual)].tolist()


def run_layers(language_model, stages, visual, hidden, rotary, layers):
    """Our `LayerPruner` on the decoder `layers` (indices, in order), called as the model calls them."""
    pruner = LayerPruner(SimpleNamespace(layers=language_model.layers), stages, visual)
    with torch.no_grad(), pruner.attached():
        for index in layers:
            out = language_model.layers[index](hidden, attention_mask=None, position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
    return pruner


def cases(count):
    """Random (backbone, prefix, N, suffix, keep, layer, seed): N and L of both parities, keep from 1
    to N - 1."""
    rng = np.random.default_rng(30)
    for case in range(count):
        visual = 2 + case  # 2 ... count + 1
        keep = [1, visual - 1, int(rng.integers(1, visual))][case % 3]
        prefix, suffix = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        yield BACKBONES[case % 2], prefix, visual, suffix, keep, int(rng.integers(1, 12)), case


# ------------------------------------------------------------------ PyramidDrop
@pytest.mark.parametrize("backbone, prefix, visual, suffix, keep, layer, seed", list(cases(24)))
def test_fidelity_pyramiddrop_stage_keeps_the_boundary_layers_own_ranking(
    adapters, backbone, prefix, visual, suffix, keep, layer, seed
):
    language_model = adapters[backbone].model.model.language_model
    (stage,) = pyramiddrop.schedule([layer], visual, keep / visual)
    assert (stage.layer, stage.keep, stage.rank_by) == (layer, keep, STAGE_INPUT)
    hidden, rotary, positions = random_prompt(language_model, prefix, visual, suffix, seed)
    with torch.no_grad():  # the hidden states leaving layer b - 1 enter layer b
        entering = language_model.layers[layer - 1](hidden, attention_mask=None, position_embeddings=rotary)
        entering = entering[0] if isinstance(entering, tuple) else entering
        expected = pdrop_reference(language_model.layers[layer], entering, *rotary, positions, keep)
    pruner = run_layers(language_model, [stage], positions, hidden, rotary, [layer - 1, layer])
    assert kept_visual(pruner, layer, positions) == expected
    assert pruner.layer_tokens[layer] == keep


@pytest.mark.parametrize("backbone", BACKBONES)
def test_fidelity_pyramiddrop_every_stage_of_a_schedule(adapters, backbone):
    """All three stages of `pyramiddrop.stages` on the 12-layer stack: each boundary keeps the top of
    the reference's ranking on the hidden states entering it (the tokens kept so far, at their own
    positions: our port does not renumber them, a documented deviation)."""
    language_model = adapters[backbone].model.model.language_model
    stages = pyramiddrop.stages(12, 37, 0.5, layers=[3, 6, 9])
    hidden, rotary, positions = random_prompt(language_model, 4, 37, 5, seed=7)
    entering = {}
    pruner = LayerPruner(SimpleNamespace(layers=language_model.layers), stages, positions)

    def capture(index):
        def hook(module, args, kwargs):  # registered before the pruner's hooks: the unpruned input
            seen = pruner.kept if pruner.kept is not None else torch.arange(hidden.shape[1])
            entering[index] = (args[0] if args else kwargs["hidden_states"], seen)

        return hook

    handles = [
        language_model.layers[s.layer].register_forward_pre_hook(capture(s.layer), with_kwargs=True) for s in stages
    ]
    try:
        with torch.no_grad(), pruner.attached():
            states = hidden
            for layer in language_model.layers:
                out = layer(states, attention_mask=None, position_embeddings=rotary)
                states = out[0] if isinstance(out, tuple) else out
    finally:
        for handle in handles:
            handle.remove()
    for stage in stages:
        states, seen = entering[stage.layer]
        local_visual = torch.nonzero(torch.isin(seen, positions)).flatten()
        with torch.no_grad():
            local = pdrop_reference(
                language_model.layers[stage.layer], states, *(t[:, seen] for t in rotary), local_visual, stage.keep
            )
        assert kept_visual(pruner, stage.layer, positions) == seen[local].tolist()
    assert pruner.layer_tokens == [37] * 3 + [s.keep for s in stages for _ in range(3)]


@pytest.mark.parametrize("backbone", BACKBONES)
def test_fidelity_pyramiddrop_in_a_real_forward(adapters, backbone):
    """The same in the model's own forward on a video prompt (on Qwen3-VL after its deepstack layer;
    its video tokens are split by timestamp text, and every visual token is ranked as one set)."""
    adapter = adapters[backbone]
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * 8, (4 * px, 6 * px), adapter.grid)
    inputs = adapter.build_inputs(chat_prompt(adapter), synthetic_video(8), plan)
    visual = torch.nonzero(inputs["mm_token_type_ids"][0] == VIDEO_TOKEN_TYPE).flatten()
    language_model = adapter.model.model.language_model
    stages = pyramiddrop.stages(12, len(visual), 0.5, layers=[2, 5, 8], first_layer=adapter.first_prunable_layer)
    assert [s.layer for s in stages] == [2, 5, 8]
    pruner = LayerPruner(language_model, stages, visual)
    entering = {}

    def capture(index):
        def hook(module, args, kwargs):
            states = args[0] if args else kwargs["hidden_states"]
            seen = pruner.kept if pruner.kept is not None else torch.arange(states.shape[1])
            entering[index] = (states, kwargs["position_embeddings"], seen)

        return hook

    handles = [
        language_model.layers[s.layer].register_forward_pre_hook(capture(s.layer), with_kwargs=True) for s in stages
    ]
    try:
        adapter.model.model.rope_deltas = None
        with torch.no_grad(), pruner.attached():
            adapter.model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    for stage in stages:
        states, (cos, sin), seen = entering[stage.layer]
        local_visual = torch.nonzero(torch.isin(seen, visual)).flatten()
        with torch.no_grad():
            local = pdrop_reference(
                language_model.layers[stage.layer], states, cos[:, seen], sin[:, seen], local_visual, stage.keep
            )
        assert kept_visual(pruner, stage.layer, visual) == seen[local].tolist()


def test_fidelity_pyramiddrop_keep_counts():
    # The reference keeps int(N * ratio_i) (modeling_llama_pdrop.py:1307) with ratios [1, 0.5, 0.25,
    # 0.125] (scripts/v1_5/pdrop_eval/*.sh; llava/eval/model_vqa_loader.py:94-96 prepends 1.0) after
    # layers 8, 16, 24 of 32. At that schedule's own layer average our lambda gives its counts.
    for n in (17, 576, 999, 1000):
        reference = [int(n * r) for r in (0.5, 0.25, 0.125)]
        target = sum([n] * 8 + [c for c in reference for _ in range(8)]) / (32 * n)
        stages = pyramiddrop.stages(32, n, target)
        assert [(s.layer, s.keep) for s in stages] == list(zip([8, 16, 24], reference))
        assert all(s.rank_by == STAGE_INPUT for s in stages)
    assert target == (1000 + 500 + 250 + 125) / 4000  # 0.46875
    # By hand, 12 layers, stages at 1, 2, 3, N = 100, R = 0.25: the layer sum 100 + c1 + c2 + 9 c3
    # must stay within 300 for c_i = floor(lambda^i 100). c3 reaches 14 at lambda = 0.14^(1/3) =
    # 0.51925, before c2 reaches 27 (0.27^(1/2) = 0.5196) or c1 52 (0.52), and 100 + 51 + 26 + 126 =
    # 303 > 300; just below it the counts are 51, 26, 13: (100 + 51 + 26 + 117) / 1200 = 0.245.
    stages = pyramiddrop.stages(12, 100, 0.25, layers=[1, 2, 3])
    assert [s.keep for s in stages] == [51, 26, 13]
    assert layer_average(stages, 12, 100) == 294 / 1200
    # The default boundaries sit at the reference's relative depths: 8, 16, 24 of 32 -> L q // 4.
    assert pyramiddrop.default_layers(28) == [7, 14, 21] and pyramiddrop.default_layers(36, 3) == [9, 18, 27]


# ------------------------------------------------------------------ FastV
@pytest.mark.parametrize("backbone, prefix, visual, suffix, keep, layer, seed", list(cases(12)))
def test_fidelity_fastv_stage_keeps_the_previous_layers_ranking(
    adapters, backbone, prefix, visual, suffix, keep, layer, seed
):
    language_model = adapters[backbone].model.model.language_model
    (stage,) = fastv.stages(12, visual, 1.0, layers=[layer])
    stage = dataclasses.replace(stage, keep=keep)
    assert stage.rank_by == LAST_TOKEN
    hidden, rotary, positions = random_prompt(language_model, prefix, visual, suffix, seed)
    with torch.no_grad():
        expected = fastv_reference(language_model.layers[layer - 1], hidden, *rotary, prefix, visual, keep)
    pruner = run_layers(language_model, [stage], positions, hidden, rotary, [layer - 1, layer])
    assert kept_visual(pruner, layer, positions) == expected


def test_fidelity_fastv_keep_count():
    # The reference keeps round(N (1 - r)) after layer K (modeling_llama.py:1048); at the layer average
    # of that schedule, (K N + (L - K) k) / (L N), ours keeps the same k (paper: K = 2, r = 0.5).
    for n in (576, 577, 1000):
        for k_layer, r in ((2, 0.5), (3, 0.75)):
            k = round(n * (1 - r))
            (stage,) = fastv.stages(32, n, (k_layer * n + (32 - k_layer) * k) / (32 * n), layers=[k_layer])
            assert (stage.layer, stage.keep) == (k_layer, k)
