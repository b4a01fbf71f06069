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
from orchestrator.batch import CellTable, parse_experiments
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
