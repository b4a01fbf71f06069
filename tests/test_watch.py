"""The watch loop over LocalTarget with real agent processes and small trainers written as `command:` variants:
steady reached, a crash falls back to the next variant (linked, named for its chain), --no-fallback only
reports, and a re-attach continues from the stored offsets without counting a step twice."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from harness import cli as harness_cli
from harness import write_inventory
from harness.nvidia_smi import STATE_ENV, Gpu, NvidiaSmiState
from rich.console import Console

from orchestrator.connections import Connections
from orchestrator.decide import DecideConfig, StepObs
from orchestrator.inventory import load_inventory
from orchestrator import runs
from orchestrator.runs import launch, prepare, spec_for, stop
from orchestrator.commands.watch import resolve_names
from orchestrator.errors import UnknownRun
from orchestrator.states import Action, Verdict
from orchestrator.store import Run, Store
from orchestrator.view import render
from orchestrator.chains import next_run_names
from orchestrator.watch import Watcher

PY = sys.executable
# Thresholds shortened for tests through the inventory's `watch:` section (decide/ keeps its own defaults).
FAST_WATCH = {"min_steady_steps": 40, "min_steady_seconds": 1, "stall_floor_s": 30, "first_step_grace_s": 60}

STEADY_TRAINER = """\
import os, random, sys, time
from datetime import datetime, timezone
steps, every = int(sys.argv[1]), float(sys.argv[2])
level = float(sys.argv[3]) if len(sys.argv) > 3 else 1000.0
gate = sys.argv[4] if len(sys.argv) > 4 else None  # its first step waits until this file exists
rng = random.Random(7)
print("ts=%s event=start" % datetime.now(timezone.utc).isoformat(), flush=True)
while gate and not os.path.exists(gate):
    time.sleep(0.05)
for step in range(1, steps + 1):
    ts = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    tok_s = level * (1 + rng.uniform(-0.004, 0.004))
    print(f"ts={ts} event=step step={step} tok_s={tok_s:.1f} loss={2.0 / step:.4f} q_fill=0.90 active=1/1", flush=True)
    time.sleep(every)
"""

# The cudagraph_tls crash (docs/design.md, "Crash signatures"), as a threaded trainer prints it when one drafter thread dies; the
# process then stays alive (the other threads go on, the GPU of the dead one idles).
CUDAGRAPH_TLS_CRASH = """\
import sys, time
from datetime import datetime, timezone
def now():
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
SITE = "/usr/local/lib/python3.11/site-packages"
for step in (1, 2, 3):
    print(f"ts={now()} event=step step={step} tok_s=900.0 loss=3.0 active=2/2", flush=True)
    time.sleep(0.05)
print(f'''Exception in thread Thread-2 (drafter):
Traceback (most recent call last):
  File "/usr/lib/python3.11/threading.py", line 1045, in _bootstrap_inner
    self.run()
  File "/usr/lib/python3.11/threading.py", line 982, in run
    self._target(*self._args, **self._kwargs)
  File "/workspace/.dfo/pkg/ab12/trainer/pipeline.py", line 88, in drafter_loop
    loss = step_fn(batch)
  File "{SITE}/torch/_dynamo/eval_frame.py", line 655, in _fn
    return fn(*args, **kwargs)
  File "{SITE}/torch/_inductor/cudagraph_trees.py", line 365, in get_container
    tree_manager_containers = self.tls_containers()
  File "{SITE}/torch/_inductor/cudagraph_trees.py", line 312, in get_obj
    assert torch._C._is_key_in_tls(attr_name)
AssertionError''', flush=True)
time.sleep(600)
"""


def write_trainers(directory: Path) -> dict[str, str]:
    """The trainer scripts in `directory`, and the `command:` of each variant that runs them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "steady_trainer.py").write_text(STEADY_TRAINER)
    (directory / "tls_crash.py").write_text(CUDAGRAPH_TLS_CRASH)
    return {
        "trees": f"{PY} {directory}/tls_crash.py",
        "nographs": f"{PY} {directory}/steady_trainer.py 400 0.02",
        "short": f"{PY} {directory}/steady_trainer.py 30 0.02",
        "failing": f"{PY} {directory}/steady_trainer.py 5 0.02; exit 3",
        "silent": f"{PY} {directory}/steady_trainer.py 3 0.02; sleep 600",
        "slower": f"{PY} {directory}/steady_trainer.py 400 0.02 800",
        "paced": f"{PY} {directory}/steady_trainer.py 400 0.1",  # steady ~6 s after its start, not ~1 s
        "gated": f"{PY} {directory}/steady_trainer.py 400 0.1 1000 {directory}/go",  # steps once `go` exists
        # 4 s, 5 steps, then a crash of the catalogue's (a line signature, cuda_capture_unsupported), exit 1
        "capturing": f"sleep 4; {PY} {directory}/steady_trainer.py 5 0.02; echo 'RuntimeError: CUDA error: operation "
                     f"not permitted when stream is capturing'; exit 1",
    }


@pytest.fixture
def lab(tmp_path, monkeypatch, pct_env):
    """A local target with its own workspace, the test trainers as variants, a fresh registry, and the
    nvidia-smi stand-in showing one busy H200."""
    gpu_state = NvidiaSmiState(tmp_path / "nvidia-smi.json", [Gpu(0, memory_used_mib=40960, utilization_pct=87)])
    monkeypatch.setenv(STATE_ENV, str(gpu_state.path))
    workspace = tmp_path / "ws"
    commands = write_trainers(tmp_path / "scripts")
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(workspace)},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {name: {"command": command} for name, command in commands.items()},
        "fallback": ["trees", "nographs"],
        "watch": FAST_WATCH,
    })
    monkeypatch.setenv("DFO_HOME", str(tmp_path / "state"))
    inventory = load_inventory(path)
    with Connections(inventory) as connections, Store(tmp_path / "state" / "dfo.db") as store:
        lab = Lab(inventory, connections, store, workspace)
        lab.path = path
        yield lab
        for watcher in lab.watchers:
            watcher.close()
        for run in store.list_runs(active=True):
            stop(connections.container(run.target), store, run.name, grace_s=2)


class Lab:
    def __init__(self, inventory, connections, store, workspace: Path) -> None:
        self.inventory, self.connections, self.store, self.workspace = inventory, connections, store, workspace
        self.watchers: list[Watcher] = []

    def launch(self, variant: str, name: str, batch: str | None = None) -> str:
        spec = spec_for(self.inventory, "here", variant, batch=batch)
        return launch(self.connections.container("here"), spec, self.store, name=name).run.name

    def watcher(self, **options) -> Watcher:
        watcher = Watcher(self.inventory, self.connections, self.store, **options)
        self.watchers.append(watcher)
        return watcher

    def log_steps(self, name: str) -> list[int]:
        text = (self.workspace / "logs" / f"{name}.log").read_text()
        return [int(line.split(" step=")[1].split()[0]) for line in text.splitlines() if " event=step " in line]


def run_until(watcher: Watcher, done, timeout: float = 30.0) -> list[dict]:
    """Step the watcher until done(watcher) or fail after `timeout` seconds; returns every event."""
    events: list = []
    deadline = time.monotonic() + timeout
    while not done(watcher):
        assert time.monotonic() < deadline, f"timed out; chains: {watcher.chains()}; last events: {events[-5:]}"
        events += watcher.step(0.2)
    return events


def wait_for_exit(lab, name: str, timeout: float = 60.0) -> Path:
    """The exit file of lab run `name` once its run has ended (the status written in it)."""
    exit_file = lab.workspace / "logs" / f"{name}.log.exit"
    deadline = time.monotonic() + timeout
    while not (exit_file.exists() and exit_file.read_text().strip()):
        assert time.monotonic() < deadline, f"{name} did not end within {timeout:g} s"
        time.sleep(0.1)
    return exit_file


def test_fallback_names_show_the_chain_and_skip_taken_names() -> None:
    with Store.in_memory() as store:
        store.add_run(Run(name="t1", target="here", variant="trees", state="crashed"))
        assert list(next_run_names(store, "t1", "nographs"))[:2] == ["t1.2-nographs", "t1.2-nographs-2"]
        store.add_run(Run(name="t1.2-nographs", target="here", variant="nographs", state="crashed"))  # no parent link
        assert next(iter(next_run_names(store, "t1", "nographs"))) == "t1.2-nographs-2"


def test_steady_command_reaches_steady_keep_and_stores_every_step(lab) -> None:
    lab.launch("nographs", "s1")
    watcher = lab.watcher()
    watcher.attach("s1")
    events = run_until(watcher, lambda w: w.settled() and w.runs()[0].gpu_now)  # a GPU sample shown, too
    [decision] = watcher.final_decisions()
    assert (decision.decision, decision.action, decision.run) == ("steady", "keep", "s1")
    assert (decision.decision, decision.action) == (Verdict.STEADY, Action.KEEP)  # typed: the enums, not their text
    assert 980 < decision.steady_tok_s < 1020 and decision.warmup_end_step is not None
    stored = lab.store.get_run("s1").decision
    assert stored["decision"] == "steady" and stored["evidence"]["steady"]["steps_used"] > 0
    steps = [s["step"] for s in lab.store.samples("s1")]
    assert steps == lab.log_steps("s1")[: len(steps)] and len(steps) >= 40
    assert [e.kind for e in events].count("decision") == 1
    view = Console(record=True, width=120)
    view.print(render(watcher))
    shown = view.export_text()
    assert f"steady {decision.steady_tok_s:,.0f} tok/s" in shown  # 999 or 1,0xx: the level is 1,000 +- 0.4%
    assert "s1" in shown and "active drafters 1/1" in shown and "queue 90%" in shown
    assert "GPU0" in shown and "87%" in shown and "here: connected" in shown
    assert any(ch in shown for ch in "▁▂▃▄▅▆▇")  # the tok/s sparkline
    watcher.close()
    assert lab.store.get_run("s1").state == "running"  # closing the watch never stops a run


def test_crash_while_alive_stops_it_and_launches_the_next_variant_linked(lab) -> None:
    lab.launch("trees", "c1")
    watcher = lab.watcher()
    watcher.attach("c1")
    events = run_until(watcher, Watcher.settled, timeout=40)
    [chain] = watcher.chains()
    assert chain["runs"] == ["c1", "c1.2-nographs"] and chain["decision"]["decision"] == "steady"
    crashed = lab.store.get_run("c1")
    assert crashed.state == "stopped" and crashed.decision["signature"] == "cudagraph_tls"
    assert (crashed.decision["action"], crashed.decision["next_run"]) == ("fallback", "c1.2-nographs")
    child = lab.store.get_run("c1.2-nographs")
    assert (child.parent, child.variant, child.chain) == ("c1", "nographs", [])
    kinds = [e.kind for e in events]
    assert kinds.index("stopped") < kinds.index("fell_back")
    assert len(watcher.observers) == 1  # the fallback is followed on the container's one channel
    assert {e["kind"] for e in lab.store.events("c1")} >= {"decision", "stopped", "fell_back"}
    # the crash is said once (--json, the registry's events, `dfo metrics`' timeline); its successor's name is
    # the fell_back event's and the stored decision's, not a second crash decision
    said = [e.decision for e in events if e.kind == "decision" and e.run == "c1" and e.decision["decision"] == "crash"]
    stored = [e["data"]["decision"] for e in lab.store.events("c1", kind="decision")
              if e["data"]["decision"]["decision"] == "crash"]
    assert (len(said), len(stored)) == (1, 1), (said, stored)
    assert [e.next_run for e in events if e.kind == "fell_back"] == ["c1.2-nographs"]


def test_the_watch_hands_each_decision_to_its_lifecycle_and_only_the_lifecycle_stops_and_falls_back(
        lab, monkeypatch) -> None:
    # issue 28's split: the Watcher follows, judges, stores and emits; what is done about a decision (the policy,
    # the stop, the successor's launch) is its lifecycle controller's alone, on the controller's one executor
    lab.launch("trees", "c1")
    watcher = lab.watcher()
    lifecycle, heard, carried = watcher.lifecycle, [], []
    decided, fall_back, stop = lifecycle.decided, lifecycle.supervisor.fall_back, lifecycle.supervisor.stop
    monkeypatch.setattr(lifecycle, "decided", lambda w: (heard.append((w.name, w.decision.decision)), decided(w)))
    monkeypatch.setattr(lifecycle.supervisor, "fall_back",
                        lambda run, variant, *a, **k: (carried.append(("fall_back", run.name, variant)),
                                                       fall_back(run, variant, *a, **k))[1])
    monkeypatch.setattr(lifecycle.supervisor, "stop",
                        lambda name, reason: (carried.append(("stop", name)), stop(name, reason))[1])
    watcher.attach("c1")
    events = run_until(watcher, Watcher.settled, timeout=40)
    assert [chain["runs"] for chain in watcher.chains()] == [["c1", "c1.2-nographs"]]
    assert carried == [("fall_back", "c1", "nographs"), ("stop", "c1")]  # the stop is the fallback's own
    emitted = [(e.run, e.decision["decision"]) for e in events if e.kind == "decision"]
    assert ("c1", "crash") in heard and set(emitted) <= set(heard)  # every decision said reached the lifecycle
    assert lab.store.get_run("c1").state == "stopped" and lab.store.get_run("c1.2-nographs").parent == "c1"


def test_a_run_another_dfo_is_still_launching_is_followed_once_it_starts_never_judged_gone_before(lab) -> None:
    # a watch that finds a run `launching` (its row made, its package pushed, its start not sent yet) by a dfo that
    # lives waits for that dfo to record its PID: followed without one, "no process, no exit file" read as a crash
    # 3 s later (exit -1), and the observer that later took the chain over stopped the healthy run
    prepared = prepare(lab.connections.container("here"), spec_for(lab.inventory, "here", "nographs"), lab.store,
                       name="pl")
    assert lab.store.get_run("pl").state == "launching"
    watcher = lab.watcher()
    watcher.attach("pl")
    events: list = []
    deadline = time.monotonic() + 5  # longer than the 3 s a PID gone without an exit file is given
    while time.monotonic() < deadline:
        events += watcher.step(0.2)
    assert [e.kind for e in events if e.kind in ("decision", "ended")] == []  # nothing judged while it launches
    prepared.start()
    events += run_until(watcher, Watcher.settled, timeout=40)
    [decision] = watcher.final_decisions()
    assert (decision.decision, decision.action, decision.run) == ("steady", "keep", "pl"), decision.reason
    assert lab.store.get_run("pl").state == "running"


def test_a_run_whose_launch_another_dfo_abandons_before_its_start_ends_the_watch_saying_nothing_ran(lab) -> None:
    prepared = prepare(lab.connections.container("here"), spec_for(lab.inventory, "here", "nographs"), lab.store,
                       name="pa")
    watcher = lab.watcher()
    watcher.attach("pa")
    watcher.step(0.2)
    prepared.cancel()  # a refused start forgets the row
    events = run_until(watcher, Watcher.settled, timeout=10)
    assert [e.kind for e in events if e.kind in ("decision", "ended", "acting")] == []  # no crash judged, nothing done
    [chain] = watcher.chains()
    assert chain["decision"]["decision"] == "undecided" and "nothing ran" in chain["decision"]["reason"]


def test_a_launch_renews_its_row_while_under_way_and_stops_once_started(lab, monkeypatch) -> None:
    monkeypatch.setattr(runs, "LAUNCH_LEASE_S", 0.4)
    prepared = prepare(lab.connections.container("here"), spec_for(lab.inventory, "here", "nographs"), lab.store,
                       name="pr")
    first = lab.store.get_run("pr").owner_seen_at
    deadline = time.monotonic() + 5
    while lab.store.get_run("pr").owner_seen_at == first:
        assert time.monotonic() < deadline, "the launching row was never renewed"
        time.sleep(0.05)
    seen_from_ws2 = replace(lab.store.get_run("pr"), owner="ws2:4242")  # as a dfo of another workstation reads it
    assert runs.launcher_alive(seen_from_ws2)
    assert not runs.launcher_alive(seen_from_ws2, now=seen_from_ws2.owner_seen_at + 0.5)  # had it stopped renewing
    prepared.start()
    deadline = time.monotonic() + 5
    while any(thread.name == "launch-lease-pr" for thread in threading.enumerate()):
        assert time.monotonic() < deadline, "the renewals went on after the start"
        time.sleep(0.05)
    assert lab.store.get_run("pr").state == "running"


def test_a_launch_a_dead_dfo_of_another_workstation_left_is_settled_once_its_row_is_not_renewed(lab, monkeypatch) -> None:
    # a dfo of another workstation cannot be looked at from here: its `launching` row was taken to be under way
    # for ever, and a watch of it waited for ever. Now the row is a lease that dfo renews while it launches.
    monkeypatch.setattr(runs, "LAUNCH_LEASE_S", 2.0)
    prepared = prepare(lab.connections.container("here"), spec_for(lab.inventory, "here", "nographs"), lab.store,
                       name="px")
    lab.store.update_run("px", owner="ws2:4242", owner_seen_at=time.time())  # ws2's dfo, renewing until now ...
    prepared.opened.call.cancel()  # ... dies before the start: its call on the target goes with it
    watcher = lab.watcher()
    watcher.attach("px")
    events: list = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        events += watcher.step(0.2)
    assert lab.store.get_run("px").state == "launching"  # within its lease: waited for, nothing judged
    assert [e.kind for e in events if e.kind in ("decision", "ended")] == []
    events += run_until(watcher, Watcher.settled, timeout=30)
    assert lab.store.get_run("px").state == "failed"
    assert [e.kind for e in events if e.kind in ("decision", "ended", "acting")] == []  # no crash judged, nothing done
    [chain] = watcher.chains()
    assert chain["decision"]["decision"] == "undecided"
    assert chain["decision"]["reason"] == "its launch never started on here (`failed`, no process found): nothing ran"


def test_a_launch_its_dead_dfo_never_started_is_not_judged_a_crash_nor_fallen_back_from(lab) -> None:
    # the row of a dfo of this workstation killed before the start, nothing of it on the target: marked `failed`,
    # then followed without a PID: "no process, no exit file" was judged a crash (exit -1) and fallen back from
    prepared = prepare(lab.connections.container("here"), spec_for(lab.inventory, "here", "trees"), lab.store,
                       name="pd")
    dead = subprocess.Popen(["true"])
    dead.wait()
    lab.store.update_run("pd", owner=f"{socket.gethostname()}:{dead.pid}")  # its launcher, gone
    prepared.opened.call.cancel()
    watcher = lab.watcher()
    watcher.attach("pd")
    events = run_until(watcher, Watcher.settled, timeout=20)
    assert [e.kind for e in events if e.kind in ("decision", "ended", "acting")] == []
    assert [run.name for run in lab.store.list_runs()] == ["pd"]  # no successor launched
    assert lab.store.get_run("pd").state == "failed"
    [chain] = watcher.chains()
    assert (chain["decision"]["decision"], chain["decision"]["reason"]) == (
        "undecided", "its launch never started on here (`failed`, no process found): nothing ran")
    view = Console(record=True, width=160)
    view.print(render(watcher))
    assert "nothing ran: its launch never started" in view.export_text()  # not "its container is out of reach"


def test_a_watch_that_attaches_a_successor_passed_by_follows_its_chain_to_the_one_launched_after_it(lab) -> None:
    # another dfo finished a fallback a dead dfo left half done: its half-launched successor marked `failed` and
    # passed by, the next name launched. A watch listing the failed one (it was `launching` when the watch listed
    # the active runs) ended at once, "nothing ran", while the chain went on at the new run
    lab.launch("short", "c")
    container = lab.connections.container("here")
    passed = prepare(container, spec_for(lab.inventory, "here", "nographs", parent="c"), lab.store, name="c.2-nographs")
    passed.cancel("its dfo died inside the launch; passed by for c.2-nographs-2")
    launch(container, spec_for(lab.inventory, "here", "nographs", parent="c"), lab.store, name="c.2-nographs-2")
    watcher = lab.watcher()
    watcher.attach("c.2-nographs")
    run_until(watcher, Watcher.settled, timeout=30)
    [chain] = watcher.chains()
    assert chain["runs"] == ["c", "c.2-nographs", "c.2-nographs-2"]
    assert (chain["current"], chain["decision"]["decision"]) == ("c.2-nographs-2", "steady"), chain["decision"]["reason"]


def test_attaching_a_start_never_seen_answered_does_not_stop_the_watch_while_its_grace_lasts(lab) -> None:
    # a start dfo sent but never saw answered (`unconfirmed`, no PID) whose process is not there yet is looked for
    # until watch.start_grace_s is over; attach did that asleep, the watch's lock held, so the live view of every
    # other run froze for up to start_grace_s (30 s by default). Now it is looked for on the watch's own polls.
    inventory = lab.inventory.model_copy(update={"watch": lab.inventory.watch.model_copy(update={"start_grace_s": 6.0})})
    lab.launch("nographs", "busy")
    slow = prepare(lab.connections.container("here"), spec_for(inventory, "here", "nographs"), lab.store, name="slow")
    try:
        lab.store.update_run("slow", state="unconfirmed", ended_at=datetime.now(timezone.utc).isoformat())
        watcher = Watcher(inventory, lab.connections, lab.store)
        lab.watchers.append(watcher)
        watcher.attach("busy")
        began = time.monotonic()
        watcher.attach("slow")
        assert time.monotonic() - began < 3  # not the grace's 6 s
        steps = []
        while time.monotonic() - began < 5:  # within the grace: busy's steps go on being handled
            steps += [e for e in watcher.step(0.2) if e.kind == "step" and e.run == "busy"]
        assert steps and lab.store.get_run("slow").state == "unconfirmed"
        run_until(watcher, lambda w: lab.store.get_run("slow").state == "failed", timeout=20)  # its grace over
        assert lab.store.get_run("busy").state == "running"
    finally:
        slow.opened.call.cancel()


def test_no_fallback_reports_a_nonzero_exit_and_launches_nothing(lab) -> None:
    lab.launch("failing", "f1")
    watcher = lab.watcher(fallback=False)
    watcher.attach("f1")
    run_until(watcher, Watcher.settled)
    [decision] = watcher.final_decisions()
    assert (decision.decision, decision.signature, decision.next_run) == ("crash", "exit_nonzero", None)
    assert decision.action == "stop"
    assert [r.name for r in lab.store.list_runs()] == ["f1"]
    assert lab.store.get_run("f1").state == "crashed" and lab.store.get_run("f1").exit_code == 3


def test_reattach_continues_from_the_offset_without_counting_twice(lab) -> None:
    lab.launch("nographs", "r1")
    first = lab.watcher()
    first.attach("r1")
    run_until(first, lambda w: len(lab.store.samples("r1")) >= 65)  # more than the sparkline keeps
    first.close()
    offset = lab.store.get_run("r1").log_offset
    assert offset > 0
    time.sleep(0.5)  # the run goes on while nobody watches
    second = lab.watcher()
    attached = second.attach("r1")
    assert attached.last_stored_step == lab.store.samples("r1")[-1]["step"]
    assert attached.latest.step == attached.last_stored_step  # the view shows where the run stood at once
    [event] = [e for e in lab.store.events("r1", kind="attached")][-1:]
    # the steps it logged meanwhile are read at the attach (its whole log, Watcher._replay), stored once
    assert event["data"]["steps_stored"] == len(lab.store.samples("r1")) and event["data"]["offset"] >= offset
    run_until(second, Watcher.settled)
    steps = [s["step"] for s in lab.store.samples("r1")]
    assert steps == sorted(set(steps)) and steps == lab.log_steps("r1")[: len(steps)]
    second.close()


def test_a_reattach_judges_each_step_once_and_says_no_decision_the_registry_holds_already(lab, monkeypatch) -> None:
    # the re-attach judges the run from its whole log (its text lines give a crash its signature), once: not from
    # its stored steps first and then from the log again; a decision the first watch recorded is not news again
    lab.launch("nographs", "j1")
    first = lab.watcher()
    first.attach("j1")
    run_until(first, lambda w: w.runs()[0].decision.decision == "steady" and len(lab.store.samples("j1")) >= 65)
    first.close()
    stored = len(lab.store.samples("j1"))
    judged: list[int] = []
    second = lab.watcher()
    new_judge = second._new_judge

    def counting_judge(run, chain):
        judge = new_judge(run, chain)
        observe = judge.observe
        judge.observe = lambda obs: (judged.append(obs.step) if isinstance(obs, StepObs) else None, observe(obs))[1]
        return judge

    monkeypatch.setattr(second, "_new_judge", counting_judge)
    attached = second.attach("j1")
    assert len(judged) >= stored and judged == sorted(set(judged)), (stored, judged[:3], len(judged))  # each once
    assert judged == [s["step"] for s in lab.store.samples("j1")][: len(judged)]
    assert attached.decision.decision == "steady"  # the view shows the verdict at once
    events = second.step(0)
    assert [e.decision["decision"] for e in events if e.kind == "decision"] == []  # steady was said by the first watch
    second.close()


def test_truncated_log_is_read_again_from_zero_with_an_event_and_no_double_count(lab) -> None:
    lab.launch("nographs", "t1")
    watcher = lab.watcher()
    watcher.attach("t1")
    run_until(watcher, lambda w: len(lab.store.samples("t1")) >= 60)
    before = len(lab.store.samples("t1"))
    (lab.workspace / "logs" / "t1.log").write_bytes(b"")  # rotated away under the run
    events = run_until(watcher, lambda w: len(lab.store.samples("t1")) >= before + 20)
    assert [e for e in events if e.kind == "truncated"]
    steps = [s["step"] for s in lab.store.samples("t1")]
    assert steps == sorted(set(steps))
    assert {e["kind"] for e in lab.store.events("t1")} >= {"attached", "truncated"}


def cli(tmp_path: Path) -> tuple[str, dict]:
    env = {**os.environ, "DFO_HOME": str(tmp_path / "state")}
    env.pop("DFO_INVENTORY", None)
    return str(Path(sys.executable).parent / "dfo"), env


@pytest.mark.slow
def test_launch_watch_cli_follows_its_own_chain_to_steady(lab, tmp_path) -> None:
    done = harness_cli.dfo("launch", "--host", "here", "--variant", "failing", "--name", "w1", "--no-preflight", "--chain",
                           "failing,nographs", "--watch", "--until-decided", "--json", "-i", str(lab.path),
                           env={"DFO_HOME": str(tmp_path / "state")})
    assert done.returncode == 0, done.stderr + done.stdout[-2000:]
    objects = [json.loads(line) for line in done.stdout.splitlines()]
    assert objects[0]["run"] == "w1" and "pid" in objects[0]  # launch's own JSON comes first
    final = objects[-1]
    assert (final["run"], final["decision"], final["action"], final["chain"]) == ("w1.2-nographs", "steady", "keep", "w1")
    assert lab.store.get_run("w1").decision["signature"] == "exit_nonzero"


def test_a_silent_run_is_stalled_on_the_watch_clock_and_falls_back(lab) -> None:
    lab.launch("silent", "q1")
    config = DecideConfig(stall_floor_s=2, min_steady_steps=40, min_steady_seconds=1)
    watcher = lab.watcher(decide_config=config, chain_override=["silent", "nographs"])
    watcher.attach("q1")
    run_until(watcher, lambda w: lab.store.get_run("q1").decision is not None
              and lab.store.get_run("q1").decision["decision"] == "stall")
    stalled = lab.store.get_run("q1").decision
    assert stalled["at_step"] == 3 and stalled["evidence"]["silent_s"] > 2
    assert stalled["action"] == "fallback" and stalled["next_variant"] == "nographs"
    run_until(watcher, lambda w: len(w.chains()[0]["runs"]) == 2)
    assert watcher.chains()[0]["runs"] == ["q1", "q1.2-nographs"]


def test_poll_mode_reaches_the_same_verdict(lab) -> None:
    lab.launch("nographs", "p1")
    watcher = lab.watcher(poll=0.5)
    watcher.attach("p1")
    run_until(watcher, Watcher.settled)
    [decision] = watcher.final_decisions()
    assert (decision.decision, decision.action) == ("steady", "keep")
    steps = [s["step"] for s in lab.store.samples("p1")]
    assert steps == lab.log_steps("p1")[: len(steps)]


@pytest.mark.slow
def test_ctrl_c_ends_the_watch_and_leaves_the_run_and_no_agent_running(lab, tmp_path) -> None:
    lab.launch("paced", "k1")  # 40 s: 'nographs' (8 s) had ended by the Ctrl-C when a loaded machine was slow to start dfo
    dfo, env = cli(tmp_path)
    watching = subprocess.Popen([dfo, "watch", "k1", "--json", "-i", str(lab.path)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = (watching.stdout.readline() for _ in range(50))
        assert any('"kind": "step"' in line for line in lines)  # it is watching
        ours = f"{lab.workspace}/.dfo/pkg/.*dfo_agent.py"
        agents = subprocess.run(["pgrep", "-f", ours], capture_output=True, text=True).stdout.split()
        assert agents
        watching.send_signal(signal.SIGINT)
        assert watching.wait(timeout=20) == 130
        assert "the runs go on" in watching.stderr.read()
    finally:
        watching.kill()
    assert lab.store.get_run("k1").state == "running"
    assert all(not Path(f"/proc/{pid}").exists() for pid in agents)  # its channel's agent exited with it


def test_a_ctrl_c_while_the_live_view_prints_a_batch_of_lines_still_shows_every_line_and_the_frame(lab) -> None:
    """The Ctrl-C lands as the first scroll-back line of a batch is written (a run that crashed: its verdict, its
    ending). Before, the rest of the batch and the frame were lost (a CI run's `dfo watch` showed a decline but
    not the verdict it re-opened); now every line is printed, then the frame, then the watch ends (Ctrl-C)."""
    from orchestrator.commands.watch import SHOWN_EVENTS, drive, event_line, show
    from rich.live import Live

    lab.launch("failing", "f1")  # 5 steps, exit 3
    wait_for_exit(lab, "f1")
    emitted: list = []
    unshown: list = []
    watcher = lab.watcher(fallback=False, on_event=lambda event: (emitted.append(event), unshown.append(event)))
    watcher.attach("f1")

    class PressesCtrlC(io.StringIO):
        def write(self, text: str) -> int:
            if " f1: " in text and not pressed:
                pressed.append(text)
                os.kill(os.getpid(), signal.SIGINT)
            return super().write(text)

    pressed: list[str] = []
    screen = PressesCtrlC()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with Live(render(watcher), console=Console(file=screen, width=200), auto_refresh=False) as live:
                drive(watcher, False, 0.1, lambda: show(live, watcher, unshown))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert pressed, "no scroll-back line was written"
    lines = [event_line(event) for event in emitted if event.kind in SHOWN_EVENTS]
    shown = screen.getvalue()
    assert len(lines) >= 2 and "crash" in shown and all(line in shown for line in lines), (lines, shown)
    assert shown.rindex("f1") > shown.index(lines[-1])  # the frame, after the lines
    assert unshown == []


def test_a_ctrl_c_held_while_lines_print_takes_effect_after_them_and_a_second_one_at_once() -> None:
    """What the live view and --json print is printed whole (commands/common.py ctrl_c_held); a second Ctrl-C is
    not held: a write to a pipe nobody reads must not keep dfo from leaving."""
    from orchestrator.commands.common import ctrl_c_held

    done: list[str] = []
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c_held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                done.append("printed after the first")
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c_held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                done.append("printed after the second")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert done == ["printed after the first"]


def test_watch_names_resolve_to_the_newest_run_of_their_chain_and_default_to_active_runs() -> None:
    with Store.in_memory() as store:
        store.add_run(Run("a", "here", variant="trees", state="stopped"))
        store.add_run(Run("a.2-notrees", "here", variant="notrees", parent="a", state="crashed"))
        store.add_run(Run("a.3-nographs", "here", variant="nographs", parent="a.2-notrees", state="running"))
        store.add_run(Run("b", "here", variant="eager", state="running"))
        store.add_run(Run("old", "here", variant="eager", state="exited"))
        assert resolve_names(store, []) == ["a.3-nographs", "b"]
        assert resolve_names(store, ["a", "a.2-notrees", "old"]) == ["a.3-nographs", "old"]
        with pytest.raises(UnknownRun):
            resolve_names(store, ["nope"])


def test_too_slow_against_the_best_steady_run_of_the_same_batch_unless_peer_baselines_are_off(lab) -> None:
    lab.launch("nographs", "fast1", batch="b1")
    watcher = lab.watcher(fallback=False)
    watcher.attach("fast1")
    run_until(watcher, Watcher.settled)
    lab.launch("slower", "slow1", batch="b1")
    lab.launch("slower", "slow2", batch="b1")
    watcher.attach("slow1")
    judged_alone = lab.watcher(fallback=False, peer_baseline=False)
    judged_alone.attach("slow2")
    run_until(watcher, Watcher.settled)
    run_until(judged_alone, Watcher.settled)
    slow = lab.store.get_run("slow1").decision
    assert (slow["decision"], slow["action"]) == ("too_slow", "stop")
    assert slow["evidence"]["baseline_tok_s"] == lab.store.get_run("fast1").decision["steady_tok_s"]
    assert 790 < slow["steady_tok_s"] < 810 and slow["interval"][1] < 0.9 * slow["evidence"]["baseline_tok_s"]
    assert lab.store.get_run("slow2").decision["decision"] == "steady"


def test_a_watch_waiting_on_a_lease_held_on_another_workstation_says_who_holds_it_once(lab, tmp_path) -> None:
    # the chain's lease is held by a live dfo of another workstation (it renews; it cannot be looked at from here):
    # the watch only shows the run; it said nothing of why in its live view (the JSON `attached` alone named it)
    from orchestrator.logfmt import format_ts

    # a run that steps every 0.1 s once the test opens its gate, after the hand-over below: its verdict (a quiet
    # level) then comes ~6 s later. Ungated, a loaded machine gave the verdict before the hand-over: the watch
    # ended on what it only showed, and never took over
    lab.launch("gated", "h9")
    since = time.time() - 90
    lab.store.claim("chain:h9", "ws2-dfo", pid=4242, host="ws2.example.org", ttl_s=15, now=since)
    lab.store.claim("chain:h9", "ws2-dfo", pid=4242, host="ws2.example.org", ttl_s=600, now=time.time())  # renewed
    dfo, env = cli(tmp_path)
    watching = subprocess.Popen([dfo, "watch", "h9", "--until-decided", "--interval", "0.2", "-i", str(lab.path)],
                                env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[str] = []
    told = threading.Event()

    def read() -> None:
        for line in watching.stdout:
            lines.append(line)
            if "held by dfo" in line:
                told.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert told.wait(timeout=30), "".join(lines)[-3000:]
        time.sleep(1)  # renewals tried meanwhile: the line must not repeat
        lab.store.release_claim("chain:h9", "ws2-dfo")  # that dfo ended: this watch takes the chain over
        (tmp_path / "scripts" / "go").touch()
        watching.wait(timeout=90)
        reader.join(timeout=10)
        err = watching.stderr.read()
    finally:
        watching.kill()
    out = "".join(lines)
    assert watching.returncode == 0, err[-2000:] + out[-2000:]
    said = [line for line in out.splitlines() if "lease_held" in line or "held by dfo" in line]
    stamp = format_ts(since)
    assert len(said) == 1, out[-3000:]
    assert (f"h9: its chain is held by dfo pid 4242 on ws2.example.org since {stamp[:10]} {stamp[11:19]} UTC: this "
            "watch shows it and stores or acts on nothing while that dfo renews its lease; it takes the chain over "
            "once that dfo ends (its lease runs out 600 s later): end it on ws2.example.org (Ctrl-C, or kill 4242) "
            "to take over") in said[0], said[0]
    assert "took_over" in out and lab.store.get_run("h9").decision["decision"] == "steady"  # then it acted
