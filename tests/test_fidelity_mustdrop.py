"""Fidelity of MustDrop (`baselines/mustdrop.py`) against its reference: liuting20/MustDrop@909afa5 (LLaVA-1.5)
and the vision stage as ModelTC/LightCompress@9701d035 runs it, llmc/compression/token_reduction/mustdrop.py.

The reference, written out by hand below, independently of our module:
- the vision stage (LightCompress `conditional_pooling` and `merge_wavg`, :29-194, the authors'
  `multimodal_encoder/local_merge.py:30-146` with LightCompress's fix_r = (N - retained) // 8, :196-207): 3 x 3
  windows of the square patch grid (a [CLS] token first), each window's mean pairwise cosine similarity with the
  self-pairs masked out, the top r windows merged into their last token by the size-weighted mean;
- the key set (`multimodal_encoder/clip_encoder.py:98-107`): the top ceil(0.08 n) tokens by attention;
- the prefilling stage (`language_model/modelling_sparse_llama.py:253-267, 336-354`): the pruning layer's attention
  from the text after the image to the image tokens, mean over heads; dropped when the sum over the text is below
  global_thr x the image tokens' total and the largest below individual_thr, unless in the key set.

Documented differences, and how they are tested here:
- counts: the vision stage merges ceil((N - keep) / 8) windows, the last only partly, where fix_r = (N - keep) // 8
  (equal where 8 divides N - keep: compared there); our LLM stages keep the top k by max(global / (g total),
  individual / t): a token passes the reference's filter exactly when that is at least 1, so at the reference's
  own count k the kept sets are equal (compared on the tiny decoder stacks, float64);
- our windows are per frame pair (t, h, w), every window of the video one pool: the reference's image is one pair;
- Qwen has no [CLS]: the key set ranks the attention each token received, a merged token's the sum of its members'
  (the reference's [CLS] row is written out on the merged tokens' received attention here);
- merged tokens stay at their last token's position (the reference lists them first): compared keyed by position.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.backbones.layer_pruning import LayerPruner
from resadapt_eval.baselines import VisualTokens, mustdrop
from resadapt_eval.baselines.common import merge_groups
from resadapt_eval.baselines.inside_llm import DUAL_FILTER, Stage

from .helpers import BACKBONES, Reached, chat_prompt, plain_run, random_prompt, synthetic_video

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CASES = 30


# ------------------------------------------------------------------ the reference, by hand
def reference_pooling(feat, window, fix_r):
    """LightCompress mustdrop.py:29-194 (`conditional_pooling` with fix_r, then `merge_wavg`, size None), B = 1:
    {position among the patches: feature} of the tokens after the merge (the [CLS] token left out)."""
    ws_h, ws_w = window
    num_token_window = ws_h * ws_w
    feat = feat[:, 1:, :]  # :42-45, the [CLS] token set aside
    B, N, D = feat.size()
    base = int(math.sqrt(N))
    grid = feat.transpose(1, 2).reshape(B, D, base, base)  # 'b (h w) c -> b c h w'
    grid = grid.reshape(B, D, base // ws_h, ws_h, base // ws_w, ws_w).permute(0, 2, 4, 1, 3, 5)  # b gh gw c ps ps
    flattened = grid.reshape(B, base // ws_h, base // ws_w, D, -1)
    sims = F.cosine_similarity(flattened.unsqueeze(-1), flattened.unsqueeze(-2), dim=3)  # :69-73
    sims = sims * (1 - torch.eye(num_token_window, dtype=sims.dtype))  # :76-77
    similarity_map = sims.sum(-1).sum(-1) / (num_token_window * (num_token_window - 1))  # :80-82
    similarity_map = similarity_map.reshape(B, -1)  # 'b c h w -> b (c h w)'
    r = fix_r  # :95-96
    _, idxs = similarity_map.topk(r, dim=-1)  # :98
    tensor = torch.arange(base * base).reshape(base, base)[None]  # :101-108
    windowed = tensor.unfold(1, ws_h, ws_h).unfold(2, ws_w, ws_w).reshape(B, -1, num_token_window)  # :111-116
    gathered = torch.gather(windowed, 1, idxs.unsqueeze(-1).expand(-1, -1, num_token_window))  # :119-123
    mask = torch.ones((B, windowed.shape[1]), dtype=bool)
    mask.scatter_(1, idxs, torch.zeros_like(idxs, dtype=torch.bool))  # :126-137
    unm_idx = windowed[mask.unsqueeze(-1).expand(-1, -1, num_token_window)].reshape(B, -1).sort(dim=-1).values
    src_idx = gathered[:, :, :-1].reshape(B, -1)  # :146-147
    dst_idx = gathered[:, :, -1].reshape(B, -1)  # :148
    merge_idx = torch.arange(r).repeat_interleave(num_token_window - 1)[None]  # :149-155

    def merge(x, mode):  # :157-179
        n, _, c = x.shape
        src = x.gather(-2, src_idx[..., None].expand(n, r * (num_token_window - 1), c))
        dst = x.gather(-2, dst_idx[..., None].expand(n, r, c))
        unm = x.gather(-2, unm_idx[..., None].expand(n, unm_idx.shape[1], c))
        dst = dst.scatter_reduce(-2, merge_idx[..., None].expand(n, r * (num_token_window - 1), c), src, reduce=mode)
        return torch.cat([dst, unm], dim=1)

    size = torch.ones_like(feat[..., 0, None])  # merge_wavg, :183-194
    x = merge(feat * size, "sum") / merge(size, "sum")
    positions = torch.cat([dst_idx, unm_idx], dim=1)[0].tolist()
    return {p: x[0, i] for i, p in enumerate(positions)}


def reference_key_set(cls_attention, keep_rate=0.08):
    """clip_encoder.py:100-107: the top ceil(keep_rate n) tokens by the [CLS] row, mean over heads."""
    left_tokens = math.ceil(keep_rate * cls_attention.shape[-1])
    _, index = torch.topk(cls_attention.mean(dim=1), left_tokens, dim=1, largest=True)
    return set(index[0].tolist())


def reference_dual_filter(attn, v_token_start, img_seq, global_thr, individual_thr):
    """modelling_sparse_llama.py:336-354 (`dual_attention_filter`): the image tokens kept (indices into the image)."""
    _, _, total_seq, _ = attn.shape
    attn = attn[0]
    text_seq = total_seq - img_seq - v_token_start
    attn = attn.narrow(1, v_token_start + img_seq, text_seq).narrow(2, v_token_start, img_seq)
    attn = attn.mean(dim=0)
    attn_sum = attn.sum(dim=0)
    candidate_mask = (attn_sum < attn_sum.sum(dim=0) * global_thr) & (attn.max(dim=0)[0] < individual_thr)
    return torch.arange(img_seq)[~candidate_mask]


# ------------------------------------------------------------------ the vision stage
@pytest.mark.parametrize("seed", range(CASES))
def test_the_window_merge_equals_the_reference_where_its_count_is_fix_r(seed):
    g = torch.Generator().manual_seed(seed)
    side = 3 * int(torch.randint(2, 6, (), generator=g))  # a square grid of whole windows, as the reference asserts
    n = side * side
    feats = torch.randn(n, 16, generator=g, dtype=torch.float64)
    similar = torch.rand(n, generator=g) < 0.5  # some windows of near-copies, so that similarities spread
    feats[similar] = feats[similar] * 0.1 + torch.randn(16, generator=g, dtype=torch.float64)
    windows = (side // 3) ** 2
    fix_r = int(torch.randint(0, windows + 1, (), generator=g))
    keep = n - 8 * fix_r
    tokens = VisualTokens(feats, [n], [(1, side, side)], received_attention=torch.rand(n, generator=g))
    compression = mustdrop.compress(tokens, keep, seed=0)
    kept, _, (merged,) = merge_groups(compression, feats)
    expected = reference_pooling(torch.cat([feats.new_zeros(1, 16), feats])[None], (3, 3), fix_r)
    assert sorted(expected) == kept.tolist()
    for row, position in enumerate(kept.tolist()):
        assert torch.allclose(merged[row], expected[position], atol=1e-12), position


@pytest.mark.parametrize("seed", range(CASES))
def test_any_count_keeps_exactly_keep_and_the_last_window_merges_its_last_tokens(seed):
    g = torch.Generator().manual_seed(100 + seed)
    grids = [
        (1, int(torch.randint(3, 9, (), generator=g)), int(torch.randint(3, 10, (), generator=g))) for _ in range(3)
    ]
    sizes = [t * h * w for t, h, w in grids]
    n = sum(sizes)
    feats = torch.randn(n, 12, generator=g, dtype=torch.float64)
    fewest = mustdrop.COMPRESSOR.fewest(grids)
    keep = int(torch.randint(fewest, n + 1, (), generator=g))
    compression = mustdrop.compress(VisualTokens(feats, sizes, grids, received_attention=torch.rand(n)), keep, 0)
    assert len(compression.kept) == keep
    # by hand: windows of every pair pooled, ranked by similarity; 8 merged from each but the last
    table = mustdrop.windows(grids, "cpu")
    rows = F.normalize(feats[table], dim=-1)
    sims = (rows @ rows.transpose(1, 2)).sum(dim=(1, 2)) - 9  # less the 9 self-pairs
    order = torch.sort(sims / 72, descending=True, stable=True).indices
    count = -(-(n - keep) // 8)
    expected = torch.arange(n)
    for rank, w in enumerate(order[:count].tolist()):
        members = table[w, :-1] if rank < count - 1 else table[w, 8 - ((n - keep) - 8 * (count - 1)) : 8]
        expected[members] = table[w, -1]
    assert torch.equal(compression.assignment, expected)


def test_below_the_window_floor_the_merge_is_refused():
    grids = [(1, 4, 7), (1, 3, 3)]  # 2 + 1 whole windows: 24 of 37 tokens can merge
    assert mustdrop.COMPRESSOR.fewest(grids) == 37 - 24
    tokens = VisualTokens(torch.randn(37, 8), [28, 9], grids, received_attention=torch.rand(37))
    with pytest.raises(Exception, match="MustDrop's merge of 3 whole 3x3 windows"):
        mustdrop.compress(tokens, 12, 0)


@pytest.mark.parametrize("seed", range(CASES))
def test_the_key_set_is_the_reference_s_top_8_percent_on_the_merged_tokens(seed):
    g = torch.Generator().manual_seed(200 + seed)
    grids = [(1, 6, 6), (1, 6, 9)]
    n = 36 + 54
    received = torch.rand(n, generator=g, dtype=torch.float64)
    keep = int(torch.randint(mustdrop.COMPRESSOR.fewest(grids), n + 1, (), generator=g))
    tokens = VisualTokens(torch.randn(n, 8, generator=g, dtype=torch.float64), [36, 54], grids, received)
    compression = mustdrop.compress(tokens, keep, 0)
    kept = compression.kept
    # the [CLS] row over the tokens after the merge: a merged token's received attention is its members' sum
    cls_row = torch.zeros(n, dtype=torch.float64).index_add_(0, compression.assignment, received)[kept]
    expected = {int(kept[i]) for i in reference_key_set(cls_row[None, None])}
    assert set(torch.nonzero(compression.protected).flatten().tolist()) == expected


# ------------------------------------------------------------------ the prefilling stage
@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("seed", range(12))
def test_a_stage_keeps_the_reference_s_tokens_at_its_own_count(text_models, backbone, seed):
    """The reference's dual filter on layer K - 1's eager attention map with its thresholds, and the key set: at
    the count it keeps, our stage keeps the same tokens."""
    model, first = text_models[backbone]
    g = torch.Generator().manual_seed(300 + seed)
    visual = int(torch.randint(20, 90, (), generator=g))
    embeds, positions = random_prompt(g, model.config.hidden_size, visual)
    layer = max(1, first) + int(torch.randint(0, 3, (), generator=g))
    attention, _ = plain_run(model, embeds, layer)
    start = int(positions[0])
    # thresholds at the attention's own scale, so that some tokens pass and some do not
    rows = attention[0].mean(dim=0)[start + visual :, start : start + visual]
    pair = (float(rows.sum(dim=0).median() / rows.sum()), float(rows.max(dim=0).values.median()))
    key = positions[torch.randperm(visual, generator=g)[: math.ceil(0.08 * visual)]]
    important = set((reference_dual_filter(attention, start, visual, *pair) + start).tolist()) | set(key.tolist())
    if len(important) in (0, visual):
        pytest.skip("the filter keeps none or all")
    stage = Stage(layer, len(important), rank_by=DUAL_FILTER, cut_cache=True, thresholds=pair)
    pruner, seen = LayerPruner(model, [stage], positions, protected=key), {}

    def reached(module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]
        raise Reached

    with torch.no_grad(), pruner.attached():
        handle = model.layers[layer].register_forward_pre_hook(reached, with_kwargs=True)
        try:
            with pytest.raises(Reached):
                model(inputs_embeds=embeds)
        finally:
            handle.remove()
    kept = set(pruner.kept_by_layer[layer].tolist()) & set(positions.tolist())
    assert kept == important


def test_thresholds_and_shares_by_hand():
    assert mustdrop.thresholds(0.5) == (0.001, 0.001)  # 192 of 576 is the nearest setting
    assert mustdrop.thresholds(0.25) == (0.0012, 0.001)
    assert mustdrop.thresholds(0.1) == (0.011, 0.01)
    # stages after layers 2, 6, 10, 14 of 32 -> from 3, 7, 11, 15: a share rho each, the vision stage's too
    layers = [3, 7, 11, 15]
    rho = mustdrop.stage_ratio(0.25, layers, 32)
    by_hand = (3 * rho + 4 * rho**2 + 4 * rho**3 + 4 * rho**4 + 17 * rho**5) / 32
    assert by_hand == pytest.approx(0.25, abs=1e-12)
    stages = mustdrop.stages(32, 1000, 0.25, layers)
    assert [s.keep for s in stages] == [math.floor(rho**i * 1000 + 1e-9) for i in (1, 2, 3, 4)]
    assert all(s.cut_cache and s.rank_by == DUAL_FILTER and s.thresholds == (0.0012, 0.001) for s in stages)
    assert list(mustdrop.cut_layers(stages)) == list(range(2, 15))  # the reference's layers 2 to 14
    assert mustdrop.stages(32, 1000, 1.0, layers) == []


# ------------------------------------------------------------------ the decoding stage
@pytest.mark.parametrize("backbone", BACKBONES)
def test_decoding_attends_to_the_last_stage_s_tokens_in_the_cut_layers(adapters, eager_adapters, backbone):
    """After the prefill the caches of the layers before the first stage to the layer before the last hold the
    last stage's tokens (the reference's layers 2 to 14, :300-325); the other layers keep what they saw. The
    decoding steps skip those columns (`keys_dropped`), and eager attention (a mask cut to the cached columns)
    generates what SDPA (no mask) does."""
    from resadapt_eval.budget.plan import plan_from_scales

    answers = []
    for pool in (adapters, eager_adapters):
        adapter = pool[backbone]
        px = adapter.grid.token_px
        plan = plan_from_scales([1.0] * 8, (6 * px, 6 * px), adapter.grid)
        inputs = adapter.build_inputs(chat_prompt(adapter), synthetic_video(8), plan)
        first = adapter.first_prunable_layer
        stages = mustdrop.stages(12, plan.visual_tokens, 0.25, [max(1, first), 4, 6, 8], first)
        pruned = adapter.pruned_inputs(inputs, stages)
        with torch.no_grad(), pruned.pruner.attached():
            out = adapter.model.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        pruner, prompt = pruned.pruner, inputs["input_ids"].shape[1]
        text = prompt - plan.visual_tokens
        cut = mustdrop.cut_layers(stages)
        assert list(cut) == list(range(max(1, first) - 1, 8))
        lengths = [layer.keys.shape[2] for layer in out.past_key_values.layers]
        held = [text + n for n in pruner.layer_tokens]
        expected = [text + stages[-1].keep if i in cut else held[i] for i in range(12)]
        assert lengths == [n + 3 for n in expected]  # the prompt as cached, then 3 fed-back tokens
        assert pruner.keys_dropped == 3 * sum(held[i] - (text + stages[-1].keep) for i in cut) > 0
        answers.append(out.sequences[0, prompt:].tolist())
    assert answers[0] == answers[1]
