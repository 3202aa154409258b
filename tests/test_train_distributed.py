"""`resadapt-eval train` under `accelerate launch` with 2 CPU processes (gloo; accelerate's own
ACCELERATE_USE_CPU switch): the same checkpoints and metrics as one process with the same global
batch, a resumed 2-process run equal to an uninterrupted one, and the Allocator checkpoint's
budget.json."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from .helpers import REPO, free_port

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
LAUNCH += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
STEPS = 3


def config_file(tmp_path, fixtures_dir, name: str, **train_overrides):
    """configs/train_tiny.yaml with a global batch of 4 prompts (2 per process), and R drawn per
    prompt from [0.3, 0.6] (the engine's own seeded draw, besides the allocations and answers)."""
    config = yaml.safe_load((REPO / "configs" / "train_tiny.yaml").read_text())
    config["output_dir"] = str(tmp_path / name)
    config["data"] = str(fixtures_dir / "smoke_videoqa" / "train.jsonl")
    config["backbone"]["pretrained"] = str(fixtures_dir / "qwen25vl")
    config["rollout"].update(retention=[0.3, 0.6], pair_reduction="max", min_pixels=3136)
    config["train"].update({"steps": STEPS, "batch_size": 4, **train_overrides})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config, *args, processes: int = 1):
    command = [*LAUNCH, "--main_process_port", str(free_port()), "-m"] if processes == 2 else [sys.executable, "-m"]
    proc = subprocess.run(
        [*command, "resadapt_eval.cli", "train", "--config", str(config), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, ACCELERATE_USE_CPU="true") if processes == 2 else None,
    )
    return proc


def weights(run, step):
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "allocator" / "model.safetensors"))


def max_abs_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


RUN_COSTS = ("seconds", "cache")  # wall clocks and cache counts: measured, not reproduced


def metrics(run):
    """The metrics rows without their measured costs (`seconds`, `cache`), checked present."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(set(RUN_COSTS) <= set(row) for row in rows)
    return [{k: v for k, v in row.items() if k not in RUN_COSTS} for row in rows]


def test_two_processes_train_the_same_allocator_as_one_and_resume(fixtures_dir, tmp_path):
    """Every prompt's randomness is seeded by (seed, step, index in the global batch), not by the
    process, so both runs sample the same allocations, R and answers; the metrics are gathered
    from both processes and reduced in global-batch order. The weights are not bitwise
    equal: one process differentiates the mean loss over 4 prompts, two processes each the mean
    over 2 and DDP averages the two gradients (and each process runs torch with 1 thread instead
    of 2), which rounds differently at float32 precision. Measured: max |difference| 3.1e-8 after
    3 AdamW steps (lr 2e-5, the weights move by about 2e-5 a step), metrics within 4e-9; asserted
    below 1e-6. (With the seeds taken per process instead, as index // 2, the weights differed by
    1.2e-4 and the sampled mean scale by 0.03.)"""
    one = train(config_file(tmp_path, fixtures_dir, "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = train(config_file(tmp_path, fixtures_dir, "two"), processes=2)
    assert two.returncode == 0, two.stderr[-3000:]
    # process 0 alone reports and writes metrics
    assert two.stdout.count("checkpoint: ") == 1

    run_one, run_two = tmp_path / "one", tmp_path / "two"
    trained = [max_abs_difference(weights(run_one, s), weights(run_one, s - 1)) for s in (2, 3)]
    assert min(trained) > 1e-6  # the weights move by far more than the tolerance
    for step in range(1, STEPS + 1):
        assert max_abs_difference(weights(run_one, step), weights(run_two, step)) < 1e-6
    m_one, m_two = metrics(run_one), metrics(run_two)
    assert [m["step"] for m in m_two] == [1, 2, 3]
    assert [m.keys() for m in m_two] == [m.keys() for m in m_one]
    for a, b in zip(m_one, m_two):
        assert b == {k: pytest.approx(v, rel=0, abs=1e-6) for k, v in a.items()}
    assert all(m["achieved_retention"] <= 0.6 for m in m_one)

    # Resume: stopped after step 2, continued to 3 on 2 processes -> the uninterrupted checkpoint.
    stopped = config_file(tmp_path, fixtures_dir, "resumed")
    first = train(stopped, "--steps", "2", processes=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (tmp_path / "resumed" / "checkpoints" / "step-000003").exists()
    second = train(stopped, "--resume", processes=2)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = tmp_path / "resumed"
    assert max_abs_difference(weights(resumed, 3), weights(run_two, 3)) == 0.0
    assert metrics(resumed) == m_two
    state = torch.load(resumed / "checkpoints" / "step-000003" / "trainer.pt", weights_only=False)
    reference = torch.load(run_two / "checkpoints" / "step-000003" / "trainer.pt", weights_only=False)
    assert state["step"] == 3
    for a, b in zip(state["optimizer"]["state"].values(), reference["optimizer"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))

    # The Allocator folder carries the budget it was trained under, keyed as model_args.
    budget = json.loads((run_two / "checkpoints" / "step-000003" / "allocator" / "budget.json").read_text())
    assert budget == dict(
        s_min=0.2,
        s_max=1.8,
        min_tokens_per_pair=1,
        max_tokens_per_pair=None,
        pair_reduction="max",
        max_num_frames=8,
        min_pixels=3136,
        max_pixels=None,
    )


def test_a_batch_that_does_not_split_evenly_is_refused(fixtures_dir, tmp_path):
    proc = train(config_file(tmp_path, fixtures_dir, "odd", batch_size=3), processes=2)
    assert proc.returncode != 0
    assert "train.batch_size 3 is not divisible by the 2 processes" in proc.stderr


def test_prompt_seeds_are_distinct_per_seed_step_and_index():
    from resadapt_eval.train.trainer import prompt_seed

    seeds = {prompt_seed(seed, step, i) for seed in range(2) for step in range(3) for i in range(4)}
    assert len(seeds) == 24
    assert prompt_seed(0, 1, 2) == prompt_seed(0, 1, 2)
