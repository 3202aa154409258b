"""The method registry: one declaration per method, read by every surface."""

from importlib import import_module
from pathlib import Path

import numpy as np
import pytest
import torch

from resadapt_eval.baselines.common import TokenCompressor, holds_nothing, no_matmul
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.kinds import COMPRESSOR, FRAME_SELECTION, RESIZE_POLICY
from resadapt_eval.methods import METHODS, REQUIRED_RETENTION, Method, get_method, register
from resadapt_eval.pipeline import VideoPipelineConfig
from resadapt_eval.report.collect import CellRun
from resadapt_eval.report.plots import pareto_figure
from resadapt_eval.report.tables import build_tables
from resadapt_eval.sweep import ModelCard, cell_command, plan_cells


def keep_first(tokens, keep, seed=0):
    """A toy compressor for the test: keep the first `keep` tokens."""
    assignment = torch.full((tokens.features.shape[0],), -1, dtype=torch.long)
    assignment[:keep] = torch.arange(keep)
    return assignment


KEEP_FIRST = TokenCompressor(keep_first, working_bytes=holds_nothing, host_syncs=0, config_flops=no_matmul)


@pytest.fixture
def extra_method():
    """A method added the way a new baseline is: one compressor plus one registration."""
    method = register(
        Method("keep_first", "Keep First", "KeepFirst", COMPRESSOR, REQUIRED_RETENTION, compressor=KEEP_FIRST)
    )
    yield method
    del METHODS[method.name]


def surfaces(name: str, backbone: str = "qwen25vl") -> dict:
    """How method `name` appears on every surface: lmms-eval model name and class, sweep cell,
    table row, plot legend."""
    from lmms_eval.models import MODEL_REGISTRY_V2, get_model

    from resadapt_eval.lmms import manifests

    model_name = get_method(name).model_names(backbone)[0]
    module, class_name = manifests.model_names()[model_name][0].rsplit(".", 1)
    cls = getattr(import_module(module), class_name)
    card = ModelCard(name="card", backbone=backbone, pretrained="ckpt", allocator="untrained")
    (cell, *_) = plan_cells([name], [0.25], [8])
    command = cell_command(card, cell, ["task"], Path("out"))
    run = CellRun(
        card="card",
        backbone=backbone,
        paper_backbone=None,
        method=name,
        retention=cell.retention,
        frames=8,
        path=Path("x"),
        scores={"videomme": 50.0},
        columns_by_table={"video_qa": ["videomme"]},
        records=[{"achieved_retention": 0.25, "error": None, "task": "videomme"}],
    )
    (table,) = build_tables([run])
    figure = pareto_figure([run], "videomme", 8)
    return dict(
        model=model_name,
        # what lmms-eval resolves the name to (its registry is read from the entry point at start-up)
        resolves=get_model(model_name) is cls if model_name in MODEL_REGISTRY_V2.list_model_names() else None,
        fixed_method=cls.fixed_method,
        command_model=command[command.index("--model") + 1],
        command_method=dict(arg.split("=", 1) for arg in command[command.index("--model_args") + 1].split(","))[
            "method"
        ],
        row=table.rows[0]["method"],
        legend=[t.get_text() for t in figure.axes[0].get_legend().get_texts()],
    )


@pytest.mark.parametrize("name", list(METHODS))
def test_every_registered_method_appears_consistently(name):
    method = METHODS[name]
    seen = surfaces(name)
    assert seen["model"] == f"{name}_qwen25vl"
    assert seen["resolves"] is True
    assert seen["fixed_method"] == (None if name == "resadapt" else name)  # resadapt_<backbone> takes any method
    assert seen["command_model"] == seen["model"] and seen["command_method"] == name
    assert seen["row"] == method.display_name
    assert seen["legend"] == [method.display_name]


def test_a_newly_registered_method_reaches_every_surface(extra_method):
    seen = surfaces("keep_first", "qwen3vl")
    assert seen == dict(
        model="keep_first_qwen3vl",
        resolves=None,
        fixed_method="keep_first",
        command_model="keep_first_qwen3vl",
        command_method="keep_first",
        row="Keep First",
        legend=["Keep First"],
    )
    assert VideoPipelineConfig(method="keep_first", budget=BudgetSpec(retention=0.5)).method == "keep_first"
    with pytest.raises(ValueError, match="needs a target retention"):
        VideoPipelineConfig(method="keep_first")


def test_the_old_fixedscale_model_name_is_an_alias():
    from lmms_eval.models import get_model

    from resadapt_eval.lmms.models import FixedScaleQwen3VL

    assert get_model("fixedscale_qwen3vl") is get_model("fixed_scale_qwen3vl") is FixedScaleQwen3VL


def test_paper_order_and_properties_come_from_the_registry():
    assert list(METHODS)[:5] == ["vanilla", "random_drop", "tome", "visionzip", "flashvid"]  # the paper's rows
    assert list(METHODS)[-2:] == ["fixed_scale", "resadapt"]
    paper = ["vanilla", "random_drop", "tome", "visionzip", "flashvid", "fixed_scale", "resadapt"]
    assert [m for m, spec in METHODS.items() if spec.in_paper] == paper  # the demo's default set
    compressors = [m for m, spec in METHODS.items() if spec.kind.name == "vision-side compressor"]
    assert len(compressors) == 14
    vllm = {"vanilla", "evs", "vidcom2_engine", "fixed_scale", "resadapt", *compressors}
    assert {m for m, spec in METHODS.items() if spec.vllm} == vllm
    assert [m for m, spec in METHODS.items() if not spec.hf] == ["evs", "vidcom2_engine"]  # vLLM's own code
    assert plan_cells(["vanilla", "tome"], [0.5, 0.25], [8])[0].retention is None  # vanilla once, no target
    assert len(plan_cells(["vanilla", "tome"], [0.5, 0.25], [8])) == 3


@pytest.mark.parametrize("where", ["registry", "config", "sweep"])
def test_an_unregistered_method_is_rejected_with_the_known_ones(where):
    call = {
        "registry": lambda: get_method("tokencarver"),
        "config": lambda: VideoPipelineConfig(method="tokencarver"),
        "sweep": lambda: plan_cells(["vanilla", "tokencarver"], [0.25], [8]),
    }[where]
    with pytest.raises(ValueError, match="tokencarver") as error:
        call()
    assert all(name in str(error.value) for name in METHODS)


def test_a_method_declaration_is_checked():
    with pytest.raises(ValueError, match="bad: a vision-side compressor method gives compressor="):
        Method("bad", "Bad", "Bad", COMPRESSOR, REQUIRED_RETENTION)
    with pytest.raises(ValueError, match="bad: a vision-side compressor method takes no policy="):
        Method("bad", "Bad", "Bad", COMPRESSOR, REQUIRED_RETENTION, policy=np.ones, compressor=KEEP_FIRST)
    with pytest.raises(ValueError, match="give a scale policy, or take the scales from the Allocator"):
        Method("bad", "Bad", "Bad", RESIZE_POLICY, REQUIRED_RETENTION)
    with pytest.raises(ValueError, match="frame selection is what operator=select"):
        Method("bad", "Bad", "Bad", FRAME_SELECTION, REQUIRED_RETENTION, needs_allocator=True)
    with pytest.raises(ValueError, match="already registered"):
        register(METHODS["tome"])
    with pytest.raises(ValueError, match="no retention target"):
        VideoPipelineConfig(method="vanilla", budget=BudgetSpec(retention=0.25))
