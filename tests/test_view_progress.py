"""The live views say how far a run is: elapsed time, step N of M and an ETA when the trainer's event=start gives
its step total (the watch panel), and each running cell's step and tok/s (the batch view). Real runs, real
watcher (LocalTarget and its agent), rendered as a terminal would show them."""

from __future__ import annotations

import re
import sys

from rich.console import Console

from harness import write_inventory
from orchestrator.batch import Progress
from orchestrator.commands.batch import render_progress
from orchestrator.connections import Connections
from orchestrator.inventory import load_inventory
from orchestrator.runs import launch, spec_for, stop
from orchestrator.store import Store
from orchestrator.view import duration, eta_seconds, render
from orchestrator.watch import Watcher
from test_watch import run_until

TRAINER = """\
import sys, time
from datetime import datetime, timezone
def now():
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
total = int(sys.argv[1])
print(f"ts={now()} event=start run=r steps={total}", flush=True)
for step in range(1, total + 1):
    print(f"ts={now()} event=step step={step} tok_s=1000.0 loss=2.0", flush=True)
    time.sleep(0.05)
"""


def shown(renderable, width: int = 140) -> str:
    console = Console(record=True, width=width, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text()


def test_eta_comes_from_the_recent_step_rate():
    assert eta_seconds([(100.0, 10), (110.0, 110)], 1110) == 100.0  # 10 steps/s, 1000 to go
    assert eta_seconds([(100.0, 10)], 1110) is None and eta_seconds([(100.0, 10), (110.0, 110)], None) is None
    assert (duration(42), duration(185), duration(7620)) == ("42s", "3m05s", "2h07m")


def script_inventory(tmp_path, monkeypatch, variant: str, script: str, args: str = ""):
    """The local target `here` with one `command:` variant running `script` (Python), and a fresh registry."""
    (tmp_path / "trainer.py").write_text(script)
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(tmp_path / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {variant: {"command": f"{sys.executable} {tmp_path}/trainer.py {args}".rstrip()}},
    })
    monkeypatch.setenv("DFO_HOME", str(tmp_path / "state"))
    return load_inventory(path)


def test_watch_panel_and_batch_view_show_elapsed_step_of_total_eta_and_tok_s(tmp_path, monkeypatch):
    inventory = script_inventory(tmp_path, monkeypatch, "counted", TRAINER, "400")
    with Connections(inventory) as connections, Store(tmp_path / "state" / "dfo.db") as store:
        launch(connections.container("here"), spec_for(inventory, "here", "counted"), store, name="p1")
        watcher = Watcher(inventory, connections, store)
        try:
            watcher.attach("p1")
            run_until(watcher, lambda w: w.runs()[0].latest and w.runs()[0].latest.step >= 40)
            panel = shown(render(watcher))
            batch = shown(render_progress(Progress("sweep", {"done": 0, "failed": 0, "error": 0, "running": 1,
                                                             "pending": 2}, [("counted.here.r1", "p1")], None, []),
                                          watcher))
        finally:
            watcher.close()
            stop(connections.container("here"), store, "p1", grace_s=2)
    step = watcher.runs()[0].latest.step
    assert "running " in panel and f"of 400 (ETA " in panel, panel
    eta_text = panel.split("(ETA ")[1].split(")")[0]
    minutes, _, secs = eta_text.rpartition("m")
    eta = int(minutes or 0) * 60 + int(secs.rstrip("s"))
    assert 0.5 * (400 - step) * 0.05 < eta < 3 * (400 - step) * 0.05 + 2  # about 0.05 s a step to go
    assert "counted.here.r1" in batch and "p1" in batch and " of 400" in batch and "1,000 tok/s" in batch


COMPILING_TRAINER = """\
import os, sys, time
from datetime import datetime, timezone
def now():
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
print(f"ts={now()} event=start run=r variant={sys.argv[1]} steps=100000", flush=True)
while not os.path.exists(sys.argv[2]):  # "compiling" until the test says go
    time.sleep(0.05)
for step in range(1, 100001):
    print(f"ts={now()} event=step step={step} tok_s=1000.0 loss=2.0", flush=True)
    time.sleep(0.05)
"""


def panels_before_and_after_the_first_step(tmp_path, monkeypatch, compile_variant: str) -> tuple[str, str]:
    """The watch panel of a run whose event=start names `compile_variant`, once before its first step, once after
    its fifth."""
    go = tmp_path / "go"
    inventory = script_inventory(tmp_path, monkeypatch, "v", COMPILING_TRAINER, f"{compile_variant} {go}")
    with Connections(inventory) as connections, Store(tmp_path / "state" / "dfo.db") as store:
        launch(connections.container("here"), spec_for(inventory, "here", "v"), store, name="c1")
        watcher = Watcher(inventory, connections, store)
        try:
            watcher.attach("c1")
            run_until(watcher, lambda w: any("event=start" in line for line in w.runs()[0].lines))
            before = shown(render(watcher))
            go.touch()
            run_until(watcher, lambda w: w.runs()[0].latest and w.runs()[0].latest.step >= 5)
            after = shown(render(watcher))
        finally:
            watcher.close()
            stop(connections.container("here"), store, "c1", grace_s=2)
    return before, after


def test_watch_panel_names_the_compile_phase_then_only_the_steps(tmp_path, monkeypatch):
    compiling, stepping = panels_before_and_after_the_first_step(tmp_path, monkeypatch, "trees")
    assert re.search(r"compiling, \d+s", compiling), compiling  # was: "running 3s no step yet"
    assert "no step yet" not in compiling
    assert "step " in stepping and "compiling" not in stepping and "waiting for the first step" not in stepping


def test_watch_panel_of_an_eager_run_before_its_first_step_says_no_step_yet_and_for_how_long(tmp_path, monkeypatch):
    waiting, _ = panels_before_and_after_the_first_step(tmp_path, monkeypatch, "eager")
    assert re.search(r"no step yet, \d+s", waiting) and "compiling" not in waiting, waiting
