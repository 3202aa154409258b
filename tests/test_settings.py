"""Bad settings stop the model at start with a message naming the argument (no per-sample failures)."""

import pytest
import torch

from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.lmms.models import ResAdaptQwen25VL
from resadapt_eval.pipeline import VideoPipelineConfig

from .helpers import REPO

BAD = {
    "fixed_scale without retention": (dict(method="fixed_scale"), "retention"),
    "min_pixels above max_pixels": (dict(min_pixels=5000, max_pixels=4000), "min_pixels=5000 exceeds max_pixels=4000"),
    "max_pixels below one token": (dict(max_pixels=100), "max_pixels=100 is below one visual token"),
    "unknown pair reduction": (dict(method="fixed_scale", retention=0.25, pair_reduction="median"), "pair_reduction"),
    "quantile outside (0, 1)": (
        dict(method="resadapt", allocator="untrained", allocator_quantile=1.5),
        "allocator_quantile",
    ),
    "top_k of 0": (
        dict(method="resadapt", allocator="untrained", operator="select", top_k=0),
        "top_k must be at least 1",
    ),
    "no candidates": (dict(method="resadapt", allocator="untrained", operator="select", candidates=0), "candidates"),
    "infinite retention": (dict(method="tome", retention="inf"), "retention must be a finite positive number"),
    "infinite retention, fixed_scale": (
        dict(method="fixed_scale", retention="inf"),
        "retention must be a finite positive number",
    ),
    "retention not a number": (dict(method="fixed_scale", retention="abc"), "retention='abc': expected float"),
    "strict not a boolean": (dict(strict="maybe"), "strict='maybe'"),
    "unknown dtype": (dict(dtype="bogus"), "dtype='bogus'"),
    "unknown method": (dict(method="tokencarver"), "unknown method 'tokencarver'"),
    "unknown argument": (dict(retension=0.25), "unknown model_args retension"),
    "retention for vanilla": (dict(retention=0.25), "has no retention target"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_setting_stops_at_start_naming_it(fixtures_dir, case):
    model_args, message = BAD[case]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ResAdaptQwen25VL(
            pretrained=str(fixtures_dir / "qwen25vl"), dtype=model_args.pop("dtype", "float32"), **model_args
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU where there is none")
def test_cuda_without_a_gpu_names_the_device(fixtures_dir):
    with pytest.raises(ValueError, match="device='cuda': no CUDA device"):
        ResAdaptQwen25VL(pretrained=str(fixtures_dir / "qwen25vl"), device="cuda")


def test_a_checkpoint_of_the_other_backbone_is_refused(fixtures_dir):
    with pytest.raises(ValueError, match="is a qwen3_vl model; qwen25vl needs a qwen2_5_vl checkpoint"):
        ResAdaptQwen25VL(pretrained=str(fixtures_dir / "qwen3vl"), dtype="float32")


def test_booleans_are_parsed_strictly(fixtures_dir):
    for text, value in (("no", False), ("false", False), ("0", False), ("true", True), ("yes", True)):
        model = ResAdaptQwen25VL(pretrained=str(fixtures_dir / "qwen25vl"), dtype="float32", strict=text)
        assert model.strict is value and model.pipeline.spec.strict is value


def test_resadapt_without_an_allocator_says_what_to_pass_and_offers_no_other_backbones_checkpoint():
    """Forgetting allocator= is an error saying what can be passed, not a silent untrained run; the
    settings alone do not know the backbone, so no committed checkpoint is offered here (`sweep`,
    which knows the card's, offers those trained with it: test_careful_user)."""
    with pytest.raises(ValueError) as error:
        VideoPipelineConfig(method="resadapt", budget=BudgetSpec(retention=0.25))
    message = str(error.value)
    assert "allocator=" in message and "allocator=untrained" in message and "trained with this backbone" in message
    assert "needle" not in message


NEEDLE_ALLOCATOR = REPO / "results" / "needle" / "allocator-qwen25vl"


def test_an_allocator_checkpoint_carries_its_training_budget():
    """The committed needle Allocator was trained with s in [0.1, 1.0] on 16 frames: a bare
    lmms-eval command gets the settings the needle card spells out, and an explicit setting that
    differs wins with a warning naming both values."""
    from loguru import logger

    from resadapt_eval.runspec import config_from_model_args
    from resadapt_eval.sweep import load_card

    card = load_card(REPO / "model_cards" / "needle-qwen25vl.yaml")
    card_args = {k: v for k, v in card.model_args.items() if k not in ("device", "dtype")}
    from_card = config_from_model_args(
        method="resadapt", allocator=card.allocator, retention=0.25, max_num_frames=card.frames[0], **card_args
    )
    bare = config_from_model_args(method="resadapt", allocator=str(NEEDLE_ALLOCATOR), retention=0.25)
    assert (bare.budget.s_min, bare.budget.s_max, bare.max_num_frames) == (0.1, 1.0, 16)
    assert bare.budget == from_card.budget and bare.max_num_frames == from_card.max_num_frames

    warnings = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    try:
        overridden = config_from_model_args(
            method="resadapt", allocator=str(NEEDLE_ALLOCATOR), retention=0.25, s_max="1.8"
        )
    finally:
        logger.remove(sink)
    assert overridden.budget.s_max == 1.8 and overridden.budget.s_min == 0.1
    assert any("s_max=1.8 differs from the s_max=1.0" in str(w) for w in warnings)


def test_a_corrupt_training_budget_is_an_error_naming_the_file(tmp_path):
    from resadapt_eval.allocator import CheckpointError
    from resadapt_eval.runspec import config_from_model_args

    (tmp_path / "budget.json").write_text('{"s_max": 1.0, "s_mx": 2}')
    with pytest.raises(CheckpointError, match=r"budget.json: unknown budget settings \['s_mx'\]"):
        config_from_model_args(method="resadapt", allocator=str(tmp_path), retention=0.25)
