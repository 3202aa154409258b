"""Merging inside the vision tower (iLLaVA, `kinds.InTowerMerger`) on the tiny Qwen3-VL: exact budgets,
positions, the tower's FLOPs by block, and R = 1 equal to vanilla."""

import pytest
import torch

from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.compute.flops import dims_from_config, load_dims, vision_flops
from resadapt_eval.estimates import row_flops, row_memory
from resadapt_eval.kinds import IN_TOWER_MERGER
from resadapt_eval.methods import get_method
from resadapt_eval.pipeline import VideoPipeline, VideoPipelineConfig

from .helpers import first_logits_and_text, vanilla_setup, video_request

pytestmark = pytest.mark.usefixtures("one_thread")


def records_beside_vanilla(adapter, fixtures_dir, method: str, retention: float):
    """(the method's record, vanilla's) on the first smoke video, 16 frames."""
    records = []
    for name, budget in ((method, BudgetSpec(retention=retention)), ("vanilla", BudgetSpec())):
        config = VideoPipelineConfig(method=name, max_num_frames=16, budget=budget)
        records.append(VideoPipeline(adapter, config).run(video_request(adapter, fixtures_dir))[1])
    return records


@pytest.mark.parametrize("retention", [0.5, 0.25, 0.1])
def test_the_llm_gets_floor_r_n_tokens_and_the_tower_s_blocks_count_what_they_held(adapters, fixtures_dir, retention):
    adapter = adapters["qwen3vl"]
    record, vanilla = records_beside_vanilla(adapter, fixtures_dir, "illava", retention)
    assert record.error is None
    n = record.reference_tokens
    assert record.visual_tokens == len(record.merged_sizes) == int(retention * n + 1e-9)
    assert sum(record.merged_sizes) == n  # every unit is averaged into a kept one
    assert record.achieved_retention == record.visual_tokens / n
    # block 0 sees every patch, block 1 (after the merge) and the merger the kept units' patches
    assert record.tower_tokens == [4 * n, 4 * record.visual_tokens, 4 * record.visual_tokens]
    dims = dims_from_config(adapter.model.config)
    grids = [tuple(g) for g in record.grids]
    tower = IN_TOWER_MERGER.tower_counts(get_method("illava"), dims, [t * h * w for t, h, w in grids], retention)
    assert (record.vision_flops, record.vision_attention_flops) == vision_flops(dims.vision, grids, tower)
    assert record.vision_flops + record.vision_attention_flops < vanilla.vision_flops + vanilla.vision_attention_flops
    # the counted ranking work equals the formula the config-only rows use
    assert record.method_flops == IN_TOWER_MERGER.own_flops(get_method("illava"), dims, grids, retention, None) > 0


def test_at_r_1_it_is_vanilla_and_kept_tokens_keep_their_positions(adapters):
    adapter = adapters["qwen3vl"]
    prompt, video, plan = vanilla_setup(adapter)
    spec_units = list(plan.pair_tokens)
    full = adapter.build_inputs(prompt, video, plan)
    positions = adapter.full_positions(full)

    def merged(after):
        return adapter.build_tower_merged_inputs(
            prompt, video, plan, {0: after}, get_method("illava").tower_merge.merge, lambda fn: fn
        )

    same, reducer = merged(spec_units)
    assert torch.equal(reducer.origin, torch.arange(sum(spec_units)))
    logits, text = first_logits_and_text(adapter, same)
    vanilla_logits, vanilla_text = first_logits_and_text(adapter, full)
    assert torch.equal(text, vanilla_text)
    torch.testing.assert_close(logits, vanilla_logits, atol=1e-5, rtol=0)

    half, reducer = merged([max(1, n // 2) for n in spec_units])
    video_at = torch.nonzero(full["mm_token_type_ids"][0] == 2).flatten()
    kept_at = torch.nonzero(half["mm_token_type_ids"][0] == 2).flatten()
    torch.testing.assert_close(half["position_ids"][..., kept_at], positions[..., video_at[reducer.origin]])


def test_a_7b_and_8b_row_from_configs_shows_the_tower_s_savings():
    """`resadapt-eval flops` from configs alone: iLLaVA's vision FLOPs below vanilla's at the same
    frames on Qwen3-VL-8B; Qwen2.5-VL-7B stops at start."""
    dims = load_dims("qwen3vl-8b")
    vanilla, tokens = row_flops(dims, "vanilla", 32, (720, 1280))
    merged, kept = row_flops(dims, "illava", 32, (720, 1280), retention=0.25)
    assert kept == int(0.25 * tokens)
    assert merged.vision + merged.vision_attention < 0.7 * (vanilla.vision + vanilla.vision_attention)
    assert merged.method > 0
    # `flops --memory`: the tower runs before the LLM, with its ranking's attention rows beside it
    memory, _ = row_memory(dims, "illava", 32, (720, 1280), retention=0.25)
    plain, _ = row_memory(dims, "vanilla", 32, (720, 1280))
    assert memory.extra_encoding > 0 and not memory.tower_in_generate and memory.kv < plain.kv
    with pytest.raises(ValueError, match="reducing tokens inside the vision tower runs on Qwen3-VL only"):
        row_flops(load_dims("qwen25vl-7b"), "illava", 32, (720, 1280), retention=0.25)


@pytest.mark.parametrize("retention", [0.5, 0.25])
def test_ipcv_prunes_the_tower_restores_every_token_and_dart_meets_r(adapters, fixtures_dir, retention):
    adapter = adapters["qwen3vl"]
    record, vanilla = records_beside_vanilla(adapter, fixtures_dir, "ipcv", retention)
    assert record.error is None
    n, layers = record.reference_tokens, record.layer_visual_tokens
    assert record.visual_tokens == n == layers[0]  # every token enters the LLM, restored
    assert retention - 0.01 <= record.achieved_retention == sum(layers) / len(layers) / n <= retention
    # block 0 sees every patch; block 1 (after K = 1) each pair's int(n R) patches; the merger every patch
    pair_patches = [4 * t * h * w for t, h, w in record.grids]
    assert record.tower_tokens == [4 * n, sum(int(p * retention + 1e-9) for p in pair_patches), 4 * n]
    dims = dims_from_config(adapter.model.config)
    grids = [tuple(g) for g in record.grids]
    method = get_method("ipcv")
    tower = method.kind.tower_counts(method, dims, [t * h * w for t, h, w in grids], retention)
    assert (record.vision_flops, record.vision_attention_flops) == vision_flops(dims.vision, grids, tower)
    assert record.vision_flops + record.vision_attention_flops < vanilla.vision_flops + vanilla.vision_attention_flops
    removed, kept = 4 * n - sum(tower.blocks[-1]), sum(tower.blocks[-1])
    assert record.method_flops > 2 * removed * kept * dims.vision.hidden  # the neighbour search, and DART's ranking


def test_ipcv_at_r_1_is_vanilla(adapters, fixtures_dir):
    adapter = adapters["qwen3vl"]
    request = video_request(adapter, fixtures_dir)
    outputs = {}
    for name, retention in (("ipcv", 1.0), ("vanilla", None)):
        config = VideoPipelineConfig(method=name, max_num_frames=8, budget=BudgetSpec(retention=retention))
        outputs[name] = VideoPipeline(adapter, config).run(request)
    (text, record), (vanilla_text, vanilla) = outputs["ipcv"], outputs["vanilla"]
    assert record.error is None and text == vanilla_text
    assert record.tower_tokens == [4 * vanilla.visual_tokens] * 3 and record.achieved_retention == 1.0


def test_tower_layers_name_the_blocks_and_the_default_is_the_references(adapters, fixtures_dir):
    """`tower_layers=` the method's own blocks on the tiny tower (iLLaVA: after block 0; IPCV: K = 1)
    gives the default's record."""
    adapter = adapters["qwen3vl"]
    request = video_request(adapter, fixtures_dir)
    for name, blocks in (("illava", "0"), ("ipcv", "1")):
        records = []
        for given in (None, blocks):
            config = VideoPipelineConfig(
                method=name, max_num_frames=8, budget=BudgetSpec(retention=0.5), tower_layers=given
            )
            records.append(VideoPipeline(adapter, config).run(request)[1])
        assert records[0].error is None and records[0].tower_tokens == records[1].tower_tokens
        assert records[0].merged_sizes == records[1].merged_sizes and records[0].total_flops == records[1].total_flops
