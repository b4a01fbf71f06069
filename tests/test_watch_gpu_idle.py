"""The watch on a two-GPU target: per-GPU samples in the event stream and the view, and a drafter GPU that
goes idle while the other stays busy is flagged (`gpu_idle`) and named in the crash verdict that follows.

Real agent and real `nvidia-smi -lms 1000` sampler over LocalTarget, the nvidia-smi stand-in driven through
its state file, a small `command:` trainer that logs steps until told to die."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from harness import write_inventory
from harness.nvidia_smi import STATE_ENV, Gpu, NvidiaSmiState
from rich.console import Console

from orchestrator.connections import Connections
from orchestrator.inventory import load_inventory
from orchestrator.runs import launch, spec_for, stop
from orchestrator.store import Store
from orchestrator.view import render
from orchestrator.watch import Watcher

# logs a step every 0.1 s until the file named by argv[1] exists, then dies like a drafter process
DRAFTER_DIES = """\
import os, sys, time
from datetime import datetime, timezone
def now():
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
step = 0
while not os.path.exists(sys.argv[1]):
    step += 1
    print(f"ts={now()} event=step step={step} tok_s=50000.0 loss=3.0 active=2/2", flush=True)
    time.sleep(0.1)
print("Traceback (most recent call last):\\nRuntimeError: injected failure in drafter 1", flush=True)
print(f"ts={now()} event=error reason=\\"drafter1: process ended (exit status 1)\\"", flush=True)
sys.exit(1)
"""


@pytest.mark.slow
def test_the_gpu_that_goes_idle_first_is_flagged_and_named_in_the_crash(tmp_path, monkeypatch, pct_env):
    busy = dict(memory_used_mib=40960, utilization_pct=95)
    gpus = NvidiaSmiState(tmp_path / "nvidia-smi.json", [Gpu(0, **busy), Gpu(1, **busy), Gpu(2, **busy)])
    monkeypatch.setenv(STATE_ENV, str(gpus.path))
    monkeypatch.setenv("DFO_HOME", str(tmp_path / "state"))
    (tmp_path / "drafter_dies.py").write_text(DRAFTER_DIES)
    die = tmp_path / "die-now"
    workspace = tmp_path / "ws"
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(workspace)},
        "hosts": {"local": {"transport": "local", "containers": {"two": {"ctid": None, "gpus": [0, 1]}}}},
        "variants": {"dies": {"command": f"{sys.executable} {tmp_path}/drafter_dies.py {die}"}},
        "fallback": ["dies"],
    })
    inventory = load_inventory(path)
    with Connections(inventory) as connections, Store(tmp_path / "state" / "dfo.db") as store:
        launch(connections.container("two"), spec_for(inventory, "two", "dies"), store, name="g1")
        watcher = Watcher(inventory, connections, store)
        try:
            watcher.attach("g1")
            events = drive(watcher, lambda evs: sum(e.kind == "gpu" for e in evs) >= 2)
            gpus.set_load(1, utilization_pct=0)  # drafter 1's GPU stops; GPU 0 keeps going
            events += drive(watcher, lambda evs: any(e.kind == "gpu_idle" for e in evs))
            [idle] = [e for e in events if e.kind == "gpu_idle"]
            assert (idle.gpu, idle.busy_gpus, idle.run) == (1, [0], "g1")
            shown = Console(record=True, width=140)
            shown.print(render(watcher))
            view = shown.export_text()
            assert "GPU0" in view and "GPU1" in view and "GPU2" not in view and "went idle" in view
            die.write_text("")
            events += drive(watcher, lambda evs: watcher.settled())
        finally:
            watcher.close()
            for run in store.list_runs(active=True):
                stop(connections.container(run.target), store, run.name, grace_s=2)
    samples = [e.gpus for e in events if e.kind == "gpu"]
    assert samples and all(sorted(g["index"] for g in s) == [0, 1] for s in samples)  # the target's GPUs only
    assert {"mem_used_mib", "mem_total_mib", "util_pct"} <= set(samples[0][0])
    [decision] = watcher.final_decisions()
    assert decision.decision == "crash"
    assert f"GPU 1 went idle first at {idle.idle_since} (GPU 0 still busy)" in decision.reason
    assert decision.evidence["gpu_idle_first"]["gpu"] == 1
    assert [e["kind"] for e in store_events(tmp_path)].count("gpu_idle") == 1  # kept in the registry too


def drive(watcher: Watcher, done, timeout: float = 30.0) -> list[dict]:
    events: list = []
    deadline = time.monotonic() + timeout
    while not done(events):
        assert time.monotonic() < deadline, f"timed out; last events: {events[-5:]}"
        events += watcher.step(0.2)
    return events


def store_events(tmp_path: Path) -> list[dict]:
    with Store(tmp_path / "state" / "dfo.db") as store:
        return store.events("g1")
