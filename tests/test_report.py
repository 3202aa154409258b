"""Sweeps (resume, failures), tables and plots from real lmms-eval output of the tiny model."""

import csv
import json
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from resadapt_eval.report.collect import collect, collect_dirs
from resadapt_eval.report.plots import pareto_lines, write_plots
from resadapt_eval.report.tables import build_tables, to_latex, to_markdown
from resadapt_eval.sweep import load_card, plan_cells, sweep_configs

from .helpers import REPO, REPORT_GRID, sweep_cmd

CARD = REPO / "model_cards" / "tiny-qwen25vl.yaml"


def test_sweep_cells_and_records(report_sweep):
    cells = sorted(p.parent.name for p in report_sweep.glob("*/cell.json"))
    assert cells == [
        "fixed_scale-r0.25-f8",
        "fixed_scale-r0.5-f8",
        "resadapt-r0.25-f8",
        "resadapt-r0.5-f8",
        "vanilla-f8",
    ]
    for name in cells:
        meta = json.loads((report_sweep / name / "cell.json").read_text())
        assert meta["status"] == "done" and meta["error"] is None
        assert (report_sweep / name / meta["results"]).is_file()


def test_every_table_cell_equals_the_results_json_and_r_the_sidecar_mean(report_sweep):
    runs = collect(report_sweep)
    (table,) = build_tables(runs)
    assert table.name == "video_qa" and table.columns == ["resadapt_smoke_videoqa"]
    assert len(table.rows) == 5
    for row in table.rows:
        # the tiny card runs the untrained Allocator on purpose, and its rows say so
        method = {"Vanilla": "vanilla", "FixedScale": "fixed_scale", "ResAdapt (untrained)": "resadapt"}[row["method"]]
        cell = "vanilla-f8" if row["target"] is None else f"{method}-r{row['target']:g}-f8"
        meta = json.loads((report_sweep / cell / "cell.json").read_text())
        results = json.loads((report_sweep / cell / meta["results"]).read_text())
        assert (
            row["resadapt_smoke_videoqa"]
            == results["results"]["resadapt_smoke_videoqa"]["videomme_perception_score,none"]
        )
        records = [
            json.loads(line)
            for p in (report_sweep / cell).rglob("resadapt_samples_*.jsonl")
            for line in p.read_text().splitlines()
        ]
        assert len(records) == 4
        assert row["R"] == pytest.approx(sum(r["achieved_retention"] for r in records) / len(records))
        assert row["TFLOPs"] == pytest.approx(sum(r["total_flops"] for r in records) / len(records) / 1e12)
        if row["target"] is not None:
            assert row["R"] <= row["target"]
    markdown, latex = to_markdown(table), to_latex(table)
    assert markdown.count("\n| ") == 1 + 5  # header + rows
    assert r"\toprule" in latex and r"\bottomrule" in latex and latex.count(r"\\") == 1 + 5
    # the CLI writes md, tex and csv
    proc = subprocess.run(
        [sys.executable, "-m", "resadapt_eval.cli", "tables", str(report_sweep), "--paper"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = {p.name for p in (report_sweep / "tables").iterdir()}
    # with --paper, the paper's CAPO ablation beside our ResAdapt cells (no backbone or R to match)
    ablation = {"capo_dist_ablation.md", "capo_dist_ablation.csv"}
    assert written == {"video_qa.md", "video_qa.tex", "video_qa.csv", "latency.md", "latency.csv"} | ablation
    # the latency table from the same run: one row per cell, TFLOPs the sidecar means
    latency = {(r["method"], r["R"]): r for r in csv.DictReader((report_sweep / "tables" / "latency.csv").open())}
    assert len(latency) == 5 and all(float(r["ttft_ms"]) > 0 for r in latency.values())
    vanilla = next(r for r in latency.values() if r["method"] == "vanilla")
    assert float(vanilla["total_tflops"]) == pytest.approx(table.rows[0]["TFLOPs"])
    assert "resadapt_smoke_videoqa (paper)" in proc.stdout  # the tiny card has no paper rows: the columns show —


def test_best_of_each_group_is_bold():
    from resadapt_eval.report.tables import Table

    table = Table(
        "video_qa",
        "Video QA",
        ["a"],
        rows=[
            dict(card="c", frames=8, method="FixedScale", target=0.25, R=0.24, a=50.0, status="done"),
            dict(card="c", frames=8, method="ResAdapt", target=0.25, R=0.23, a=60.0, status="done"),
            dict(card="c", frames=8, method="Vanilla", target=None, R=1.0, a=70.0, status="done"),
        ],
    )
    assert table.best() == {(1, "a")}  # vanilla is alone in its group
    assert "**60.0**" in to_markdown(table) and r"\textbf{60.0}" in to_latex(table)


def test_plots_one_pareto_line_per_method(report_sweep, tmp_path):
    runs = collect(report_sweep)
    lines = pareto_lines(runs, "resadapt_smoke_videoqa", 8)
    assert sorted(lines) == ["fixed_scale", "resadapt", "vanilla"]
    assert len(lines["fixed_scale"]) == 2 and len(lines["vanilla"]) == 1
    assert all(xs == sorted(xs) for xs in ([x for x, _ in pts] for pts in lines.values()))
    # on the compute axis, each method's cells in the same order, and resizing before the encoder is cheaper
    compute = pareto_lines(runs, "resadapt_smoke_videoqa", 8, axis="tflops")
    assert sorted(compute) == sorted(lines) and all(len(compute[m]) == len(lines[m]) for m in lines)
    assert max(x for x, _ in compute["fixed_scale"]) < compute["vanilla"][0][0]
    # on the vision tower's axis too: resizing saves encoder work, its cells' mean vision FLOPs
    vision = pareto_lines(runs, "resadapt_smoke_videoqa", 8, axis="vision_tflops")
    assert max(x for x, _ in vision["fixed_scale"]) < vision["vanilla"][0][0] < compute["vanilla"][0][0]
    (vanilla_cell,) = [r for r in runs if r.method == "vanilla"]
    flops = [r["vision_flops"] + r["vision_attention_flops"] for r in vanilla_cell.records if r["error"] is None]
    assert vision["vanilla"][0][0] == sum(flops) / len(flops) / 1e12
    written = write_plots(runs, tmp_path)
    names = {p.name for p in written}
    assert {"pareto_resadapt_smoke_videoqa_f8.png", "pareto_resadapt_smoke_videoqa_f8.pdf"} <= names
    assert {"pareto_tflops_resadapt_smoke_videoqa_f8.png", "pareto_tflops_resadapt_smoke_videoqa_f8.pdf"} <= names
    assert "pareto_vision_tflops_resadapt_smoke_videoqa_f8.png" in names
    assert any(n.startswith("scales_resadapt") for n in names) and any(n.startswith("heatmap_resadapt") for n in names)
    assert all(p.stat().st_size > 1000 for p in written)


def test_tables_and_plots_read_a_sweep_run_in_parts_and_refuse_a_cell_twice(report_sweep, tmp_path, capsys):
    import shutil

    from resadapt_eval.cli import main

    first, second = tmp_path / "part_a", tmp_path / "part_b"
    for cell in report_sweep.glob("*/cell.json"):
        part = second if cell.parent.name.startswith("resadapt") else first
        shutil.copytree(cell.parent, part / cell.parent.name)
    runs = collect_dirs([first, second])
    assert sorted(r.path.name for r in runs) == sorted(r.path.name for r in collect(report_sweep))
    assert sorted(pareto_lines(runs, "resadapt_smoke_videoqa", 8)) == ["fixed_scale", "resadapt", "vanilla"]
    assert main(["plots", str(first), str(second)]) == 0
    assert (first / "plots" / "pareto_resadapt_smoke_videoqa_f8.png").stat().st_size > 1000
    assert main(["tables", str(first), str(second), "--out", str(tmp_path / "tables")]) == 0
    with (tmp_path / "tables" / "video_qa.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 5
    # the same cell in two folders (here a copy; in practice an ablation at the same method and R) stops, naming both
    shutil.copytree(second, tmp_path / "again")
    assert main(["plots", str(second), str(tmp_path / "again")]) == 1
    message = capsys.readouterr().err
    assert "plots:" in message and str(second / "resadapt-r0.25-f8") in message and str(tmp_path / "again") in message


def test_killed_sweep_reruns_only_unfinished_cells(fixtures_dir, tmp_path):
    cmd = sweep_cmd(tmp_path, "vanilla,fixed_scale", limit=1)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = tmp_path / "vanilla-f8" / "cell.json"
    deadline = time.time() + 300
    while not first.exists() and time.time() < deadline:
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    assert first.exists()
    finished = {p.parent.name: p.stat().st_mtime for p in tmp_path.glob("*/cell.json")}
    assert len(finished) < 2
    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-2000:]
    assert f"{len(finished)} already done, {2 - len(finished)} to run" in rerun.stdout
    for name, mtime in finished.items():
        assert (tmp_path / name / "cell.json").stat().st_mtime == mtime  # not run again
    assert all(json.loads(p.read_text())["status"] == "done" for p in tmp_path.glob("*/cell.json"))
    assert len(list(tmp_path.glob("*/cell.json"))) == 2


def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(fixtures_dir, tmp_path):
    card = yaml.safe_load(CARD.read_text())
    card.update(pretrained=str(tmp_path / "no-such-model"), include_path=str(REPO / "tasks"))
    bad_card = tmp_path / "bad.yaml"
    bad_card.write_text(yaml.safe_dump(card))
    proc = subprocess.run(
        sweep_cmd(tmp_path / "run", "vanilla", limit=1, card=bad_card),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    meta = json.loads((tmp_path / "run" / "vanilla-f8" / "cell.json").read_text())
    assert meta["status"] == "failed" and "no-such-model" in meta["error"]
    assert "failed cell vanilla-f8" in proc.stdout


def refused_in_process(capsys, cmd: list[str]) -> subprocess.CompletedProcess:
    """A sweep command that stops at start (before any lmms-eval run), run in this process: its exit code and
    what it printed (its interpreter start is the subprocess's only extra)."""
    from resadapt_eval.cli import main

    capsys.readouterr()
    code = main(cmd[3:])  # past `python -m resadapt_eval.cli`
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(cmd, code, printed.out, printed.err)


def test_a_changed_limit_does_not_reuse_finished_cells(report_sweep, tmp_path, capsys):
    shutil.copytree(report_sweep / "vanilla-f8", tmp_path / "vanilla-f8")  # a finished cell of limit 4
    cell = tmp_path / "vanilla-f8" / "cell.json"
    assert json.loads(cell.read_text())["samples"] == REPORT_GRID["limit"] == 4
    same = refused_in_process(capsys, sweep_cmd(tmp_path, "vanilla", limit=4))  # runs nothing: all done
    assert same.returncode == 0 and "1 already done, 0 to run" in same.stdout, same.stdout + same.stderr

    changed = refused_in_process(capsys, sweep_cmd(tmp_path, "vanilla", limit=2))
    assert changed.returncode == 2
    assert "vanilla-f8 changed: limit: 4 -> 2" in changed.stderr and "--rerun-changed" in changed.stderr
    assert json.loads(cell.read_text())["samples"] == 4  # untouched

    rerun = subprocess.run(
        sweep_cmd(tmp_path, "vanilla", limit=2) + ["--rerun-changed"], cwd=REPO, capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stdout[-2000:]
    assert "0 already done, 1 to run" in rerun.stdout
    meta = json.loads(cell.read_text())
    assert (meta["status"], meta["samples"], meta["config"]["limit"]) == ("done", 2, 2)
    # --model-args extends the card's model_args: part of every cell's configuration
    extra = refused_in_process(capsys, sweep_cmd(tmp_path, "vanilla", limit=2) + ["--model-args", "max_pixels=50176"])
    assert extra.returncode == 2 and "card.model_args.max_pixels: None -> '50176'" in extra.stderr
    # a model_arg the cells set themselves stops at start with one line naming the option to use
    clash = refused_in_process(capsys, sweep_cmd(tmp_path, "vanilla", limit=2) + ["--model-args", "retention=0.1"])
    assert clash.returncode == 2 and clash.stderr.strip().splitlines() == [
        "sweep: --model-args sets retention, which every cell sets itself; use --retention for retention"
    ]


def test_an_all_failed_cell_is_reported_failed_and_tables_show_the_failures(fixtures_dir, tmp_path):
    """A target no smoke video reaches (above every video's floor, so the run starts) fails every
    sample: lmms-eval exits 0 with a score, but the cell is failed (with the first errors) and its
    table row shows the failure count, not the score."""
    proc = subprocess.run(
        sweep_cmd(tmp_path, "vanilla,fixed_scale", retention="0.01", limit=2),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stdout[-2000:]
    meta = json.loads((tmp_path / "fixed_scale-r0.01-f8" / "cell.json").read_text())
    assert (meta["status"], meta["samples"], meta["failed_samples"]) == ("failed", 2, 2)
    assert "2 of 2 samples failed" in meta["error"] and "retention 0.01 " in meta["error"]
    assert json.loads((tmp_path / "vanilla-f8" / "cell.json").read_text())["status"] == "done"

    # a failed cell is never taken as done: the same command's plan (what `sweep` prints as "1 already done,
    # 1 to run" before running the failed cell again) reuses the vanilla cell only
    card = load_card(CARD)
    cells = plan_cells(["vanilla", "fixed_scale"], [0.01], card.frames)
    _, reusable = sweep_configs(card, cells, card.tasks, tmp_path, 2, rerun_changed=False)
    assert [cell.name for cell in reusable] == ["vanilla-f8"]

    (table,) = build_tables(collect(tmp_path, include_failed=True))
    rows = {row["method"]: row for row in table.rows}
    assert rows["FixedScale"]["R"] is None and rows["FixedScale"]["resadapt_smoke_videoqa"] is None
    assert rows["Vanilla"]["R"] == 1.0 and rows["Vanilla"]["resadapt_smoke_videoqa"] is not None
    assert "| failed 2/2 |" in to_markdown(table)
    assert [run.method for run in collect(tmp_path)] == ["vanilla"]  # plots read done cells only


def test_paper_numbers_sit_beside_ours_with_deltas(tmp_path):
    from resadapt_eval.report.collect import CellRun
    from resadapt_eval.report.tables import paper_row, read_paper

    rows = read_paper(REPO / "results" / "paper" / "video_qa.csv")
    run = CellRun(
        card="qwen25vl-7b-32f",
        backbone="qwen25vl",
        paper_backbone="Qwen2.5-VL-7B",
        method="random_drop",
        retention=0.25,
        frames=32,
        path=tmp_path,
        scores={"videomme": 60.0},
        columns_by_table={"video_qa": ["videomme"]},
        records=[dict(task="videomme", error=None, achieved_retention=0.25)],
    )
    assert paper_row(rows, run)["videomme"] == "58.9"
    # the nearest retention wins: FixedScale at a 0.10 target is the paper's 12.3% row
    fixed = CellRun(**{**run.__dict__, "method": "fixed_scale", "retention": 0.10})
    assert paper_row(rows, fixed)["retention"] == "12.3"
    (table,) = build_tables([run], REPO / "results" / "paper")
    assert table.rows[0]["paper_videomme"] == 58.9
    assert "| 60.0 | 58.9 | +1.1 |" in to_markdown(table, with_paper=True)


def test_cells_are_named_and_keyed_by_everything_that_sets_their_result():
    from dataclasses import replace

    from resadapt_eval.sweep import Cell, cell_config, config_changes, config_key, load_card, plan_cells

    assert Cell("fixed_scale", 0.25, 8).name == "fixed_scale-r0.25-f8"
    assert Cell("fixed_scale", 0.2500001, 8).name == "fixed_scale-r0.2500001-f8"
    assert len(plan_cells(["vanilla", "fixed_scale"], [0.25, 0.25, 0.1], [8])) == 3
    card = load_card(CARD)
    cell = Cell("fixed_scale", 0.25, 8)
    base = cell_config(card, cell, ["t"], 4)
    variants = {
        "tasks": cell_config(card, cell, ["t", "u"], 4),
        "limit": cell_config(card, cell, ["t"], None),
        "card model_args": cell_config(replace(card, model_args={**card.model_args, "s_max": 1.0}), cell, ["t"], 4),
        "pretrained": cell_config(replace(card, pretrained="other"), cell, ["t"], 4),
        "frames": cell_config(card, Cell("fixed_scale", 0.25, 16), ["t"], 4),
    }
    for name, variant in variants.items():
        assert config_key(variant) != config_key(base), name
    assert config_key(cell_config(card, cell, ["t"], 4)) == config_key(base)
    assert config_changes(base, variants["card model_args"]) == ["card.model_args.s_max: 1.8 -> 1.0"]


def test_sweep_model_args_replace_the_allocator_and_refuse_what_cells_set(tmp_path):
    from resadapt_eval.sweep import Cell, cell_command, load_card, with_model_args

    card = load_card(REPO / "model_cards" / "needle-qwen25vl.yaml")
    cell = Cell("resadapt", 0.25, 16)
    overridden = with_model_args(card, f"allocator={tmp_path},max_pixels=50176")
    command = cell_command(overridden, cell, ["t"], tmp_path)
    args = command[command.index("--model_args") + 1]
    assert f"allocator={tmp_path}," in args + "," and card.allocator not in args
    assert "max_pixels=50176" in args
    assert overridden.allocator == str(tmp_path) and "allocator" not in overridden.model_args
    # a cell sets these itself: a value here would be overwritten, so it stops naming the option to use
    cell_set = (("retention=0.1", "--retention"), ("max_num_frames=8", "--frames"), ("method=vanilla", "--methods"))
    for pair, option in cell_set:
        with pytest.raises(ValueError, match=f"--model-args sets {pair.split('=')[0]}.*{option}"):
            with_model_args(card, pair)
    with pytest.raises(ValueError, match="k=v"):
        with_model_args(card, "s_max")
    bad = yaml.safe_load((REPO / "model_cards" / "needle-qwen25vl.yaml").read_text())
    bad["model_args"]["retention"] = 0.1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="model_args sets retention.*--retention"):
        load_card(tmp_path / "bad.yaml")


def test_every_method_has_its_own_style_and_the_papers_methods_the_strong_colours():
    from resadapt_eval.methods import METHODS
    from resadapt_eval.report.plots import method_style

    styles = {m: method_style(m) for m in METHODS}
    assert len({(s["color"], s["marker"]) for s in styles.values()}) == len(METHODS)
    paper = [m for m, spec in METHODS.items() if spec.in_paper]
    tab20 = __import__("matplotlib").pyplot.get_cmap("tab20")
    assert [styles[m]["color"] for m in paper] == [tab20(2 * i) for i in range(len(paper))]
