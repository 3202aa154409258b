"""The paper's training configs (configs/paper_*.yaml) and model cards (model_cards/paper-*.yaml).

The configs name the hub checkpoints and run on GPUs; here each is built as a user without them
would: a copy of the YAML with the backbone, the SmolVLM encoders, the data and the device swapped
for the offline tiny fixtures, everything else as written, then `build_trainer` (what
`resadapt-eval train --config` runs). The paper's values must reach the trainer, the Allocator, the
optimiser, the CAPO loss and the rollout budget unchanged.
"""

import json

import pytest
import torch
import yaml

from resadapt_eval.capo.losses import CAPOConfig
from resadapt_eval.sweep import load_card
from resadapt_eval.train.config import build_trainer

from .helpers import REPO

# config -> (backbone family, base pixels per frame: 8,192 tokens over 64 pairs on its token grid)
CONFIGS = {
    "paper_qwen25vl_7b.yaml": ("qwen25vl", 128 * 28 * 28),
    "paper_qwen3vl_8b.yaml": ("qwen3vl", 128 * 32 * 32),
}


def offline_copy(name, tmp_path, fixtures_dir):
    """The config with only what cannot run here replaced: hub ids -> tiny fixtures, GPU -> CPU."""
    config = yaml.safe_load((REPO / "configs" / name).read_text())
    family = config["backbone"]["family"]
    config["output_dir"] = str(tmp_path / "run")
    config["data"] = str(fixtures_dir / "smoke_videoqa" / "train.jsonl")
    config["backbone"].update(pretrained=str(fixtures_dir / family), device="cpu", dtype="float32")
    # vLLM runs in its own environment (make test-vllm): here the same rollouts go through the HF engine
    config["rollout"].update(engine="hf")
    del config["rollout"]["vllm"]
    config["allocator"]["encoder_path"] = str(fixtures_dir / "smolvlm")
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


HUB = {"qwen25vl": "Qwen/Qwen2.5-VL-7B-Instruct", "qwen3vl": "Qwen/Qwen3-VL-8B-Instruct"}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paper_config_as_written(name, tmp_path, fixtures_dir):
    config = yaml.safe_load((REPO / "configs" / name).read_text())
    family, _ = CONFIGS[name]
    assert config["backbone"] == dict(family=family, pretrained=HUB[family], device="cuda", dtype="bfloat16")
    assert config["rollout"]["engine"] == "vllm"
    assert config["rollout"]["vllm"] == dict(gpu_memory_utilization=0.85, tensor_parallel_size=1, max_model_len=32768)
    assert config["allocator"]["encoder"] == "smolvlm"
    assert config["allocator"]["encoder_path"] == "HuggingFaceTB/SmolVLM2-256M-Video-Instruct"
    # The offline copy the other tests build differs in the swapped settings only.
    copy = yaml.safe_load(offline_copy(name, tmp_path, fixtures_dir).read_text())
    for section in ("capo", "train"):
        assert copy[section] == config[section]
    engine_keys = ("engine", "vllm")
    assert {k: v for k, v in copy["rollout"].items() if k not in engine_keys} == {
        k: v for k, v in config["rollout"].items() if k not in engine_keys
    }
    assert {k: v for k, v in copy["allocator"].items() if k != "encoder_path"} == {
        k: v for k, v in config["allocator"].items() if k != "encoder_path"
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paper_config_builds_the_trainer_with_the_papers_values(name, tmp_path, fixtures_dir):
    family, base_pixels = CONFIGS[name]
    trainer = build_trainer(offline_copy(name, tmp_path, fixtures_dir))

    # Loop (paper App. Training Configuration): one epoch of ~93.4K samples at batch 128, M = 16, N = 1.
    train = trainer.config
    assert (train.steps, train.batch_size, train.num_allocations, train.rollouts_per_allocation) == (730, 128, 16, 1)
    assert (train.lr, train.backbone_lr, train.weight_decay, train.grad_clip) == (2e-5, 1e-6, 0.01, 1.0)
    assert train.ppo_epochs == 1 and train.train_backbone is False
    # The optimiser the trainer built: AdamW over the Allocator's trainable weights at those settings.
    assert isinstance(trainer.optimizer.optimizer, torch.optim.AdamW)
    (group,) = trainer.optimizer.param_groups
    assert (group["lr"], group["weight_decay"]) == (2e-5, 0.01)
    assert group["params"] and all(p.requires_grad for p in group["params"])

    # Allocator (paper Sec. 3.2, App. Complexity Analysis): SmolVLM encoders, D = 1,024, L = 4, Beta head.
    allocator = trainer.allocator
    cfg = allocator.config
    assert (cfg.encoder, cfg.encoder_path) == ("smolvlm", str(fixtures_dir / "smolvlm"))
    assert allocator.encoders.name == "smolvlm"
    assert (cfg.width, cfg.num_layers, cfg.num_heads, cfg.policy) == (1024, 4, 16, "beta")
    assert len(allocator.layers) == 4
    assert (cfg.s_min, cfg.s_max) == (0.2, 1.8)

    # CAPO: the authors' code values (= CAPOConfig's defaults), the asymmetric PPO clip 0.2 / 0.28.
    capo = trainer.capo
    assert (capo.clip_low, capo.clip_high, capo.advantage) == (0.2, 0.28, "capo")
    assert capo == CAPOConfig()

    # Rollouts: T = 128 frames, scales in [0.2, 1.8], an 8,192-token video budget at scale 1.
    engine = trainer.engine
    assert type(engine.adapter).__name__ == {"qwen25vl": "Qwen25VLAdapter", "qwen3vl": "Qwen3VLAdapter"}[family]
    assert engine.max_num_frames == 128
    assert (engine.budget.s_min, engine.budget.s_max) == (0.2, 1.8)
    assert (engine.budget.min_tokens_per_pair, engine.budget.max_tokens_per_pair) == (4, 768)
    assert engine.planner.max_pixels == base_pixels
    assert engine.retention is None and engine.check_format is True and engine.max_new_tokens == 4096
    for source in ((720, 1280), (1080, 1920), (480, 640), (1280, 720)):
        tokens = engine.planner.vanilla_tokens(128, engine.planner.base_hw(source))
        assert 0.85 * 8192 < tokens <= 8192, (source, tokens)
    # What the checkpoint's budget.json records, so evaluation plans as training did.
    budget = engine.budget_settings()
    assert (budget["max_num_frames"], budget["max_pixels"], budget["s_min"], budget["s_max"]) == (
        128,
        base_pixels,
        0.2,
        1.8,
    )


def test_steps_override_keeps_the_rest(tmp_path, fixtures_dir):
    # `resadapt-eval train --steps 500` (the authors' script's total_training_steps) changes the steps only.
    trainer = build_trainer(offline_copy("paper_qwen25vl_7b.yaml", tmp_path, fixtures_dir), steps=500)
    assert trainer.config.steps == 500
    assert (trainer.config.batch_size, trainer.config.num_allocations, trainer.config.lr) == (128, 16, 2e-5)


# --- model cards ----------------------------------------------------------------------------

CARDS = {
    "paper-qwen25vl-7b.yaml": ("qwen25vl", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL-7B"),
    "paper-qwen3vl-8b.yaml": ("qwen3vl", "Qwen/Qwen3-VL-8B-Instruct", "Qwen3-VL-8B"),
}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_paper_cards_load_with_the_authors_budget_rule(name, tmp_path):
    card = load_card(REPO / "model_cards" / name)
    backbone, pretrained, paper_backbone = CARDS[name]
    assert (card.backbone, card.pretrained, card.paper_backbone) == (backbone, pretrained, paper_backbone)
    assert card.name == name.removesuffix(".yaml")
    assert card.frames == [32, 128]  # the paper's two temporal horizons (Tables 1-2)
    assert card.model_args["budget_rule"] == "authors_code"
    assert (card.model_args["s_min"], card.model_args["s_max"]) == (0.2, 1.8)
    assert card.model_args["max_pixels"] == 768 * 28 * 28
    assert card.gen_kwargs == {"max_new_tokens": 256}
    assert card.allocator is None  # no trained Allocator is published

    # The model class accepts every model_arg; the rule sets the authors' bounds (a 28 px base grid,
    # 4..768 tokens per pair) that the card does not spell out.
    from resadapt_eval.runspec import config_from_model_args

    args = {k: v for k, v in card.model_args.items() if k not in ("device", "dtype", "attn_implementation")}
    budget = config_from_model_args(method="fixed_scale", retention=0.25, **args).budget
    assert (budget.budget_rule, budget.base_grid_px) == ("authors_code", 28)
    assert (budget.min_tokens_per_pair, budget.max_tokens_per_pair) == (4, 768)
    # With an Allocator trained by configs/paper_*.yaml (its budget.json: the 8,192-token training base),
    # the card still evaluates at its own base size and frame count.
    from resadapt_eval.allocator import Allocator, AllocatorConfig

    checkpoint = tmp_path / "allocator"
    Allocator(AllocatorConfig(encoder="tiny", width=32, num_heads=4, num_layers=2)).save_pretrained(checkpoint)
    trained = dict(max_pixels=100352, max_num_frames=128, s_min=0.2, s_max=1.8, min_tokens_per_pair=4)
    (checkpoint / "budget.json").write_text(json.dumps(trained))
    config = config_from_model_args(
        method="resadapt", allocator=str(checkpoint), retention=0.25, max_num_frames=32, **args
    )
    assert (config.max_pixels, config.max_num_frames) == (768 * 28 * 28, 32)


@pytest.mark.parametrize("name, machines, processes", [("one_node_8_gpus", 1, 8), ("four_nodes_32_gpus", 4, 32)])
def test_the_accelerate_configs_load_and_split_the_papers_batch_evenly(name, machines, processes):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    config = ClusterConfig.from_yaml_file(str(REPO / "configs" / "accelerate" / f"{name}.yaml"))
    assert (config.num_machines, config.num_processes, config.distributed_type) == (
        machines,
        processes,
        DistributedType.MULTI_GPU,
    )
    for paper in CONFIGS:
        batch = yaml.safe_load((REPO / "configs" / paper).read_text())["train"]["batch_size"]
        assert batch % config.num_processes == 0
