"""What a careful user hits first (issue 31, item 6): each case stops at start naming the
argument or file, or fails one sample with its reason while the run goes on; in-process, through
the lmms-eval model classes and the CLI's functions."""

import json
import re
from pathlib import Path

import pytest
import torch

from resadapt_eval.allocator import Allocator, AllocatorConfig, CheckpointError

from .helpers import REPO

VIDEOS = ("smoke_000.mp4", "smoke_001.mp4")


def tiny_allocator(directory, **overrides):
    config = AllocatorConfig(**{**dict(encoder="tiny", width=32, num_heads=4, num_layers=2), **overrides})
    return Allocator(config).save_pretrained(directory)


def lmms_model(fixtures_dir, tmp_path, backbone="qwen25vl", **model_args):
    from resadapt_eval.lmms import models

    cls = models.ResAdaptQwen25VL if backbone == "qwen25vl" else models.ResAdaptQwen3VL
    args = dict(pretrained=str(fixtures_dir / backbone), max_num_frames=8, device="cpu", dtype="float32")
    return cls(**{**args, "sidecar_dir": str(tmp_path / "sidecars"), **model_args})


def answer(model, fixtures_dir, videos=VIDEOS):
    """`generate_until` on one lmms-eval instance per smoke video, as lmms-eval calls it; the
    answers and the sidecar records."""
    from lmms_eval.api.instance import Instance

    folder = fixtures_dir / "smoke_videoqa" / "videos"
    model.task_dict = {"t": {"test": {i: dict(video=str(folder / v)) for i, v in enumerate(videos)}}}

    def messages(doc):
        return [{"role": "user", "content": [{"type": "video", "url": doc["video"]}, {"type": "text", "text": "Q?"}]}]

    instances = [
        Instance(
            "generate_until",
            ("", messages, dict(max_new_tokens=2), i, "t", "test"),
            i,
            dict(task="t", doc_id=i, repeats=1),
        )
        for i in range(len(videos))
    ]
    results = model.generate_until(instances)
    records = [json.loads(line) for line in model.sidecar_path.read_text().splitlines()]
    return [r.text for r in results], records


# ---------------------------------------------------------------- 1. non-finite Allocator weights and records


def test_an_allocator_checkpoint_with_nan_weights_is_refused_at_load_naming_file_and_tensor(tmp_path):
    folder = tiny_allocator(tmp_path / "nan")
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    state["head.weight"][0, 0] = float("nan")
    save_file(state, str(weights))
    with pytest.raises(CheckpointError, match=rf"{weights}: tensor head.weight holds 1 non-finite value"):
        Allocator.from_pretrained(folder)


def test_a_non_finite_value_fails_its_sample_and_the_run_goes_on(fixtures_dir, tmp_path):
    folder = tiny_allocator(tmp_path / "alloc")
    model = lmms_model(fixtures_dir, tmp_path, method="resadapt", allocator=str(folder), retention=0.25)
    with torch.no_grad():  # weights that turn NaN after loading (the checkpoint itself is refused)
        model.pipeline.allocator.allocator.head.weight.fill_(float("nan"))
    texts, records = answer(model, fixtures_dir)
    assert texts == ["", ""]
    assert len(records) == 2
    assert all("non-finite values (NaN or inf) in raw_scales" in r["error"] for r in records)
    assert all(r["raw_scales"] is None for r in records)
    manifest = json.loads(model.manifest_path.read_text())
    assert (manifest["samples"], manifest["failed_samples"]) == (2, 2)


def test_the_record_writer_turns_a_non_finite_number_into_a_failed_sample():
    from resadapt_eval.record import SampleRecord, sidecar_line

    record = SampleRecord(
        doc_id=3, task="t", method="vanilla", achieved_retention=float("inf"), scales=[1.0, float("nan")]
    )
    line = json.loads(sidecar_line(record))
    assert line["error"] == "ValueError: non-finite values (NaN or inf) in scales, achieved_retention"
    assert line["scales"] is None and line["achieved_retention"] is None and line["doc_id"] == 3


# ---------------------------------------------------------------- 2, 3. prune_layers and floors, at load


def lmms_args(text: str) -> dict:
    """model_args as lmms-eval hands them to the class (`-1` a float, `100` an int)."""
    from lmms_eval.utils import simple_parse_args_string

    return simple_parse_args_string(text)


@pytest.mark.parametrize(
    "method, prune_layers, message",
    [
        ("pyramiddrop", "100", r"model_args prune_layers \[100\] must lie in \[1, 11\] on this LLM of 12 layers"),
        ("fastv", "12", r"prune_layers \[12\] must lie in \[1, 11\]"),
        ("fastv", "0", r"prune_layers \[0\] must lie in \[1, 11\]"),
        ("fastv", "-1", r"prune_layers \[-1\] must lie in \[1, 11\]"),
        ("pyramiddrop", "-1;5", r"prune_layers \[-1, 5\] must lie in \[1, 11\]"),
        ("pyramiddrop", "9;6;3", r"prune_layers must be strictly increasing, got \[9, 6, 3\]"),
        ("pyramiddrop", "3;3;3", r"prune_layers must be strictly increasing, got \[3, 3, 3\]"),
        ("fastv", "2;4", "prune_layers='2;4' names 2 layers; method=fastv prunes at 1 layer"),
        ("pyramiddrop", "", "prune_layers is empty"),
        ("mustdrop", "2;2", r"model_args prune_layers must be strictly increasing, got \[2, 2\]"),
        ("sparsevlm", "3;6", r"model_args prune_layers \[3, 6\]: SparseVLM's reference schedules have 1 stage or 3"),
    ],
)
def test_prune_layers_the_llm_cannot_take_stop_at_load_naming_the_argument(
    fixtures_dir, tmp_path, method, prune_layers, message
):
    args = lmms_args(f"method={method},retention=0.5,prune_layers={prune_layers}")
    with pytest.raises(ValueError, match=message):
        lmms_model(fixtures_dir, tmp_path, **args)


@pytest.mark.parametrize(
    "method, tower_layers, message",
    [  # the tiny Qwen3-VL tower has 2 vision blocks
        ("illava", "1", r"model_args tower_layers \[1\] must lie in \[0, 0\] on this vision tower of 2 blocks"),
        ("illava", "-1", r"model_args tower_layers \[-1\] must lie in \[0, 0\]"),
        ("ipcv", "0", r"model_args tower_layers \[0\] must lie in \[1, 1\] on this vision tower of 2 blocks"),
        ("ipcv", "1;2", "tower_layers='1;2' names 2 blocks; method=ipcv acts at 1 block"),
        ("illava", "", "tower_layers is empty"),
        ("tome", "0", "tower_layers= is only used by methods that act inside the vision tower, not 'tome'"),
    ],
)
def test_tower_layers_the_tower_cannot_take_stop_at_load_naming_the_argument(
    fixtures_dir, tmp_path, method, tower_layers, message
):
    args = lmms_args(f"method={method},retention=0.5,tower_layers={tower_layers}")
    with pytest.raises(ValueError, match=message):
        lmms_model(fixtures_dir, tmp_path, "qwen3vl", **args)


@pytest.mark.parametrize(
    "method, retention, prune_layers, message",
    [
        (
            "pyramiddrop",
            0.25,
            None,
            r"retention=0.25 with the default prune_layers: PyramidDrop with stages at \[3, 6, 9\] keeps a "
            "layer-averaged retention above 0.2500",
        ),
        ("pyramiddrop", 0.1, None, r"retention=0.1 with the default prune_layers: .* above 0.2500"),
        ("pyramiddrop", 0.05, "1;4;8", r"retention=0.05 with prune_layers='1;4;8': .* above 0.0833"),
        (
            "fastv",
            0.01,
            None,
            r"retention=0.01 with the default prune_layers: FastV pruning after layer 2 keeps .* above 0.1667",
        ),
    ],
)
def test_a_retention_below_the_floor_of_every_video_stops_at_load(
    fixtures_dir, tmp_path, method, retention, prune_layers, message
):
    args = dict(method=method, retention=retention, **({"prune_layers": prune_layers} if prune_layers else {}))
    with pytest.raises(ValueError, match=message) as caught:
        lmms_model(fixtures_dir, tmp_path, **args)
    assert "on every video on this LLM of 12 layers" in str(caught.value)


def test_a_floor_that_depends_on_the_video_stays_per_sample(fixtures_dir, tmp_path):
    """Just above PyramidDrop's 0.25: reachable on a long enough video, so the run starts and a
    short one fails alone, naming its own floor."""
    model = lmms_model(fixtures_dir, tmp_path, method="pyramiddrop", retention=0.2501)
    texts, records = answer(model, fixtures_dir, videos=VIDEOS[:1])
    assert texts == [""] and "InfeasibleBudget: retention 0.2501 is below the reachable floor" in records[0]["error"]


# ---------------------------------------------------------------- 4. sweep --model-args, checked before any cell


@pytest.mark.parametrize(
    "model_args, message",
    [
        ("bogus_key=1", r"cell vanilla-f8 \(vanilla_qwen25vl\): unknown model_args bogus_key"),
        ("s_min=abc", r"cell vanilla-f8 \(vanilla_qwen25vl\): model_args s_min='abc': expected float"),
        ("prune_layers=2", "cell vanilla-f8 .*prune_layers= is only used by methods that prune inside the LLM"),
        ("batch_size=2", "model_args batch_size=2: resadapt models answer one request at a time"),
    ],
)
def test_sweep_model_args_that_would_stop_a_cell_stop_the_sweep_before_any_cell(
    fixtures_dir, tmp_path, capsys, model_args, message
):
    from resadapt_eval.cli import main

    from .helpers import REPO

    out = tmp_path / "sweep"
    argv = ["sweep", "--card", str(REPO / "model_cards" / "tiny-qwen25vl.yaml"), "--output", str(out)]
    status = main([*argv, "--methods", "vanilla,fixed_scale", "--retention", "0.25", "--model-args", model_args])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("sweep: cell ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not out.exists()  # no cell ran


def test_a_sweep_retention_that_is_not_a_number_stops_naming_the_option(fixtures_dir, tmp_path, capsys):
    from resadapt_eval.cli import main

    from .helpers import REPO

    argv = ["sweep", "--card", str(REPO / "model_cards" / "tiny-qwen25vl.yaml"), "--output", str(tmp_path / "s")]
    assert main([*argv, "--methods", "fixed_scale", "--retention", "0.25,abc"]) == 2
    assert "--retention numbers; got None, '0.25,abc'" in capsys.readouterr().err


def test_the_sweep_checks_each_cell_with_its_own_model_class(fixtures_dir):
    """A setting one method of the grid refuses stops the sweep at start, naming that cell."""
    from resadapt_eval.sweep import check_cells, load_card, plan_cells, with_model_args

    from .helpers import REPO

    card = with_model_args(load_card(REPO / "model_cards" / "tiny-qwen25vl.yaml"), "prune_layers=2;4")
    cells = plan_cells(["fastv"], [0.5], [8])
    with pytest.raises(ValueError, match="cell fastv-r0.5-f8 .*names 2 layers; method=fastv prunes at 1 layer"):
        check_cells(card, cells)
    check_cells(with_model_args(card, "prune_layers=1"), cells)  # a good one passes
    # a method of a kind that runs on Qwen3-VL only, on a Qwen2.5-VL card
    with pytest.raises(
        ValueError, match="cell illava-r0.25-f8: method=illava runs on qwen3vl only, not this card's qwen25vl"
    ):
        check_cells(card, plan_cells(["illava"], [0.25], [8]))


# ---------------------------------------------------------------- 9. pretrained and batch_size


def test_a_pretrained_folder_that_does_not_exist_is_named_as_such(fixtures_dir, tmp_path):
    missing = tmp_path / "nonexistent"
    with pytest.raises(
        ValueError, match=rf"pretrained='{missing}': no such folder, and the Hugging Face hub is offline"
    ):
        lmms_model(fixtures_dir, tmp_path, pretrained=str(missing))
    with pytest.raises(ValueError, match="no such folder, and the Hugging Face hub is offline .* no cached copy"):
        lmms_model(fixtures_dir, tmp_path, pretrained="nobody/no-such-model")
    with pytest.raises(ValueError, match="the folder has no config.json"):
        lmms_model(fixtures_dir, tmp_path, pretrained=str(tmp_path))


def lmms_model_at(fixtures_dir, tmp_path, **overrides):
    args = dict(max_num_frames=8, device="cpu", dtype="float32", sidecar_dir=str(tmp_path / "sidecars"))
    return dict(pretrained=str(fixtures_dir / "qwen25vl"), **{**args, **overrides})


def test_a_batch_size_other_than_1_says_why_from_model_args_or_the_command_line(fixtures_dir, tmp_path):
    from resadapt_eval.lmms.models import ResAdaptQwen25VL

    command_line = dict(batch_size=1, max_batch_size=None, device=None)  # what lmms-eval's CLI passes
    args = ",".join(f"{k}={v}" for k, v in lmms_model_at(fixtures_dir, tmp_path, batch_size=2).items())
    with pytest.raises(
        ValueError, match="model_args batch_size=2: resadapt models answer one request at a time per process"
    ):
        ResAdaptQwen25VL.create_from_arg_string(args, command_line)
    args = ",".join(f"{k}={v}" for k, v in lmms_model_at(fixtures_dir, tmp_path).items())
    with pytest.raises(ValueError, match="--batch_size 2: resadapt models answer one request at a time"):
        ResAdaptQwen25VL.create_from_arg_string(args, {**command_line, "batch_size": "2"})
    with pytest.raises(ValueError, match="model_args device='cpu' and the command line's --device 'meta' disagree"):
        ResAdaptQwen25VL.create_from_arg_string(args, {**command_line, "device": "meta"})
    model = ResAdaptQwen25VL.create_from_arg_string(args, {**command_line, "device": "cpu"})
    assert model.pipeline.backbone.device.type == "cpu"


# ---------------------------------------------------------------- 5. a truncated sidecar line


def fake_cell(run_dir, name="vanilla-f8", samples=3):
    """A finished cell as the sweep leaves it: cell.json, lmms-eval's results and a sidecar."""
    from resadapt_eval.record import SampleRecord, sidecar_line

    cell = run_dir / name
    (cell / "out").mkdir(parents=True)
    (cell / "out" / "x_results.json").write_text(
        json.dumps({"results": {"resadapt_smoke_videoqa": {"videomme_perception_score,none": 50.0}}})
    )
    meta = dict(card="tiny", backbone="qwen25vl", paper_backbone=None, method="vanilla", retention=None, frames=8)
    meta |= dict(status="done", results="out/x_results.json", samples=samples, failed_samples=0)
    (cell / "cell.json").write_text(json.dumps(meta))
    lines = [
        sidecar_line(
            SampleRecord(
                doc_id=i, task="resadapt_smoke_videoqa", method="vanilla", achieved_retention=1.0, total_flops=10**12
            )
        )
        for i in range(samples)
    ]
    sidecar = cell / "out" / "resadapt_samples_1_rank0.jsonl"
    sidecar.write_text("".join(lines))
    return sidecar


def test_a_truncated_sidecar_line_is_skipped_with_a_warning_and_counted_failed(tmp_path, capsys):
    from resadapt_eval.cli import main
    from resadapt_eval.report.collect import collect

    sidecar = fake_cell(tmp_path)
    lines = sidecar.read_text().splitlines(keepends=True)
    sidecar.write_text(lines[0] + lines[1][:60] + "\n" + lines[2])  # the second record cut short
    with pytest.warns(
        UserWarning,
        match=rf"{sidecar}, line 2: unreadable sidecar record; skipped, its sample counted as failed "
        r"\(Unterminated string",
    ):
        (run,) = collect(tmp_path, include_failed=True)
    assert [r["doc_id"] for r in run.records] == [0, 2]
    assert (run.samples, run.failed_samples) == (3, 1)
    with pytest.warns(UserWarning, match="line 2: unreadable sidecar record"):
        assert main(["tables", str(tmp_path), "--out", str(tmp_path / "tables")]) == 0
    assert "| tiny | 8 | Vanilla | 100.0% | 1 | 50.0 |" in capsys.readouterr().out  # R of the readable records
    with (tmp_path / "tables" / "video_qa.csv").open() as f:
        (row,) = list(__import__("csv").DictReader(f))
    assert (row["samples"], row["failed_samples"]) == ("3", "1")


# ---------------------------------------------------------------- 6. base_grid_px keeps the vanilla reference


def test_base_grid_px_takes_only_the_backbones_grid_or_the_authors_28(fixtures_dir, tmp_path):
    from resadapt_eval.lmms.models import ResAdaptQwen3VL, ResAdaptQwen25VL

    with pytest.raises(ValueError, match=r"base_grid_px=7: .* allowed: 28 \(or leave it out"):
        lmms_model(fixtures_dir, tmp_path, base_grid_px=7)
    with pytest.raises(ValueError, match=r"base_grid_px=32: .*this backbone's grid \(28 px\)"):
        ResAdaptQwen25VL.checked_config(base_grid_px=32)
    with pytest.raises(ValueError, match=r"base_grid_px=7: .* allowed: 28 or 32"):
        ResAdaptQwen3VL.checked_config(base_grid_px=7)
    for cls, grids in ((ResAdaptQwen25VL, (28,)), (ResAdaptQwen3VL, (28, 32))):
        for px in grids:
            assert cls.checked_config(base_grid_px=px).budget.base_grid_px == px
    assert ResAdaptQwen3VL.checked_config(budget_rule="authors_code").budget.base_grid_px == 28
    from resadapt_eval.lmms.vllm_models import ResAdaptQwen3VLVLLM

    with pytest.raises(ValueError, match="base_grid_px=7"):
        ResAdaptQwen3VLVLLM.checked_config(base_grid_px=7, chunk_size=4)
    with pytest.raises(ValueError, match="model_args kv_cache_memory_bytes='lots': expected int"):
        ResAdaptQwen3VLVLLM.checked_config(kv_cache_memory_bytes="lots")


def test_the_vllm_classes_hand_enforce_eager_to_vllm_and_name_a_bad_value():
    from resadapt_eval.lmms.vllm_models import ResAdaptQwen3VLVLLM, ResAdaptQwen25VLVLLM

    assert ResAdaptQwen25VLVLLM.engine_settings({})[0]["enforce_eager"] is False  # vLLM's default: compiled
    assert ResAdaptQwen25VLVLLM.engine_settings({"enforce_eager": "true"})[0]["enforce_eager"] is True
    with pytest.raises(ValueError, match="model_args enforce_eager='often': expected bool"):
        ResAdaptQwen3VLVLLM.checked_config(enforce_eager="often")


# ---------------------------------------------------------------- 7. resadapt-eval flops on bad input


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "0x0"], "flops: --size takes WIDTHxHEIGHT in pixels, both at least 1 (e.g. 896x672), got '0x0'"),
        (["--size", "wide"], "flops: --size takes WIDTHxHEIGHT"),
        (["--size", "5000x10"], "flops: --size 5000x10: absolute aspect ratio must be smaller than 200"),
        (["--frames", "-4"], "flops: --frames takes comma-separated frame counts, each at least 1, got '-4'"),
        (["--backbone", "nope"], "flops: --backbone nope: unknown backbone 'nope'"),
        (["--methods", "vanilla,nope"], "flops: --methods: unknown method 'nope'"),
        (["--methods", "fixed_scale", "--retention", "-0.5"], "flops: --retention must be a finite positive number"),
        (["--output-tokens", "-1"], "flops: --output-tokens must be at least 0, got -1"),
        (["--methods", "resadapt", "--allocator", "nowhere"], "flops: --allocator nowhere: "),
    ],
)
def test_flops_answers_bad_input_with_one_line_and_exit_2(capsys, argv, message):
    from resadapt_eval.cli import main

    assert main(["flops", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and len(captured.err.strip().splitlines()) == 1
    assert captured.out == ""  # no table


# ---------------------------------------------------------------- 8. Allocator folders


def loguru_messages():
    """A list that collects loguru's warnings while the test runs (lmms-eval's logger)."""
    from loguru import logger

    messages = []
    handler = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    return messages, lambda: logger.remove(handler)


def test_a_model_folder_given_as_allocator_is_not_an_allocator_config(fixtures_dir, tmp_path):
    model_folder = fixtures_dir / "qwen25vl"
    with pytest.raises(
        CheckpointError,
        match=rf"{model_folder / 'config.json'}: not an Allocator config \(no format_version, model_type 'qwen2_5_vl'",
    ) as caught:
        lmms_model(fixtures_dir, tmp_path, method="resadapt", allocator=str(model_folder), retention=0.25)
    assert "upgrade" not in str(caught.value) and "or `untrained`" in str(caught.value)


def test_allocator_builtin_says_a_checkpoint_folder_or_untrained_is_expected(fixtures_dir, tmp_path):
    from resadapt_eval.lmms.models import ResAdaptQwen25VL

    with pytest.raises(
        CheckpointError,
        match=r"builtin/config.json: missing Allocator config \(no such folder\); allocator= takes an Allocator "
        "checkpoint folder .* or `untrained`",
    ):
        ResAdaptQwen25VL.checked_config(method="resadapt", allocator="builtin")
    with pytest.raises(CheckpointError, match=r"missing Allocator config \(the folder has no config.json\)"):
        ResAdaptQwen25VL.checked_config(method="resadapt", allocator=str(tmp_path))


def test_a_checkpoint_without_budget_json_is_warned_about_and_every_record_says_so(fixtures_dir, tmp_path):
    folder = tiny_allocator(tmp_path / "alloc")
    messages, stop = loguru_messages()
    try:
        model = lmms_model(fixtures_dir, tmp_path, method="resadapt", allocator=str(folder), retention=0.25)
    finally:
        stop()
    assert any(f"the Allocator {folder} has no budget.json" in m and "s in [0.2, 1.8]" in m for m in messages)
    _, records = answer(model, fixtures_dir)
    assert [r["allocator_budget"] for r in records] == ["missing", "missing"]
    assert all(r["error"] is None for r in records)
    assert json.loads(model.manifest_path.read_text())["allocator_budget_source"] == "missing"

    (folder / "budget.json").write_text(json.dumps(dict(s_min=0.2, s_max=1.8)))
    model = lmms_model(fixtures_dir, tmp_path / "again", method="resadapt", allocator=str(folder), retention=0.25)
    _, records = answer(model, fixtures_dir, videos=VIDEOS[:1])
    assert records[0]["allocator_budget"] == "budget.json"


def test_a_checkpoint_trained_on_another_backbone_stops_at_start_unless_transferred_on_purpose(fixtures_dir, tmp_path):
    folder = tiny_allocator(tmp_path / "alloc")
    trained = dict(family="qwen3vl", pretrained=str(fixtures_dir / "qwen3vl"))
    (folder / "backbone.json").write_text(json.dumps(trained))
    args = dict(method="resadapt", allocator=str(folder), retention=0.25)
    with pytest.raises(ValueError, match="was trained with another backbone: family qwen25vl") as refused:
        lmms_model(fixtures_dir, tmp_path, **args)
    assert f"pretrained {fixtures_dir / 'qwen25vl'} (trained with {fixtures_dir / 'qwen3vl'})" in str(refused.value)
    assert "allocator_transfer=true" in str(refused.value)
    messages, stop = loguru_messages()
    try:
        lmms_model(fixtures_dir, tmp_path, allocator_transfer=True, **args)
        lmms_model(fixtures_dir, tmp_path, "qwen3vl", **args)
    finally:
        stop()
    (warning,) = [m for m in messages if "trained with another backbone" in m]
    assert f"family qwen25vl (trained with qwen3vl); pretrained {fixtures_dir / 'qwen25vl'}" in warning
    assert "on purpose (allocator_transfer=true)" in warning


def test_the_shipped_needle_allocators_name_their_backbone_and_are_refused_for_a_7b_card(capsys):
    """Each committed Allocator's backbone.json names the needle backbone beside it (a relative path,
    so the check holds wherever the repository lies); given to a 7B card, `sweep` stops at start
    naming the mismatch, and a 7B card without an Allocator is never offered them."""
    from resadapt_eval.allocator import known_allocators, training_backbone
    from resadapt_eval.cli import main

    shipped = sorted(p.parent for p in (REPO / "results").glob("**/allocator*/model.safetensors"))
    assert len(shipped) >= 2
    for folder in shipped:
        trained = training_backbone(str(folder))
        assert Path(trained["pretrained"]).is_dir() and Path(trained["pretrained"]).parent == folder.parent, folder
    seven_b = REPO / "model_cards" / "qwen25vl-7b-32f.yaml"
    assert known_allocators("qwen25vl", "Qwen/Qwen2.5-VL-7B-Instruct") == []
    for folder in shipped:
        argv = ["sweep", "--card", str(seven_b), "--methods", "resadapt", "--retention", "0.25"]
        argv += ["--model-args", f"allocator={folder}", "--output", "/nonexistent/never-written"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert f"allocator={folder} was trained with another backbone" in err
        assert "pretrained Qwen/Qwen2.5-VL-7B-Instruct (trained with" in err
    assert (
        main(
            [
                "sweep",
                "--card",
                str(seven_b),
                "--methods",
                "resadapt",
                "--retention",
                "0.25",
                "--output",
                "/nonexistent/x",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"card qwen25vl-7b-32f sets no `allocator:` ({seven_b})" in err and "needle" not in err


def test_a_needle_card_without_an_allocator_is_offered_the_ones_trained_with_its_backbone(tmp_path, capsys):
    import yaml

    from resadapt_eval.cli import main

    card = yaml.safe_load((REPO / "model_cards" / "needle-qwen25vl.yaml").read_text())
    card.update(pretrained=str(REPO / "results" / "needle" / "backbone-qwen25vl"), allocator=None, needle_data=None)
    card["include_path"] = str(REPO / "tasks")
    path = tmp_path / "needle-no-allocator.yaml"
    path.write_text(yaml.safe_dump(card))
    argv = [
        "sweep",
        "--card",
        str(path),
        "--methods",
        "resadapt",
        "--retention",
        "0.25",
        "--output",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"sets no `allocator:` ({path})" in err
    offered = err.split("committed for this backbone: ")[1].split(", or to")[0].split(", ")
    assert offered == ["results/needle/allocator-long-qwen25vl", "results/needle/allocator-qwen25vl"]
    assert not (tmp_path / "o").exists()


def test_the_trainer_records_the_backbone_beside_the_checkpoint(fixtures_dir, tmp_path):
    from resadapt_eval.train.config import build_trainer

    from .helpers import tiny_train_config

    trainer = build_trainer(tiny_train_config(tmp_path, fixtures_dir), steps=1)
    trainer.train(progress=False)
    saved = tmp_path / "run" / "checkpoints" / "step-000001" / "allocator" / "backbone.json"
    assert json.loads(saved.read_text()) == dict(family="qwen25vl", pretrained=str(fixtures_dir / "qwen25vl"))


# ---------------------------------------------------------------- 6. a malformed dataset row


def test_a_videomme_row_with_null_options_fails_that_sample_and_the_run_goes_on(fixtures_dir, tmp_path):
    """lmms-eval builds every prompt before the first sample: its own `videomme_doc_to_text` raises
    a TypeError on `options: null` and ends the run. Through our task functions the row is recorded
    as failed with its reason, and the other rows are answered and scored."""
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    rows = [json.loads(line) for line in (fixtures_dir / "benchmarks/videomme/test.jsonl").read_text().splitlines()]
    rows = rows[:3]
    rows[1]["options"] = None
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task_yaml = (fixtures_dir.parent / "tasks/resadapt_fixtures/resadapt_fixture_videomme.yaml").read_text()
    task_yaml = task_yaml.replace("resadapt_fixture_videomme", "careful_videomme")
    task_yaml = re.sub(r"test: \S+", f"test: {data}", task_yaml)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "careful_videomme.yaml").write_text(task_yaml)

    model = lmms_model(fixtures_dir, tmp_path, method="fixed_scale", retention=0.25)
    results = simple_evaluate(
        model=model,
        tasks=["careful_videomme"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        log_samples=True,
    )
    records = [json.loads(line) for line in model.sidecar_path.read_text().splitlines()]
    assert len(records) == 3
    failed = [r for r in records if r["error"] is not None]
    assert len(failed) == 1 and failed[0]["doc_id"] == 1
    assert "question_id='smoke_001-1' cannot be asked: options is None" in failed[0]["error"]
    assert [len(results["samples"]["careful_videomme"])] == [3]
    manifest = json.loads(model.manifest_path.read_text())
    assert (manifest["samples"], manifest["failed_samples"]) == (3, 1)


def test_a_report_of_a_folder_that_does_not_exist_says_so(tmp_path, capsys):
    from resadapt_eval.cli import main

    for command in ("tables", "plots"):
        assert main([command, str(tmp_path / "no-such-sweep")]) == 2
        assert capsys.readouterr().err.strip() == f"{command}: {tmp_path / 'no-such-sweep'} does not exist"


def test_flops_beyond_the_context_length_says_so(capsys):
    """Qwen2.5-VL-7B takes 128,000 tokens (max_position_embeddings): 512 frames of 896x672 are 196,608
    visual tokens at 768 a pair, so that row counts a sequence no run can have, and says so."""
    from resadapt_eval.cli import main

    argv = ["flops", "--backbone", "qwen25vl-7b", "--frames", "32,512", "--methods", "vanilla"]
    assert main(argv) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert notes == [
        "note: at 512 frames vanilla's sequence is 196632 tokens (visual, text and output), beyond qwen25vl-7b's "
        "context length of 128000 tokens (max_position_embeddings): the model cannot take it, and its rows count "
        "a sequence no run can have"
    ]


def test_how_a_process_ended_reads_as_a_person_would_say_it():
    import signal

    from resadapt_eval.guard import exit_description

    assert exit_description(-signal.SIGKILL) == "was killed by SIGKILL (exit code -9)"
    assert exit_description(128 + signal.SIGKILL) == "was killed by SIGKILL (exit code 137)"
    assert exit_description(128 + signal.SIGSEGV) == "was killed by SIGSEGV (exit code 139)"
    assert exit_description(1) == "exited with exit code 1"


def test_resize_fast_uses_the_uint8_kernel_within_a_few_levels_and_every_record_says_which_ran(fixtures_dir, tmp_path):
    """resize=fast: torchvision v2's uint8 bicubic kernel, its frames at most a few uint8 levels from
    the exact (float) path on a 720p frame; the records name the resize that ran; a typo stops at start."""
    import numpy as np

    from resadapt_eval.backbones.layout import resize_frames

    g = np.random.default_rng(0)
    x, y = np.linspace(0, 1, 1280)[None, :, None], np.linspace(0, 1, 720)[:, None, None]
    frame = 127 + 60 * np.sin(20 * x + 7 * y) + g.normal(0, 20, (720, 1280, 3))
    frames = np.stack([frame.clip(0, 255).astype(np.uint8)] * 2)
    exact, fast = resize_frames(frames, 504, 896), resize_frames(frames, 504, 896, "fast")
    assert exact.shape == fast.shape == (2, 3, 504, 896) and exact.dtype == fast.dtype == torch.uint8
    difference = (exact.int() - fast.int()).abs()
    assert 0 < difference.max() <= 4 and difference.float().mean() < 0.5  # measured: 3 and 0.18
    assert torch.equal(resize_frames(frames, 720, 1280, "fast"), resize_frames(frames, 720, 1280))  # no resize

    for mode in ("exact", "fast"):
        model = lmms_model(fixtures_dir, tmp_path / mode, method="fixed_scale", retention=0.25, resize=mode)
        _, records = answer(model, fixtures_dir, videos=VIDEOS[:1])
        assert records[0]["error"] is None and records[0]["resize"] == mode
    with pytest.raises(ValueError, match="resize must be one of exact, fast, got 'fastest'"):
        lmms_model(fixtures_dir, tmp_path, method="fixed_scale", retention=0.25, resize="fastest")
