"""What a fallback launch carries and checks: the user's `--set` overrides go to the next built-in-trainer
variant; the target's GPUs must be idle again (the preflight's GPU check) before it starts; a container
out of reach for good ends the watch undecided, while a shorter outage resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import typer
from harness import write_inventory
from harness.nvidia_smi import STATE_ENV, Gpu, NvidiaSmiState

from rich.console import Console

from orchestrator.chains import FallbacksLeft, Outcome
from orchestrator.commands.runs import stop_command
from orchestrator.connections import Connections
from orchestrator.decide import DecideConfig
from orchestrator.errors import CommandTimeout
from orchestrator.inventory import load_inventory
from orchestrator.remote.base import render as shell_form
from orchestrator.remote.local import LocalTarget
from orchestrator.runs import launch, spec_for, stop
from orchestrator.store import Store
from orchestrator.view import render
from orchestrator.watch import Watcher
from test_view_progress import shown
from test_watch import CUDAGRAPH_TLS_CRASH, FAST_WATCH, PY, run_until, write_trainers

# Stands in for the target's python: `-m trainer ARGS` prints ARGS, makes the run's directory (runs/NAME in the
# workspace) as the trainer does once it accepts its settings (a launch with --set waits for that, up to
# runs.SETTINGS_CHECK_S), then plays a trainer chosen by its --variant (trees: the cudagraph_tls crash; any
# other: a steady run); anything else is the real python (the push probe, the watch agent).
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "trainer" ]; then
  echo "trainer args: $*"
  name=$(echo " $* " | sed -n 's/.* --run-name \\([^ ]*\\) .*/\\1/p')
  [ -n "$name" ] && mkdir -p "runs/$name"
  case " $* " in
    *" --variant trees "*) exec {py} {scripts}/tls_crash.py ;;
    *) exec {py} {scripts}/steady_trainer.py 400 0.02 ;;
  esac
fi
exec {py} "$@"
"""


def make_lab(tmp_path: Path, monkeypatch, *, gpus: list[int] | None = None, gpu_busy: bool = False):
    """Inventory, connections and store for the local target, with built-in-trainer variants run by FAKE_PYTHON
    and the nvidia-smi stand-in showing GPU 0 (busy or idle)."""
    state = NvidiaSmiState(tmp_path / "nvidia-smi.json",
                           [Gpu(0, memory_used_mib=40960 if gpu_busy else 0, utilization_pct=87 if gpu_busy else 0)])
    monkeypatch.setenv(STATE_ENV, str(state.path))
    scripts = tmp_path / "scripts"
    write_trainers(scripts)
    python = tmp_path / "fakepython"
    python.write_text(FAKE_PYTHON.format(py=PY, scripts=scripts))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    container = {"ctid": None, "python": str(python), **({"gpus": gpus} if gpus else {})}
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(tmp_path / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": container}}},
        "variants": {"trees": {"compile": "trees", "preset": "tiny-cpu", "args": {"steps": 2000}},
                     "nographs": {"compile": "nographs", "preset": "tiny-cpu"},
                     "mine": {"command": f"{PY} {scripts}/steady_trainer.py 400 0.02"},  # 8 s
                     # 2 min: for a test that needs its run alive while dfo processes start on a loaded machine
                     "long": {"command": f"{PY} {scripts}/steady_trainer.py 6000 0.02"}},
        "fallback": ["trees", "nographs"],
        "watch": FAST_WATCH,
    })
    monkeypatch.setenv("DFO_HOME", str(tmp_path / "state"))
    return load_inventory(path), state


def record_commands(monkeypatch) -> list[str]:
    """Every command the local target runs or streams from now on, rendered as a shell would get it."""
    sent: list[str] = []
    run, stream = LocalTarget.run, LocalTarget.stream

    def recording_run(self, cmd, **kwargs):
        sent.append(shell_form(cmd))
        return run(self, cmd, **kwargs)

    def recording_stream(self, cmd):
        sent.append(shell_form(cmd))
        return stream(self, cmd)

    monkeypatch.setattr(LocalTarget, "run", recording_run)
    monkeypatch.setattr(LocalTarget, "stream", recording_stream)
    return sent


class Session:
    def __init__(self, inventory, store: Store, connections: Connections) -> None:
        self.inventory, self.store, self.connections = inventory, store, connections
        self.watchers: list[Watcher] = []

    def launch(self, variant: str, name: str, sets: dict | None = None) -> str:
        spec = spec_for(self.inventory, "here", variant, sets=sets)
        return launch(self.connections.container("here"), spec, self.store, name=name).run.name

    def watcher(self, **options) -> Watcher:
        self.watchers.append(Watcher(self.inventory, self.connections, self.store, **options))
        return self.watchers[-1]

    def close(self) -> None:
        for watcher in self.watchers:
            watcher.close()
        for run in self.store.list_runs(active=True):
            stop(self.connections.container(run.target), self.store, run.name, grace_s=2)


def session(tmp_path, inventory):
    connections = Connections(inventory)
    store = Store(tmp_path / "state" / "dfo.db")
    return Session(inventory, store, connections)


def test_set_overrides_of_the_first_launch_go_to_the_fallback_run(tmp_path, monkeypatch, pct_env) -> None:
    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    try:
        lab.launch("trees", "o1", sets={"steps": "77", "optim.lr": "0.01"})
        watcher = lab.watcher()
        watcher.attach("o1")
        run_until(watcher, lambda w: len(w.chains()[0]["runs"]) == 2, timeout=40)
        child = lab.store.get_run("o1.2-nographs")
        assert "--steps 77" in child.command and "--set optim.lr=0.01" in child.command
        assert "--variant nographs" in child.command
        [launched] = lab.store.events("o1.2-nographs", kind="started")
        assert launched["data"]["sets"] == {"steps": "77", "optim.lr": "0.01"}
        run_until(watcher, lambda w: lab.store.samples("o1.2-nographs"))
        log = (tmp_path / "ws" / "logs" / "o1.2-nographs.log").read_text()
        assert "--steps 77" in log.splitlines()[0]  # the trainer itself was given them
    finally:
        lab.close()


@pytest.mark.slow
def test_a_fallback_waits_for_the_gpus_to_go_idle_and_starts_once_they_do(tmp_path, monkeypatch, pct_env) -> None:
    inventory, gpu_state = make_lab(tmp_path, monkeypatch, gpus=[0], gpu_busy=True)
    sent = record_commands(monkeypatch)
    lab = session(tmp_path, inventory)
    try:
        lab.launch("trees", "g1")
        watcher = lab.watcher(gpu_release_s=20)
        watcher.attach("g1")
        run_until(watcher, lambda w: lab.store.get_run("g1").state == "stopped", timeout=30)
        time.sleep(2)
        assert len(watcher.chains()[0]["runs"]) == 1  # the GPU still reads busy: nothing started yet
        gpu_state.set_load(0, memory_used_mib=0, utilization_pct=0)
        run_until(watcher, lambda w: len(w.chains()[0]["runs"]) == 2, timeout=20)
    finally:
        lab.close()
    # each try is one remote command: the GPU check, the launch probe and the start together (was three: an
    # nvidia-smi query per poll, then the probe, then the start script)
    tries = [cmd for cmd in sent if "--query-gpu" in cmd or ("setsid nohup" in cmd and "g1.2-nographs" in cmd)]
    assert tries and all(word in cmd for cmd in tries for word in ("--query-gpu", "log=free", "setsid nohup"))


def test_a_fallback_onto_gpus_that_stay_busy_is_not_launched_and_says_why(tmp_path, monkeypatch, pct_env) -> None:
    inventory, _ = make_lab(tmp_path, monkeypatch, gpus=[0], gpu_busy=True)
    lab = session(tmp_path, inventory)
    try:
        lab.launch("trees", "b1")
        watcher = lab.watcher(gpu_release_s=1)
        watcher.attach("b1")
        events = run_until(watcher, Watcher.settled, timeout=30)
        [error] = [e for e in events if e.kind == "action_error"]
        assert "not launching nographs" in error.error and "GPU 0 40960 MiB" in error.error
        assert [r.name for r in lab.store.list_runs()] == ["b1"]
        assert watcher.final_decisions()[0].next_run is None
    finally:
        lab.close()


def pids_where(match) -> list[int]:
    """PIDs of the processes whose command line (its NUL-separated parts) `match` accepts."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parts = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(parts):
            pids.append(int(proc.name))
    return pids


def agent_pids(workspace: Path) -> list[int]:
    where = str(workspace).encode()
    return pids_where(lambda parts: any(part.endswith(b"dfo_agent.py") and where in part for part in parts))


def cut_off(workspace: Path) -> list[Path]:
    """The container stops answering: its agent is killed and cannot be started again."""
    agents = list(workspace.glob(".dfo/pkg/*/dfo_agent.py"))
    for agent in agents:
        agent.rename(agent.with_suffix(".gone"))
    for pid in agent_pids(workspace):
        os.kill(pid, 9)
    return agents


@pytest.mark.slow
def test_a_container_out_of_reach_for_good_ends_the_watch_undecided_and_a_short_outage_resumes(
        tmp_path, monkeypatch, pct_env) -> None:
    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    workspace = tmp_path / "ws"
    try:
        lab.launch("long", "u1")  # still running after the outage, however slow the machine
        watcher = lab.watcher(unreachable_s=2, decide_config=DecideConfig(min_steady_steps=10_000))
        watcher.attach("u1")
        run_until(watcher, lambda w: len(lab.store.samples("u1")) >= 5)
        agents = cut_off(workspace)
        events = run_until(watcher, Watcher.settled, timeout=30)
        [decision] = watcher.final_decisions()
        assert (decision.decision, decision.action) == ("undecided", "none")
        assert "here unreachable for" in decision.reason and decision.evidence["unreachable_s"] >= 2
        assert "unreachable" in [e.kind for e in events]
        assert watcher.runs()[0].lost and lab.store.get_run("u1").decision["reason"] == decision.reason
        assert lab.store.get_run("u1").state == "running"  # giving up on watching never touches the run
        view = Console(record=True, width=160)
        view.print(render(watcher))
        shown = view.export_text()
        assert "here: reconnecting" in shown and "gives up after 2 s" in shown and "given up" in shown

        for agent in agents:  # the container answers again: the run is followed and judged from where it was
            agent.with_suffix(".gone").rename(agent)
        stored = len(lab.store.samples("u1"))
        run_until(watcher, lambda w: not w.runs()[0].lost and len(lab.store.samples("u1")) > stored + 5, timeout=30)
        steps = [s["step"] for s in lab.store.samples("u1")]
        assert steps == sorted(set(steps)) and not watcher.settled()
    finally:
        lab.close()


def test_a_fallback_whose_launch_is_refused_closes_with_the_refusal_and_is_not_tried_again(
        tmp_path, monkeypatch, pct_env) -> None:
    # the successor's log is already there: its launch is refused before anything starts (its row forgotten);
    # the fallback ends with that refusal, it is not left open with "no run named ..." for every next watch
    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    try:
        lab.launch("trees", "r1")
        (tmp_path / "ws" / "logs" / "r1.2-nographs.log").write_text("a log from before\n")
        watcher = lab.watcher()
        watcher.attach("r1")
        events = run_until(watcher, Watcher.settled, timeout=30)
        [error] = [e for e in events if e.kind == "action_error"]
        assert "launching nographs failed" in error.error and "never overwrites a log" in error.error
        assert lab.store.open_intents() == []  # closed: the next watch does not try it again
        assert [r.name for r in lab.store.list_runs()] == ["r1"]
    finally:
        lab.close()


def start_unanswered(lab: Session, monkeypatch, parent: str, name: str) -> None:
    """Launch `parent` (a steady run), then its successor `name` whose start gets no answer although it started
    (DFO_TEST_START_TIMEOUT_AT=after_start): its row `unconfirmed` (no PID), its process running."""
    lab.launch("mine", parent)
    monkeypatch.setenv("DFO_TEST_START_TIMEOUT_AT", "after_start")
    with pytest.raises(CommandTimeout):
        launch(lab.connections.container("here"), spec_for(lab.inventory, "here", "mine", parent=parent), lab.store,
               name=name)
    monkeypatch.delenv("DFO_TEST_START_TIMEOUT_AT")


def test_dfo_stop_stops_a_successor_whose_start_got_no_answer_but_runs(tmp_path, monkeypatch, pct_env, capsys) -> None:
    # a fallback's successor started, its PID never came back: its row is `unconfirmed` (no PID), yet it runs
    # (docs/runs.md); `dfo stop` finds it by its exit file path, as it does a `launching` row, and stops it
    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    try:
        start_unanswered(lab, monkeypatch, "s1", "s1.2-mine")
        unseen = lab.store.get_run("s1.2-mine")
        assert (unseen.state, unseen.pid) == ("unconfirmed", None)
        capsys.readouterr()
        with pytest.raises(typer.Exit) as done:  # the command's exit status (c8bf307: several runs, one status)
            stop_command(["s1.2-mine"], all_runs=False, grace=2, inventory=None, as_json=True)
        assert done.value.exit_code == 0
        stopped = json.loads(capsys.readouterr().out)
        assert (stopped["state"], stopped["signal"]) == ("stopped", "TERM")
        assert not run_processes(tmp_path / "ws", "s1.2-mine")  # nothing of it is left running
    finally:
        lab.close()


def run_processes(workspace: Path, name: str) -> list[int]:
    """PIDs whose command line names run `name`'s exit file."""
    marker = str(workspace / "logs" / f"{name}.log.exit").encode()
    return pids_where(lambda parts: any(marker in part for part in parts))


def test_a_second_dfo_stop_that_finds_the_run_ended_by_the_first_keeps_the_first_ones_record(
        tmp_path, monkeypatch, pct_env) -> None:
    # two stops of one run (a batch's stop_when and the user's, say): the second is past its identity check when
    # the first's SIGTERM ends the run; it signals nothing, and must not rewrite the run as having crashed on
    # its own (exit 143) nor withdraw the first's stop request (a watch would then take the exit for a crash)
    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    paused = tmp_path / "paused"
    try:
        lab.launch("long", "d1")  # "mine" (8 s) ended on its own while a loaded machine started the second dfo
        second = subprocess.Popen([str(Path(sys.executable).parent / "dfo"), "stop", "d1", "--grace", "5", "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "DFO_TEST_PAUSE_AT": "identified", "DFO_TEST_PAUSE_FILE": str(paused)})
        try:
            deadline = time.monotonic() + 60
            while not paused.exists():
                assert second.poll() is None and time.monotonic() < deadline, second.communicate(timeout=5)
                time.sleep(0.05)
            first = stop(lab.connections.container("here"), lab.store, "d1", grace_s=5)
            assert (first.run.state, first.signal) == ("stopped", "TERM")
            paused.unlink()
            out, err = second.communicate(timeout=60)
        finally:
            second.kill()
        assert second.returncode == 0, err
        assert json.loads(out)["signal"] is None  # the second signalled nothing
        run = lab.store.get_run("d1")
        assert (run.state, run.exit_code) == ("stopped", first.run.exit_code)
        assert run.stop_requested_at is not None
    finally:
        lab.close()


def test_a_watch_of_a_run_whose_start_got_no_answer_follows_it_when_it_runs(tmp_path, monkeypatch, pct_env) -> None:
    # its row is `unconfirmed` (no PID), yet it runs: the watch finds it by its exit file path first (as for a
    # `launching` row) and judges its steps, instead of reading "no exit file" as a crash (exit -1)
    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    try:
        start_unanswered(lab, monkeypatch, "w1", "w1.2-mine")
        watcher = lab.watcher()
        watcher.attach("w1.2-mine")
        run_until(watcher, Watcher.settled, timeout=40)
        [chain] = watcher.chains()
        assert (chain["current"], chain["decision"]["decision"]) == ("w1.2-mine", "steady"), chain["decision"]["reason"]
        assert lab.store.get_run("w1.2-mine").state == "running"
    finally:
        lab.close()


def test_a_watch_leaves_a_batch_runs_crash_to_its_batch_and_says_which_command(tmp_path, monkeypatch, pct_env) -> None:
    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    try:
        spec = spec_for(inventory, "here", "trees", batch="bw")
        launch(lab.connections.container("here"), spec, lab.store, name="bw.trees.here.r1")
        events = []
        watcher = lab.watcher(on_event=lambda event: events.append(event.to_json()))
        watcher.attach("bw.trees.here.r1")
        run_until(watcher, lambda w: any(event["kind"] == "left_to_batch" for event in events), timeout=40)
        [left] = [event for event in events if event["kind"] == "left_to_batch"]
        assert (left["batch"], left["command"]) == ("bw", "dfo batch FILE (batch bw)")  # no batch file recorded
        assert lab.store.children("bw.trees.here.r1") == [] and lab.store.open_intents() == []  # nothing done
        assert not any(event["kind"] in ("acting", "stopped", "fell_back") for event in events)
    finally:
        lab.close()


def test_a_watch_leaves_a_batch_cells_open_fallback_to_its_batch_when_it_holds_the_chain(
        tmp_path, monkeypatch, pct_env) -> None:
    # a `dfo batch` killed inside a cell's fallback leaves its intent open; a `dfo watch` of the cell's run that
    # takes the chain's claim (the dead batch's lease ran out: a slow machine) finished it itself, launching the
    # successor outside the batch's GPU ledger; it says which command finishes it and launches nothing
    from orchestrator.chains import FALLBACK, record_fallback
    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    try:
        spec = spec_for(inventory, "here", "trees", batch="bo")
        launch(lab.connections.container("here"), spec, lab.store, name="bo.trees.here.r1")
        record_fallback(lab.store, "bo.trees.here.r1", FALLBACK,
                        {"run": "bo.trees.here.r1", "variant": "nographs", "name": "bo.trees.here.r1.2-nographs",
                         "chain": ["trees", "nographs"], "reason": "crash"})
        events: list[dict] = []
        watcher = lab.watcher(on_event=lambda event: events.append(event.to_json()))
        watcher.attach("bo.trees.here.r1")
        assert watcher.owns("bo.trees.here.r1")
        run_until(watcher, lambda w: any(event["kind"] == "left_to_batch" for event in events), timeout=20)
        [left] = [event for event in events if event["kind"] == "left_to_batch"]
        assert (left["run"], left["command"]) == ("bo.trees.here.r1", "dfo batch FILE (batch bo)")
        deadline = time.monotonic() + 3  # a fallback carried out here would have stopped it and launched by then
        while time.monotonic() < deadline:
            watcher.step(0.2)
        assert lab.store.children("bo.trees.here.r1") == [] and len(lab.store.open_intents()) == 1  # nothing done
        assert not any(event["kind"] in ("acting", "stopped", "fell_back") for event in events)
    finally:
        lab.close()


def test_a_batch_cells_crash_is_acted_on_and_recorded_as_a_watch_acts_on_a_runs(tmp_path, monkeypatch, pct_env) -> None:
    """A cell's crash (cudagraph_tls, its process alive) is decided and carried out by the batch's Lifecycle with the
    code `dfo watch` falls back with, under BATCH_POLICY: the crashed run's decision (what `dfo runs NAME` shows and a
    notification carries) says `fallback` to nographs and names the successor it launched, and its record has the
    `acting`, `stopped` and `fell_back` events, as a watched run's crash has. Before, the batch's Watcher judged with
    fallback off and its scheduler fell back itself: the decision said `stop` (no next variant, no next run) while the
    cell fell back, and the run's record said nothing of the fallback."""
    from orchestrator.batch import open_watcher, run_batch
    from orchestrator.experiments import parse_experiments

    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    try:
        lab.launch("trees", "w1")  # the same crash under `dfo watch`: what a fallback leaves in the registry
        watcher = lab.watcher()
        watcher.attach("w1")
        run_until(watcher, lambda w: len(w.chains()[0]["runs"]) == 2 and not w.runs()[0].acting, timeout=40)
        plan = parse_experiments("batch: bf\ntargets: [here]\nmatrix: {variant: [trees]}\nfallback: [trees, nographs]\n"
                                 "stop_when: {steps: 30}\n", inventory)
        batch = open_watcher(inventory, lab.connections, lab.store)
        try:
            [cell] = run_batch(plan, inventory, lab.connections, lab.store, batch, poll_s=0.3)
        finally:
            batch.close()
        root = "bf.trees.here.r1"
        assert (cell.state, cell.outcome["runs"]) == ("done", [root, f"{root}.2-nographs"]), cell
        for run, successor in (("w1", "w1.2-nographs"), (root, f"{root}.2-nographs")):
            decision = lab.store.get_run(run).decision
            assert (decision["decision"], decision["signature"], decision["action"], decision["next_variant"],
                    decision["next_run"]) == ("crash", "cudagraph_tls", "fallback", "nographs", successor), (run, decision)
            kinds = [event["kind"] for event in lab.store.events(run)]
            assert kinds.count("acting") == kinds.count("stopped") == kinds.count("fell_back") == 1, (run, kinds)
            [fell_back] = lab.store.events(run, kind="fell_back")
            assert (fell_back["data"]["next_run"], fell_back["data"]["variant"]) == (successor, "nographs")
        assert lab.store.get_run(f"{root}.2-nographs").parent == root
    finally:
        lab.close()


# cudagraph_tls while the process lives (test_watch's trainer), then, on SIGTERM, 6 s to write a checkpoint and exit 75
CHECKPOINTING_CRASH = ("import signal\nasked = []\nsignal.signal(signal.SIGTERM, lambda *_: asked.append(1))\n"
                       + CUDAGRAPH_TLS_CRASH.replace("time.sleep(600)", "while not asked:\n    time.sleep(0.05)\n"
                                                     "print('writing the checkpoint', flush=True)\ntime.sleep(6)\n"
                                                     "sys.exit(75)"))


def checkpointing_inventory(tmp_path, monkeypatch):
    """The local target with `ckpt` (CHECKPOINTING_CRASH, stop_grace_s: 20) falling back to `nographs` (steady),
    and a fresh registry."""
    scripts = tmp_path / "scripts"
    write_trainers(scripts)
    (scripts / "checkpointing_crash.py").write_text(CHECKPOINTING_CRASH)
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(tmp_path / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {"ckpt": {"command": f"{PY} {scripts}/checkpointing_crash.py", "stop_grace_s": 20},
                     "nographs": {"command": f"{PY} {scripts}/steady_trainer.py 400 0.02"}},
        "fallback": ["ckpt", "nographs"],
        "watch": FAST_WATCH,
    })
    monkeypatch.setenv("DFO_HOME", str(tmp_path / "state"))
    return load_inventory(path)


def test_the_live_view_shows_a_fallbacks_stop_waiting_for_the_run_to_checkpoint_and_exit(tmp_path, monkeypatch,
                                                                                          pct_env) -> None:
    """A run that crashes (cudagraph_tls) while its process lives, and then takes 6 s after its SIGTERM to write its
    checkpoint: while the fallback's stop waits for it, its panel says so, with since when, how long ago the SIGTERM
    went out and the grace left before SIGKILL (its variant's stop_grace_s: 20 s), and keeps up with the wait. Once
    it has exited and its successor runs, the line is gone. The view showed only `crash [cudagraph_tls] -> fallback
    (in progress)`; `dfo stop` alone said `waiting for run ... to checkpoint and exit` (every 10 s, on stderr)."""
    lab = session(tmp_path, checkpointing_inventory(tmp_path, monkeypatch))
    try:
        lab.launch("ckpt", "k1")
        watcher = lab.watcher()
        watcher.attach("k1")
        panels: list[str] = []

        def waiting(w) -> bool:
            panels.append(shown(render(w)))
            return "stopping: waiting for it to checkpoint and exit since " in panels[-1]

        def sent() -> int:
            return int(re.search(r"\(SIGTERM sent (\d+)s ago;", panels[-1]).group(1))

        run_until(watcher, waiting, timeout=30)
        run_until(watcher, lambda w: waiting(w) and sent() >= 3, timeout=10)  # the line keeps up with the wait
        line = next(line for line in panels[-1].splitlines() if "stopping: waiting" in line)
        assert "crash [cudagraph_tls]" in panels[-1] and " of its 20 s grace)" in line, panels[-1]
        left = int(line.split("SIGKILL in ")[1].split("s of its")[0])
        assert 20 - sent() - 1 <= left <= 20 - sent(), line
        run_until(watcher, lambda w: len(w.chains()[0]["runs"]) == 2 and not w.runs()[0].acting, timeout=40)
        after = shown(render(watcher))
        assert "stopping: waiting" not in after, after
        assert (lab.store.get_run("k1").state, lab.store.get_run("k1").exit_code) == ("stopped", 75)
    finally:
        lab.close()


def test_the_batch_view_shows_a_cells_fallback_stop_waiting_for_its_run_to_checkpoint_and_exit(tmp_path, monkeypatch,
                                                                                               pct_env) -> None:
    """`dfo batch`'s live view (render_progress, as each progress comes) of a cell whose run crashes and takes 6 s to
    checkpoint after the SIGTERM of the cell's fallback: its running row says the stop's wait instead of the step,
    as the watch's panel does (the batch's Supervisor hands its waits to the Watcher); it said the last step and
    tok/s. Then the successor runs to the batch's stop_when and the cell is done."""
    from orchestrator.batch import open_watcher, run_batch
    from orchestrator.commands.batch import render_progress
    from orchestrator.experiments import parse_experiments

    inventory = checkpointing_inventory(tmp_path, monkeypatch)
    plan = parse_experiments("batch: bw\ntargets: [here]\nmatrix: {variant: [ckpt]}\nfallback: [ckpt, nographs]\n"
                             "stop_when: {steps: 30}\n", inventory)
    frames: list[str] = []
    with Connections(inventory) as connections, Store(tmp_path / "state" / "dfo.db") as store:
        watcher = open_watcher(inventory, connections, store)
        try:
            [cell] = run_batch(plan, inventory, connections, store, watcher, poll_s=0.3,
                               on_progress=lambda progress: frames.append(shown(render_progress(progress, watcher), 220)))
        finally:
            watcher.close()
    waits = [line for frame in frames for line in frame.splitlines() if "stopping: waiting" in line]
    assert waits and all(" bw.ckpt.here.r1 " in line and " of its 20 s grace)" in line for line in waits), frames[-3:]
    said = sorted({int(re.search(r"\(SIGTERM sent (\d+)s ago;", line).group(1)) for line in waits})
    assert said[0] <= 1 and said[-1] >= 4, said  # kept up with the wait
    assert cell.state == "done" and cell.outcome["runs"] == ["bw.ckpt.here.r1", "bw.ckpt.here.r1.2-nographs"], cell


class StuckStop:
    """Supervisor.stop standing in for a stop stuck in a remote call past every timeout: it ends only when the
    test lets it go (`release`), saying which thread it ran on."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, name: str, reason: str) -> Outcome:
        self.threads.append(threading.current_thread())
        self.release.wait(60)
        return Outcome(name, reason=reason, note="let go by the test")


def stuck_stop_under_way(tmp_path, monkeypatch, name: str, **options) -> tuple[Session, Watcher, StuckStop]:
    """A watch of run `name` whose stop (its action) is stuck: what `dfo watch` holds when Ctrl-C comes."""
    inventory, _ = make_lab(tmp_path, monkeypatch)
    lab = session(tmp_path, inventory)
    lab.launch("mine", name)
    watcher = lab.watcher(**options)
    watcher.attach(name)
    stuck = StuckStop()
    monkeypatch.setattr(watcher.lifecycle.supervisor, "stop", stuck)
    watcher.stop_run(name, "test")
    deadline = time.monotonic() + 10
    while not stuck.threads:
        assert time.monotonic() < deadline, "the stop never started"
        time.sleep(0.05)
    return lab, watcher, stuck


def test_a_second_ctrl_c_leaves_a_stuck_stop_at_once_whichever_thread_the_os_gives_it_to(
        tmp_path, monkeypatch, pct_env) -> None:
    # before: the first Ctrl-C's wait joined the action's thread with no timeout, which a SIGINT delivered to
    # another thread (the OS may pick any) never woke: dfo waited for the stuck stop, here until the test let it go
    lab, watcher, stuck = stuck_stop_under_way(tmp_path, monkeypatch, "k1", stop_grace_s=1)
    let_go = threading.Timer(20, stuck.release.set)
    let_go.start()
    said: list[list[str]] = []
    try:
        threading.Timer(0.3, signal.pthread_kill, [stuck.threads[0].ident, signal.SIGINT]).start()  # Ctrl-C again
        started = time.monotonic()
        try:
            left = watcher.lifecycle.finish_actions(said.append)  # what the first Ctrl-C does
        except KeyboardInterrupt:
            pytest.fail("the second Ctrl-C came through only once the stuck stop had ended")
        assert time.monotonic() - started < 10, "the second Ctrl-C was taken only once the stuck stop had ended"
        assert isinstance(left, FallbacksLeft) and left.overdue_s is None
        assert said == [["k1 (a stop only: test)"]] and left.fallbacks == ["k1 (a stop only: test)"]
    finally:
        let_go.cancel()
        stuck.release.set()
        lab.close()


def test_after_ctrl_c_a_stop_still_under_way_past_its_bound_is_left_half_done(
        tmp_path, monkeypatch, pct_env, capfd) -> None:
    # a stop takes its grace plus its remote calls' timeouts at most (runs.STOP_MARGIN_S, 1 s here): one stuck
    # past that no longer keeps dfo waiting (before: for as long as it was stuck, here until the test let it go)
    from orchestrator import chains
    from orchestrator.commands import common
    from orchestrator.commands.watch import stopped_watching

    monkeypatch.setattr(chains, "STOP_MARGIN_S", 1.0, raising=False)  # (raising: before, chains had no bound)
    lab, watcher, stuck = stuck_stop_under_way(tmp_path, monkeypatch, "k2", stop_grace_s=0.5)
    let_go = threading.Timer(20, stuck.release.set)
    let_go.start()
    try:
        started = time.monotonic()
        left = watcher.lifecycle.finish_actions(lambda fallbacks: None)
        assert time.monotonic() - started < 10  # the bound is 1.5 s; the stop is let go at 20 s
        assert isinstance(left, FallbacksLeft) and left.fallbacks == ["k2 (a stop only: test)"] and left.overdue_s == 1.5
        monkeypatch.setattr(common.os, "_exit", lambda code: sys.exit(code))  # dfo leaves at once: os._exit
        with pytest.raises(SystemExit) as leaving:
            stopped_watching(left)
        assert leaving.value.code == 130
        assert ("still under way after 1.5 s, longer than its remote calls can take: the fallback of k2 (a stop only: "
                "test) is left half done; the next `dfo watch` finishes it; the runs go on") in capfd.readouterr().err
    finally:
        let_go.cancel()
        stuck.release.set()
        lab.close()
