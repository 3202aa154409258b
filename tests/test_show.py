"""What each method keeps, as pictures and numbers: `resadapt-eval show`, the kept-token maps and the
positional bias of `plots` and `tables`, and `--hard-subset`."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from resadapt_eval.baselines.common import Compression, TokenCompressor, holds_nothing, no_matmul
from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.cli import main
from resadapt_eval.kept import read_kept
from resadapt_eval.kinds import COMPRESSOR
from resadapt_eval.methods import METHODS, REQUIRED_RETENTION, Method, register
from resadapt_eval.pipeline import VideoPipeline, VideoPipelineConfig
from resadapt_eval.report.collect import CellRun
from resadapt_eval.report.hard_subset import Reference, hard_rows
from resadapt_eval.report.kept_maps import kept_map, kept_plots
from resadapt_eval.report.plots import _save
from resadapt_eval.report.show import DIM, contact_sheet, draw_tokens, frames_of, sample_rows

from .helpers import video_request

METHODS_SHOWN = [("vanilla", None), ("fixed_scale", 0.25), ("random_drop", 0.25), ("tome", 0.25)]


def top_rows(tokens, keep, seed=0):
    """A toy compressor with a positional bias: each pair keeps its first tokens (its top rows)."""
    assignment = torch.full((tokens.features.shape[0],), -1, dtype=torch.long)
    start, per_pair = 0, keep // len(tokens.pair_sizes)
    extra = keep - per_pair * len(tokens.pair_sizes)
    for i, size in enumerate(tokens.pair_sizes):
        n = per_pair + (1 if i < extra else 0)
        assignment[start : start + n] = torch.arange(start, start + n)
        start += size
    return Compression(assignment)


@pytest.fixture
def top_rows_method():
    method = register(
        Method(
            "top_rows",
            "Top Rows",
            "TopRows",
            COMPRESSOR,
            REQUIRED_RETENTION,
            compressor=TokenCompressor(top_rows, working_bytes=holds_nothing, host_syncs=0, config_flops=no_matmul),
        )
    )
    yield method
    del METHODS[method.name]


def run_folder(adapter, fixtures_dir, folder: Path, methods) -> list[dict]:
    """Each method's record of the first smoke video (doc id 7) in `folder`'s sidecar, as a run writes it."""
    request = video_request(adapter, fixtures_dir)
    request = dataclasses.replace(request, doc_id=7, task="t")
    records = []
    for method, retention in methods:
        config = VideoPipelineConfig(method=method, max_num_frames=8, budget=BudgetSpec(retention=retention))
        _, record = VideoPipeline(adapter, config).run(request)
        assert record.error is None, record.error
        records.append(record.to_dict())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "resadapt_samples_20261128_rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_show_draws_one_row_per_method_and_dims_exactly_the_dropped_tokens(adapters, fixtures_dir, tmp_path):
    records = run_folder(adapters["qwen25vl"], fixtures_dir, tmp_path / "run", METHODS_SHOWN)
    rows = sample_rows(tmp_path / "run", 7)
    order = sorted((m for m, _ in METHODS_SHOWN), key=list(METHODS).index)
    assert [r.record["method"] for r in rows] == order  # the registry's order: the paper's rows
    records = sorted(records, key=lambda r: order.index(r["method"]))
    sheet = contact_sheet(rows, tmp_path / "sheet.png")
    with Image.open(sheet.path) as png:
        assert png.size == sheet.size and png.size[0] > 600 and png.size[1] > 4 * 60
    for record, dropped in zip(records, sheet.dropped):
        kept = read_kept(record)
        pair_sizes = [t * h * w for t, h, w in record["grids"]]
        starts = np.cumsum([0, *pair_sizes])
        per_pair = [int((~kept.mask[a:b]).sum()) for a, b in zip(starts[:-1], starts[1:])]
        assert dropped == [d for d in per_pair for _ in range(2)]  # both frames of a pair
        assert sum(dropped) == 2 * (sum(pair_sizes) - record["visual_tokens"])
    by_method = dict(zip(order, sheet.dropped))
    assert sum(by_method["vanilla"]) == sum(by_method["fixed_scale"]) == 0 < sum(by_method["random_drop"])

    # the picture itself: a frame's dimmed token cells are exactly its dropped tokens
    record = records[order.index("random_drop")]
    frame = frames_of(record)[0]
    _, gh, gw = record["grids"][0]
    h, w = record["pair_sizes"][0]
    everything = np.arange(gh * gw)
    from resadapt_eval.video import read_frames

    plain = draw_tokens(read_frames(record["video"], record["frame_indices"][:1])[0], [h, w], (gh, gw), everything, 0)
    th, tw = h // gh, w // gw
    drawn, before = (
        image.astype(float).reshape(gh, th, gw, tw, 3).mean(axis=(1, 3, 4)) for image in (frame.image, plain)
    )
    dimmed = np.abs(drawn - DIM * before) < np.abs(drawn - before)  # closer to the dimmed cell than to the plain one
    lit = before > 20  # cells bright enough for dimming to show
    assert lit.mean() > 0.9 and (dimmed == frame.dropped)[lit].all()
    assert frame.dropped.sum() == by_method["random_drop"][0]
    assert read_kept(records[order.index("tome")]).merges  # its groups drawn in colour


def test_show_on_a_sweep_folder_and_its_errors(report_sweep, tmp_path, capsys):
    out = tmp_path / "sheet.png"
    assert main(["show", str(report_sweep), "--sample", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    cells = [line for line in printed.splitlines() if "dropped tokens per frame" in line]
    assert len(cells) == 5 and out.is_file()  # vanilla, fixed_scale and resadapt at 0.5 and 0.25
    assert main(["show", str(report_sweep), "--sample", "1", "--methods", "resadapt", "--out", str(out)]) == 0
    assert printed.count("resadapt R=") == 2

    tables = tmp_path / "tables"
    assert main(["tables", str(report_sweep), "--hard-subset", "fixed_scale@0.25", "--out", str(tables)]) == 0
    hard = (tables / "hard_subset.csv").read_text().splitlines()
    assert len(hard) == 1 + 5 and "Accuracy on the hard subset" in capsys.readouterr().out  # a row per cell
    assert main(["tables", str(report_sweep), "--hard-subset", "tome@0.25", "--out", str(tables)]) == 2
    assert "no cell of tome@0.25 in the folders" in capsys.readouterr().err

    assert main(["show", str(report_sweep), "--sample", "99", "--out", str(out)]) == 2
    assert "no record of doc id 99; the folder holds doc ids 0, 1, 2, 3" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["show", str(tmp_path / "empty"), "--sample", "0"]) == 2
    assert "holds no sidecar records" in capsys.readouterr().err
    (tmp_path / "videos").mkdir()
    assert main(["show", str(report_sweep), "--sample", "1", "--video-root", str(tmp_path / "videos")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--video-root {tmp_path / 'videos'} does not hold the video" in err

    # a folder copied elsewhere, drawn with the videos' new root
    video = Path(json.loads(next(report_sweep.rglob("resadapt_samples_*.jsonl")).read_text().splitlines()[0])["video"])
    moved = tmp_path / "moved" / video.parent.name
    moved.mkdir(parents=True)
    (moved / video.name).write_bytes(video.read_bytes())
    assert (
        main(["show", str(report_sweep), "--sample", "0", "--video-root", str(tmp_path / "moved"), "--out", str(out)])
        == 0
    )


def test_a_compressor_keeping_the_top_rows_shows_in_the_maps_and_the_bias(
    adapters, fixtures_dir, tmp_path, top_rows_method
):
    shown = [("top_rows", 0.25), ("random_drop", 0.25)]
    records = run_folder(adapters["qwen3vl"], fixtures_dir, tmp_path / "run", shown)
    maps = [
        kept_map(CellRun("c", "qwen3vl", None, m, r, 8, tmp_path, records=[rec])) for (m, r), rec in zip(shown, records)
    ]
    top, random = maps
    assert top.top_share > 0.95 and top.bottom_share == 0 and top.top_bottom_ratio == float("inf")
    assert 0.15 < random.top_share < 0.5 and 0.3 < random.top_bottom_ratio < 3
    rows, cols = np.nonzero(top.share > 0.5)
    assert rows.max() < 6 and cols.min() == 0  # the kept area: the top rows, every column
    cells = [CellRun("c", "qwen3vl", None, m, r, 8, tmp_path, records=[rec]) for (m, r), rec in zip(shown, records)]
    written = kept_plots(cells, tmp_path / "plots", _save)
    assert sorted(p.name for p in written) == sorted(
        f"kept_{kind}_c_f8.{ext}" for kind in ("map", "frames") for ext in ("png", "pdf")
    )


def test_the_hard_subset_is_the_references_wrong_answers():
    def cell(method, r, scores):
        return CellRun(
            "c", "qwen25vl", None, method, r, 8, Path("."), outcomes={("t", i): s for i, s in enumerate(scores)}
        )

    runs = [
        cell("fixed_scale", 0.25, [1, 0, 0, 1, 0]),  # wrong on 1, 2, 4
        cell("tome", 0.25, [0, 1, 0, 1, 1]),  # right on 1 and 4 of them
        cell("fixed_scale", 0.5, [1, 1, 1, 1, 0]),
        cell("tome", 0.5, [0, 0, 1, 1, 1]),
    ]
    same_r = {(r["method"], r["retention"]): r for r in hard_rows(runs, Reference.parse("fixed_scale"))}
    assert same_r["tome", 0.25]["subset"] == 3 and same_r["tome", 0.25]["score"] == pytest.approx(200 / 3)
    assert same_r["tome", 0.5]["subset"] == 1 and same_r["tome", 0.5]["score"] == 100.0
    assert same_r["fixed_scale", 0.25]["score"] == 0.0
    fixed = {(r["method"], r["retention"]): r for r in hard_rows(runs, Reference.parse("fixed_scale@0.25"))}
    assert fixed["tome", 0.5]["subset"] == 3 and fixed["tome", 0.5]["score"] == pytest.approx(200 / 3)
    with pytest.raises(ValueError, match="no cell of tome@0.1 in the folders"):
        hard_rows(runs, Reference.parse("tome@0.1"))
    with pytest.raises(ValueError, match="R must be a number"):
        Reference.parse("tome@x")
