"""Fidelity of HoliTom (issue 30): the reference's rules, written out here, run against our port on the same
random tensors.

Reference: cokeshao/HoliTom@e9b2972, holitom/llava_arch.py (`cluster_dpc_knn` :29-51, `select_static_windows`
:53-98, `merge_tokens_by_clustering` :100-150, `merge_tokens_by_attention_density` :152-197,
`merge_tokens_by_density` :199-214, `holitom` :234-276, `get_static_dynamic_features` :278-312, the video branch
of `prepare_inputs_labels_for_multimodal` :347-404) and holitom/modeling_qwen2.py :121-211 (the inner-LLM merge);
defaults from scripts/eval_ov-7b_holitom.sh :2-74 (T = 0.65 at RETAIN_RATIO = 0.10, T = 0.80 at 0.15, 0.20, 0.25;
HOLITOM_k = 18, HOLITOM_r = 0.5) and llava_arch.py :352-355 (BETA = 0.6, D = 0, K = 7, MAX_WINDOW_SIZE = 1024); the
beta merge is the default branch of :137 (NO_BETA unset in every script).

Every deviation documented in `resadapt_eval/baselines/holitom.py` is applied to the reference rule below (each is
named where it is applied); everything else is the reference's rule.
"""

import math
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.baselines import holitom
from resadapt_eval.baselines.common import DROPPED, VisualTokens, merge_groups
from resadapt_eval.baselines.inside_llm import LAST_TOKEN, Stage

from .helpers import BACKBONES, plain_run, pruned_run, random_prompt, scene_tokens

K, MAX_WINDOW, BETA = 7, 1024, 0.6  # llava_arch.py :354-355, :352
# eval_ov-7b_holitom.sh: RETAIN_RATIO -> T (:2, :12, :22, :32; the same without inner merging, :44-74)
T_BY_RETAIN_RATIO = {Fraction(10, 100): 0.65, Fraction(15, 100): 0.80, Fraction(20, 100): 0.80, Fraction(25, 100): 0.80}
INNER_K, INNER_LAYERS, INNER_R = 18, 28, 0.5  # eval_ov-7b_holitom.sh HOLITOM_k=18 (of 28 layers), HOLITOM_r=0.5
CASES = 24  # random cases per setting


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---- the reference's vision side, written out ----


def ref_step_similarity(features, sizes, grids, starts):
    """llava_arch.py :377-380: the cosine of each position's tokens in consecutive frames, (follower, cosine) per
    step. Deviation: pairs of different grids follow each token of the earlier pair to its most similar token of the
    later pair, which keeps only its most similar follower (ties: the lower index)."""
    steps = []
    for p in range(len(sizes) - 1):
        a = F.normalize(features[starts[p] : starts[p] + sizes[p]].float(), dim=-1)
        b = F.normalize(features[starts[p + 1] : starts[p + 1] + sizes[p + 1]].float(), dim=-1)
        if grids[p] == grids[p + 1]:
            steps.append((list(range(sizes[p])), (a * b).sum(dim=-1).tolist()))
            continue
        sim = (a @ b.T).tolist()
        follower = [max(range(sizes[p + 1]), key=lambda j: (row[j], -j)) for row in sim]
        cosine = [sim[i][follower[i]] for i in range(sizes[p])]
        taken = set()
        for i in sorted(range(sizes[p]), key=lambda i: (-cosine[i], i)):
            if follower[i] in taken:
                cosine[i] = -math.inf
            taken.add(follower[i])
        steps.append((follower, cosine))
    return steps


def ref_chain(steps, first: int, last: int, position: int):
    """A position of pair `first` followed to pair `last`: its local index in each pair and its lowest cosine."""
    path, strength = [position], math.inf
    for p in range(first, last):
        follower, cosine = steps[p]
        strength = min(strength, cosine[path[-1]])
        path.append(follower[path[-1]])
    return path, strength


def ref_tau(keep: int, total: int) -> float:
    """The scripts' T for their RETAIN_RATIO, the share of the video tokens entering the LLM (:348, :388-390), here
    keep / N. Deviation: between and beyond the scripts' settings, the T of the nearest (equally near: the higher)."""
    share = Fraction(keep, total)
    nearest = min(T_BY_RETAIN_RATIO, key=lambda r: (abs(r - share), -r))
    return T_BY_RETAIN_RATIO[nearest]


def ref_windows(steps, sizes, tau):
    """select_static_windows (:53-98): pruned_static_count[s][e] = (e - s) x the positions static (cosine > tau) over
    every step s..e-1 (:55-66); the dynamic programme keeps a window [j + 1, i] only when it saves strictly more,
    shortest first (:75-87); backtracking (:89-95)."""
    n = len(sizes)
    count = [[0] * n for _ in range(n)]
    for s in range(n):
        for e in range(s + 1, n):
            static = sum(ref_chain(steps, s, e, pos)[1] > tau for pos in range(sizes[s]))
            count[s][e] = (e - s) * static
    dp, prev = [0] * n, [0] * n
    for i in range(n):
        max_val, best_j = (dp[i - 1] if i > 0 else 0), i
        for window_size in range(2, min(i + 1, MAX_WINDOW) + 1):
            j = i - window_size
            value = (dp[j] if j >= 0 else 0) + count[j + 1][i]
            if value > max_val:
                max_val, best_j = value, j + 1
        dp[i], prev[i] = max_val, best_j
    windows, i = [], n - 1
    while i >= 0:
        windows.append((prev[i], i))
        i = prev[i] - 1
    return windows[::-1]


def ref_dpc_centres(x: torch.Tensor, cluster_num: int):
    """cluster_dpc_knn (:29-51) with k = min(K, cluster_num) (:175, :203): the centres (row indices, score order)
    and the distances. Deviation: the random density jitter (:38-40) replaced by the index tie-break (the lower
    index is denser and wins score ties)."""
    x = x.float()
    n, c = x.shape
    dist = torch.cdist(x, x) / (c**0.5)  # :33
    nearest = torch.topk(dist, min(K, cluster_num), dim=-1, largest=False).values  # :36
    density = (-(nearest**2).mean(dim=-1)).exp()  # :37
    rho = density.tolist()
    mask = torch.tensor(  # :43 mask[i, j]: j denser than i
        [[rho[j] > rho[i] or (rho[j] == rho[i] and j < i) for j in range(n)] for i in range(n)], dtype=x.dtype
    )
    delta = (dist * mask + dist.max() * (1 - mask)).min(dim=-1).values  # :44-45
    score = (delta * density).tolist()  # :48
    return sorted(range(n), key=lambda i: (-score[i], i))[:cluster_num], dist  # :49


def ref_apportion(total: int, sizes: list[int], floors: list[int]) -> list[int]:
    """Deviation (budget): `total` split over the sets in proportion to their sizes, largest remainder first (ties:
    the earlier set), each share within [floor, size]."""
    quota = [total * s / sum(sizes) for s in sizes]
    share = [min(s, max(f, int(q))) for s, f, q in zip(sizes, floors, quota)]
    order = sorted(range(len(sizes)), key=lambda i: (-(quota[i] - int(quota[i])), i))
    while sum(share) < total:
        for i in order:
            if share[i] < sizes[i] and sum(share) < total:
                share[i] += 1
    while sum(share) > total:
        for i in reversed(order):
            if share[i] > floors[i] and sum(share) > total:
                share[i] -= 1
    return share


def ref_holitom(tokens: VisualTokens, keep: int):
    """The video branch (:364-404; similarities :377-380, windows :382-384, static / dynamic split :393-396) with
    our documented deviations applied: the assignment and {destination: merged feature} (float64)."""
    features, sizes, grids, attention = tokens.features, tokens.pair_sizes, tokens.grids, tokens.received_attention
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    steps = ref_step_similarity(features, sizes, grids, starts)
    tau = ref_tau(keep, sum(sizes))
    windows = []  # get_static_dynamic_features (:278-312): each window's static positions (chains) and strengths
    for first, last in ref_windows(steps, sizes, tau):
        chains = [ref_chain(steps, first, last, pos) for pos in range(sizes[first])] if last > first else []
        static = [(path, strength) for path, strength in chains if strength > tau]  # :295-297
        # deviation: a window keeps a token outside its chains in every pair (the weakest chains go back)
        excess = len(static) - (min(sizes[first : last + 1]) - 1)
        if excess > 0:
            weakest = sorted(range(len(static)), key=lambda r: (static[r][1], r))[:excess]
            static = [c for r, c in enumerate(static) if r not in weakest]
        windows.append([first, last, static])
    # deviation: the least redundant chains over all windows go back until temporal merging leaves >= keep tokens
    left = sum(sizes) - sum((last - first) * len(static) for first, last, static in windows)
    released = set()
    for strength, k, r in sorted((c[1], k, r) for k, w in enumerate(windows) for r, c in enumerate(w[2])):
        if left >= keep:
            break
        released.add((k, r))
        left += windows[k][1] - windows[k][0]
    for k, w in enumerate(windows):
        w[2] = [c for r, c in enumerate(w[2]) if (k, r) not in released]

    dynamic = []  # each pair's dynamic tokens (:300-301), window by window
    for first, last, static in windows:
        for column, p in enumerate(range(first, last + 1)):
            taken = {path[column] for path, _ in static}
            dynamic.append([starts[p] + pos for pos in range(sizes[p]) if pos not in taken])
    # deviation (budget): keep apportioned over the dynamic sets (at least one each) and each window's static chains,
    # in place of ceil(r' n) per frame and round(r' m) per window (:154-155, :201), r' = R N / (N - saved) (:388-390)
    share = ref_apportion(
        keep, [len(d) for d in dynamic] + [len(w[2]) for w in windows], [1] * len(dynamic) + [0] * len(windows)
    )
    assignment, merged = [DROPPED] * sum(sizes), {}
    for index, count in zip(dynamic, share):  # merge_tokens_by_attention_density, D = 0: the top attention (:157-163)
        values = attention[index].tolist()
        for i in sorted(range(len(index)), key=lambda i: (-values[i], i))[:count]:  # ties: the lower index
            assignment[index[i]] = index[i]
            merged[index[i]] = features[index[i]]
    for (first, _, static), count in zip(windows, share[len(dynamic) :]):
        if not static or count == 0:  # merge_tokens_by_density with round(r' m) = 0 clusters keeps none (:210-212)
            continue
        tokens_of = [[starts[first + column] + pos for column, pos in enumerate(path)] for path, _ in static]
        means = torch.stack([features[t].mean(dim=0) for t in tokens_of])  # the temporal mean (:303)
        centres, dist = ref_dpc_centres(means, count)
        targets = sorted(centres)  # :204
        groups = {t: [t] for t in targets}
        for i in range(
            len(static)
        ):  # merge_tokens_by_clustering (:100-150): a non-target joins its nearest target (:127)
            if i not in groups:
                groups[targets[min(range(len(targets)), key=lambda j: (float(dist[i, targets[j]]), j))]].append(i)
        for t, members in groups.items():
            # deviation: the group sits at its target's token in the window's first pair
            destination = tokens_of[t][0]
            for i in members:
                for token in tokens_of[i]:
                    assignment[token] = destination
            others = [i for i in members if i != t]
            if others:  # :133-140 (NO_BETA unset): Beta x the target + (1 - Beta) x the mean of the cluster's members
                merged[destination] = BETA * means[t] + (1 - BETA) * means[others].mean(dim=0)
            else:  # :145-146: a target nobody joined stays as it is
                merged[destination] = means[t]
    return assignment, merged


# ---- random videos ----

SETTINGS = {
    "8 pairs x 6 (even)": [(1, 2, 3)] * 8,
    "6 pairs x 9 (odd)": [(1, 3, 3)] * 6,
    "2 pairs x 15 (odd)": [(1, 3, 5)] * 2,
    "12 pairs x 4": [(1, 2, 2)] * 12,
    "4 pairs x 20 (budgets below N / 8)": [(1, 4, 5)] * 4,
    "grid changes": [(1, 2, 3)] * 3 + [(1, 3, 3)] * 2 + [(1, 3, 2)] * 2 + [(1, 2, 3)] * 2,
}


def video(g: torch.Generator, grids, ties: bool) -> VisualTokens:
    tokens = scene_tokens(g, grids, ties)
    attention = torch.rand(tokens.features.shape[0], generator=g, dtype=torch.float64)
    if ties:  # coarse attention: many equal values within a pair
        attention = (attention * 4).round() / 4
    return replace(tokens, received_attention=attention)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fidelity_holitom_outer_stage_matches_the_reference(setting, ties):
    grids = SETTINGS[setting]
    g = torch.Generator().manual_seed(2 * list(SETTINGS).index(setting) + ties)
    total, num_pairs = sum(t * h * w for t, h, w in grids), len(grids)
    low = max(num_pairs, -(-total // 8) - 1)  # the budgets below N / 8 (T = 0.65), where there are any
    for case in range(CASES):
        if case < 2:
            keep = [num_pairs, total - 1][case]
        elif case % 4 == 2:
            keep = int(torch.randint(num_pairs, low + 1, (), generator=g))
        else:
            keep = int(torch.randint(num_pairs, total, (), generator=g))
        tokens = video(g, grids, ties)
        expected, expected_features = ref_holitom(tokens, keep)
        ours = holitom.compress(tokens, keep)
        assert ours.assignment.tolist() == expected, (setting, keep)
        destinations, _, (merged,) = merge_groups(ours, tokens.features)
        assert destinations.tolist() == sorted(expected_features) and len(destinations) == keep
        reference = torch.stack([expected_features[d] for d in destinations.tolist()])
        assert merged.dtype == torch.float64
        torch.testing.assert_close(merged, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("tau", [0.65, 0.8])
def test_fidelity_holitom_windows_match_the_dynamic_programme(tau):
    """The segmentation alone, on videos of 1 to 16 pairs with many static positions, at both of the scripts' T."""
    g = torch.Generator().manual_seed(5)
    for case in range(2 * CASES):
        num_pairs = int(torch.randint(1, 17, (), generator=g))
        grids = [(1, 2, 3) if case % 4 or p % 5 else (1, 3, 2) for p in range(num_pairs)]
        tokens = video(g, grids, ties=False)
        starts, sizes = tokens.pair_starts, tokens.pair_sizes
        steps = holitom.step_matches(tokens, F.normalize(tokens.features.float(), dim=-1))
        ours = holitom.temporal_segments(holitom.redundancy_gains(steps, sizes, tau))
        assert ours == ref_windows(ref_step_similarity(tokens.features, sizes, grids, starts), sizes, tau), case


def test_fidelity_holitom_tau_follows_the_scripts():
    """T by the share of the tokens entering the LLM, at every budget of several video sizes."""
    for total in (24, 30, 48, 54, 80, 100, 1001):
        for keep in range(1, total + 1):
            assert holitom.static_threshold(keep, total) == ref_tau(keep, total), (keep, total)


# ---- the inner-LLM merge ----


def test_fidelity_holitom_inner_stage_schedule():
    """Before layer HOLITOM_k = 18 of 28 (modeling_qwen2.py :144-146), at the same relative depth (deviation: round(18
    L / 28), not before `first_layer`), round(n (1 - r)) tokens stay (:158-160; deviation: R where larger), ranked
    by the last token's attention (:148-155) and merged into (:162-181)."""
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        layers = int(torch.randint(4, 49, (), generator=g))
        first = int(torch.randint(0, 4, (), generator=g))
        n = int(torch.randint(1, 3000, (), generator=g))
        retention = float(torch.randint(1, 101, (), generator=g)) / 100
        (stage,) = holitom.stages(layers, n, retention, None, first)
        assert stage.layer == min(layers - 1, max(first, 1, round(INNER_K * layers / INNER_LAYERS)))
        expected = round(n * (1 - INNER_R)) if retention <= 1 - INNER_R else round(n * retention)
        assert stage.keep == min(n, max(1, expected))
        assert stage.merge and stage.rank_by == LAST_TOKEN
    assert holitom.stages(28, 1000, 0.1)[0] == Stage(18, 500, merge=True)


@pytest.mark.parametrize("visual", [15, 16])
@pytest.mark.parametrize("backbone", BACKBONES)
def test_fidelity_holitom_inner_merge_matches_the_reference(text_models, backbone, visual):
    """modeling_qwen2.py :146-208 on the eager attention map of layer K - 1 and the hidden states entering layer K:
    the top tokens by the last token's attention (mean over heads) stay; each other visual token, in token order, is
    averaged into its most cosine-similar kept token, kept = (kept + dropped) / 2, with the similarities of the
    states before merging; the later layers see the kept tokens in their order. Deviation: `keep` from the stage
    (here every budget from 1 to n - 1)."""
    model, first = text_models[backbone]
    (stage,) = holitom.stages(len(model.layers), visual, 0.25, None, first)
    g = torch.Generator().manual_seed(visual + 100 * BACKBONES.index(backbone))
    for case in range(CASES):
        keep = [1, visual - 1][case] if case < 2 else int(torch.randint(1, visual, (), generator=g))
        embeds, positions = random_prompt(g, model.config.hidden_size, visual)
        attention, hidden = plain_run(model, embeds, stage.layer)
        start, length = int(positions[0]), visual
        row = torch.mean(attention, dim=1)[0][-1][start : start + length]  # :150-156
        top = row.topk(keep).indices + start  # :158-160
        non_top = torch.tensor([i for i in range(start, start + length) if i not in top.tolist()], dtype=torch.long)
        states = hidden.clone()
        non_top_states, top_states = states[:, non_top, :], states[:, top, :]  # :169-170
        sim = torch.bmm(non_top_states, top_states.transpose(1, 2)) / (
            torch.norm(non_top_states, dim=-1, keepdim=True)
            * torch.norm(top_states, dim=-1, keepdim=True).transpose(1, 2)
        )  # :171-174
        nearest = sim.max(dim=-1).indices  # :175
        for i, token in enumerate(non_top.tolist()):  # :177-181
            target = int(top[nearest[0, i]])
            states[0, target] = (states[0, target] + states[0, token]) / 2
        keep_indexs = (
            torch.cat([torch.arange(start), top, torch.arange(start + length, embeds.shape[1])]).sort().values
        )  # :185-197
        kept, ours = pruned_run(model, embeds, replace(stage, keep=keep), positions)
        assert kept.tolist() == keep_indexs.tolist(), (backbone, visual, keep)
        torch.testing.assert_close(ours, states[:, keep_indexs], atol=1e-6, rtol=0)  # :202
