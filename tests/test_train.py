"""The CAPO trainer: the reward-design ablation in simulation, and real training on the tiny backbone."""

import os

import pytest

from resadapt_eval.train.simulation import run_ablation, summarize


@pytest.mark.slow  # the paper's reward-design ablation in simulation (docs/results.md), a minute on one core
def test_simulated_ablation_reproduces_the_papers_findings():
    table = summarize(run_ablation(steps=300, seed=0), last=100)
    direct, accuracy_only, capo, capo_sim = (table[k] for k in ("direct cost", "accuracy only", "CAPO", "CAPO + L_sim"))
    # (i) a direct cost penalty collapses toward s_min = 0.2, and accuracy with it
    assert direct["mean_scale"] < 0.35 and direct["accuracy"] < 0.2
    # (ii) accuracy only saturates toward s_max = 1.8
    assert accuracy_only["mean_scale"] > 1.45
    # (iii) CAPO settles in between, with accuracy close to accuracy-only
    assert direct["mean_scale"] + 0.5 < capo["mean_scale"] < accuracy_only["mean_scale"] - 0.15
    assert capo["accuracy"] >= accuracy_only["accuracy"] - 0.05
    assert capo["reward"] >= accuracy_only["reward"] - 0.03
    # (iv) L_sim raises within-video scale diversity over CAPO without it
    assert capo_sim["scale_std"] > capo["scale_std"] + 0.2
    assert capo_sim["accuracy"] >= accuracy_only["accuracy"] - 0.05


import json  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402

from resadapt_eval.allocator import Allocator  # noqa: E402

from .helpers import run_lmms_eval, sidecar_records, tiny_train_config, train_cli  # noqa: E402


def test_train_cli_checkpoints_resumes_and_the_checkpoint_runs_in_lmms_eval(fixtures_dir, tmp_path):
    config = tiny_train_config(tmp_path, fixtures_dir)
    proc = train_cli("--config", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-000003" / "allocator"
    assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert 0.2 <= m["mean_scale"] <= 1.8 and m["achieved_retention"] > 0 and 0 <= m["accuracy"] <= 1
        assert {"reward", "scale_std", "gini", "loss_policy", "loss_sim", "loss_con"} <= set(m)

    # Without --resume an existing run is not overwritten.
    again = train_cli("--config", str(config))
    assert again.returncode != 0 and "already holds checkpoints" in again.stderr

    resumed = train_cli("--config", str(config), "--resume", "--steps", "4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    state = torch.load(run / "checkpoints" / "step-000004" / "trainer.pt", weights_only=False)
    assert state["step"] == 4
    # The step-4 weights moved on from step 3 (training continued from the checkpoint).
    w3 = Allocator.from_pretrained(ckpt).trainable_state_dict()
    w4 = Allocator.from_pretrained(run / "checkpoints" / "step-000004" / "allocator").trainable_state_dict()
    assert any(not torch.equal(w3[k], w4[k]) for k in w3)

    out = tmp_path / "eval"
    model_args = dict(
        pretrained=fixtures_dir / "qwen25vl",
        method="resadapt",
        allocator=ckpt,
        retention=0.25,
        max_num_frames=8,
        device="cpu",
    )
    proc = run_lmms_eval("resadapt_qwen25vl", model_args, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sidecar_records(out)
    assert len(records) == 8 and all(r["error"] is None and r["achieved_retention"] <= 0.25 for r in records)


def test_joint_backbone_update_changes_the_backbone(fixtures_dir, tmp_path):
    config = tiny_train_config(tmp_path, fixtures_dir, steps=1, train_backbone=True, backbone_lr=1e-3)
    proc = train_cli("--config", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "run" / "checkpoints" / "step-000001"
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "loss_backbone" in metrics
    from safetensors.torch import load_file

    before = load_file(str(fixtures_dir / "qwen25vl" / "model.safetensors"))
    after = load_file(str(folder / "backbone" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)


def test_gini_by_hand():
    from resadapt_eval.train.trainer import gini

    assert gini([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert gini([0.0, 0.0, 0.0, 4.0]) == pytest.approx(24 / 32)  # sum |xi - xj| = 24; 2 n^2 mean = 32


def test_training_data_formats_and_errors(tmp_path):
    import pandas as pd

    from resadapt_eval.train.data import load_samples

    rows = [
        dict(video="clips/a.mp4", question="Q?", answer="B", task_type="multiple_choice"),
        dict(video="/abs/b.mp4", question="When?", answer="", task_type="temporal_grounding", segments=[[1.0, 2.5]]),
    ]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = load_samples(jsonl)
    assert samples[0].video == str(tmp_path / "clips" / "a.mp4") and samples[0].segments == []
    assert samples[1].video == "/abs/b.mp4" and samples[1].segments == [(1.0, 2.5)]
    parquet = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(parquet)
    assert [s.answer for s in load_samples(parquet)] == ["B", ""]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(dict(video="a.mp4", question="Q", answer="A")) + "\n")
    with pytest.raises(ValueError, match=f"{bad}: missing columns \\['task_type'\\]"):
        load_samples(bad)
    bad.write_text(json.dumps(dict(video="a.mp4", question="Q", answer="A", task_type="poetry")) + "\n")
    with pytest.raises(ValueError, match="row 0: task_type 'poetry'"):
        load_samples(bad)
    with pytest.raises(FileNotFoundError, match="training data not found"):
        load_samples(tmp_path / "nope.jsonl")


def two_sample_config(tmp_path, fixtures_dir, name, cache):
    """The tiny config on the first two smoke clips (each drawn three times in 3 steps of 2), with
    `cache` as its cache section."""
    source = fixtures_dir / "smoke_videoqa" / "train.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines()[:2]]
    for row in rows:
        row["video"] = str((source.parent / row["video"]).resolve())
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = yaml.safe_load(tiny_train_config(tmp_path, fixtures_dir).read_text())
    config.update(output_dir=str(tmp_path / name), data=str(data), cache=cache)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_caches_change_nothing_but_the_time_and_every_step_is_clocked(fixtures_dir, tmp_path, one_thread):
    from resadapt_eval.train.config import build_trainer

    runs = {}
    for name, mb in (("cached", 64), ("uncached", 0)):
        cache = dict(frames_mb=mb, pairs_mb=mb, features_mb=mb)
        trainer = build_trainer(two_sample_config(tmp_path, fixtures_dir, name, cache))
        runs[name] = (trainer.train(progress=False), trainer)
    (cached, with_caches), (uncached, without) = runs["cached"], runs["uncached"]
    a = with_caches.allocator.trainable_state_dict()
    b = without.allocator.trainable_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(cached) == len(uncached) == 3
    for row_cached, row_uncached in zip(cached, uncached):
        costs = ("seconds", "cache")
        assert {k: v for k, v in row_cached.items() if k not in costs} == {
            k: v for k, v in row_uncached.items() if k not in costs
        }
    # 6 draws of 2 videos: 2 misses then hits; without a cache every draw misses.
    counts, nothing = cached[-1]["cache"], uncached[-1]["cache"]
    assert {k: v for k, v in counts.items() if not k.startswith("pairs")} == dict(
        features_hits=4, features_misses=2, frames_hits=4, frames_misses=2
    )
    assert {k: v for k, v in nothing.items() if not k.startswith("pairs")} == dict(
        features_hits=0, features_misses=6, frames_hits=0, frames_misses=6
    )
    # 6 draws x 4 allocations x 4 pairs = 96 resized pairs, many at a size asked for before
    assert counts["pairs_hits"] + counts["pairs_misses"] == nothing["pairs_misses"] == 96
    assert nothing["pairs_hits"] == 0 and counts["pairs_hits"] > 0
    for row in cached + uncached:
        seconds = row["seconds"]
        assert set(seconds) == {"decode", "features", "allocation", "rollout_build", "rollout_generate", "rewards"} | {
            "update",
            "step",
        }
        assert seconds["rollout_generate"] > 0 and seconds["update"] > 0
        assert sum(v for k, v in seconds.items() if k != "step") <= seconds["step"]
        assert row["rollouts"] == 2 * 4  # batch 2 x M 4 x N 1
        assert 0 < row["response_tokens"] <= row["rollouts"] * 4  # max_new_tokens 4
    # the metrics file carries the same rows
    written = [json.loads(line) for line in (tmp_path / "cached" / "metrics.jsonl").read_text().splitlines()]
    assert [r["cache"] for r in written] == [r["cache"] for r in cached]


@pytest.mark.parametrize(
    "rollout, train, message",
    [
        (dict(engine="vllm"), dict(train_backbone=True), "rollout.engine vllm keeps the backbone frozen"),
        (dict(engine="sglang"), {}, r"rollout.engine must be one of \('hf', 'vllm'\), got 'sglang'"),
        (dict(vllm=dict(gpu_memory_utilization=0.5)), {}, "rollout.vllm sets the vLLM engine, but rollout.engine"),
        (dict(engine="vllm", vllm=dict(gpu_memory=0.5)), {}, r"unknown keys \['gpu_memory'\] in `rollout.vllm`"),
    ],
)
def test_engine_settings_that_cannot_work_stop_before_anything_loads(fixtures_dir, tmp_path, rollout, train, message):
    from resadapt_eval.train.config import build_trainer

    config = yaml.safe_load(tiny_train_config(tmp_path, fixtures_dir).read_text())
    config["rollout"].update(rollout)
    config["train"].update(train)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=message):
        build_trainer(path)


def test_tensor_parallel_engines_under_several_processes_are_refused():
    from resadapt_eval.train.vllm_rollouts import pin_engine_gpu

    with pytest.raises(ValueError, match="tensor_parallel_size 2 with 4 processes"):
        with pin_engine_gpu("cuda:0", num_processes=4, tensor_parallel_size=2):
            pass


def test_the_engine_gpu_is_visible_only_while_the_engine_starts(monkeypatch):
    """Each process's engine is spawned seeing only its Allocator's GPU (by UUID); afterwards this
    process's CUDA_VISIBLE_DEVICES is what it was (here: unset, then a launcher's value)."""
    import types

    import torch

    from resadapt_eval.train.vllm_rollouts import pin_engine_gpu

    uuids = {0: "aaaa-0", 1: "bbbb-1"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid=uuids[d.index]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pin_engine_gpu("cuda:1", num_processes=2, tensor_parallel_size=1):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb-1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match="engine failed"):
        with pin_engine_gpu("cuda:0", num_processes=2, tensor_parallel_size=1):
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa-0"
            raise RuntimeError("engine failed")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    with pin_engine_gpu("cuda:0", num_processes=1, tensor_parallel_size=1):  # one process: nothing changes
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
