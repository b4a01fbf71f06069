"""dfo report from a registry filled as a batch leaves it: rows per cell, best configuration, CSV/JSON, a real PNG."""

from __future__ import annotations

import csv
import io
import json
import textwrap

import numpy
import pytest
from matplotlib import image

from orchestrator import report
from orchestrator.batch import CellTable
from orchestrator.experiments import parse_experiments
from orchestrator.errors import UsageError
from orchestrator.inventory import parse_inventory
from orchestrator.logfmt import format_ts
from orchestrator.store import Run, Store

INVENTORY = parse_inventory(textwrap.dedent("""
    hosts:
      pve1: {address: 10.0.0.1, containers: {ct200: {ctid: 200, gpus: [0, 1]}, ct201: {ctid: 201, gpus: [0, 1]}}}
    variants:
      trees: {compile: trees, preset: tiny-cpu}
      nographs: {compile: nographs, preset: tiny-cpu}
    fallback: [trees, nographs]
"""))
T0 = 1_800_000_000.0


def steady(run: str, tok_s: float, warmup_end_step: int = 20) -> dict:
    return {"decision": "steady", "run": run, "steady_tok_s": tok_s, "interval": [tok_s * 0.98, tok_s * 1.02],
            "warmup_end_step": warmup_end_step, "action": "keep"}


def add_run(store: Store, name: str, target: str, variant: str, levels: tuple[float, float], *, parent=None, decision=None):
    store.add_run(Run(name=name, target=target, variant=variant, parent=parent, batch="sweep", state="stopped",
                      started_at=format_ts(T0), ended_at=format_ts(T0 + 100), decision=decision))
    warm, level = levels
    store.add_samples(name, [{"step": s, "ts": T0 + 5 + s, "tok_s": warm if s < 20 else level} for s in range(0, 80)])


@pytest.fixture
def filled():
    """2 targets x 2 variants: trees crashed on ct201 and fell back to nographs; one cell never started."""
    plan = parse_experiments("batch: sweep\ntargets: [ct200, ct201]\nmatrix: {variant: [trees, nographs]}\n", INVENTORY)
    with Store.in_memory() as store:
        table = CellTable(store)
        table.save_plan(plan, format_ts(T0))
        add_run(store, "sweep.trees.ct200.r1", "ct200", "trees", (50, 900), decision=steady("sweep.trees.ct200.r1", 900))
        add_run(store, "sweep.trees.ct201.r1", "ct201", "trees", (50, 60), decision={"decision": "crash", "run": "x"})
        add_run(store, "sweep.trees.ct201.r1.2-nographs", "ct201", "nographs", (40, 700), parent="sweep.trees.ct201.r1",
                decision=steady("sweep.trees.ct201.r1.2-nographs", 700))
        add_run(store, "sweep.nographs.ct200.r1", "ct200", "nographs", (40, 650), decision=steady("sweep.nographs.ct200.r1", 650))
        store.add_gpu_samples("ct200", [{"ts": T0 + 50, "index": 0, "mem_used_mib": 20480.0}], run="sweep.trees.ct200.r1")
        store.add_gpu_samples("ct200", [{"ts": T0 + 50, "index": 1, "mem_used_mib": 30720.0}], run=None)  # shared sample
        for cell, run in (("trees.ct200.r1", "sweep.trees.ct200.r1"), ("trees.ct201.r1", "sweep.trees.ct201.r1"),
                          ("nographs.ct200.r1", "sweep.nographs.ct200.r1")):
            table.update("sweep", cell, state="done", root_run=run, gpu_ids=[0, 1], outcome={"why": "stop_when steady"})
        table.update("sweep", "nographs.ct201.r1", state="error", outcome={"error": "preflight failed: gpus_idle: busy"})
        yield store


def test_every_cell_has_a_row_with_its_figures(filled):
    rows = {row.cell: row for row in report.cell_rows(filled, "sweep")}
    assert list(rows) == ["trees.ct200.r1", "trees.ct201.r1", "nographs.ct200.r1", "nographs.ct201.r1"]
    trees = rows["trees.ct200.r1"]
    assert (trees.decision, trees.steady_tok_s, trees.interval_low, trees.interval_high) == ("steady", 900, 882, 918)
    assert trees.warmup_s == 25.0  # step 20 came 25 s after the start
    assert trees.peak_gpu_mem_mib == 20480.0
    fell_back = rows["trees.ct201.r1"]
    assert fell_back.fallbacks == ["nographs"] and fell_back.final_run == "sweep.trees.ct201.r1.2-nographs"
    assert fell_back.steady_tok_s == 700 and fell_back.config == "nographs"
    assert rows["nographs.ct200.r1"].peak_gpu_mem_mib == 30720.0  # from the target's samples while it ran
    assert rows["nographs.ct201.r1"].state == "error" and "gpus_idle" in rows["nographs.ct201.r1"].why


def test_best_configuration_per_target(filled):
    best = report.best_per_target(report.cell_rows(filled, "sweep"))
    assert [(b["target"], b["config"], b["steady_tok_s"]) for b in best] == [("ct200", "trees", 900.0), ("ct201", "nographs", 700.0)]


def test_csv_and_json_exports_carry_every_cell(filled):
    rows = report.cell_rows(filled, "sweep")
    parsed = list(csv.DictReader(io.StringIO(report.to_csv(rows))))
    assert [r["cell"] for r in parsed] == [row.cell for row in rows]
    assert parsed[1]["fallbacks"] == "nographs" and float(parsed[0]["steady_tok_s"]) == 900
    data = json.loads(json.dumps(report.to_json("sweep", rows)))
    assert len(data["cells"]) == 4 and data["best"][0]["config"] == "trees"


def test_unknown_batch_names_the_known_ones(filled):
    with pytest.raises(UsageError, match="no batch named 'nope' in the registry; known batches: sweep"):
        report.cell_rows(filled, "nope")


def test_plot_is_a_png_of_the_right_size_showing_the_data(filled, tmp_path):
    path = report.plot(filled, "sweep", report.cell_rows(filled, "sweep"), tmp_path / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)
    assert pixels.shape[:2] == (500, 1300)
    rgb = pixels[..., :3]
    assert rgb.std() > 0.05  # not a blank canvas
    coloured = (rgb.max(axis=2) - rgb.min(axis=2)) > 0.3  # lines and markers, not black text on white
    left, right = coloured[:, :750], coloured[:, 800:]
    assert left.sum() > 500 and right.sum() > 50  # both panels drew data
    empty = report.plot(filled, "sweep", [], tmp_path / "empty.png")
    assert ((image.imread(empty)[..., :3].max(axis=2) - image.imread(empty)[..., :3].min(axis=2)) > 0.3).sum() < numpy.prod(coloured.shape) * 0.001


# ---------------------------------------------------------------------------------------------- honest figures

def _sweep(store: Store, matrix: str, stop_when: str = "steady"):
    plan = parse_experiments(f"batch: sweep\ntargets: [ct200]\nmatrix: {matrix}\nstop_when: {stop_when}\n", INVENTORY)
    table = CellTable(store)
    table.save_plan(plan, format_ts(T0))
    return table


def add_levels(store: Store, name: str, variant: str, levels: list[float], *, decision=None):
    """A run whose tok/s steps through `levels`, one metric line per second."""
    store.add_run(Run(name=name, target="ct200", variant=variant, batch="sweep", state="stopped",
                      started_at=format_ts(T0), ended_at=format_ts(T0 + len(levels)), decision=decision))
    store.add_samples(name, [{"step": 10 * k, "ts": T0 + k, "tok_s": level} for k, level in enumerate(levels)])


def test_undecided_cell_gets_a_labelled_last_window_figure_and_is_not_ranked_against_steady_ones():
    with Store.in_memory() as store:
        table = _sweep(store, "{variant: [trees, nographs]}")
        add_levels(store, "s.trees", "trees", [900.0] * 100, decision=steady("s.trees", 7129))
        # still climbing when it was stopped: 8,800 over its last minute, no verdict
        add_levels(store, "s.nographs", "nographs", [5000.0] * 40 + [8800.0] * 60,
                   decision={"decision": "undecided", "run": "s.nographs", "steady_tok_s": None, "interval": None})
        table.update("sweep", "trees.ct200.r1", state="done", root_run="s.trees")
        table.update("sweep", "nographs.ct200.r1", state="done", root_run="s.nographs")
        rows = {row.cell: row for row in report.cell_rows(store, "sweep")}
        best = report.best_per_target(list(rows.values()))
    assert (rows["trees.ct200.r1"].tok_s, rows["trees.ct200.r1"].basis) == (7129, report.STEADY)
    assert (rows["nographs.ct200.r1"].tok_s, rows["nographs.ct200.r1"].basis) == (8800.0, report.LAST_WINDOW)
    assert rows["nographs.ct200.r1"].steady_tok_s is None
    assert [(b["config"], b["basis"]) for b in best] == [("trees", report.STEADY)]
    line = report.describe_best(best[0])
    assert "trees at 7,129 tok/s (steady" in line and "nographs ran faster (8,800" in line and "not compared" in line


def test_stop_when_steps_cells_without_a_verdict_still_get_figures_and_a_best():
    with Store.in_memory() as store:
        table = _sweep(store, "{variant: [trees, nographs]}", stop_when="{steps: 500}")
        add_levels(store, "s.trees", "trees", [100.0] * 10 + [600.0] * 41)  # no decision stored at all
        add_levels(store, "s.nographs", "nographs", [100.0] * 10 + [450.0] * 41)
        table.update("sweep", "trees.ct200.r1", state="done", root_run="s.trees", outcome={"why": "stop_when reached step 500"})
        table.update("sweep", "nographs.ct200.r1", state="done", root_run="s.nographs")
        rows = report.cell_rows(store, "sweep")
    assert [(row.tok_s, row.basis) for row in rows] == [(600.0, report.LAST_WINDOW), (450.0, report.LAST_WINDOW)]
    best = report.best_per_target(rows)
    assert (best[0]["config"], best[0]["tok_s"], best[0]["steady_tok_s"]) == ("trees", 600.0, None)
    assert "last-window median; no cell reached a steady state" in report.describe_best(best[0])


def test_last_window_is_the_last_minute_of_training_steps():
    samples = [{"ts": T0 + k, "tok_s": 100.0 if k < 80 else 300.0, "phase": "train"} for k in range(130)]
    samples.append({"ts": T0 + 131, "tok_s": 5.0, "phase": "eval"})  # evaluation is not training throughput
    assert report.last_window_median(samples) == 300.0  # 50 of the 61 lines in the last minute are at 300
    assert report.last_window_median([{"ts": T0, "tok_s": 7.0}, {"ts": T0 + 500, "tok_s": 9.0}]) == 8.0
    assert report.last_window_median([]) is None


def test_plot_survives_a_steady_figure_outside_its_interval(tmp_path):
    """Seen on real data: a median figure below its batch-means interval made matplotlib raise on negative yerr."""
    with Store.in_memory() as store:
        table = _sweep(store, "{variant: [trees]}")
        add_levels(store, "s.trees", "trees", [7000.0] * 50,
                   decision={**steady("s.trees", 7129), "interval": [7150.0, 7300.0]})
        table.update("sweep", "trees.ct200.r1", state="done", root_run="s.trees")
        rows = report.cell_rows(store, "sweep")
        path = report.plot(store, "sweep", rows, tmp_path / "outside.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.interval_bounds(rows[0]) == (7150.0, 7300.0)


def test_plot_colours_runs_by_configuration_not_by_run(filled, tmp_path):
    """Five runs of two configurations: two line colours (tab10's first two), not five."""
    path = report.plot(filled, "sweep", report.cell_rows(filled, "sweep"), tmp_path / "sweep.png")
    rgb = image.imread(path)[..., :3]
    left = rgb[40:380, 60:700]  # the over-time panel's plotting area

    def share(colour):
        return (numpy.abs(left - numpy.array(colour)).max(axis=2) < 0.08).mean()

    blue, orange, green, red = (0.122, 0.467, 0.706), (1.0, 0.498, 0.055), (0.173, 0.627, 0.173), (0.839, 0.153, 0.157)
    assert share(blue) > 0.0003 and share(orange) > 0.0003  # a one-pixel line is a small share of the panel
    assert share(green) < 0.00003 and share(red) < 0.00003


def test_report_table_fits_80_columns_with_figures_whole(filled, monkeypatch):
    from rich.console import Console

    from orchestrator.commands import batch as batch_command

    out = io.StringIO()
    monkeypatch.setattr(batch_command, "console", Console(file=out, width=80, color_system=None))
    rows = report.cell_rows(filled, "sweep")
    rows[0].fallbacks = ["nographs-with-a-long-name", "eager"]
    rows[0].tok_s = rows[0].steady_tok_s = 7129.4
    batch_command.show_report("sweep", rows, as_json=False)
    text = out.getvalue()
    assert max(map(len, text.splitlines())) <= 80
    assert "7,129" in text and "…" not in text
    assert "trees.ct200.r1" in text and "not shown for lack of width" in text
