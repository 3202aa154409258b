"""Host-device syncs of every compressor's `compress` (issue 40): a small constant, whatever the number
of frame pairs, and never more than its reference's (docs/baselines.md, "Cost"). Counted by
`measure.syncs.counting_syncs` on CPU tensors, where each counted call is a sync on a GPU."""

import pytest
import torch

from resadapt_eval.baselines.common import VisualTokens
from resadapt_eval.measure.syncs import counting_syncs
from resadapt_eval.methods import METHODS

# the most syncs each compress may make on random tokens (no two pairs alike, so no multi-pair segment)
# is its declaration's `TokenCompressor.host_syncs`: the reads of its cuts, labels or weights, once per
# video (the references' counts grow with frames, segments or picks: random_drop has none, ToMe,
# DivPrune and DyCoke 0, FlashVID 1 + 9 F + 1 per multi-frame segment, VisionZip 5 per batch, VidCom2
# 2, FastVID 6 + S, PruneVid at least 3 F, HoliTom F (F - 1) / 2 + 4 W + 1; PruMerge+ 1 + 6 outliers
# an image; Pooling, VisPruner and FasterVLM 0, G-Prune 2 a graph, V-CAST T + 7 or more)
# (vLLM's own VidCom2, `vidcom2_engine`, needs vLLM: counted in tests/test_fidelity_vidcom2_engine.py)
COMPRESSORS = {
    name: method.compressor for name, method in METHODS.items() if method.compressor is not None and method.hf
}


def random_tokens(pairs: int, side: int = 6, width: int = 64, seed: int = 0) -> VisualTokens:
    g = torch.Generator().manual_seed(seed)
    n = pairs * side * side
    attention = torch.rand(n, generator=g)
    return VisualTokens(
        torch.randn(n, width, generator=g),
        [side * side] * pairs,
        [(1, side, side)] * pairs,
        attention,
        torch.randn(n, 16, generator=g),
        query=torch.randn(7, width, generator=g),  # a question of 7 tokens, for a compressor that reads one
    )


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_a_compressor_s_host_syncs_do_not_grow_with_the_pairs(name):
    compressor = COMPRESSORS[name]
    counts = []
    for pairs in (4, 16):
        tokens = random_tokens(pairs)
        with counting_syncs() as syncs:
            compressor.compress(tokens, len(tokens.features) // 4, 0)
        counts.append(syncs["n"])
    assert counts[0] == counts[1] <= compressor.host_syncs, counts


def test_the_counter_sees_the_syncs_a_gpu_would_wait_for():
    x = torch.randn(8)
    with counting_syncs() as syncs:
        x[x > 0], int(x.argmax()), x.tolist(), torch.nonzero(x), x.cpu()
        x.topk(2), x.sort(), x.masked_fill(x > 0, 0), x[torch.tensor([1, 2])]  # none of these
    assert syncs["n"] == 5


def test_dart_reads_its_pivots_once_whatever_the_tokens():
    """DART's selection (`dart.select`) reads only its 8 pivots' prompt indices, to visit them in its
    reference's order: 1 sync at any length (its reference: one per chosen token, and 2 more for the pivots)."""
    from resadapt_eval.baselines import dart

    counts = []
    for visual in (40, 400):
        g = torch.Generator().manual_seed(visual)
        length = visual + 20
        hidden, key_l1 = torch.randn(1, length, 32, generator=g), torch.rand(length, generator=g)
        positions, after = torch.arange(10, 10 + visual), torch.arange(10 + visual, length)
        with counting_syncs() as syncs:
            taken = dart.select(hidden, torch.nn.RMSNorm(32), key_l1, positions, after, visual // 4)
        assert int(taken.sum()) == visual // 4
        counts.append(syncs["n"])
    assert counts == [1, 1]


def tower_inputs(pairs: int, side: int = 4, width: int = 32, heads: int = 2, seed: int = 0):
    """Hidden states of `pairs` frame pairs of side x side merge units (4 patches each), their
    segments and rotary tables, and a vision attention module of `width` (random weights)."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    patches = pairs * side * side * 4
    attention = SimpleNamespace(
        qkv=torch.nn.Linear(width, 3 * width), num_heads=heads, scaling=(width // heads) ** -0.5
    )
    hidden = torch.randn(patches, width, generator=g)
    angles = torch.randn(patches, width // heads, generator=g)
    cu_seqlens = torch.arange(pairs + 1, dtype=torch.int32) * side * side * 4
    return hidden, [side * side * 4] * pairs, (angles.cos(), angles.sin()), cu_seqlens, attention


def test_the_in_tower_methods_host_syncs_do_not_grow_with_the_pairs():
    """iLLaVA's merge (its recomputed attention reads the segment bounds, its survivors are a
    data-dependent size: 2) and IPCV's pruning (its kept and removed patches: 2), for 4 and 16 pairs;
    the references sync per frame (iLLaVA's `set(...tolist())`, :482-484) or per call (IPCV's
    `torch.unique`, `cu_seqlens` from a Python loop over kept tokens in the Qwen3-VL port)."""
    from types import SimpleNamespace

    from resadapt_eval.backbones.qwen import ADAPTERS
    from resadapt_eval.backbones.tower_reduction import TowerPruner, TowerReducer
    from resadapt_eval.baselines import illava, ipcv

    counts = {"illava": [], "ipcv": []}
    for pairs in (4, 16):
        hidden, segments, (cos, sin), cu_seqlens, attention = tower_inputs(pairs)
        visual = SimpleNamespace(blocks=[None] * 4, spatial_merge_size=2, deepstack_visual_indexes=[])
        units = [n // 4 for n in segments]
        reducer = TowerReducer(visual, {1: [n // 2 for n in units]}, units, ADAPTERS["qwen3vl"].vision_rotary,
                               illava.merge_units, lambda fn: fn)  # fmt: skip
        reducer.origin = torch.arange(sum(units))
        reducer.sizes = torch.ones_like(reducer.origin)
        reducer._captured = dict(
            module=attention, hidden_states=hidden, cu_seqlens=cu_seqlens, position_embeddings=(cos, sin)
        )
        pruner = TowerPruner(visual, ipcv.PRUNING, segments, [n // 4 for n in segments], lambda fn: fn)
        pruner._previous = hidden + 1
        with counting_syncs() as merged:
            reducer.work(1, hidden)
        with counting_syncs() as pruned:
            pruner.work(hidden, dict(cu_seqlens=cu_seqlens, position_embeddings=(cos, sin)))
            pruner.restored(hidden[pruner._state["kept"]])
        counts["illava"].append(merged["n"])
        counts["ipcv"].append(pruned["n"])
    assert counts == {"illava": [2, 2], "ipcv": [2, 2]}
