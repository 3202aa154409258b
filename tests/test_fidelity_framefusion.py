"""Fidelity of FrameFusion (`baselines/framefusion.py`, run by `backbones/layer_pruning.FusionPruner`) to the
authors' code, thu-nics/FrameFusion@fbec1d2e6bd383361c2c87ca13e73f80a8c1a9e9:
- framefusion/main.py: `FrameFusion.forward` (pruning :60-101, merging :103-138),
  `compute_similarity_and_token_index_by_patch` (:180-241), `merge_tokens_and_get_mask` (:243-319),
  `_compute_pruning_ratio` (:321-343), `cosine_similarity` (:345-349), `find_contigious_latter_index` (:351-380);
- framefusion/utils.py:27-57 (`scaled_dot_product_attention`: the last `num` = 4 queries' attention weights);
- framefusion/models/qwen2/modeling_qwen2_vl.py: the calls (layer 0 before attention, :177-180; after every
  layer's attention, :199-201) and the weights' computation (:253-264 projections and rotary, :270 repeat_kv,
  :287 is_causal, :289-301 the weights only after merging ends);
- framefusion/models/qwenvl/modeling_qwen2_vl.py:118-137: the patch of a visual token is its index within its
  frame (pair), text is TEXT_TOKEN (Qwen2-VL's one video block).
Each rule is written out below by hand with those lines, independently of our module, and run on the same tensors.

What is asserted:
- the similarity, its patch order, and the merge of any merged set that leaves every patch's first token
  (`merge_groups`, `average_into`, as `FusionPruner._merge` runs them): identical hidden states (1e-9, float64)
  and keep masks, text untouched; every kept token the mean of its own run (itself and the merged tokens after
  it of its own patch), every token in one such run (nothing lost);
- the merged set: ours (`merge_decision`) is the reference's `similarity >= 0.6` set whenever it takes that
  branch, with the same end of merging (< 0.1 of the tokens); in the other branch it is the reference's top-k
  set at our count min(n - floor(budget / layers), n - P) (P: a frame pair's tokens, the first tokens of their
  patch); the reference's own count int(ub n) is one less than n - floor(budget / layers) where its kept share
  is fractional (it keeps the ceiling, we the floor) or where float rounding leaves ub n just below an
  integer, equal otherwise (all three occur);
- the fallback never merges a first-of-patch token: by hand on 2 pairs x 3 patches, and on every random case
  and real prefill; where fewer than the needed count have a same-patch token before them, all of those merge
  and the next layer prunes to its allowance;
- the pruning: the top tokens by the last 4 queries' attention averaged over heads and queries (eager weights in
  float64; ours in float32) are the kept ones at equal keep counts, on a real tiny decoder stack;
- the budget: `typical_layers` by hand (and its `InfeasibleBudget` exactly below (f N + P + L - f - 1) / (L N),
  `kinds.AdaptiveInLLMPruner.retention_floor`), and an independent simulation over per-layer similar counts:
  every layer sum within floor(R L N), each reducing layer at the largest count that fits, every merging layer
  a pair's tokens at least, the engine's `InfeasibleBudget` never reached where `typical_layers` accepts;
- one real prefill per backbone and R in {0.5, 0.25, 0.1}: the reference rule re-run layer by layer on the
  captured layer inputs (merges at layer inputs from `first_prunable_layer` on, the ranking at the layer of the
  last merge, the pruning at the next layer's input, our exact counts) gives the same per-layer visual counts,
  the same kept prompt positions and the same merged states; where 8 frames cannot reach R (tiny Qwen3-VL at
  R = 0.1), `typical_layers` (the token budget) and the prefill both raise `InfeasibleBudget` at the same floor,
  and 16 frames run.

Documented differences (framefusion.py's docstring) and how they appear here:
- the seam: a merge after layer l's attention is here at layer l + 1's input; so the ranking is the attention of
  the layer whose input merged last, and the pruning at the input of the layer after it;
- the counts: ours n - floor(budget / layers) merged and floor(budget / layers) kept at the pruning, over the
  real number of layers, where the reference takes int(ub n) and round(n (1 - ratio)) from 28 layers and its
  fractional cost; where the similar tokens alone would leave the later layers less than they must hold (a
  token each after a pruning, a pair's tokens at a further merging layer), ours merges the top n - allowance
  (the reference goes on: it raises once its cost is spent, or keeps round(n (1 - ratio)) tokens, possibly none);
- that top-k is taken among the tokens with a same-patch token before them (at most n - P); the reference's
  top-k can take a first-of-patch token (IGNORE) and average it into another patch's token, or, from the first
  position in patch order, into the last token, which it then drops (`test_..._never_merges_a_first_of_patch_token`
  shows both on the same states). Where that caps the count below the needed one, ours ends merging and the
  next layer prunes to its allowance (the reference's top-k branch ends all reduction); on the real prefills:
  Qwen2.5-VL's half-drifting video at R = 0.1 (layer 1 keeps a pair's 24 tokens, layer 2 prunes to 3) and every
  16-frame video on Qwen3-VL at R = 0.1 (192, 24, then 1 a layer);
- ties go to the earlier token (the reference's `topk` leaves their order unspecified; here only IGNORE ties);
- the ranking is softmaxed in float32 and ranks every visual token as one pool (on Qwen3-VL the frames are split by
  timestamp text; the reference slices one contiguous block).
"""

import math

import numpy as np
import pytest
import torch

from resadapt_eval.backbones.layer_pruning import FusionPruner, query_attention
from resadapt_eval.baselines import framefusion
from resadapt_eval.budget.plan import InfeasibleBudget, plan_from_scales
from resadapt_eval.video import DecodedVideo

from .helpers import BACKBONES, chat_prompt, drifting_video, synthetic_video

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CASES = 24
TEXT_TOKEN, IGNORE_TOKEN = -1, -2  # main.py:5-6
SIMILARITY_LOWER_BOUND, RATIO_LOWER_BOUND = 0.6, 0.1  # main.py:9 (interface.py passes them through)


# ------------------------------------------------------------------ the reference, by hand
def ref_cosine_similarity(mat1, mat2):
    # main.py:345-349
    dot_product = torch.sum(mat1 * mat2, dim=-1)
    return dot_product / (torch.norm(mat1, dim=-1) * torch.norm(mat2, dim=-1))


def ref_find_contigious_latter_index(index_tensor):
    """main.py:351-380: each run of ones replaced by zeros but its last element, which holds the run's length."""
    zero = torch.zeros((index_tensor.shape[0], 1), dtype=index_tensor.dtype)
    t_prev = torch.cat([zero, index_tensor[:, :-1]], dim=1)  # :366
    t_next = torch.cat([index_tensor[:, 1:], zero], dim=1)  # :367
    run_starts = (index_tensor == 1) & (t_prev == 0)  # :370
    run_ends = (index_tensor == 1) & (t_next == 0)  # :371
    start_indices = torch.nonzero(run_starts, as_tuple=True)  # :373
    end_indices = torch.nonzero(run_ends, as_tuple=True)  # :374
    run_lengths = (end_indices[1] - start_indices[1] + 1).to(index_tensor.dtype)  # :375
    output = torch.zeros_like(index_tensor)  # :377
    output[end_indices[0], end_indices[1]] = run_lengths  # :378
    return output


def ref_similarity_and_token_index_by_patch(hidden_states, token_patch_type, patch_num):
    """main.py:180-241 (batch 1): (1, n) similarity of each visual token to the one before it in (patch, position)
    order, IGNORE_TOKEN across patches and first; (1, n) their sequence indices in that order."""
    patch_by_patch, token_index_by_patch = torch.where(token_patch_type == torch.arange(patch_num)[:, None])  # :208-210
    patch_by_patch, token_index_by_patch = patch_by_patch[None, :], token_index_by_patch[None, :]  # :213-214
    similarity = ref_cosine_similarity(  # :216-223
        hidden_states[torch.arange(1), token_index_by_patch[:, :-1], :],
        hidden_states[torch.arange(1), token_index_by_patch[:, 1:], :],
    )
    similarity[patch_by_patch[:, :-1] != patch_by_patch[:, 1:]] = IGNORE_TOKEN  # :225
    first = torch.full((1, 1), IGNORE_TOKEN, dtype=hidden_states.dtype)  # :227-238
    return torch.cat((first, similarity), dim=1), token_index_by_patch


def ref_merge_tokens_and_get_mask(hidden_states, similarity_by_patch, token_index_by_patch, merge_index_by_patch):
    """main.py:243-319 (batch 1) on a copy of `hidden_states` (the reference merges in place): each run of merged
    tokens (consecutive in patch order) added into the token before it, which is divided by the run's length + 1;
    the keep mask (1, L) False at the merged tokens."""
    hidden_states = hidden_states.clone()
    if merge_index_by_patch.shape[0] == 0:  # :264-266
        return hidden_states, torch.ones(hidden_states.shape[:-1], dtype=torch.bool)
    bsz_index = torch.arange(1)[:, None]  # :268
    merge_mask_by_patch = torch.zeros(1, similarity_by_patch.shape[1], dtype=hidden_states.dtype)  # :269-274
    merge_mask_by_patch[bsz_index, merge_index_by_patch] = 1  # :275
    last_merge_token_by_patch = ref_find_contigious_latter_index(merge_mask_by_patch)  # :276
    keep_mask = torch.ones(hidden_states.shape[:-1], dtype=torch.bool)  # :278
    keep_mask[bsz_index, token_index_by_patch[bsz_index, merge_index_by_patch]] = False  # :279
    unique_merge_nums = torch.sort(torch.unique(last_merge_token_by_patch.to(torch.long))).values  # :282
    if (unique_merge_nums[0] == 0).item():  # :283
        unique_merge_nums = unique_merge_nums[1:]
    merge_num_indices, token_merge_index_in_patch = torch.where(  # :285-287
        last_merge_token_by_patch == unique_merge_nums[:, None]
    )
    merge_nums = unique_merge_nums[merge_num_indices]  # :289
    start_in_patch = token_merge_index_in_patch - merge_nums  # :290 (-1 for a run from the first token)
    member_start_in_patch = torch.repeat_interleave(start_in_patch, merge_nums)  # :291
    contiguous = torch.arange(1, torch.sum(merge_nums) + 1)  # :293-294
    cumulative = torch.cumsum(merge_nums, dim=0)  # :296
    run_start = torch.cat((torch.tensor([0]), cumulative[:-1]))  # :297
    within_run = contiguous - torch.repeat_interleave(run_start, merge_nums)  # :299
    member_in_patch = member_start_in_patch + within_run  # :301
    hidden_states.index_add_(  # :304-311
        dim=1,
        index=token_index_by_patch[0, member_start_in_patch],
        source=hidden_states[bsz_index, token_index_by_patch[bsz_index, member_in_patch]],
    )
    hidden_states[bsz_index, token_index_by_patch[bsz_index, start_in_patch]] /= merge_nums[None, :, None] + 1  # :314
    return hidden_states, keep_mask


def ref_compute_pruning_ratio(sparsity_list, cost, num_layers=28):
    """main.py:321-343: the sparsity the next layer needs for a layer-averaged `cost`, after the layers of
    `sparsity_list` (each a layer's share of tokens removed)."""
    s, total_calculation = 1, 0  # :333-334
    for sparsity in sparsity_list:  # :335-337
        s *= 1 - sparsity
        total_calculation += s
    remain_calculation = num_layers * cost - total_calculation  # :338
    if remain_calculation < 0:  # :339-340
        raise ValueError("The cost is too small")
    if remain_calculation / ((num_layers - len(sparsity_list)) * s) > 1:  # :341-342
        return 0
    return 1 - remain_calculation / ((num_layers - len(sparsity_list)) * s)  # :343


def ref_topk_sorted(values, k):
    """main.py:122-123: torch.topk(values, k).indices, sorted; `topk` leaves equal values' order unspecified,
    here the earlier index first (our documented tie rule)."""
    ranked = sorted(range(len(values)), key=lambda i: (-float(values[i]), i))
    return torch.tensor(sorted(ranked[:k]), dtype=torch.long)


def ref_merging(hidden_states, patch_type, patch_num, sparsity_upper_bound, count=None):
    """main.py:103-138, the merging branch of `forward`, on (1, L, H) hidden states and (1, L) patch types:
    (hidden states (1, L', H) and patch types (1, L') left, keep mask (1, L), merged positions in patch order,
    finish_merging, finish_pruning). `count`: the top-k branch's k, int(sparsity_upper_bound * n) as the reference
    has it (:122) unless given."""
    similarity, token_index = ref_similarity_and_token_index_by_patch(hidden_states, patch_type, patch_num)  # :110
    frame_token_num = torch.sum(patch_type != TEXT_TOKEN).item()  # :112
    merge_index = torch.where(similarity >= SIMILARITY_LOWER_BOUND)[1]  # :113
    above_k_ratio = merge_index.shape[0] / frame_token_num  # :114
    if above_k_ratio < sparsity_upper_bound:  # :116-120
        finish_merging, finish_pruning = above_k_ratio < RATIO_LOWER_BOUND, False
    else:  # :121-127
        k = int(sparsity_upper_bound * frame_token_num) if count is None else count
        merge_index = ref_topk_sorted(similarity[0], k)
        finish_merging = finish_pruning = True
    merged, token_mask = ref_merge_tokens_and_get_mask(hidden_states, similarity, token_index, merge_index)  # :129
    patch_type = patch_type[token_mask].reshape(1, -1)  # :132
    merged = merged[token_mask, :].reshape(1, -1, hidden_states.shape[-1])  # :133
    return merged, patch_type, token_mask, merge_index, finish_merging, finish_pruning


def rotate_half(x):
    # transformers' rotate_half, as apply_multimodal_rotary_pos_emb uses it (modeling_qwen2_vl.py:262-264)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_query_key_states(attention, normed, cos, sin):
    """modeling_qwen2_vl.py:253-264, :270 in float64: (1, heads, L, d) queries and keys of the attention input
    `normed` (1, L, H), q_proj / k_proj (and Qwen3-VL's per-head q/k norms), rotary with the layer's cos/sin
    (1, L, d) (transformers' rotary embedding has already laid out the M-RoPE sections), the key heads repeated
    for their query heads (`repeat_kv`)."""
    d, length = attention.head_dim, normed.shape[1]

    def project(linear, x):
        bias = None if linear.bias is None else linear.bias.double()
        return torch.nn.functional.linear(x, linear.weight.double(), bias).view(1, length, -1, d)

    x = normed.double()
    q, k = project(attention.q_proj, x), project(attention.k_proj, x)
    if hasattr(attention, "q_norm"):  # Qwen3-VL: RMSNorm over each head, before the rotary
        q, k = (rms(norm, t) for norm, t in ((attention.q_norm, q), (attention.k_norm, k)))
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    c, s = cos.double()[:, None], sin.double()[:, None]
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    return q, k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def rms(norm, x):
    """An RMSNorm module's rule in float64."""
    return norm.weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


def ref_scaled_dot_product_attention(query, key, num=4):
    """utils.py:27-57 with is_causal=True and no mask (the prefill without padding, modeling_qwen2_vl.py:287,
    :292-300): the softmax weights (1, heads, num, S) of the last `num` queries over every key."""
    query = query[:, :, -num:, :]  # :29
    L, S = query.size(-2), key.size(-2)  # :30
    scale_factor = 1 / math.sqrt(query.size(-1))  # :31
    attn_bias = torch.zeros(L, S, dtype=query.dtype)  # :32
    temp_mask = torch.ones(L, S, dtype=torch.bool).triu(diagonal=S - L + 1)  # :34-36
    attn_bias.masked_fill_(temp_mask, float("-inf"))  # :37
    attn_weight = query @ key.transpose(-2, -1) * scale_factor  # :51
    attn_weight += attn_bias  # :52
    return torch.softmax(attn_weight, dim=-1)  # :53


def ref_pruning_keep(self_attn_weights, image, keep):
    """main.py:60-94: the (sorted) sequence indices kept: every non-image token and the `keep` image tokens of
    highest attention averaged over heads and queries. `image`: the image tokens' sequence indices (the
    reference's block image_token_pruning_start_index + [0, length), :65-71; here any set)."""
    last_layer_attention_avg = torch.mean(self_attn_weights, dim=(1, 2))[0]  # :69-70
    image_attention = last_layer_attention_avg[image]  # :71
    top = image[ref_topk_sorted(image_attention, keep)]  # :74-79
    others = torch.tensor([i for i in range(self_attn_weights.shape[-1]) if i not in set(image.tolist())])
    return torch.cat((others, top)).sort().values  # :81-92


# ------------------------------------------------------------------ random visual blocks, float64
def random_case(seed, width=16):
    """(hidden (1, L, H), patch types (1, L), prefix, patches (n,), patch_num): text before and after a block of
    2..8 frame pairs of 3..12 patches, each later pair's token = the previous pair's + noise of a random size,
    so that cosine similarities spread around 0.6 (noise s times a unit Gaussian: cos ~ 1 / sqrt(1 + s^2))."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    pairs, patch_num = 2 + seed % 7, 3 + (seed * 5) % 10
    prefix, suffix = int(rng.integers(0, 6)), int(rng.integers(0, 6))
    frames = [torch.randn(patch_num, width, generator=g, dtype=torch.float64)]
    for _ in range(pairs - 1):
        size = torch.from_numpy(np.exp(rng.uniform(np.log(0.3), np.log(6.0), patch_num)))
        frames.append(frames[-1] + size[:, None] * torch.randn(patch_num, width, generator=g, dtype=torch.float64))
    text = [torch.randn(count, width, generator=g, dtype=torch.float64) for count in (prefix, suffix)]
    hidden = torch.cat([text[0], *frames, text[1]])[None]
    patches = torch.arange(patch_num).repeat(pairs)
    patch_type = torch.cat([torch.full((prefix,), TEXT_TOKEN), patches, torch.full((suffix,), TEXT_TOKEN)])[None]
    return hidden, patch_type, prefix, patches, patch_num


def merge_sets(similarity, patch_num, seed):
    """Merged sets (positions in patch order) to check the merge on: the similar tokens, a top-k and a random
    subset of the tokens that are not first of their patch (runs of every length)."""
    rng = np.random.default_rng(seed)
    allowed = torch.nonzero(similarity > IGNORE_TOKEN).flatten()
    k = int(rng.integers(0, len(allowed) + 1))
    return [
        torch.nonzero(similarity >= SIMILARITY_LOWER_BOUND).flatten(),
        ref_topk_sorted(similarity, k),
        allowed[torch.from_numpy(rng.random(len(allowed)) < 0.6)],
    ]


def ours_merge(hidden, rows, order, merged):
    """Our merge as `FusionPruner._merge` runs it (`merge_groups`, then `average_into` on the cut copy) on hidden
    states (L, H) whose visual tokens are the rows (n,), in prompt order; order: (n,) from `neighbour_similarity`;
    merged: (n,) bool in that order. Returns (the hidden states left (L', H), kept (n,) bool in prompt order)."""
    count = int(merged.sum())
    members, targets = framefusion.merge_groups(order, merged, count)
    kept = torch.ones(len(rows), dtype=torch.bool)
    kept[members] = False
    stays = torch.ones(len(hidden), dtype=torch.bool)
    stays[rows[members]] = False
    row_in_cut = torch.cumsum(stays, 0) - 1
    cut = hidden[stays].clone()
    framefusion.average_into(cut, hidden, rows[members], row_in_cut[rows[targets]], row_in_cut[rows[kept]])
    return cut, kept


def own_runs(patches, merged):
    """Each kept token's run, written out: {kept token: [it, the merged tokens after it]}, indices into the n
    visual tokens. patches: (n,) in prompt order; merged: (n,) bool in prompt order. Within each patch, in prompt
    order, a token not merged starts a run and a merged one joins the run before it; a merged first token of its
    patch has no run of its own patch (asserted: it does not happen)."""
    runs = {}
    for patch in patches.unique().tolist():
        start = None
        for token in torch.nonzero(patches == patch).flatten().tolist():
            if not merged[token]:
                start, runs[token] = token, [token]
            else:
                assert start is not None, f"the first token of patch {patch} merged"
                runs[start].append(token)
    return runs


def assert_run_means(before, after, patches, merged, atol):
    """Every kept token's state after the merge is the mean of its run's states before it, and every token is in
    one run (nothing lost). before: (n, H) the visual states; after: (k, H) the kept ones', in prompt order."""
    runs = own_runs(patches, merged)
    assert sorted(token for run in runs.values() for token in run) == list(range(len(patches)))
    assert sorted(runs) == torch.nonzero(~merged).flatten().tolist()
    for row, start in enumerate(sorted(runs)):
        assert torch.allclose(after[row], before[runs[start]].mean(dim=0), rtol=0, atol=atol), (start, runs[start])


@pytest.mark.parametrize("seed", range(CASES))
def test_fidelity_framefusion_similarity_and_merge(seed):
    """`neighbour_similarity` is the reference's patch order and similarity; our merge of the similar set, a top-k
    and a random set (none merging a first-of-patch token) is the reference's: the same states (1e-9, float64) and
    keep mask, text untouched, and every kept token the mean of its own run."""
    hidden, patch_type, prefix, patches, patch_num = random_case(seed)
    n = len(patches)
    rows = torch.arange(prefix, prefix + n)
    order, similarity = framefusion.neighbour_similarity(hidden[0], rows, patches)
    ref_similarity, token_index = ref_similarity_and_token_index_by_patch(hidden, patch_type, patch_num)
    assert torch.equal(order + prefix, token_index[0])
    assert torch.allclose(similarity, ref_similarity[0], rtol=0, atol=1e-12)
    assert ((similarity >= 0.6) == (ref_similarity[0] >= 0.6)).all()
    for merge_index in merge_sets(ref_similarity[0], patch_num, seed):
        merged = torch.zeros(n, dtype=torch.bool)
        merged[merge_index] = True
        states, kept = ours_merge(hidden[0], rows, order, merged)
        expected, keep_mask = ref_merge_tokens_and_get_mask(hidden, ref_similarity, token_index, merge_index)
        text = torch.ones(hidden.shape[1], dtype=torch.bool)
        text[rows] = False
        assert torch.equal(kept, keep_mask[0, rows]) and keep_mask[0, text].all()
        assert torch.allclose(states, expected[0, keep_mask[0]], rtol=0, atol=1e-9)
        assert torch.equal(expected[0, text], hidden[0, text])
        in_prompt_order = torch.zeros(n, dtype=torch.bool)
        in_prompt_order[order] = merged
        assert_run_means(hidden[0, rows], states[~text[keep_mask[0]]], patches, in_prompt_order, 1e-9)


def test_fidelity_framefusion_fallback_never_merges_a_first_of_patch_token():
    """2 frame pairs x 3 patches (prompt order: patches 0 1 2 0 1 2), states [1, 0], [0, 1], [1, 1], [1, .1],
    [.1, 1], [-1, 1]: in patch order the tokens are 0 3 1 4 2 5 and their similarities IGNORE, .995, IGNORE, .995,
    IGNORE, 0. Over 2 layers with 8 token-layers left (allowance 4, 2 needed) the top 2 merge, the reference's set;
    with 4 left (allowance 2, 4 needed, and 2 similar would leave 0 < P = 3) only the 3 tokens with a same-patch
    token before them can merge: all 3, each into its own patch's first token (nothing reaches another patch), and
    the next layer prunes to its allowance. The reference's top 4 at that point also takes token 0 (IGNORE, the
    first in patch order): its run wraps to the last token, 5, which is itself dropped, so patch 0 keeps nothing
    and tokens 0 and 3 are lost."""
    states = torch.tensor([[1, 0], [0, 1], [1, 1], [1, 0.1], [0.1, 1], [-1, 1]], dtype=torch.float64)
    patches, rows = torch.tensor([0, 1, 2, 0, 1, 2]), torch.arange(6)
    order, similarity = framefusion.neighbour_similarity(states, rows, patches)
    assert order.tolist() == [0, 3, 1, 4, 2, 5]
    close = 1 / math.sqrt(1.01)
    assert torch.allclose(
        similarity, torch.tensor([IGNORE_TOKEN, close, IGNORE_TOKEN, close, IGNORE_TOKEN, 0.0]).double()
    )
    ref_similarity, token_index = ref_similarity_and_token_index_by_patch(states[None], patches[None], 3)

    merged, count, done_merging, done = framefusion.merge_decision(similarity, 8, 2, 3)
    assert torch.nonzero(merged).flatten().tolist() == [1, 3] and count == 2 and done_merging and done
    cut, kept = ours_merge(states, rows, order, merged)
    assert kept.tolist() == [True, True, True, False, False, True]
    assert torch.allclose(cut, torch.tensor([[1, 0.05], [0.05, 1], [1, 1], [-1, 1]]).double())
    expected, keep_mask = ref_merge_tokens_and_get_mask(
        states[None], ref_similarity, token_index, ref_topk_sorted(similarity, 2)
    )
    assert torch.equal(keep_mask[0], kept) and torch.allclose(expected[0, kept], cut)

    merged, count, done_merging, done = framefusion.merge_decision(similarity, 4, 2, 3)
    assert torch.nonzero(merged).flatten().tolist() == [1, 3, 5] and count == 3 and done_merging and not done
    cut, kept = ours_merge(states, rows, order, merged)
    assert kept.tolist() == [True, True, True, False, False, False]
    assert torch.allclose(cut, torch.tensor([[1, 0.05], [0.05, 1], [0, 1]]).double())
    in_prompt_order = torch.zeros(6, dtype=torch.bool)
    in_prompt_order[order] = merged
    assert own_runs(patches, in_prompt_order) == {0: [0, 3], 1: [1, 4], 2: [2, 5]}
    assert framefusion.prune_keep(3, 4 - 3, 1) == 1  # the next layer: the 1 token-layer left
    # the reference's top 4 (at our needed count): token 0 as well, averaged with 3 into 5, which is dropped
    top = ref_topk_sorted(ref_similarity[0], 4)
    assert top.tolist() == [0, 1, 3, 5]
    expected, keep_mask = ref_merge_tokens_and_get_mask(states[None], ref_similarity, token_index, top)
    assert keep_mask[0].tolist() == [False, True, True, False, False, False]
    assert torch.allclose(expected[0, keep_mask[0]], torch.tensor([[0.05, 1], [0, 1]]).double())
    assert torch.allclose(expected[0, 5], (states[5] + states[0] + states[3]) / 3)  # into a dropped token


# ------------------------------------------------------------------ the merged set and its count
def decision_cases():
    """(seed, R, L, after a merge): the first merging layer (the reference's first call, an empty sparsity list)
    or the one after a merge (one entry), on 12, 28 and 36 layers."""
    for seed in range(CASES):
        for retention in (0.9, 0.75, 0.5, 0.25, 0.15, 0.1):
            yield seed, retention, (12, 28, 36)[seed % 3], seed % 2 == 1


def test_fidelity_framefusion_merged_set_and_count():
    """Ours takes the reference's `similarity >= 0.6` set where it takes that branch, else the reference's top-k
    set at our count: n - floor(budget / layers), at most the n - P tokens with a same-patch token before them.
    The reference's count int(ub n) is n - floor(budget / layers) or one less (it keeps the ceiling of the
    budget's share, ours its floor; or its float ub n falls just below the integer). Where the similar tokens alone
    would leave the later layers less than they must hold (a token each after a pruning, a pair's tokens at a
    further merging layer), ours takes its top-k instead (the reference goes on). Where fewer than needed have a
    same-patch token before them, ours merges all of them and the next layer prunes; the reference's top-k at the
    needed count takes first-of-patch tokens as well."""
    branches, counts = {"similar": 0, "needed": 0, "short": 0, "capped": 0}, set()
    for seed, retention, layers, after_merge in decision_cases():
        hidden, patch_type, prefix, patches, patch_num = random_case(seed)
        n = len(patches)
        before = n + 1 + seed % (n // 2) if after_merge else n  # a merge before took the N0 tokens to n
        sparsity_list = [(before - n) / before] if after_merge else []  # the reference's record of it
        budget = framefusion.total_budget(retention, layers, before) - (n if after_merge else 0)  # that layer held n
        left = layers - len(sparsity_list)
        if budget // left < 1:
            continue  # below one token a layer: `typical_layers` refuses such a retention up front
        _, similarity = framefusion.neighbour_similarity(hidden[0], torch.arange(prefix, prefix + n), patches)
        merged, count, done_merging, done = framefusion.merge_decision(similarity, budget, left, patch_num)
        ub = ref_compute_pruning_ratio(sparsity_list, retention, layers)
        _, _, _, ref_index, ref_finish_merging, ref_finish_pruning = ref_merging(hidden, patch_type, patch_num, ub)
        needed, ref_count, similar = n - budget // left, int(ub * n), int((similarity >= 0.6).sum())
        ends = similar < 0.1 * n
        later = left - 1 if ends or left == 1 else patch_num + left - 2  # what the later layers must hold at least
        assert int(merged.sum()) == count and not merged[similarity == IGNORE_TOKEN].any()
        if similar < needed and budget - (n - similar) >= later:  # the similar set, as the reference
            branches["similar"] += 1
            assert torch.equal(merged, similarity >= 0.6) and count == similar and not done and done_merging == ends
            assert not ref_finish_pruning and torch.equal(torch.nonzero(merged).flatten(), ref_index)
            assert ref_finish_merging == ends
            continue
        take = min(max(needed, 0), n - patch_num)
        assert count == take and done_merging and done == (take == max(needed, 0))
        assert torch.equal(torch.nonzero(merged).flatten(), ref_topk_sorted(similarity, take))
        if similar < needed:  # documented: the similar set alone leaves the later layers too little
            branches["short"] += 1
            assert budget - (n - similar) < later
        else:  # the reference's top-k branch: its own count n - floor(budget / layers) or one less
            branches["needed"] += 1
            assert ref_finish_merging and ref_finish_pruning
            share = (retention * layers * before - (n if after_merge else 0)) / left
            if share >= n:  # every token fits: neither merges any, and no reduction follows
                assert count == ref_count == 0 and ub == 0
            else:  # the reference keeps ceil(share) (or one more where ub n falls just below an integer), ours floor
                fractional, truncated = share != math.floor(share), round(ub * n) - ub * n > 0
                assert needed - ref_count == (1 if fractional or truncated else 0), (needed, ref_count, share, ub * n)
                counts.add("ceiling" if fractional else "float" if truncated else "equal")
            if ref_count == count:
                assert torch.equal(torch.nonzero(merged).flatten(), ref_index)
        if take < needed:  # every token with a same-patch token before it; the reference's top-k reaches further
            branches["capped"] += 1
            assert count == n - patch_num and not done
            extra = sorted(
                set(ref_topk_sorted(similarity, needed).tolist()) - set(torch.nonzero(merged).flatten().tolist())
            )
            assert len(extra) == needed - take and (similarity[extra] == IGNORE_TOKEN).all()
    assert branches["similar"] >= 20 and branches["needed"] >= 20, branches
    assert branches["short"] >= 3 and branches["capped"] >= 3, branches
    assert counts == {"ceiling", "float", "equal"}


# ------------------------------------------------------------------ the pruning's ranking, on a real decoder stack
def ranking_cases(count):
    """(backbone, prefix, N, suffix, keep, layer, seed): N of both parities, keep in 1..N - 1, the ranking layer in
    0..10 of 12, text after the video of 0..5 tokens (with fewer than 4, visual tokens are among the queries)."""
    rng = np.random.default_rng(52)
    for case in range(count):
        visual = 5 + case
        keep = [1, visual - 1, int(rng.integers(1, visual))][case % 3]
        yield BACKBONES[case % 2], int(rng.integers(1, 6)), visual, int(rng.integers(0, 6)), keep, case % 11, case


@pytest.mark.parametrize("backbone, prefix, visual, suffix, keep, layer, seed", list(ranking_cases(CASES)))
def test_fidelity_framefusion_pruning_keeps_the_last_queries_top_tokens(
    text_models, backbone, prefix, visual, suffix, keep, layer, seed
):
    """Every visual token its own patch (nothing is similar): merging ends at its first layer, `layer`, whose
    attention ranks, and layer + 1 keeps floor(budget left / layers left) = `keep` (the budget set for it): the
    reference's top `keep` by the eager weights of the last 4 queries (float64), mean over heads and queries."""
    model, _ = text_models[backbone]
    num_layers = len(model.layers)
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, prefix + visual + suffix, model.config.hidden_size, generator=g, dtype=torch.float64)
    positions = torch.arange(prefix, prefix + visual)
    budget = (layer + 1) * visual + keep * (num_layers - layer - 1)
    pruner = FusionPruner(model, positions, torch.arange(visual), budget, first_layer=layer)
    attention, seen = model.layers[layer].self_attn, {}

    def attention_input(module, args, kwargs):
        seen["input"] = (args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"])

    def attention_weights(module, args, output):
        seen["weights"] = output[1]  # the eager map (1, heads, L, L)

    handles = [
        attention.register_forward_pre_hook(attention_input, with_kwargs=True),
        attention.register_forward_hook(attention_weights),
    ]
    try:
        with torch.no_grad(), pruner.attached():
            model(inputs_embeds=embeds)
    finally:
        for handle in handles:
            handle.remove()
    normed, (cos, sin) = seen["input"]
    with torch.no_grad():
        weights = ref_scaled_dot_product_attention(*ref_query_key_states(attention, normed, cos, sin))
        ours = query_attention(attention, normed, cos, sin, normed.shape[1] - framefusion.QUERY_ROWS)
    assert torch.allclose(weights, seen["weights"][:, :, -4:], rtol=0, atol=1e-6)  # our transcription is the map
    assert torch.allclose(ours.mean(dim=(0, 1)).double(), weights.mean(dim=(1, 2))[0], rtol=0, atol=1e-6)
    assert pruner.kept_by_layer[layer + 1].tolist() == ref_pruning_keep(weights, positions, keep).tolist()
    assert pruner.layer_tokens == [visual] * (layer + 1) + [keep] * (num_layers - layer - 1)


# ------------------------------------------------------------------ the exact budget
def floor_of(num_layers, visual, first_layer, patches):
    """`kinds.AdaptiveInLLMPruner.retention_floor`'s R, written out: every token up to the first merging layer f, a
    pair's P tokens there, then one a layer: (f N + P + L - f - 1) / (L N)."""
    return (first_layer * visual + patches + num_layers - first_layer - 1) / (num_layers * visual)


def test_fidelity_framefusion_typical_layers_by_hand():
    # 12 layers, N = 100 in 4 pairs of P = 25, R = 0.25: floor(R L N) = 300 token-layers. Layer 0 holds 100 and
    # merges nothing (no similar tokens), so the 11 after it keep floor(200 / 11) = 18: 100 + 198 = 298 <= 300.
    assert framefusion.typical_layers(12, 100, 0.25, 0, 25) == [100] + [18] * 11
    # R = 0.1: 120; 100 + 11 floor(20 / 11) = 111.
    assert framefusion.typical_layers(12, 100, 0.1, 0, 25) == [100] + [1] * 11
    # R = 0.05: 60 - 100 leaves the 11 layers after the first less than a token each: the first merges the most
    # similar of the 75 tokens with a same-patch token before them, 100 - floor(60 / 12) = 95 needed: all 75, it
    # holds a pair's 25, and the next layer prunes to floor(35 / 11) = 3 (25 + 33 = 58).
    assert framefusion.typical_layers(12, 100, 0.05, 0, 25) == [25] + [3] * 11
    # in 25 pairs of P = 4, 96 have one: the 95 merge at once and every layer holds floor(60 / 12) = 5.
    assert framefusion.typical_layers(12, 100, 0.05, 0, 4) == [5] * 12
    # in 2 pairs of 50: the first layer holds 50, which leaves 10 for 11 layers: no video of 2 pairs of 50 reaches
    # R = 0.05 (the floor is (50 + 11) / 1200); at that floor, 50 then 1 a layer.
    with pytest.raises(InfeasibleBudget) as raised:
        framefusion.typical_layers(12, 100, 0.05, 0, 50)
    assert raised.value.floor == pytest.approx(floor_of(12, 100, 0, 50)) == 61 / 1200
    assert framefusion.typical_layers(12, 100, 61 / 1200, 0, 50) == [50] + [1] * 11
    assert framefusion.typical_layers(12, 100, 1.0, 0, 25) == [100] * 12  # every token fits
    # 28 layers, N = 1000, R = 0.3 (the reference's default cost): 8400; 1000 + 27 floor(7400 / 27) = 1000 + 27 * 274.
    assert framefusion.typical_layers(28, 1000, 0.3, 0, 100) == [1000] + [274] * 27
    # merging from layer 3 (Qwen3-VL's deepstack): R = 0.5, 600; 300 over layers 0-2, layer 3 holds 100, then
    # floor(200 / 8) = 25; at R = 0.25 the first three layers spend all 300, and even a pair's 25 at layer 3 and a
    # token in each of the 8 after it do not fit: the floor is (300 + 25 + 8) / 1200.
    assert framefusion.typical_layers(12, 100, 0.5, 3, 25) == [100] * 4 + [25] * 8
    with pytest.raises(InfeasibleBudget) as raised:
        framefusion.typical_layers(12, 100, 0.25, 3, 25)
    assert raised.value.floor == pytest.approx(floor_of(12, 100, 3, 25)) == 333 / 1200
    assert framefusion.typical_layers(12, 100, 333 / 1200, 3, 25) == [100] * 3 + [25] + [1] * 8
    # the reference's own count at the pruning, round(N (1 - ratio)) after one layer of no merge (sparsity 0):
    # 28 R / 27 - 1/27 of the tokens, 274.07 of 1000 at R = 0.3: round gives 274, as our floor; at R = 0.25,
    # 6000 / 27 = 222.2 -> 222, ours floor((7000 - 1000) / 27) = 222; at 0.26 (6280 / 27 = 232.6) 233 against 232.
    for retention, ours in ((0.3, 274), (0.25, 222), (0.26, 232)):
        ratio = ref_compute_pruning_ratio([0.0], retention, 28)
        reference = round(1000 * (1 - ratio))
        assert framefusion.typical_layers(28, 1000, retention, 0, 100)[1] == ours and reference - ours in (0, 1)


def simulate(num_layers, visual, patch_num, retention, first_layer, similar_shares, seed):
    """Per-layer visual counts as the engine decides them (the phases of `FusionPruner._reduce` and `_merge`),
    written here independently: merging layers from `first_layer` on, where layer i's n tokens are P = `patch_num`
    first of their patch (IGNORE: each patch keeps its first token) and, of the others, round(share_i n) at or
    above 0.6 (`merge_decision`); then the pruning (`prune_keep`) after the layer where merging ended. The
    engine's `InfeasibleBudget` (a merge that leaves the later layers less than a token each) is asserted never to
    be reached. Returns (counts, the layer whose reduction the budget set or None, the merging layers, the layers
    that merged fewer than needed: all but a pair's tokens, the next layer pruning)."""
    g = torch.Generator().manual_seed(seed)
    budget = framefusion.total_budget(retention, num_layers, visual)
    left, phase, counts, limited, n, ranked, merging, short = budget, "merge", [], None, visual, None, [], []
    for layer in range(num_layers):
        layers_left = num_layers - layer
        if layer >= first_layer and phase == "merge":
            merging.append(layer)
            share = similar_shares[(layer - first_layer) % len(similar_shares)]
            others = torch.randperm(n, generator=g)[patch_num:]  # the tokens with a same-patch token before them
            similarity = torch.full((n,), IGNORE_TOKEN, dtype=torch.float64)
            similarity[others] = torch.rand(len(others), generator=g, dtype=torch.float64) * 0.59  # below 0.6
            similarity[others[: min(len(others), round(share * n))]] += 0.6
            merged, count, done_merging, done = framefusion.merge_decision(similarity, left, layers_left, patch_num)
            assert not merged[similarity == IGNORE_TOKEN].any() and n - count >= patch_num
            assert done or left - (n - count) >= layers_left - 1, (layer, n, count, left)
            if count < n - left // layers_left and (done_merging and not done) and n - count == patch_num:
                short.append(layer)
            n -= count
            if done:
                phase, limited = "done", layer
            elif done_merging:
                phase, ranked = "rank", layer
        elif phase == "rank" and layer == ranked + 1:
            n, phase, limited = framefusion.prune_keep(n, left, layers_left), "done", layer
        counts.append(n)
        left -= n
    return counts, limited, merging, short


def test_fidelity_framefusion_budget_simulation():
    """Over random depths, pair sizes, pair counts, targets and per-layer similar shares: `typical_layers` refuses
    exactly the targets below (f N + P + L - f - 1) / (L N); where it accepts, the layers hold at most floor(R L N)
    visual token-layers, at least one token each and a pair's tokens at each merging layer, counts never grow, the
    engine never meets its `InfeasibleBudget`, and the layer whose reduction the budget set holds the largest count
    that fits (or all it had) in every layer from it on; with no similar tokens the counts are `typical_layers`."""
    rng = np.random.default_rng(11)
    limited_seen = refused = pair_then_pruned = 0
    for case in range(60):
        num_layers, first_layer = [(12, 0), (28, 0), (36, 3), (12, 1)][case % 4]
        patch_num, pairs = int(rng.integers(3, 60)), int(rng.integers(1, 13))
        visual = patch_num * pairs
        retention = float(np.exp(rng.uniform(np.log(0.02), np.log(0.95))))
        shares = [[0.0], [0.95], list(rng.uniform(0, 1, 4)), [float(rng.uniform(0.1, 0.7))]][case % 4]
        floor = floor_of(num_layers, visual, first_layer, patch_num)
        budget = framefusion.total_budget(retention, num_layers, visual)
        least = first_layer * visual + patch_num + num_layers - first_layer - 1  # the floor's token-layers
        try:
            typical = framefusion.typical_layers(num_layers, visual, retention, first_layer, patch_num)
        except InfeasibleBudget as raised:
            refused += 1
            assert budget < least and retention < floor and raised.floor == pytest.approx(floor)
            continue
        assert budget >= least
        counts, limited, merging, short = simulate(num_layers, visual, patch_num, retention, first_layer, shares, case)
        pair_then_pruned += len(short)
        assert all(counts[layer] == patch_num and layer + 1 == limited for layer in short)
        assert sum(counts) <= budget and min(counts) >= 1, (counts, budget)
        assert all(a >= b for a, b in zip(counts, counts[1:]))
        assert all(counts[layer] >= patch_num for layer in merging)
        if shares == [0.0]:
            assert counts == typical
        if limited is not None:
            limited_seen += 1
            spent, held, layers_left = sum(counts[:limited]), counts[limited], num_layers - limited
            assert counts[limited:] == [held] * layers_left
            before = counts[limited - 1] if limited > 0 else visual
            assert held == before or spent + (held + 1) * layers_left > budget, (counts, budget)
    assert limited_seen >= 20 and refused >= 10 and pair_then_pruned >= 10, (limited_seen, refused, pair_then_pruned)


# ------------------------------------------------------------------ the engine, on the tiny fixtures
def half_drifting_video(num_frames=8, seed=0):
    """Random 160x120 frames whose left half drifts slowly from the first frame's (about half the visual tokens
    are similar to the pair before, the rest not); indices 0..T-1 of a 2 fps file."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (num_frames, 120, 160, 3), dtype=np.uint8)
    frames[1:, :, :80] = (0.7 * frames[:1, :, :80] + 0.3 * frames[1:, :, :80]).astype(np.uint8)
    return DecodedVideo(frames=frames, indices=list(range(num_frames)), total_frames=num_frames, fps=2.0)


VIDEOS = {"random": synthetic_video, "drifting": drifting_video, "half": half_drifting_video}  # each (num_frames)


def reference_replay(layers, entering, attention_input, visual, patches, budget, first_layer):
    """The reference rule layer by layer on the captured inputs `entering[i]` = (hidden states (1, S, H) entering
    decoder layer i, before any reduction there; the prompt positions (S,) they are), with our seam and counts:
    merging (`ref_merging`) at the inputs of the layers from `first_layer` on, with needed = n - floor(budget left
    / layers left): its similar branch where the similar tokens are fewer and leave the later layers what they
    must hold (a token each after a pruning, a pair's P tokens at a further merging layer), else its top-k branch
    at min(needed, n - P) (the tokens with a same-patch token before them; where that is below needed, merging
    ends and the next layer prunes); the ranking by the last merge layer's attention (its captured input
    `attention_input[i]`), the pruning (`ref_pruning_keep`) at the next layer's input keeping floor(budget left /
    layers left). Returns (visual tokens per layer, prompt positions each layer from `first_layer` on sees, merged
    states, the paths taken)."""
    patch_of = dict(zip(visual.tolist(), patches.tolist()))
    patch_num = int(patches.max()) + 1
    left, phase, rank_layer = budget, "merge", None
    counts, kept, merged, paths = [], {}, {}, set()
    for i in range(len(layers)):
        hidden, seen = entering[i]
        now, is_visual, layers_left = seen, torch.isin(seen, visual), len(layers) - i
        n = int(is_visual.sum())
        if i >= first_layer and phase == "merge":
            patch_type = torch.tensor([patch_of.get(p, TEXT_TOKEN) for p in seen.tolist()])[None]
            similarity, _ = ref_similarity_and_token_index_by_patch(hidden, patch_type, patch_num)
            needed, similar = n - left // layers_left, int((similarity >= 0.6).sum())
            later = layers_left - 1 if similar < 0.1 * n or layers_left == 1 else patch_num + layers_left - 2
            fits = similar < needed and left - (n - similar) >= later
            take = min(max(needed, 0), n - patch_num)
            merged[i], _, mask, _, finish_merging, finish_pruning = ref_merging(
                hidden, patch_type, patch_num, needed / n if fits else 0.0, take
            )
            if fits:
                paths.add("similar, merging ends" if finish_merging else "similar, merging on")
            elif take < needed:  # documented: all but a pair's tokens merge, and the next layer prunes
                assert left - (n - take) >= layers_left - 1  # the prefill ran: the later layers get a token each
                finish_pruning = False
                paths.add("a pair's tokens, then the pruning")
            else:
                paths.add("top-k")
            now = seen[mask[0]]
            phase = "done" if finish_pruning else "rank" if finish_merging else "merge"
            rank_layer = i
        elif phase == "rank" and i == rank_layer + 1:
            normed, (cos, sin) = attention_input[rank_layer]
            q, k = ref_query_key_states(layers[rank_layer].self_attn, normed, cos, sin)
            keep = min(n, left // layers_left)
            now = seen[
                ref_pruning_keep(ref_scaled_dot_product_attention(q, k), torch.nonzero(is_visual).flatten(), keep)
            ]
            phase = "done"
            paths.add("pruning")
        if i >= first_layer:
            kept[i] = now.tolist()
        counts.append(int(torch.isin(now, visual).sum()))
        left -= counts[-1]
    return counts, kept, merged, paths


def fusion_setup(adapter, video, num_frames, retention):
    """(inputs, visual positions, budget floor(R L N), a `FusionPruner` for it, `typical_layers` as the token
    budget takes it or the `InfeasibleBudget` it raises) for `num_frames` of `video` at a 4 x 6-token base."""
    px = adapter.grid.token_px
    plan = plan_from_scales([1.0] * num_frames, (4 * px, 6 * px), adapter.grid)
    num_layers = len(adapter.model.model.language_model.layers)
    inputs = adapter.build_inputs(chat_prompt(adapter), video(num_frames), plan)
    visual = adapter.visual_positions(inputs)
    budget = framefusion.total_budget(retention, num_layers, len(visual))
    pruner = adapter.fusion_inputs(inputs, budget).pruner
    try:
        typical = framefusion.typical_layers(
            num_layers, len(visual), retention, adapter.first_prunable_layer, max(plan.pair_tokens)
        )
    except InfeasibleBudget as raised:
        typical = raised
    return inputs, visual, budget, pruner, typical


PATHS = {  # what each target's runs (both backbones) take at least (`reference_replay`'s names)
    0.5: {"top-k", "similar, merging on", "similar, merging ends", "pruning"},
    0.25: {"similar, merging on", "similar, merging ends", "pruning"},
    0.1: {"a pair's tokens, then the pruning", "pruning"},
}


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("retention", list(PATHS))
def test_fidelity_framefusion_in_a_real_prefill(adapters, backbone, retention):
    """The engine's prefill (`fusion_inputs`) on a random, a drifting and a half-drifting video of 8 frames: the
    per-layer visual counts, the kept prompt positions and the merged states are the reference rule's, re-run on
    each layer's captured input (hooks registered before the pruner's: the unreduced input), and every kept token
    is the mean of its own run. Where 8 frames cannot reach R (tiny Qwen3-VL at R = 0.1: every token in layer 0,
    a pair's 24 in layer 1 and a token in each of the 10 after it is 130 of 96 x 12 token-layers, above
    floor(0.1 x 1152) = 115), `typical_layers` (the token budget) and the prefill both raise `InfeasibleBudget` at
    that floor, and 16 frames run instead. On the random video (nothing similar) the counts are `typical_layers`.
    The runs cover: nothing similar, then the pruning; the top-k merged at once; the similar set merged, a layer
    with none, then the pruning; and all but a pair's tokens merged, then the pruning (R = 0.1)."""
    adapter = adapters[backbone]
    layers = adapter.model.model.language_model.layers
    first_layer, paths = adapter.first_prunable_layer, set()
    for name, video in VIDEOS.items():
        inputs, visual, budget, pruner, typical = fusion_setup(adapter, video, 8, retention)
        sixteen = False
        if isinstance(typical, InfeasibleBudget):
            floor = floor_of(len(layers), len(visual), first_layer, int(pruner.patches.max()) + 1)
            assert (backbone, retention) == ("qwen3vl", 0.1) and typical.floor == pytest.approx(floor)
            adapter.model.model.rope_deltas = None
            with torch.no_grad(), pruner.attached(), pytest.raises(InfeasibleBudget) as raised:
                adapter.model(**inputs)
            total = len(layers) * len(visual)  # the token-layers of every visual token in every layer
            assert raised.value.floor == pytest.approx(floor) and raised.value.target == pytest.approx(budget / total)
            inputs, visual, budget, pruner, typical = fusion_setup(adapter, video, 16, retention)
            sixteen = True
        entering, attention_input, reduced = {}, {}, {}

        def capture(store, index, key):
            def hook(module, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                if key == "entering":
                    seen = pruner.kept if pruner.kept is not None else torch.arange(hidden.shape[1])
                    store[index] = (hidden, seen)
                elif key == "attention":
                    store[index] = (hidden, kwargs["position_embeddings"])
                else:
                    store[index] = hidden

            return hook

        handles = [
            layer.register_forward_pre_hook(capture(entering, i, "entering"), with_kwargs=True)
            for i, layer in enumerate(layers)
        ]
        handles += [
            layer.self_attn.register_forward_pre_hook(capture(attention_input, i, "attention"), with_kwargs=True)
            for i, layer in enumerate(layers)
        ]
        try:
            adapter.model.model.rope_deltas = None
            with torch.no_grad(), pruner.attached():
                handles += [  # after the pruner's: what it hands the layer
                    layer.register_forward_pre_hook(capture(reduced, i, "reduced"), with_kwargs=True)
                    for i, layer in enumerate(layers)
                ]
                adapter.model(**inputs)
        finally:
            for handle in handles:
                handle.remove()
        with torch.no_grad():
            counts, kept, merged, taken = reference_replay(
                layers, entering, attention_input, visual, pruner.patches, budget, first_layer
            )
        paths |= taken
        assert pruner.layer_tokens == counts
        assert {i: k.tolist() for i, k in pruner.kept_by_layer.items()} == kept
        patch_of = dict(zip(visual.tolist(), pruner.patches.tolist()))
        for i, states in merged.items():
            assert torch.allclose(reduced[i], states, rtol=0, atol=1e-5)
            hidden, seen = entering[i]
            entering_visual, now = seen[torch.isin(seen, visual)], pruner.kept_by_layer[i]
            assert_run_means(
                hidden[0, torch.isin(seen, visual)],
                reduced[i][0, torch.isin(now, visual)],
                torch.tensor([patch_of[p] for p in entering_visual.tolist()]),
                ~torch.isin(entering_visual, now),
                1e-5,
            )
        assert sum(counts) <= budget
        if name == "random":
            assert counts == typical
        if sixteen:  # 192 tokens in 8 pairs of 24, 230 token-layers: layer 1 keeps a pair's, then floor(14 / 10)
            assert counts == [192, 24] + [1] * 10
    assert PATHS[retention] <= paths, paths
