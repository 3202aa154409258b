"""Fidelity of PruneVid (issue 30): the reference's rules, written out here, run against our port on the
same random tensors.

Reference: Visual-AI/PruneVid@b12600c, models/pllava/modeling_pllava.py (`cluster_dpc_knn` :111-169,
`segment_lengths` :184-211, `refine_clusters` :213-316, `compute_cluster_vectors` :714-757,
`spatial_merge_tokens` :759-762, `merge_frames_dynamic` :764-827), models/pllava/elastic_cache.py
(`VTPWindowCache` :108-207) and models/pllava/llama.py :445-449, :514 (the map the stage ranks by:
`attn_weights_wo_pos`, without rotary and causal mask) and :1417-1462 (the LLM stage after layer
`selected_layer`); defaults from scripts/eval.sh :8-12 (selected_layer 10, alpha 0.4, tau 0.8,
temporal_segment_ratio 0.25, cluster_ratio 0.5).

Every deviation documented in `resadapt_eval/baselines/prunevid.py` is applied to the reference rule below
(each is named where it is applied); everything else is the reference's rule.
"""

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.baselines import prunevid
from resadapt_eval.baselines.common import merge_groups, per_pair_budget
from resadapt_eval.baselines.inside_llm import TEXT_AFTER_VISUAL, Stage

from .helpers import BACKBONES, plain_run, pruned_run, random_prompt, scene_tokens

TAU, SEGMENT_RATIO, KNN, ALPHA = 0.8, 0.25, 7, 0.4  # scripts/eval.sh :10-11, modeling_pllava.py :768, :797, :808
CASES = 24  # random cases per setting


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---- the reference's vision side, written out ----


def ref_dpc_knn(x: torch.Tensor, num_clusters: int) -> list[int]:
    """modeling_pllava.py :111-169 on one batch row: the centre (row index) each row joins.
    Deviations (documented): k = min(7, n) (the reference's topk needs n >= 7); the random density jitter
    (:143-144) is replaced by a tie-break on the row index (the lower index is denser, and wins score ties)."""
    x = x.float()
    n, c = x.shape
    dist = torch.cdist(x, x) / (c**0.5)  # :129
    nearest = torch.topk(dist, k=min(KNN, n), dim=-1, largest=False).values  # :140
    density = (-(nearest**2).mean(dim=-1)).exp()  # :141
    rho = density.tolist()
    # :151 mask[i, j]: row j is denser than row i (ties: the lower index)
    mask = torch.tensor(
        [[rho[j] > rho[i] or (rho[j] == rho[i] and j < i) for j in range(n)] for i in range(n)], dtype=x.dtype
    )
    dist_max = dist.max()  # :153
    delta = (dist * mask + dist_max * (1 - mask)).min(dim=-1).values  # :154
    score = (delta * density).tolist()  # :157
    centres = sorted(range(n), key=lambda i: (-score[i], i))[:num_clusters]  # :158
    # :160-163: each row joins the centre of least distance (centre rows of dist; first centre on ties)
    owner = [centres[min(range(len(centres)), key=lambda k: (float(dist[centres[k], i]), k))] for i in range(n)]
    for centre in centres:  # :165-168: a centre joins itself
        owner[centre] = centre
    return owner


def ref_refine_clusters(labels: list[int]) -> list[int]:
    """modeling_pllava.py :213-316 on one batch row."""
    n, refined = len(labels), list(labels)
    for label in sorted(set(labels)):  # step 1 (:229-249): the cluster's runs of consecutive frames
        frames = [i for i in range(n) if labels[i] == label]
        runs, start, prev = [], frames[0], frames[0]
        for i in frames[1:]:
            if i == prev + 1:
                prev = i
            else:
                runs.append((start, prev))
                start = prev = i
        runs.append((start, prev))
        longest = max(e - s + 1 for s, e in runs)  # step 2 (:251-270): keep the longest run(s), unless single frames
        for s, e in runs:
            if longest == 1 or e - s + 1 < longest:
                refined[s : e + 1] = [-1] * (e - s + 1)
    i = 0
    while i < n:  # step 3 (:272-315): a released run joins the longer neighbouring run, the left on ties
        if refined[i] != -1:
            i += 1
            continue
        start = i
        while i < n and refined[i] == -1:
            i += 1
        end = i - 1
        left_label, left_length, right_label, right_length = None, 0, None, 0
        if start > 0:
            left_label, j = refined[start - 1], start - 1
            while j >= 0 and refined[j] == left_label:
                j -= 1
            left_length = start - j - 1
        if end < n - 1:
            right_label, j = refined[end + 1], end + 1
            while j < n and refined[j] == right_label:
                j += 1
            right_length = j - end - 1
        if left_length > right_length:
            new = left_label
        elif right_length > left_length:
            new = right_label
        else:
            new = left_label if left_label is not None else right_label
        refined[start : end + 1] = [0 if new is None else new] * (end - start + 1)
    return refined


def ref_segment_lengths(labels: list[int]) -> list[int]:
    """modeling_pllava.py :184-211: lengths of the runs of equal labels."""
    lengths = [1]
    for a, b in zip(labels, labels[1:]):
        if a == b:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def ref_segments(features: torch.Tensor, sizes: list[int], grids: list[tuple]) -> list[list[int]]:
    """The temporal segments of `merge_frames_dynamic` (modeling_pllava.py :768-770), as lists of pair indices."""
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    num_pairs = len(sizes)
    means = torch.stack([features[s : s + n].mean(dim=0) for s, n in zip(starts, sizes)])  # :768 frames.mean(dim=2)
    # :768 int(num_frames * 0.25) clusters, at least one (with fewer than 4 pairs the reference asks for none)
    labels = ref_dpc_knn(means, max(1, int(num_pairs * SEGMENT_RATIO)))
    windows, first = [], 0
    for length in ref_segment_lengths(ref_refine_clusters(labels)):  # :769-770
        windows.append(list(range(first, first + length)))
        first += length
    segments = []  # deviation: a window is split where the pairs' grid changes
    for window in windows:
        for p in window:
            if p == window[0] or grids[p] != grids[p - 1]:
                segments.append([])
            segments[-1].append(p)
    return segments


def ref_prunevid(features: torch.Tensor, sizes: list[int], grids: list[tuple], keep: int):
    """`merge_frames_dynamic` (modeling_pllava.py :764-827) with our documented deviations applied. Returns the
    assignment (each token's destination) and {destination: merged feature} (float64)."""
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    segments = ref_segments(features, sizes, grids)
    candidates = []  # :785-790: the mean pairwise cosine of each position over the window's frames, above tau
    for s, seg in enumerate(segments):
        w = len(seg)
        if w == 1:  # the reference divides by w (w - 1) = 0: NaN, never above tau
            continue
        unit = F.normalize(torch.stack([features[starts[p] : starts[p] + sizes[p]] for p in seg]), dim=-1)
        sim = (torch.einsum("wlc,tlc->wtl", unit, unit).sum(dim=1) - 1).sum(dim=0) / (w * (w - 1))  # :786-787
        candidates += [(v, s, pos) for pos, v in enumerate(sim.tolist()) if v > TAU]
    # deviation (budget): candidates merged most similar first, skipping a merge that would leave fewer than `keep`
    # tokens, make a segment's last dynamic position static, or make the groups outnumber `keep`
    static: list[list[int]] = [[] for _ in segments]
    count, groups_count = sum(sizes), len(sizes)
    for _, s, pos in sorted(candidates, key=lambda c: (-c[0], c[1], c[2])):
        saved, new_group = len(segments[s]) - 1, 0 if static[s] else 1
        if len(static[s]) + 1 < sizes[segments[s][0]] and count - saved >= keep and groups_count + new_group <= keep:
            static[s].append(pos)
            count, groups_count = count - saved, groups_count + new_group

    # :793-814: per segment its static tokens (temporal means, :795) and each frame's dynamic tokens; each set is
    # clustered (:796-808); deviation: `keep` split over the sets by `per_pair_budget` in place of the 0.5 ratio, no
    # exemption for sets of at most 14 tokens, and a static token sits at its position in the segment's first pair
    groups = []  # (features of the items, destination of each item, member tokens of each item)
    for seg, positions in zip(segments, static):
        positions = sorted(positions)  # masked_select keeps the position order
        if positions:
            frames = torch.stack([features[starts[p] : starts[p] + sizes[p]] for p in seg])
            members = [[starts[p] + pos for p in seg] for pos in positions]
            groups.append((frames[:, positions].mean(dim=0), [m[0] for m in members], members))
        for p in seg:
            dynamic = [starts[p] + pos for pos in range(sizes[p]) if pos not in positions]
            groups.append((features[dynamic], dynamic, [[i] for i in dynamic]))
    assignment, merged = list(range(sum(sizes))), {}
    for (feats, destination, members), k in zip(groups, per_pair_budget([len(g[1]) for g in groups], keep)):
        owner = list(range(len(destination))) if k == len(destination) else ref_dpc_knn(feats, k)
        for centre in sorted(set(owner)):
            items = [i for i in range(len(owner)) if owner[i] == centre]
            merged[destination[centre]] = feats[items].mean(dim=0)  # compute_cluster_vectors :745-751
            for i in items:
                for token in members[i]:
                    assignment[token] = destination[centre]
    return assignment, merged


SETTINGS = {
    "8 pairs x 6 (even)": [(1, 2, 3)] * 8,
    "6 pairs x 9 (odd)": [(1, 3, 3)] * 6,
    "3 pairs x 15 (odd, < 4 pairs)": [(1, 3, 5)] * 3,
    "12 pairs x 4": [(1, 2, 2)] * 12,
    "grid changes": [(1, 2, 3)] * 3 + [(1, 3, 3)] * 4 + [(1, 2, 3)] * 2,
}


def budgets(g: torch.Generator, num_pairs: int, total: int) -> list[int]:
    """One budget per case: the edges (one token per pair, all but one) and random ones between."""
    rand = torch.randint(num_pairs, total, (CASES,), generator=g).tolist()
    return [num_pairs, total - 1] + rand[2:]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fidelity_prunevid_vision_side_matches_the_reference(setting, ties):
    grids = SETTINGS[setting]
    g = torch.Generator().manual_seed(2 * list(SETTINGS).index(setting) + ties)
    total = sum(t * h * w for t, h, w in grids)
    for keep in budgets(g, len(grids), total):
        tokens = scene_tokens(g, grids, ties)
        expected, expected_features = ref_prunevid(tokens.features, tokens.pair_sizes, tokens.grids, keep)
        ours = prunevid.compress(tokens, keep)
        assert ours.assignment.tolist() == expected, (setting, keep)
        destinations, _, (merged,) = merge_groups(ours, tokens.features)
        assert destinations.tolist() == sorted(expected_features)
        reference = torch.stack([expected_features[d] for d in destinations.tolist()])
        assert merged.dtype == torch.float64
        torch.testing.assert_close(merged, reference, atol=1e-6, rtol=0)


def test_fidelity_prunevid_temporal_segments_with_frozen_frames():
    """Frozen pairs (exact repeats) give equal pair means, so the temporal DPC-KNN meets equal densities and
    distances: the lower pair index wins (the documented tie-break)."""
    g = torch.Generator().manual_seed(11)
    for case in range(2 * CASES):
        num_pairs = int(torch.randint(1, 17, (), generator=g))
        grids = [(1, 2, 3) if case % 3 or p < num_pairs // 2 else (1, 3, 3) for p in range(num_pairs)]
        tokens = scene_tokens(g, grids)
        sizes, starts = tokens.pair_sizes, tokens.pair_starts
        for p in range(1, num_pairs):
            if sizes[p] == sizes[p - 1] and torch.rand((), generator=g) < 0.4:
                tokens.features[starts[p] : starts[p] + sizes[p]] = tokens.features[starts[p - 1] : starts[p]]
        assert prunevid.temporal_segments(tokens) == ref_segments(tokens.features, sizes, grids), case


def test_fidelity_prunevid_refinement_and_dpc_knn_on_their_own():
    """The segmentation pieces on random labels and points, where equal labels / densities are common."""
    g = torch.Generator().manual_seed(7)
    for _ in range(200):
        n = int(torch.randint(1, 17, (), generator=g))
        labels = torch.randint(0, int(torch.randint(1, 5, (), generator=g)), (n,), generator=g).tolist()
        ours = prunevid.refine_clusters(labels)
        ref = ref_refine_clusters(labels)
        # same partition into runs (the labels themselves are the clusters' names)
        assert ref_segment_lengths(ours) == ref_segment_lengths(ref)
    for _ in range(60):
        n = int(torch.randint(1, 30, (), generator=g))
        x = torch.randn(n, 5, generator=g, dtype=torch.float64).round(decimals=0)  # coarse values: many ties
        clusters = int(torch.randint(1, n + 1, (), generator=g))
        assert prunevid.dpc_knn(x, clusters).tolist() == ref_dpc_knn(x, clusters)


# ---- the stage inside the LLM ----


def test_fidelity_prunevid_stage_schedule():
    """The stage's place and size: after layer 10 of 32 (the first layer without the pruned tokens is 11,
    llama.py :1457-1461), at the same relative depth (deviation: round(11 L / 32), not before `first_layer`), keeping
    floor(max(alpha, R) n) of the n tokens that entered (deviation: over all of them, R where larger)."""
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        layers = int(torch.randint(4, 49, (), generator=g))
        first = int(torch.randint(0, 4, (), generator=g))
        n = int(torch.randint(1, 3000, (), generator=g))
        retention = float(torch.randint(1, 101, (), generator=g)) / 100
        (stage,) = prunevid.stages(layers, n, retention, None, first)
        assert stage.layer == min(layers - 1, max(first, 1, round(11 * layers / 32)))
        assert stage.keep == min(n, max(1, math.floor(max(ALPHA, retention) * n + 1e-9)))
        assert stage.rank_by == TEXT_AFTER_VISUAL and not stage.merge
    assert prunevid.stages(32, 1000, 0.1)[0] == Stage(11, 400, rank_by=TEXT_AFTER_VISUAL)


def ref_attention_wo_pos(attention, normed: torch.Tensor) -> torch.Tensor:
    """(1, heads, L, L) the map the reference's stage reads: `attn_weights_wo_pos`, llama.py :445-449, returned
    at :514 in the prefill (the text model is built with SDPA, modeling_pllava.py :586, whose layer falls back
    to this eager forward, :645-660, since the stage's layer asks for attentions, :1417-1418). On the attention
    input `normed` (after input_layernorm, :892-904): q_proj / k_proj (:437-438), split into heads (:441-442),
    q k^T / sqrt(head_dim) (:447) with NO rotary (applied only after, :451-452) and NO causal mask (added only
    to the real attention, :478-480), softmax in float32 cast back to the model's dtype (:448).
    Adaptations to Qwen: Qwen3-VL's per-head q/k norms (part of its projections), and each key head repeated
    for its group of query heads (`repeat_kv`; PLLaVA-7B's LLaMA has one key head per query head)."""
    bsz, q_len, _ = normed.shape
    d = attention.head_dim
    query_states = attention.q_proj(normed).view(bsz, q_len, -1, d)
    key_states = attention.k_proj(normed).view(bsz, q_len, -1, d)
    if hasattr(attention, "q_norm"):
        query_states, key_states = attention.q_norm(query_states), attention.k_norm(key_states)
    query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
    key_states = key_states.repeat_interleave(query_states.shape[1] // key_states.shape[1], dim=1)
    attn_weights_wo_pos = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(d)  # :447
    return F.softmax(attn_weights_wo_pos, dim=-1, dtype=torch.float32).to(query_states.dtype)  # :448


def attention_input_and_run(model, embeds: torch.Tensor, layer: int):
    """`plain_run` (the eager, rotary and causal map of layer `layer - 1` and the hidden states entering layer
    `layer`), plus the input of layer `layer - 1`'s attention, what the reference's map is computed on."""
    seen = {}

    def capture(module, args, kwargs):
        seen["normed"] = (args[0] if args else kwargs["hidden_states"]).clone()

    handle = model.layers[layer - 1].self_attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        eager, hidden = plain_run(model, embeds, layer)
    finally:
        handle.remove()
    return seen["normed"], eager, hidden


@pytest.mark.parametrize("visual", [15, 16])
@pytest.mark.parametrize("backbone", BACKBONES)
def test_fidelity_prunevid_stage_inside_the_llm_matches_the_reference(text_models, backbone, visual):
    """VTPWindowCache (elastic_cache.py :120-202) on the map the layer before the stage returns (llama.py :1417-1418,
    :1457-1461; `ref_attention_wo_pos`: no rotary, no causal mask): the text tokens after the video attend to the
    visual tokens (:157-168: rows img_end + 1 on, columns img_start..img_end of the softmax over all L keys), max
    over heads, then over those tokens (:125); the top tokens stay, in their order (:173-177), and the later layers
    see only them (:180-199). Deviation: the top `keep` over all visual tokens (the reference keeps int(alpha size)
    within each static group and each frame's dynamic tokens, which the merged tokens no longer carry).
    The test discriminates: on some cases the eager map's (rotary, causal) rule keeps other tokens."""
    model, first = text_models[backbone]
    (stage,) = prunevid.stages(len(model.layers), visual, 0.4, None, first)
    attention_module = model.layers[stage.layer - 1].self_attn
    g = torch.Generator().manual_seed(visual + 100 * BACKBONES.index(backbone))
    eager_differs = 0
    for case in range(CASES):
        keep = [1, visual - 1][case] if case < 2 else int(torch.randint(1, visual, (), generator=g))
        embeds, positions = random_prompt(g, model.config.hidden_size, visual)
        normed, eager, hidden = attention_input_and_run(model, embeds, stage.layer)
        with torch.no_grad():
            attentions = ref_attention_wo_pos(attention_module, normed)  # layer_outputs[1], :1459
        img_start, img_end = int(positions[0]), int(positions[-1])
        text_to_image = attentions[:, :, img_end + 1 :, img_start : img_end + 1]  # :163
        scores = text_to_image[0].max(dim=0)[0].max(dim=0)[0]  # :125
        top = torch.topk(scores, k=keep).indices  # :137 / :143, one group (deviation)
        image = (top + img_start).sort().values  # :175-177
        index_list = torch.cat([torch.arange(img_start), image, torch.arange(img_end + 1, embeds.shape[1])])  # :180-182
        kept, ours = pruned_run(model, embeds, replace(stage, keep=keep), positions)
        assert kept.tolist() == index_list.tolist(), (backbone, visual, keep)
        torch.testing.assert_close(ours, hidden[:, index_list], atol=1e-6, rtol=0)  # :187 hidden_states[:, index_list]
        eager_scores = eager[0, :, img_end + 1 :, img_start : img_end + 1].amax(dim=(0, 1))
        eager_top = (torch.topk(eager_scores, k=keep).indices + img_start).sort().values
        eager_differs += not torch.equal(eager_top, image)
    assert eager_differs > 0


@pytest.mark.parametrize("backbone", BACKBONES)
def test_fidelity_prunevid_stage_ranking_in_bfloat16(text_models, backbone):
    """The same rule in the model's dtype (bfloat16): the reference's softmax runs in float32 and is cast back
    before the max over heads and text tokens (llama.py :448, elastic_cache.py :125), so the scores are equal to
    the bit, and bfloat16 ties are frequent. Deviation (documented): ties go to the earlier token (the
    reference's `torch.topk` leaves their order unspecified)."""
    from resadapt_eval.backbones.layer_pruning import text_attention

    model, first = text_models[backbone]
    visual = 16
    (stage,) = prunevid.stages(len(model.layers), visual, 0.4, None, first)
    model = copy.deepcopy(model).to(torch.bfloat16)
    attention_module = model.layers[stage.layer - 1].self_attn
    g = torch.Generator().manual_seed(7 + BACKBONES.index(backbone))
    for case in range(8):
        keep = int(torch.randint(1, visual, (), generator=g))
        embeds, positions = random_prompt(g, model.config.hidden_size, visual)
        embeds = embeds.to(torch.bfloat16)
        normed, _, _ = attention_input_and_run(model, embeds, stage.layer)
        img_start, img_end = int(positions[0]), int(positions[-1])
        with torch.no_grad():
            attentions = ref_attention_wo_pos(attention_module, normed)
            ours = text_attention(attention_module, normed, None, None, img_end + 1)
        scores = attentions[0, :, img_end + 1 :, img_start : img_end + 1].max(dim=0)[0].max(dim=0)[0]  # :163, :125
        assert scores.dtype == torch.bfloat16 and torch.equal(ours[img_start : img_end + 1], scores)
        top = sorted(range(visual), key=lambda i: (-float(scores[i]), i))[:keep]  # :137, ties to the earlier
        kept, _ = pruned_run(model, embeds, replace(stage, keep=keep), positions)
        assert kept[torch.isin(kept, positions)].tolist() == sorted(i + img_start for i in top), (backbone, keep)
