"""A run that degrades after `dfo watch` declared it steady: the watch says so, live and in its JSON.

Local target, real agent processes, small trainers written as `command:` variants (tests/test_watch.py's lab),
the nvidia-smi stand-in's memory moved by the test while the agent samples it (`nvidia-smi -lms 1000`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness import write_inventory
from harness.nvidia_smi import STATE_ENV, Gpu, NvidiaSmiState
from orchestrator.connections import Connections
from orchestrator.decide import memory
from orchestrator.inventory import load_inventory
from orchestrator.runs import stop
from orchestrator.store import Store
from test_watch import FAST_WATCH, PY, Lab, run_until

QUIET_TRAINER = """\
import sys, time
from datetime import datetime, timezone
steps = int(sys.argv[1])
print("ts=%s event=start" % datetime.now(timezone.utc).isoformat(), flush=True)
for step in range(1, steps + 1):
    ts = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    print(f"ts={ts} event=step step={step} tok_s={1000 + (step % 7) - 3:.1f} loss=1.0 active=1/1", flush=True)
    time.sleep(0.02)
time.sleep(600)  # the log goes quiet; the process (and its GPU memory) goes on
"""


@pytest.fixture
def lab(tmp_path, monkeypatch, pct_env):
    """A local target whose one variant is QUIET_TRAINER (300 steps), the nvidia-smi stand-in showing one busy
    H200 (`lab.gpu`), and a fresh registry."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "quiet_trainer.py").write_text(QUIET_TRAINER)
    gpu = NvidiaSmiState(tmp_path / "nvidia-smi.json", [Gpu(0, memory_used_mib=40_960, utilization_pct=90)])
    monkeypatch.setenv(STATE_ENV, str(gpu.path))
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(tmp_path / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {"quiet": {"command": f"{PY} {tmp_path}/scripts/quiet_trainer.py 300"}},
        "fallback": ["quiet"],
        "watch": FAST_WATCH,
    })
    monkeypatch.setenv("DFO_HOME", str(tmp_path / "state"))
    inventory = load_inventory(path)
    with Connections(inventory) as connections, Store(tmp_path / "state" / "dfo.db") as store:
        lab = Lab(inventory, connections, store, tmp_path / "ws")
        lab.path, lab.gpu = path, gpu
        yield lab
        for watcher in lab.watchers:
            watcher.close()
        for run in store.list_runs(active=True):
            stop(connections.container(run.target), store, run.name, grace_s=2)


def test_gpu_memory_climbing_while_the_log_is_quiet_is_said_without_a_new_line(lab, monkeypatch) -> None:
    """A run declared steady whose log then goes quiet (no line for the rest of the test, within the stall
    limit: 30 s) while its GPU memory climbs by 300 MiB a second: the watch says `degrading` from the GPU
    samples alone, in the stored decision and a `decision` event, with no log line after the declaration's.
    decide/memory.py's minute of samples in 5-s buckets is shortened to 8 s in 1-s buckets here (a bucket closes
    on the sample after it: one per ~2 s of the agent's 1-s samples), so it is said ~15 s into the quiet."""
    monkeypatch.setattr(memory, "MIN_WINDOW_S", 8.0)
    monkeypatch.setattr(memory, "BUCKET_S", 1.0)
    lab.launch("quiet", "m1")
    watcher = lab.watcher()
    watcher.attach("m1")
    run_until(watcher, lambda w: w.runs()[0].decision.decision == "steady")
    run_until(watcher, lambda w: w.runs()[0].latest is not None and w.runs()[0].latest.step == 300)
    quiet_from = time.monotonic()

    def climbing(w) -> bool:
        lab.gpu.set_load(0, memory_used_mib=int(40_960 + 300 * (time.monotonic() - quiet_from)))
        return w.runs()[0].decision.degrading is not None

    events = run_until(watcher, climbing, timeout=28)
    decision = watcher.runs()[0].decision
    assert decision.decision == "steady" and decision.degrading["what"] == "gpu_memory", decision.reason
    assert 10 < decision.degrading["gib_per_min"] < 25 and "; degrading: GPU 0 memory 40.0 -> " in decision.reason
    assert [e.step for e in events if e.kind == "step"] == []  # nothing came from the log meanwhile
    assert lab.store.samples("m1")[-1]["step"] == 300
    assert lab.store.get_run("m1").decision["degrading"]["what"] == "gpu_memory"
    assert any(e.kind == "decision" and e.decision["degrading"] for e in events)

