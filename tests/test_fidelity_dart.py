"""Fidelity of DART (`baselines/dart.py`) against the authors' Qwen2.5-VL code, read through the fork
xqy1111111/DART@38d7b9c94d15c524171ffe60db5e45819d5ed505, Qwen2_5-VL/Qwen2_5VL_DART/modeling_qwen2_5_vl_self.py
(the upstream ZichenWen1/DART is not in the mirror; the file is unchanged up to the fork's head d6a5af6).

The reference (`DART.forward` and `DART.get_retained_image_token`, lines of that file), written out by hand below
(`reference_retained`), independently of our module:
- :1464-1472: before decoder layer K, in the prefill only (seq_length > 1);
- :1475-1476: the states are layer K - 1's output (= layer K's input) through the LLM's final norm;
- :1477: the keys are layer K - 1's `layer_outputs[-2]`: its key states after rotary (:679-681), through the
  cache (:685; in the prefill the new keys themselves), returned by the attention (:706) and the layer (:789);
- :1482-1508: the text before and after the image block and the retained image tokens, sorted, are kept; hidden
  states, cache positions, mask and position ids are sliced (not renumbered).
Defaults: K = 2, pivot_image_token = 4, pivot_text_token = 4, reduction_ratio = 0.778 (its lmms-eval wrapper,
lmms-eval/lmms_eval/models/qwen2_5_vl.py:64-72, :114-124; Qwen2_5-VL/eval_scripts/lmms_eval.sh:8-15 sets the
same with the ratio as its 2nd argument); image_token_start_index / image_token_length are set per request to the
first `<|image_pad|>` (151655) and the distance to the first `<|vision_end|>` (151653) (qwen2_5_vl.py:332-338).

Documented differences, and how they are tested here:
- the count: the reference keeps pivot_image + (pivot_image + pivot_text) TOKEN_TOPK; ours keeps `keep` (solved
  from a layer-averaged target). Where `keep` is of the reference's form, the kept sets are identical; otherwise
  our spread (each pivot floor(e / P) tokens, the first e mod P one more) is checked against a greedy written here;
- the pivots are visited in the reference's order, that of a Python `set` of their prompt indices (:1577, :1582),
  which is increasing only while every index is below the table's size (32 for 8 ints): the random prompts here
  reach index 380, so both orders occur;
- the similarity is float32 (the reference's: the states' dtype); every visual token is one pool and the text
  pivots come from the tokens after the last visual one (on Qwen3-VL the reference rule runs on the prompt with
  the timestamps between frames left out of both). No scores tie in these cases (the reference's `topk` leaves
  the order of equal scores unspecified; ours takes the earlier token).
Random cases run in float64; the real forward in the fixtures' float32.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.backbones.layer_pruning import LayerPruner
from resadapt_eval.baselines import dart
from resadapt_eval.baselines.inside_llm import DUPLICATION, Stage
from resadapt_eval.budget.plan import plan_from_scales

from .helpers import BACKBONES, chat_prompt, synthetic_video

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CASES = 24
PIVOT_SETTINGS = [(4, 4), (2, 3), (1, 6)]  # (pivot_image_token, pivot_text_token); (4, 4) the reference's


# ------------------------------------------------------------------ the reference, by hand
def reference_retained(last_layer_state, k_states, image_positions, query_positions, ratio, pivot_image, pivot_text):
    """modeling_qwen2_5_vl_self.py:1553-1595 (`get_retained_image_token`) on `last_layer_state` (1, L, H), already
    through the final norm (:1476), and `k_states` (1, kv_heads, L, d): the set of retained prompt indices. The
    image block [start, start + length) and the tokens after it (:1569-1570) are given as position lists, so that
    a Qwen3-VL video (timestamps between its frames) is one pool as well."""
    image_positions, query_positions = list(image_positions), list(query_positions)
    token_topk = int(len(image_positions) * (1 - ratio) / (pivot_image + pivot_text))  # :1563
    any_states = k_states.permute(0, 2, 1, 3).reshape(k_states.shape[0], k_states.shape[2], -1)  # :1567
    k_image = any_states[0][image_positions, :]  # :1569
    k_query = any_states[0][query_positions, :]  # :1570
    image_l1 = torch.norm(k_image, p=1, dim=-1)  # :1572
    query_l1 = torch.norm(k_query, p=1, dim=-1)  # :1573
    image_indices = [image_positions[i] for i in image_l1.topk(pivot_image).indices.tolist()]  # :1575
    query_indices = [query_positions[i] for i in query_l1.topk(pivot_text).indices.tolist()]  # :1576
    indices_set = set(image_indices + query_indices)  # :1577
    valid_indices = set(image_positions) - set(image_indices)  # :1579
    valid_indices_list = list(valid_indices)  # :1581
    for item in list(indices_set):  # :1582 (a snapshot of the pivots, in the set's order)
        valid_vectors = last_layer_state[0][valid_indices_list, :]  # :1583
        cos_sim = -F.cosine_similarity(last_layer_state[0][item, :], valid_vectors, dim=-1)  # :1584
        top_k_indices = cos_sim.topk(token_topk).indices  # :1585
        top_k_real_indices = [valid_indices_list[i] for i in top_k_indices]  # :1587
        indices_set.update(top_k_real_indices)  # :1588
        valid_indices.difference_update(top_k_real_indices)  # :1590
        valid_indices_list = list(valid_indices)  # :1591
    indices_set.difference_update(query_indices)  # :1593
    return indices_set  # :1595 returns it as a tensor, sorted with the text at :1482-1484


def reference_count(image_length, ratio, pivot_image, pivot_text):
    """How many image tokens `reference_retained` keeps: the image pivots and TOKEN_TOPK per pivot (:1563)."""
    return pivot_image + (pivot_image + pivot_text) * int(image_length * (1 - ratio) / (pivot_image + pivot_text))


def spread_retained(last_layer_state, k_states, image_start, image_length, keep, pivot_image, pivot_text):
    """Our documented count rule as an independent greedy: the top min(pivot_image, keep) image tokens and the
    top min(pivot_text, T) of the T tokens after the block by key L1 norm are the P pivots; with e = keep - image
    pivots, the i-th pivot visited (in the reference's order) takes the floor(e / P) + (i < e mod P) remaining
    image tokens of lowest cosine similarity. The set of retained prompt indices."""
    l1 = k_states[0].permute(1, 0, 2).reshape(k_states.shape[2], -1).abs().sum(dim=-1)
    end = image_start + image_length
    image = min(pivot_image, keep)
    image_pivots = (l1[image_start:end].topk(image).indices + image_start).tolist()
    text = min(pivot_text, len(l1) - end)
    text_pivots = (l1[end:].topk(text).indices + end).tolist()
    pivots = list(set(image_pivots + text_pivots))  # the reference's visiting order (:1577, :1582)
    extra = keep - image
    retained, remaining = set(image_pivots), [i for i in range(image_start, end) if i not in image_pivots]
    for i, pivot in enumerate(pivots):
        count = extra // len(pivots) + (i < extra % len(pivots))
        if count == 0:
            continue
        sims = [
            F.cosine_similarity(last_layer_state[0, pivot], last_layer_state[0, j], dim=0).item() for j in remaining
        ]
        chosen = [remaining[j] for j in np.argsort(sims, kind="stable")[:count]]
        retained.update(chosen)
        remaining = [j for j in remaining if j not in chosen]
    return retained


# ------------------------------------------------------------------ random prompts, float64
def random_case(prefix, image_length, suffix, seed, kv_heads=2, head_dim=8, hidden_size=48):
    """Random (1, L, H) hidden states, an RMSNorm with random weight (the final norm), (1, kv_heads, L, d) keys,
    the (N,) visual positions and the (T,) positions after them, for `prefix` text, an image block of
    `image_length` tokens and `suffix` text tokens."""
    generator = torch.Generator().manual_seed(seed)
    length = prefix + image_length + suffix
    hidden = torch.randn(1, length, hidden_size, generator=generator, dtype=torch.float64)
    norm = torch.nn.RMSNorm(hidden_size, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden_size, generator=generator, dtype=torch.float64) + 0.5)
    keys = torch.randn(1, kv_heads, length, head_dim, generator=generator, dtype=torch.float64)
    visual = torch.arange(prefix, prefix + image_length)
    after = torch.arange(prefix + image_length, length)
    return hidden, norm, keys, visual, after


def ours(hidden, norm, keys, visual, after, keep, pivot_image=4, pivot_text=4) -> set[int]:
    """The prompt indices of the visual tokens `dart.select` keeps (checking it returns an (N,) bool mask)."""
    with torch.no_grad():
        taken = dart.select(hidden, norm, dart.key_l1_norms(keys), visual, after, keep, pivot_image, pivot_text)
    assert taken.dtype == torch.bool and taken.shape == visual.shape
    return set(visual[taken].tolist())


def reference_form_cases(count, pivot_image, pivot_text, seed):
    """(prefix, N, suffix, ratio, seed): N in 10..301 of both parities, ratio in (0, 1) with TOKEN_TOPK 0, the
    most whose count fits N, or drawn between."""
    rng = np.random.default_rng(seed)
    pivots = pivot_image + pivot_text
    for case in range(count):
        n = int(rng.integers(5, 151)) * 2 + case % 2  # 10 ... 301
        most = (n - pivot_image) // pivots  # the largest TOKEN_TOPK whose count fits N
        topk = [0, most, int(rng.integers(0, most + 1))][min(case % 4, 2)]
        fraction = rng.uniform(0.05, min(0.95, (n - pivots * topk) / pivots - 0.05))
        ratio = 1 - pivots * (topk + fraction) / n  # N (1 - ratio) / pivots = topk + fraction
        yield int(rng.integers(1, 40)), n, int(rng.integers(max(4, pivot_text), 16)), float(ratio), seed * 1000 + case


@pytest.mark.parametrize("pivot_image, pivot_text", PIVOT_SETTINGS)
def test_fidelity_dart_keeps_the_references_tokens_at_its_own_count(pivot_image, pivot_text):
    """Where `keep` is the reference's count, the kept image tokens are the reference's, pivots visited in its
    order (prompts up to index 380: set orders other than the increasing one occur)."""
    topks = set()
    for prefix, n, suffix, ratio, seed in reference_form_cases(CASES, pivot_image, pivot_text, 11 + pivot_image):
        hidden, norm, keys, visual, after = random_case(prefix, n, suffix, seed)
        keep = reference_count(n, ratio, pivot_image, pivot_text)
        assert 0 < ratio < 1 and pivot_image <= keep <= n
        topks.add((keep - pivot_image) // (pivot_image + pivot_text))
        with torch.no_grad():
            expected = reference_retained(
                norm(hidden), keys, visual.tolist(), after.tolist(), ratio, pivot_image, pivot_text
            )
        assert len(expected) == keep
        assert ours(hidden, norm, keys, visual, after, keep, pivot_image, pivot_text) == expected
    assert 0 in topks and len(topks) > CASES // 3  # TOKEN_TOPK 0 (only the image pivots) and many others


@pytest.mark.parametrize("prefix, n, suffix", [(3, 37, 6), (10, 48, 4), (5, 23, 2)])
def test_fidelity_dart_spreads_any_count_over_the_pivots(prefix, n, suffix):
    """For every keep in 1..N-1: exactly keep tokens, the image pivots among them (keep >= 4), and the tokens the
    greedy with floor(e / P) + (i < e mod P) per pivot keeps (the last layout has 2 text tokens: P = 4 + 2)."""
    hidden, norm, keys, visual, after = random_case(prefix, n, suffix, seed=n)
    image_pivots = set((dart.key_l1_norms(keys)[visual].topk(4).indices + prefix).tolist())
    with torch.no_grad():
        states = norm(hidden)
    for keep in range(1, n):
        kept = ours(hidden, norm, keys, visual, after, keep)
        assert len(kept) == keep
        if keep >= 4:
            assert image_pivots <= kept
        assert kept == spread_retained(states, keys, prefix, n, keep, 4, 4)


def test_fidelity_dart_key_l1_norms_flatten_the_heads_as_the_reference():
    """`key_l1_norms` equals the reference's flattening (:1567) and L1 norm (:1572-1573), bit for bit, on
    contiguous keys and on keys laid out as the rotary leaves them ((1, L, kv_heads, d) transposed)."""
    for seed, (kv_heads, length, d) in enumerate([(1, 7, 4), (2, 33, 8), (4, 128, 16), (8, 301, 128)]):
        generator = torch.Generator().manual_seed(seed)
        contiguous = torch.randn(1, kv_heads, length, d, generator=generator, dtype=torch.float64)
        transposed = contiguous.transpose(1, 2).contiguous().transpose(1, 2)
        for keys in (contiguous, transposed, contiguous.float()):
            expected = keys.permute(0, 2, 1, 3).reshape(1, length, -1)[0].norm(p=1, dim=-1)
            assert torch.equal(dart.key_l1_norms(keys), expected)


# ------------------------------------------------------------------ the engine, on the tiny fixtures
@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("ratio", [0.778, 0.5])
def test_fidelity_dart_in_a_real_forward(adapters, backbone, ratio):
    """A `LayerPruner` with DART's stage in the model's own forward on a video prompt keeps the reference's
    tokens, computed from layer K - 1's cached (post-rotary) keys and the hidden states entering layer K
    (Qwen3-VL: K after its deepstack layer; the reference rule's image block is every visual token and its query
    the text after the last one, the timestamps between the frames in neither, as in our pool)."""
    adapter = adapters[backbone]
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * 8, (4 * px, 6 * px), adapter.grid)
    inputs = adapter.build_inputs(chat_prompt(adapter), synthetic_video(8), plan)
    visual = adapter.visual_positions(inputs)
    n, length = len(visual), inputs["input_ids"].shape[1]
    language_model = adapter.model.model.language_model
    k_layer = max(dart.DEFAULT_LAYER, adapter.first_prunable_layer)  # 2 on both fixtures
    keep = reference_count(n, ratio, dart.PIVOT_IMAGE, dart.PIVOT_TEXT)
    (default,) = dart.stages(adapter.num_text_layers, n, 0.5, first_layer=adapter.first_prunable_layer)
    assert (default.layer, default.rank_by) == (k_layer, DUPLICATION)  # the stage DART's schedule builds
    pruner = LayerPruner(language_model, [Stage(k_layer, keep, rank_by=DUPLICATION)], visual)
    entering = []

    def capture(module, args, kwargs):  # registered before the pruner's hooks: the unpruned input of layer K
        entering.append(args[0] if args else kwargs["hidden_states"])

    # The fixtures' final norm has unit weight, under which it leaves every cosine as it was: a random weight for
    # this forward (restored after) makes the test see which norm the states go through.
    weight = language_model.norm.weight.detach().clone()
    handle = language_model.layers[k_layer].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            language_model.norm.weight.copy_(torch.rand(weight.shape, generator=torch.Generator().manual_seed(3)) + 0.5)
            adapter.model.model.rope_deltas = None
            with pruner.attached():
                out = adapter.model(**inputs, use_cache=True)
            states = language_model.norm(entering[0])  # :1475-1476
    finally:
        handle.remove()
        with torch.no_grad():
            language_model.norm.weight.copy_(weight)
    keys = out.past_key_values.layers[k_layer - 1].keys  # (1, kv_heads, L, d): layer K - 1 is never pruned
    assert keys.shape[2] == length and entering[0].shape[1] == length
    if backbone == "qwen25vl":  # Qwen2.5-VL's video is one block, the reference's layout
        assert torch.equal(visual, torch.arange(int(visual[0]), int(visual[-1]) + 1))
    with torch.no_grad():
        after = torch.arange(int(visual[-1]) + 1, length)  # the text after the video (Qwen3-VL: not its timestamps)
        retained = reference_retained(states, keys, visual.tolist(), after.tolist(), ratio, 4, 4)
    expected = sorted(retained)
    kept = pruner.kept_by_layer[k_layer]
    assert kept[torch.isin(kept, visual)].tolist() == expected
    assert len(expected) == keep and pruner.layer_tokens[k_layer] == keep
