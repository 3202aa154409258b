"""The needle benchmark's second half: the choice-logits rollout engine, budget-projected rollouts,
`needle train-allocator`, and the evidence-pair report."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from resadapt_eval.allocator import Allocator
from resadapt_eval.budget.plan import plan_from_scales, project_to_retention
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.needle.report import (
    CellSummary,
    binomial_se,
    cell_styles,
    evidence_hit,
    evidence_is_highest,
    pair_scale_of,
    summarize_cell,
    to_markdown,
)
from resadapt_eval.report.collect import CellRun
from resadapt_eval.train.data import TrainSample, load_samples
from resadapt_eval.train.engines import HFRolloutEngine

from .helpers import REPO


@pytest.fixture(scope="module")
def mc_sample(fixtures_dir):
    sample = load_samples(fixtures_dir / "smoke_videoqa" / "train.jsonl")[0]
    assert sample.task_type == "multiple_choice"
    return sample


def letter_logprobs(adapter, inputs, letters="ABCD"):
    """Independent path: teacher-forced log-probabilities of each letter after the prompt."""
    with torch.no_grad():
        return torch.stack(
            [
                adapter.sequence_logprobs(
                    inputs, torch.tensor(adapter.tokenizer(x, add_special_tokens=False)["input_ids"])
                )[0]
                for x in letters
            ]
        )


def test_choice_logits_reward_is_the_argmax_letter_checked_by_teacher_forcing(adapters, mc_sample):
    adapter = adapters["qwen25vl"]
    engine = HFRolloutEngine(adapter, max_num_frames=4, budget=BudgetSpec(), answer="choice_logits", temperature=0.0)
    prompt = engine.prompt(mc_sample)
    scales = np.array([[1.0, 1.0, 0.5, 0.5], [0.5, 0.5, 1.0, 1.0]])
    for allocation in scales:
        inputs = adapter.build_inputs(
            prompt.state["chat"],
            prompt.state["video"],
            plan_from_scales(allocation, prompt.state["base"], adapter.grid),
        )
        best = "ABCD"[int(letter_logprobs(adapter, inputs).argmax())]
        for answer in "ABCD":
            prompt.sample = TrainSample(mc_sample.video, mc_sample.question, answer, "multiple_choice")
            out = engine.rollouts(prompt, allocation[None], n=3)
            expected = 1.0 if answer == best else 0.0
            assert out.task_reward.tolist() == [[expected] * 3] and out.correct.tolist() == [[expected] * 3]


def test_choice_probs_at_temperature_are_the_softmax_of_the_letters_logprobs(adapters, mc_sample):
    adapter = adapters["qwen3vl"]
    engine = HFRolloutEngine(adapter, max_num_frames=4, budget=BudgetSpec(), answer="choice_logits", temperature=0.7)
    prompt = engine.prompt(mc_sample)
    inputs = adapter.build_inputs(
        prompt.state["chat"], prompt.state["video"], plan_from_scales(np.ones(4), prompt.state["base"], adapter.grid)
    )
    expected = torch.softmax(letter_logprobs(adapter, inputs) / 0.7, dim=0)
    assert torch.allclose(engine.choice_probs(inputs), expected, atol=1e-5)


def test_choice_logits_rejects_other_task_types(adapters, fixtures_dir):
    engine = HFRolloutEngine(adapters["qwen25vl"], max_num_frames=4, budget=BudgetSpec(), answer="choice_logits")
    video = load_samples(fixtures_dir / "smoke_videoqa" / "train.jsonl")[0].video
    prompt = engine.prompt(TrainSample(video=video, question="What?", answer="a cat", task_type="free_form"))
    with pytest.raises(ValueError, match="multiple-choice samples only"):
        engine.rollouts(prompt, np.ones((1, 4)), n=1)
    with pytest.raises(ValueError, match="answer must be one of"):
        HFRolloutEngine(adapters["qwen25vl"], max_num_frames=4, budget=BudgetSpec(), answer="beam")


def test_projected_rollouts_spend_exactly_the_projection_budget(adapters, mc_sample):
    adapter = adapters["qwen25vl"]
    budget = BudgetSpec(s_min=0.2, s_max=1.0)
    scales = np.array([[1.5, 1.5, 0.3, 0.3, 0.6, 0.6, 0.9, 0.9], [0.4, 0.4, 0.4, 0.4, 1.8, 1.8, 0.2, 0.2]])
    fixed = HFRolloutEngine(adapter, max_num_frames=8, budget=budget, answer="choice_logits", retention=0.4)
    prompt = fixed.prompt(mc_sample)
    expected = [
        plan_from_scales(
            project_to_retention(s, 0.4, prompt.state["base"], adapter.grid, 0.2, 1.0),
            prompt.state["base"],
            adapter.grid,
        ).retention
        for s in scales
    ]
    out = fixed.rollouts(prompt, scales, n=1)
    assert out.retention.tolist() == pytest.approx(expected) and max(expected) <= 0.4
    ranged = HFRolloutEngine(
        adapter, max_num_frames=8, budget=budget, answer="choice_logits", retention=(0.3, 0.6), seed=3
    )
    drawn = float(0.3 + 0.3 * torch.rand((), generator=torch.Generator().manual_seed(3)))  # the engine's first draw
    expected = [
        plan_from_scales(
            project_to_retention(s, drawn, prompt.state["base"], adapter.grid, 0.2, 1.0),
            prompt.state["base"],
            adapter.grid,
        ).retention
        for s in scales
    ]
    assert ranged.rollouts(prompt, scales, n=1).retention.tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="retention must be"):
        HFRolloutEngine(adapter, max_num_frames=8, budget=budget, retention=(0.6, 0.3))


def test_needle_train_allocator_writes_a_loadable_checkpoint(tmp_path):
    from resadapt_eval.needle.data import make_split

    data = make_split(tmp_path / "needle", "train", 2, seed=0, cue=True, progress=False)
    config = yaml.safe_load((REPO / "configs" / "needle_allocator.yaml").read_text())
    config.update(output_dir=str(tmp_path / "run"), data=str(data))
    config["backbone"]["pretrained"] = str(REPO / "results" / "needle" / "backbone-qwen25vl")
    config["train"].update(steps=2, batch_size=2, num_allocations=2, save_every=1)
    path = tmp_path / "needle_allocator.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "run" / "final"  # no --out: the final checkpoint stays in the run's output_dir
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resadapt_eval.cli",
            "needle",
            "train-allocator",
            "--config",
            str(path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    allocator = Allocator.from_pretrained(out)
    assert (
        allocator.config.encoder,
        allocator.config.frame_norm,
        allocator.config.width,
        allocator.config.s_min,
        allocator.config.s_max,
    ) == ("tiny", True, 64, 0.1, 1.9)
    names = ["backbone.json", "budget.json", "config.json", "model.safetensors", "training.txt"]
    assert sorted(p.name for p in out.iterdir()) == names
    # and the backbone it was trained with, which evaluation compares with the one running it
    trained = dict(family="qwen25vl", pretrained=str(REPO / "results" / "needle" / "backbone-qwen25vl"))
    assert json.loads((out / "backbone.json").read_text()) == trained
    # the budget it was trained under travels with it: a bare `allocator=OUT` gets the YAML's rollout settings
    budget = json.loads((out / "budget.json").read_text())
    assert (budget["s_min"], budget["s_max"], budget["max_num_frames"]) == (0.1, 1.0, 16)
    assert "steps=2 " in (out / "training.txt").read_text()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.25 <= m["achieved_retention"] <= 0.8 for m in metrics)  # every rollout projected into the YAML's range


def test_query_allocator_config_starts_from_the_needle_allocator_with_text_positions(tmp_path):
    from resadapt_eval.needle.data import make_split
    from resadapt_eval.train.config import build_trainer

    data = make_split(tmp_path / "query", "train", 1, seed=0, variant="query", progress=False)
    config = yaml.safe_load((REPO / "configs" / "needle_allocator_query.yaml").read_text())
    config.update(output_dir=str(tmp_path / "run"), data=str(data))
    config["backbone"]["pretrained"] = str(REPO / config["backbone"]["pretrained"].removeprefix("../"))
    config["allocator"]["checkpoint"] = str(REPO / config["allocator"]["checkpoint"].removeprefix("../"))
    path = tmp_path / "query.yaml"
    path.write_text(yaml.safe_dump(config))
    trainer = build_trainer(path)
    start = Allocator.from_pretrained(config["allocator"]["checkpoint"])
    assert trainer.allocator.config.text_positions and not start.config.text_positions
    assert set(trainer.allocator.trainable_state_dict()) == set(start.trainable_state_dict()) != set()
    for name, weight in start.trainable_state_dict().items():  # the same weights, now reading token order
        assert torch.equal(trainer.allocator.trainable_state_dict()[name], weight)
    config["allocator"]["width"] = 32  # a setting that changes the weights cannot ride on a checkpoint
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"at most text_positions.*\['text_positions', 'width'\]"):
        build_trainer(path)


def test_evidence_pair_is_highest_by_hand():
    scales = [0.2, 0.4, 1.0, 0.8, 0.3, 0.3, 0.5, 0.5]  # pairs: 0.3, 0.9, 0.3, 0.5
    assert pair_scale_of(scales).tolist() == pytest.approx([0.3, 0.9, 0.3, 0.5])
    assert evidence_is_highest(scales, 1) and not evidence_is_highest(scales, 3)
    assert not evidence_is_highest([1.0, 1.0, 1.0, 1.0], 0)  # a tie is not a hit
    assert pair_scale_of([0.2, 0.4, 1.0]).tolist() == pytest.approx([0.3, 1.0])  # odd tail repeats the last frame


def test_evidence_hit_under_frame_selection_is_both_evidence_frames_kept():
    """A frame-selection record holds only the kept frames' scales (all at the base size), so the
    evidence pair counts as found when both its frames (of the 128 candidates) were kept."""
    row = dict(evidence_pair=55, evidence_frames=[110, 111])
    kept = dict(candidates=128, frame_indices=[10, 11, 12, 13, 16, 17, 110, 111], scales=[1.0] * 8)
    half = dict(candidates=128, frame_indices=[10, 11, 12, 13, 16, 17, 111, 112], scales=[1.0] * 8)
    assert evidence_hit(kept, row) and not evidence_hit(half, row)
    # without selection: the pair scales of all frames
    scales = [0.2] * 128
    scales[110] = scales[111] = 1.0
    assert evidence_hit(dict(scales=scales, frame_indices=list(range(128))), row)
    assert not evidence_hit(dict(scales=[0.2] * 128, frame_indices=list(range(128))), row)


def test_cell_summary_by_hand(tmp_path):
    rows = {}
    records = []
    pairs = [0, 1, 2, 3]
    for i, ev in enumerate(pairs):
        video = str(tmp_path / f"v{i}.mkv")
        rows[video] = dict(video_path=video, evidence_pair=ev, evidence_frames=[2 * ev, 2 * ev + 1])
        scales = [0.3] * 8
        top = ev if i < 3 else 0  # videos 0-2: the evidence pair is highest; video 3: pair 0 is
        scales[2 * top] = scales[2 * top + 1] = 1.0
        records.append(
            dict(video=video, scales=scales, error=None, achieved_retention=0.25, task="resadapt_needle", doc_id=i)
        )
    records.append(
        dict(
            video=str(tmp_path / "v0.mkv"),
            scales=[1.0] * 8,
            error="VideoDecodeError: x",
            achieved_retention=None,
            task="resadapt_needle",
            doc_id=4,
        )
    )
    run = CellRun(
        card="needle",
        backbone="qwen25vl",
        paper_backbone=None,
        method="resadapt",
        retention=0.25,
        frames=16,
        path=tmp_path / "cell",
        records=records,
        outcomes={("resadapt_needle", i): s for i, s in enumerate([1.0, 1.0, 0.0, 1.0, 0.0])},
    )
    cell = summarize_cell(run, rows)
    assert cell.evidence_fraction == pytest.approx(0.75) and cell.evidence_se == pytest.approx(np.sqrt(0.75 * 0.25 / 4))
    assert (
        cell.accuracy == pytest.approx(0.6)
        and cell.accuracy_se == pytest.approx(np.sqrt(0.6 * 0.4 / 5))
        and cell.n == 5
    )
    assert cell.achieved_retention == pytest.approx(0.25)
    assert binomial_se(0.5, 100) == pytest.approx(0.05)
    assert cell.tflops is None  # these records carry no FLOPs
    assert "| ResAdapt | 16 | 0.25 | 0.250 | 60.0 ± 21.9 | 75.0 ± 21.7 | - | 5 |" in to_markdown([cell])
    costed = dataclasses.replace(cell, tflops=1.5e-4)
    assert "| ResAdapt | 16 | 0.25 | 0.250 | 60.0 ± 21.9 | 75.0 ± 21.7 | 1.50e-04 | 5 |" in to_markdown([costed])
    # a method whose scales are not the Allocator's has no evidence fraction (all its pairs are equal)
    fixed = summarize_cell(dataclasses.replace(run, method="fixed_scale"), rows)
    assert np.isnan(fixed.evidence_fraction) and fixed.accuracy == pytest.approx(0.6)
    assert "| FixedScale | 16 | 0.25 | 0.250 | 60.0 ± 21.9 | - | - | 5 |" in to_markdown([fixed])
    # frame selection: the records carry `candidates`, the row says so, the evidence hit is "both frames kept"
    for i, rec in enumerate(records[:4]):
        rec.update(candidates=8, frame_indices=[[0, 1], [2, 3], [6, 7], [0, 1]][i])
    selected = summarize_cell(run, rows)
    assert selected.selection and selected.label == "ResAdapt (frame selection)"
    assert selected.evidence_fraction == pytest.approx(0.5)  # videos 0, 1 kept their evidence pair; 2 and 3 another
    assert "| ResAdapt (frame selection) | 16 | 0.25 |" in to_markdown([selected])
    # the query ablation: records say the Allocator read an empty query, and the row says so
    for rec in records:
        rec.pop("candidates", None), rec.update(allocator_query="empty")
    ablation = summarize_cell(run, rows)
    assert ablation.empty_query and not ablation.selection and ablation.label == "ResAdapt (empty query)"
    assert "| ResAdapt (empty query) | 16 | 0.25 | 0.250 | 60.0 ± 21.9 | 75.0 ± 21.7 | - | 5 |" in to_markdown(
        [ablation]
    )


def test_every_cell_of_the_tflops_plot_has_its_own_colour_and_marker(tmp_path):
    """Every registered method plus a method's variants (the query split's report has 14 rows):
    no two points look alike, and a method keeps one colour."""
    from resadapt_eval.methods import METHODS

    base = dict(retention=0.25, achieved_retention=0.25, accuracy=0.5, accuracy_se=0.05, evidence_fraction=0.5)
    cells = [CellSummary(method=m, evidence_se=0.05, n=400, path=tmp_path, **base) for m in METHODS]
    cells += [
        CellSummary(method="resadapt", evidence_se=0.05, n=400, path=tmp_path, empty_query=True, **base),
        CellSummary(method="resadapt", evidence_se=0.05, n=400, path=tmp_path, selection=True, **base),
    ]
    styles = cell_styles(cells)
    assert len({(s["color"], s["marker"]) for s in styles}) == len(cells) == len(METHODS) + 2
    assert len({s["color"] for s in styles}) == len(METHODS)
    resadapt = [s for c, s in zip(cells, styles) if c.method == "resadapt"]
    assert len({s["marker"] for s in resadapt}) == 3


def test_committed_needle_allocator_spends_r025_on_the_evidence_pair(tmp_path):
    """The committed checkpoint through the `method=resadapt` pipeline's stages (decode, Allocator,
    plan), on fresh cued videos (test-split seed): at R=0.25 the evidence pair is the one pair at
    full size (224 px, the size the glyph is readable at)."""
    from resadapt_eval.backbones.qwen import Qwen25VLAdapter
    from resadapt_eval.needle.data import make_split
    from resadapt_eval.pipeline import Request, VideoPipeline, VideoPipelineConfig

    backbone = Qwen25VLAdapter.from_pretrained(str(REPO / "results" / "needle" / "backbone-qwen25vl"), dtype="float32")
    allocator = str(REPO / "results" / "needle" / "allocator-qwen25vl")
    spec = BudgetSpec(retention=0.25, s_min=0.1, s_max=1.0)  # the needle card's range
    pipeline = VideoPipeline(
        backbone, VideoPipelineConfig(method="resadapt", allocator=allocator, max_num_frames=16, budget=spec)
    )
    rows = [
        json.loads(line)
        for line in make_split(tmp_path, "test", 8, seed=2, cue=True, progress=False).read_text().splitlines()
    ]
    full = 0
    for row in rows:
        request = Request("", video=row["video_path"], query=row["question"])
        decoded = pipeline.decode(request)
        (scores,) = pipeline.score([request], {0: decoded}, {}).values()
        (plan,) = pipeline.plan(decoded, scores).plans
        assert plan.base_hw == (224, 224) and plan.retention <= 0.25
        full += [i for i, size in enumerate(plan.pair_sizes) if size == (224, 224)] == [row["evidence_pair"]]
    assert full >= 7  # 99.5% of 400 test videos in the sweep of docs/needle.md


def test_demo_runs_end_to_end_on_two_videos(tmp_path):
    """`make demo`'s command (fewer methods and videos): for each needle card (both backbones by
    default) the sweep through lmms-eval, tables, plots and the needle report, whose summary has
    one row per cell over the 2 videos."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "resadapt_eval.cli", "demo", "--out", str(out), "--methods", "vanilla,resadapt"]
        + ["--retention", "0.25", "--limit", "2", "--repo", str(REPO)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["needle-qwen25vl", "needle-qwen3vl"]
    for card in ("needle-qwen25vl", "needle-qwen3vl"):
        summary = (out / card / "needle" / "summary.md").read_text().splitlines()
        assert [line.split(" | ")[0] for line in summary[2:]] == ["| Vanilla", "| ResAdapt"]
        assert all(line.endswith("| 2 |") for line in summary[2:])
        assert (out / card / "needle" / "needle_accuracy_tflops.png").is_file()
        assert any((out / card / "tables").iterdir())
        (sheet,) = (out / card / "show").glob("sample_*.png")  # the contact sheet of one of ResAdapt's samples
        assert sheet.stat().st_size > 10_000
        assert not (out / card / "tables" / "hard_subset.md").exists()  # no FixedScale cell: no hard subset
        cell = json.loads((out / card / "resadapt-r0.25-f16" / "cell.json").read_text())
        assert cell["backbone"] == card.split("-")[1] and cell["samples"] == 2
