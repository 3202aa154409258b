"""The real `lmms-eval` CLI with our registered models on the offline smoke task."""

import json
import re
import subprocess
import sys

import pytest

from resadapt_eval.methods import AFTER_MERGER, INSIDE_LLM, INSIDE_TOWER, METHODS

# run_lmms_eval, lmms_eval_command and sidecar_records: tests/test_train.py and tests/test_vllm.py still
# import them from here
from .helpers import (
    REPO,
    check_kept,
    early_prune_layers,
    free_port,
    lmms_eval_command,
    results_json,
    run_lmms_eval,
    run_manifest,
    sidecar_records,
    smoke_task,
)
from .helpers import SMOKE_TASK as TASK


def test_models_are_registered_through_the_entry_point():
    from lmms_eval.models import get_model

    from resadapt_eval.lmms.models import ResAdaptQwen3VL, ResAdaptQwen25VL

    assert get_model("resadapt_qwen25vl") is ResAdaptQwen25VL
    assert get_model("resadapt_qwen3vl") is ResAdaptQwen3VL


@pytest.mark.parametrize("backbone", ["qwen25vl", "qwen3vl"])
def test_fixed_scale_run_exits_0_and_every_record_is_within_budget(fixtures_dir, tmp_path, backbone):
    model_args = dict(
        pretrained=fixtures_dir / backbone,
        method="fixed_scale",
        retention=0.25,
        max_num_frames=8,
        device="cpu",
        dtype="float32",
    )
    proc = run_lmms_eval(f"resadapt_{backbone}", model_args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    records = sidecar_records(tmp_path)
    dataset = (fixtures_dir / "smoke_videoqa" / "test.jsonl").read_text().splitlines()
    assert len(records) == len(dataset)
    for r in records:
        assert r["error"] is None
        assert r["task"] == TASK and r["method"] == "fixed_scale"
        assert 0.20 <= r["achieved_retention"] <= 0.25
        assert r["visual_tokens"] == sum(t * h * w for t, h, w in r["grids"])
        assert r["achieved_retention"] == pytest.approx(r["visual_tokens"] / r["reference_tokens"])
        assert len(r["scales"]) == r["num_frames"] == 8 and len(r["grids"]) == 4
        assert min(r["decode_s"], r["preprocess_s"], r["generate_s"]) > 0

    # Run totals reach lmms-eval's results JSON.
    results = results_json(tmp_path)
    throughput = results["throughput"]
    assert throughput["avg_resadapt_visual_tokens"] == sum(r["visual_tokens"] for r in records)
    assert throughput["avg_resadapt_mean_retention"] == pytest.approx(
        sum(r["achieved_retention"] for r in records) / len(records)
    )
    assert "videomme_perception_score,none" in results["results"][TASK]
    # Sidecar sits beside lmms-eval's own outputs.
    assert (
        sorted(tmp_path.rglob("*_results.json"))[0].parent
        == sorted(tmp_path.rglob("resadapt_samples_*.jsonl"))[0].parent
    )
    # The run manifest: resolved model_args, versions, git revision, outcome.
    manifest = run_manifest(tmp_path)
    assert manifest["model"] == f"ResAdapt{'Qwen25VL' if backbone == 'qwen25vl' else 'Qwen3VL'}"
    args = manifest["model_args"]
    assert (args["method"], args["retention"], args["max_num_frames"], args["dtype"]) == (
        "fixed_scale",
        0.25,
        8,
        "float32",
    )
    assert (args["s_min"], args["s_max"], args["pair_reduction"]) == (0.2, 1.8, "mean")
    assert manifest["versions"]["transformers"] and manifest["versions"]["lmms-eval"]
    assert manifest["git_revision"] is None or len(manifest["git_revision"].split("+")[0]) == 40
    assert (manifest["samples"], manifest["failed_samples"]) == (len(records), 0)
    assert manifest["visual_tokens"] == throughput["avg_resadapt_visual_tokens"]
    assert manifest["mean_retention"] == pytest.approx(throughput["avg_resadapt_mean_retention"])


@pytest.fixture
def one_video_missing(fixtures_dir, tmp_path):
    """(the missing video, an --include_path): the smoke task over the smoke rows, one row's video a
    path that does not exist (the shared fixtures stay as they are)."""
    rows = [json.loads(line) for line in (fixtures_dir / "smoke_videoqa" / "test.jsonl").read_text().splitlines()]
    missing = tmp_path / "videos" / "smoke_002.mp4"  # never written
    (row,) = [r for r in rows if r["videoID"] == "smoke_002"]
    row["video_path"] = str(missing)
    return missing, smoke_task(tmp_path / "task", rows)


def test_a_missing_video_is_recorded_and_the_run_goes_on(fixtures_dir, tmp_path, one_video_missing):
    missing, include_path = one_video_missing
    model_args = dict(pretrained=fixtures_dir / "qwen25vl", method="vanilla", max_num_frames=8, device="cpu")
    out = tmp_path / "out"
    proc = run_lmms_eval("resadapt_qwen25vl", model_args, out, include_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sidecar_records(out)
    failed = [r for r in records if r["error"]]
    assert len(records) == 8 and len(failed) == 1
    assert str(missing) in failed[0]["error"]
    assert failed[0]["visual_tokens"] == 0 and failed[0]["achieved_retention"] is None
    assert all(r["achieved_retention"] == 1.0 for r in records if not r["error"])
    assert results_json(out)["throughput"]["avg_resadapt_failed_samples"] == 1
    manifest = run_manifest(out)
    assert (manifest["samples"], manifest["failed_samples"]) == (len(records), 1)
    assert manifest["first_errors"] == [dict(task=TASK, doc_id=failed[0]["doc_id"], error=failed[0]["error"])]


def test_a_run_where_every_sample_failed_reports_no_retention(fixtures_dir, tmp_path):
    """A target above every video's floor (one token per pair of the largest plan, 1/768) that no smoke
    video reaches (fixed_scale at s_min=0.2 keeps about 4% of a pair) fails every sample: the run says
    so, and claims no retention."""
    model_args = dict(
        pretrained=fixtures_dir / "qwen25vl", method="fixed_scale", retention=0.01, max_num_frames=8, device="cpu"
    )
    proc = run_lmms_eval("resadapt_qwen25vl", model_args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sidecar_records(tmp_path)
    assert records and all("retention 0.01 is below the reachable floor" in r["error"] for r in records)
    throughput = results_json(tmp_path)["throughput"]
    assert throughput["avg_resadapt_failed_samples"] == throughput["avg_resadapt_samples"] == len(records)
    assert "avg_resadapt_mean_retention" not in throughput and "avg_resadapt_pooled_retention" not in throughput
    manifest = run_manifest(tmp_path)
    assert manifest["failed_samples"] == len(records)
    assert manifest["mean_retention"] is None and manifest["pooled_retention"] is None


def test_strict_makes_a_missing_video_stop_the_run(fixtures_dir, tmp_path, one_video_missing):
    missing, include_path = one_video_missing
    model_args = dict(
        pretrained=fixtures_dir / "qwen25vl", method="vanilla", max_num_frames=8, device="cpu", strict="true"
    )
    out = tmp_path / "out"
    proc = run_lmms_eval("resadapt_qwen25vl", model_args, out, include_path)
    # lmms-eval's CLI prints the error and exits 0 (it re-raises only with --verbosity DEBUG),
    # but the evaluation stops: no results are written.
    assert f"VideoDecodeError: video not found: {missing}" in proc.stdout + proc.stderr
    assert not list(out.rglob("*_results.json"))
    assert [r["doc_id"] for r in sidecar_records(out)] == [0, 1]


def test_bad_model_args_give_clear_errors(fixtures_dir):
    from resadapt_eval.lmms.models import ResAdaptQwen25VL

    with pytest.raises(ValueError, match="unknown model_args.*retnetion"):
        ResAdaptQwen25VL(pretrained=str(fixtures_dir / "qwen25vl"), retnetion=0.25)
    with pytest.raises(ValueError, match="unknown method 'tome2'"):
        ResAdaptQwen25VL(pretrained=str(fixtures_dir / "qwen25vl"), method="tome2")


# Qwen3-VL's is slow: the class's path is the same; both backbones run the Allocator in process (test_real_videos)
@pytest.mark.parametrize("backbone", ["qwen25vl", pytest.param("qwen3vl", marks=pytest.mark.slow)])
def test_resadapt_with_the_untrained_allocator_runs_within_budget(fixtures_dir, tmp_path, backbone):
    model_args = dict(
        pretrained=fixtures_dir / backbone,
        method="resadapt",
        allocator="untrained",
        retention=0.25,
        max_num_frames=8,
        device="cpu",
    )
    proc = run_lmms_eval(f"resadapt_{backbone}", model_args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sidecar_records(tmp_path)
    assert len(records) == 8
    for r in records:
        assert r["error"] is None and r["method"] == "resadapt" and r["allocator"] == "untrained"
        assert len(r["scales"]) == 8 and len(set(r["scales"])) > 1
        assert len(r["raw_scales"]) == 8
        assert 0.20 <= r["achieved_retention"] <= 0.25
        assert min(r["allocator_text_s"], r["allocator_visual_s"], r["allocator_predict_s"], r["scale_apply_s"]) > 0


REDUCERS = [  # on the HF classes (vLLM's own VidCom2 runs on the vLLM classes: tests/test_vllm_compression.py)
    name for name, method in METHODS.items() if method.hf and method.stage in (INSIDE_TOWER, AFTER_MERGER, INSIDE_LLM)
]
TURNS = (("qwen25vl", 0.25), ("qwen3vl", 0.1))


def reducer_runs():
    """Every token-reducing method on both backbones at R=0.25 and 0.1. `make test` runs the first
    method of each kind once, those methods taking turns at (qwen25vl, 0.25) and (qwen3vl, 0.1): a
    kind's methods share its path through the lmms-eval class, and every method runs on both
    backbones at both R in process through the same code (test_baselines.py, test_inside_llm.py,
    test_two_stage.py, test_dtype_attention.py, test_real_videos.py); the other runs are marked slow
    (`make test-cli-matrix`)."""
    kinds = []
    for method in REDUCERS:
        kind = METHODS[method].kind
        first = kind not in kinds
        kinds += [kind] if first else []
        turn = TURNS[(len(kinds) - 1) % 2]
        if turn[0] not in kind.families:  # a kind that stops at start on that backbone runs on its own
            turn = next(t for t in TURNS if t[0] in kind.families)
        for backbone, retention in (("qwen25vl", 0.25), ("qwen25vl", 0.1), ("qwen3vl", 0.25), ("qwen3vl", 0.1)):
            slow = not first or (backbone, retention) != turn
            yield pytest.param(method, backbone, retention, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("method,backbone,retention", list(reducer_runs()))
def test_token_reducers_run_through_the_cli_at_exact_budgets(fixtures_dir, tmp_path, method, backbone, retention):
    # The fixed-method names (e.g. tome_qwen3vl) share the default prompt with every other method.
    spec = METHODS[method]
    # FrameFusion keeps a frame pair's tokens in its first merging layer: after the tiny Qwen3-VL's
    # first layer (its deepstack layer) 8 frames cannot reach R=0.1 (floor 0.1045), 16 can
    frames = 16 if spec.adaptive_prune is not None else 8
    model_args = dict(pretrained=fixtures_dir / backbone, retention=retention, max_num_frames=frames, device="cpu")
    if spec.stage == INSIDE_LLM and spec.prune is not None:  # stages early enough for R=0.1 on 12 layers
        model_args["prune_layers"] = early_prune_layers(spec, ";")
    proc = run_lmms_eval(f"{method}_{backbone}", model_args, tmp_path)
    if backbone not in spec.kind.families:  # stops at start, naming why, before any sample
        assert re.search(rf"ValueError: method={method} \w+ inside the vision tower on Qwen3-VL only", proc.stderr)
        assert not list(tmp_path.rglob("*.jsonl"))
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sidecar_records(tmp_path)
    assert len(records) == 8
    for r in records:
        assert r["error"] is None and r["method"] == method
        assert retention - 0.01 <= r["achieved_retention"] <= retention
        check_kept(r)  # the kept mask decodes to exactly visual_tokens
        if spec.stage == INSIDE_LLM:  # every visual token enters the LLM; R is their layer average
            assert r["visual_tokens"] == r["reference_tokens"] >= r["layer_visual_tokens"][0]
            assert r["achieved_retention"] == sum(r["layer_visual_tokens"]) / 12 / r["reference_tokens"]
        elif spec.prune is not None:  # the compressor's tokens enter, then the method's own stage inside
            assert r["visual_tokens"] == len(r["merged_sizes"]) == r["layer_visual_tokens"][0]
            assert min(r["layer_visual_tokens"]) < r["visual_tokens"] < r["reference_tokens"]
        else:  # the most tokens within R
            assert r["visual_tokens"] == len(r["merged_sizes"]) == int(r["reference_tokens"] * retention + 1e-9)
        if spec.stage == INSIDE_TOWER:  # fewer patches enter the blocks after the first merge, then the merger
            assert r["tower_tokens"][0] == 4 * r["reference_tokens"] > r["tower_tokens"][-2]
            assert r["tower_tokens"][-1] == 4 * r["visual_tokens"]
        if spec.tower_prune is not None:  # pruned between the tower's blocks, every patch restored for the merger
            assert r["tower_tokens"][0] == r["tower_tokens"][-1] == 4 * r["reference_tokens"] > min(r["tower_tokens"])
        if spec.prune is not None:
            assert r["achieved_retention"] == sum(r["layer_visual_tokens"]) / 12 / r["reference_tokens"]


def test_frame_selection_runs_through_the_cli_with_the_frame_budget(fixtures_dir, tmp_path):
    model_args = dict(
        pretrained=fixtures_dir / "qwen25vl",
        method="resadapt",
        allocator="untrained",
        operator="select_resize",
        candidates=32,
        top_k=8,
        device="cpu",
    )
    proc = run_lmms_eval("resadapt_qwen25vl", model_args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sidecar_records(tmp_path)
    assert len(records) == 8
    for r in records:
        assert r["error"] is None and r["candidates"] == 32 and len(r["frame_indices"]) == 8
        assert r["frame_indices"] == sorted(r["frame_indices"]) and len(r["raw_scales"]) == 32
        # R is against vanilla at the candidate count; the frame budget is in full-frame equivalents
        # the candidates' vanilla plan: 16 pairs at the base size
        h, w = r["base_size"]
        assert r["reference_tokens"] == 16 * (h // 28) * (w // 28)
        tokens_per_frame = r["reference_tokens"] / 32
        assert r["frame_budget"] == pytest.approx(r["visual_tokens"] / tokens_per_frame)
        assert r["achieved_retention"] == pytest.approx(r["visual_tokens"] / r["reference_tokens"])


def test_vllm_models_are_registered_and_say_what_they_need(fixtures_dir):
    from importlib.util import find_spec

    from lmms_eval.models import get_model

    from resadapt_eval.lmms.vllm_models import ResAdaptQwen3VLVLLM, ResAdaptQwen25VLVLLM

    assert get_model("resadapt_qwen25vl_vllm") is ResAdaptQwen25VLVLLM
    assert get_model("resadapt_qwen3vl_vllm") is ResAdaptQwen3VLVLLM
    with pytest.raises(ValueError, match="HF path"):
        ResAdaptQwen25VLVLLM(pretrained=str(fixtures_dir / "qwen25vl"), method="fastv", retention=0.25)
    # vLLM's own pruning: its model names are vLLM classes, and the HF classes refuse it before loading
    from resadapt_eval.lmms.models import ResAdaptQwen25VL
    from resadapt_eval.lmms.vllm_models import EVSQwen3VL

    assert get_model("evs_qwen3vl") is EVSQwen3VL and issubclass(EVSQwen3VL, ResAdaptQwen3VLVLLM)
    with pytest.raises(ValueError, match="runs on the vLLM classes"):
        ResAdaptQwen25VL(pretrained="no-such-checkpoint", method="evs", retention=0.25)
    if find_spec("vllm") is None:  # this environment: the error names the environment to build
        with pytest.raises(ImportError, match="make test-vllm"):
            ResAdaptQwen3VLVLLM(pretrained=str(fixtures_dir / "qwen3vl"), method="vanilla")


def test_data_parallel_on_two_cpu_processes_equals_one_process(fixtures_dir, tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo; accelerate's ACCELERATE_USE_CPU switch):
    the same sidecar records and answers as one process, and run totals summed over both ranks."""
    import os

    model_args = dict(
        pretrained=fixtures_dir / "qwen25vl", method="fixed_scale", retention=0.25, max_num_frames=8, dtype="float32"
    )
    one = run_lmms_eval("resadapt_qwen25vl", model_args, tmp_path / "one")
    assert one.returncode == 0, one.stderr[-3000:]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launcher += ["--main_process_port", str(free_port())]
    cmd = launcher + lmms_eval_command("resadapt_qwen25vl", model_args, TASK, str(REPO / "tasks"), tmp_path / "two")[1:]
    env = dict(os.environ, ACCELERATE_USE_CPU="true")
    two = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert two.returncode == 0, two.stderr[-3000:]

    sidecars = sorted((tmp_path / "two").rglob("resadapt_samples_*.jsonl"))
    assert [p.name.rsplit("_", 1)[1] for p in sidecars] == ["rank0.jsonl", "rank1.jsonl"]
    assert len({p.name.rsplit("_", 1)[0] for p in sidecars}) == 1  # one run stamp on every rank
    untimed = lambda r: {k: v for k, v in r.items() if not k.endswith("_s") and k != "peak_memory_mb"}  # noqa: E731
    by_doc = {r["doc_id"]: untimed(r) for p in sidecars for r in map(json.loads, p.read_text().splitlines())}
    assert by_doc == {r["doc_id"]: untimed(r) for r in sidecar_records(tmp_path / "one")}

    def answers(out):
        (path,) = [p for p in out.rglob("*_samples_*.jsonl") if not p.name.startswith("resadapt_samples_")]
        return {s["doc_id"]: s["filtered_resps"] for s in map(json.loads, path.read_text().splitlines())}

    assert answers(tmp_path / "two") == answers(tmp_path / "one")
    totals = [
        {k: v for k, v in results_json(out)["throughput"].items() if k.startswith("avg_resadapt_")}
        for out in (tmp_path / "one", tmp_path / "two")
    ]
    assert totals[0] == totals[1] and totals[0]["avg_resadapt_samples"] == len(by_doc)
    manifest = run_manifest(tmp_path / "two")  # one, written by rank 0, counting both ranks
    assert (manifest["world_size"], manifest["samples"], manifest["failed_samples"]) == (2, len(by_doc), 0)
