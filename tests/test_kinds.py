"""Method kinds behind one protocol (`kinds.py`), the token budget each computes once per sample,
and the run spec every surface receives (`runspec.py`)."""

import dataclasses
import json
import math

import numpy as np
import pytest

from resadapt_eval.budget.plan import InfeasibleBudget
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.budget.selection import Operator
from resadapt_eval.compute.flops import dims_from_config, load_dims
from resadapt_eval.estimates import row_flops, row_plan
from resadapt_eval.kinds import ENGINE_PRUNER, FRAME_SELECTION, KINDS, RESIZE_POLICY, FrameScales, MethodKind
from resadapt_eval.methods import METHODS, NO_RETENTION, Method, register
from resadapt_eval.pipeline import VideoPipeline, VideoPipelineConfig
from resadapt_eval.runspec import RunSpec

from .helpers import video_request

RETENTION = {"pyramiddrop": 0.5}  # its default quarters cannot reach 0.25 on the 12-layer fixtures; the rest: 0.25


class EveryOtherPair(MethodKind):
    """A kind written here, as a new one would be: the frames of every other pair at the base size,
    R against all frames' vanilla tokens. Nothing else is written for it."""

    name = "every other pair"

    def scales(self, spec, planner, items, base_hws, raw) -> FrameScales:
        (video,), (base_hw,) = items, base_hws
        pair = planner.grid.temporal_patch
        kept = [i for i in range(len(video.indices)) if i // pair % 2 == 0]
        reference = planner.vanilla_tokens(len(video.indices), base_hw)
        return FrameScales((video.subset(kept),), [np.ones(len(kept))], reference)


@pytest.fixture
def every_other():
    method = register(Method("every_other", "Every Other Pair", "EveryOther", EveryOtherPair(), NO_RETENTION))
    yield method
    del METHODS[method.name]


def test_a_new_kind_is_one_class_that_the_pipeline_record_and_flops_run(adapters, fixtures_dir, every_other):
    adapter = adapters["qwen25vl"]
    request = video_request(adapter, fixtures_dir)
    _, record = VideoPipeline(adapter, VideoPipelineConfig(method="every_other", max_num_frames=8)).run(request)
    _, vanilla = VideoPipeline(adapter, VideoPipelineConfig(method="vanilla", max_num_frames=8)).run(request)
    assert record.error is None and vanilla.error is None
    assert record.frame_indices == [vanilla.frame_indices[i] for i in (0, 1, 4, 5)]
    assert record.reference_tokens == vanilla.reference_tokens == vanilla.visual_tokens
    assert 2 * record.visual_tokens == vanilla.visual_tokens and record.achieved_retention == 0.5
    assert record.input_tokens == vanilla.input_tokens - record.visual_tokens  # the engine's own prompt
    assert 0 < record.vision_flops < vanilla.vision_flops and 0 < record.llm_prefill_flops < vanilla.llm_prefill_flops


def test_every_declared_method_is_one_of_the_kinds_and_frame_selection_comes_from_the_operator():
    declared = {method.kind for method in METHODS.values()}
    assert declared == set(KINDS) - {FRAME_SELECTION}  # each kind has at least one method
    select = RunSpec.resolve(
        VideoPipelineConfig(
            method="resadapt",
            allocator="untrained",
            operator="select_resize",
            top_k=4,
            budget=BudgetSpec(retention=0.5),
        )
    )
    assert select.method is METHODS["resadapt"] and select.operator is Operator.SELECT_RESIZE
    assert select.kind is FRAME_SELECTION and select.frames_to_decode == 128 and select.retention == 0.5
    resize = RunSpec.resolve(VideoPipelineConfig(method="resadapt", allocator="untrained"))
    assert resize.kind is RESIZE_POLICY and resize.frames_to_decode == 32 and resize.retention is None
    assert RunSpec.resolve(select) is select
    with pytest.raises(dataclasses.FrozenInstanceError):
        select.operator = Operator.RESIZE
    layers = RunSpec.resolve(
        VideoPipelineConfig(method="pyramiddrop", budget=BudgetSpec(retention=0.5), prune_layers="1;4;8")
    )
    assert (layers.prune_layers, layers.stage_layers, layers.prune_layers_text) == ((1, 4, 8), [1, 4, 8], "1;4;8")


def test_vllms_own_vidcom2_needs_vllms_code_at_start():
    """`vidcom2_engine` runs vLLM's VidCom2: without vLLM >= 0.27.0 its engine is refused before it starts,
    naming what to install; with it, the compressing engine's table holds it."""
    import importlib.util

    spec = RunSpec.named("vidcom2_engine", 0.25)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match=r"vLLM's own VidCom2 .*vLLM >= 0.27.0.*method=vidcom2"):
            spec.kind.engine_args(spec)
    else:
        location = "resadapt_eval.baselines.vidcom2_engine:COMPRESSOR"
        assert spec.kind.engine_args(spec) == dict(token_compression={"vidcom2_engine": location})


def test_only_the_engine_side_pruner_sets_the_engines_pruning():
    evs = RunSpec.named("evs", 0.35)
    assert evs.kind is ENGINE_PRUNER
    rate = METHODS["evs"].pruning_rate(0.35)
    assert evs.kind.engine_args(evs) == dict(video_pruning_method="evs", video_pruning_rate=rate)
    assert 1 - rate >= 0.35 and rate < 0.65  # floor(0.35 N) tokens, not one fewer (0.35 is just below 7/20)
    others = [
        RunSpec.named(name, None if m.full_budget else 0.25)
        for name, m in METHODS.items()
        if m.kind is not ENGINE_PRUNER and name != "vidcom2_engine"  # that one needs vLLM's code (the test above)
    ]
    assert len(others) == len(METHODS) - 2 and all("video_pruning_method" not in s.kind.engine_args(s) for s in others)
    # a vision-side compressor's engine runs it inside the model (`vllm_compression`): its own table; the rest none
    for spec in others:
        table = {spec.method.name: spec.method.compressor.location} if spec.method.vllm_compressor else None
        assert spec.kind.engine_args(spec) == ({} if table is None else dict(token_compression=table))
    assert sum(spec.method.vllm_compressor for spec in others) == 14


def test_the_config_only_table_refuses_what_a_run_refuses():
    """The engine-side pruner's floor (the first pair whole) stops a row as it fails a run's sample."""
    dims = load_dims("qwen25vl-7b")
    _, visual = row_flops(dims, "evs", 16, (672, 840), retention=0.125)  # 8 pairs: the first is exactly 1/8
    _, vanilla = row_flops(dims, "vanilla", 16, (672, 840))
    assert visual * 8 == vanilla
    with pytest.raises(InfeasibleBudget, match="vLLM's evs, which keeps the first of 8 pairs whole"):
        row_flops(dims, "evs", 16, (672, 840), retention=0.1)


@pytest.mark.parametrize("backbone", ["qwen25vl", "qwen3vl"])
def test_a_runs_record_and_the_config_only_row_count_the_same_tokens(adapters, fixtures_dir, backbone):
    """Every HF method but the Allocator's (whose scales depend on the video): the record's visual tokens,
    per-layer tokens, layer average and R equal the token budget `row_plan` computes for the same frames
    and base size, by the same kind's rule."""
    adapter = adapters[backbone]
    dims = dims_from_config(adapter.model.config)
    request = video_request(adapter, fixtures_dir)
    checked = []
    for name, method in METHODS.items():
        if not method.hf or method.needs_allocator or backbone not in method.kind.families:
            continue
        retention = None if method.full_budget else RETENTION.get(name, 0.25)
        config = VideoPipelineConfig(method=name, max_num_frames=8, budget=BudgetSpec(retention=retention))
        _, record = VideoPipeline(adapter, config).run(request)
        assert record.error is None, (name, record.error)
        budget = row_plan(dims, name, 8, tuple(record.base_size), retention).budget
        assert record.reference_tokens == budget.reference, name
        assert record.visual_tokens == budget.entering, name
        if method.adaptive_prune is not None:  # counts from the video; the row's: a video without similar tokens
            allowed = math.floor(retention * len(budget.layers) * budget.reference)
            assert sum(record.layer_visual_tokens) <= allowed and sum(budget.layers) <= allowed, name
            assert len(record.layer_visual_tokens) == len(budget.layers), name
            checked.append(method.kind)
            continue
        assert record.layer_visual_tokens == (None if budget.layers is None else list(budget.layers)), name
        assert record.layer_averaged_tokens == budget.layer_average, name
        assert record.achieved_retention == budget.achieved_retention, name
        checked.append(method.kind)
    # every kind the HF path runs on this backbone
    assert set(checked) == {kind for kind in KINDS if backbone in kind.families and kind.hf} - {FRAME_SELECTION}


def test_an_engine_that_prunes_other_layers_than_the_budget_fails_the_sample(adapters, fixtures_dir, monkeypatch):
    adapter = adapters["qwen25vl"]
    config = VideoPipelineConfig(method="fastv", max_num_frames=8, budget=BudgetSpec(retention=0.25))
    pipeline = VideoPipeline(adapter, config)
    generate_batch = adapter.generate_batch

    def one_token_more(requests, gen_kwargs):
        outputs = generate_batch(requests, gen_kwargs)
        return [dataclasses.replace(o, layer_visual_tokens=[n + 1 for n in o.layer_visual_tokens]) for o in outputs]

    monkeypatch.setattr(adapter, "generate_batch", one_token_more)
    _, record = pipeline.run(video_request(adapter, fixtures_dir))
    held, counted = record.error.removeprefix("RuntimeError: the engine's layers held ").split(" visual tokens, ")
    assert [n - 1 for n in json.loads(held)] == record.layer_visual_tokens  # the record keeps the budget's counts
    assert counted == f"the plan counts {tuple(record.layer_visual_tokens)}"
