"""The run lifecycle through a real sshd and a real LXC container behind the pct stand-in, as a user drives it
from the command line: a launch killed at each point is resolved by the next `dfo runs`; `dfo runs` sees runs
that ended unwatched; `dfo logs -f` ends with the run; watch/logs/stop find the inventory the run came from
(and say when it changed or is gone); two watchers of one chain store every step once and fall back once,
the second taking over when the first is killed -9; a stop during a watch is no crash; `launch --watch`
exit codes; `dfo resume` continues a stopped trainer from its checkpoint's step."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from harness import write_inventory
from harness.cli import DFO, Ran, dfo
from harness.lxc import LxcContainer
from orchestrator.connections import Connections
from orchestrator.inventory import load_inventory
from orchestrator.logfmt import format_ts
from orchestrator.runs import stop
from orchestrator.store import Run, Store
from test_launch_ssh import wait_for
from test_watch import FAST_WATCH, PY, write_trainers

pytestmark = [pytest.mark.lxc, pytest.mark.slow]

# Steady for 1000 steps (about 20 s), then exit 3: long enough for a watcher's lease (15 s) to run out.
LONG_THEN_CRASH = "{py} /workspace/scripts/steady_trainer.py 1000 0.02; exit 3"
GATE = "/workspace/go"
START_GRACE_S = 8  # a start that got no answer: how long its run may take to show (watch.start_grace_s)
GATED = f"while [ ! -e {GATE} ]; do sleep 0.1; done; exit 3"  # runs until the test opens the gate, then exits 3


@dataclass
class Lab:
    inventory: Path
    container: LxcContainer
    state: Path
    start_grace_s: float = 8.0  # the inventory's watch.start_grace_s

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "DFO_HOME": str(self.state), **extra}
        env.pop("DFO_INVENTORY", None)
        return env

    def dfo(self, *args: str, timeout: float = 120, inventory: bool = True, **env: str) -> Ran:
        """`dfo ARGS -i INVENTORY` in this process (harness.cli.dfo: a process of its own, within `timeout`, where
        `env` arms a fault hook that ends dfo)."""
        argv = [*args, *(["-i", str(self.inventory)] if inventory else [])]
        try:
            return dfo(*argv, env={"DFO_HOME": str(self.state), **env}, timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # say where it was: a flake under load is otherwise mute
            said = b"".join(part for part in (exc.stdout, exc.stderr) if isinstance(part, bytes)).decode(errors="replace")
            with self.store() as store:
                events = [(event["at"], event["run"], event["kind"], event["data"]) for event in store.events()[-15:]]
            raise AssertionError(f"dfo {' '.join(args)} ran past {timeout:g} s; it said: {said[-2000:]!r}; "
                                 f"the registry's last events: {events}") from exc

    def popen(self, *args: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen([DFO, *args, "-i", str(self.inventory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.env(**env))

    def launch(self, variant: str, name: str, *extra: str) -> None:
        done = self.dfo("launch", "--host", "ct_a", "--variant", variant, "--name", name, "--no-preflight", *extra)
        assert done.returncode == 0, done.stderr

    def runs(self) -> dict[str, dict]:
        done = self.dfo("runs", "--json", inventory=False)
        assert done.returncode == 0, done.stderr
        return {run["name"]: run for run in json.loads(done.stdout)}

    def log_steps(self, name: str) -> list[int]:
        text = self.container.path(f"/workspace/logs/{name}.log").read_text()
        return [int(m) for m in re.findall(r" event=step step=(\d+) ", text)]

    def store(self) -> Store:
        return Store(self.state / "dfo.db")


def stall_floor_s(request) -> float:
    """The watch's stall floor: FAST_WATCH's 30 s, or what a test's `stall_floor` mark asks. Only a test that waits
    for a stall asks for a short one: a 3-s floor for every run took a trainer that a loaded CI machine held up
    for a few seconds (a write to its log stuck behind the disk) for a stalled one, and stopped it."""
    mark = request.node.get_closest_marker("stall_floor")
    return mark.args[0] if mark else FAST_WATCH["stall_floor_s"]


def start_grace_s(request) -> float:
    """watch.start_grace_s: START_GRACE_S, or what a test's `start_grace` mark asks (a test whose next step must
    come within the grace of a start that got no answer: a loaded machine used up 8 s between two dfo commands)."""
    mark = request.node.get_closest_marker("start_grace")
    return mark.args[0] if mark else START_GRACE_S


@pytest.fixture
def lab(request, tmp_path, sshd, ssh_home, container: LxcContainer):
    commands = write_trainers(container.path("/workspace/scripts"))
    inside = {name: command.replace(str(container.path("/workspace/scripts")), "/workspace/scripts")
              for name, command in commands.items()}
    variants = {name: {"command": command} for name, command in inside.items()}
    variants["longcrash"] = {"command": LONG_THEN_CRASH.format(py=PY)}
    variants["gated"] = {"command": GATED}
    variants["long"] = {"command": f"{PY} /workspace/scripts/steady_trainer.py 6000 0.02"}  # 2 min: outlives a test
    variants["eager"] = {"compile": "eager", "preset": "tiny-cpu"}
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0},
        "hosts": {"pve1": {"address": "testhost", "containers": {
            "ct_a": {"ctid": container.vmid, "gpus": [0], "python": PY}}}},
        "variants": variants,
        "fallback": ["trees", "nographs"],
        "watch": {**FAST_WATCH, "stall_floor_s": stall_floor_s(request), "start_grace_s": start_grace_s(request)},
    })
    lab = Lab(inventory, container, tmp_path / "state", start_grace_s(request))
    yield lab
    with Connections(load_inventory(inventory)) as connections, lab.store() as store:
        for run in store.list_runs(active=True):
            if run.pid is not None:
                stop(connections.container(run.target), store, run.name, grace_s=2)


def test_a_launch_killed_at_each_point_is_resolved_by_the_next_dfo_runs_and_can_be_stopped(lab: Lab) -> None:
    for point in ("reserved", "started", "recorded"):
        killed = lab.dfo("launch", "--host", "ct_a", "--variant", "long", "--name", f"k-{point}", "--no-preflight",
                         DFO_TEST_LAUNCH_EXIT_AT=point)
        assert killed.returncode == 137, killed.stderr
    runs = lab.runs()
    assert runs["k-reserved"]["state"] == "failed"  # nothing was started: the launch is marked failed
    started = runs["k-started"]
    assert started["state"] == "running" and started["pid"] is not None  # found by its exit file path
    assert runs["k-recorded"]["state"] == "running"
    assert "steady_trainer.py" in lab.container.attach("ps", "-eo", "args").stdout
    for name in ("k-started", "k-recorded"):
        stopped = lab.dfo("stop", name, "--grace", "5", "--json")
        assert stopped.returncode == 0, stopped.stderr
        assert json.loads(stopped.stdout)["state"] == "stopped"
    assert "steady_trainer.py" not in lab.container.attach("ps", "-eo", "args").stdout  # no orphan left


def test_dfo_runs_sees_runs_that_ended_while_nobody_watched(lab: Lab) -> None:
    lab.launch("short", "u-ok")
    lab.launch("failing", "u-bad")
    wait_for(lambda: lab.container.path("/workspace/logs/u-ok.log.exit").exists()
             and lab.container.path("/workspace/logs/u-bad.log.exit").exists(), timeout=60, what="both runs to end")
    runs = lab.runs()
    assert (runs["u-ok"]["state"], runs["u-ok"]["exit_code"]) == ("exited", 0)
    assert (runs["u-bad"]["state"], runs["u-bad"]["exit_code"]) == ("crashed", 3)


def test_logs_follow_ends_when_the_run_ends_with_its_exit_status_on_request(lab: Lab) -> None:
    lab.launch("short", "f-ok")
    started = time.monotonic()
    followed = lab.dfo("logs", "f-ok", "-f", "-n", "1", timeout=60)
    assert followed.returncode == 0, followed.stderr
    assert " step=30 " in followed.stdout.splitlines()[-1] and time.monotonic() - started < 30
    lab.launch("failing", "f-bad")
    followed = lab.dfo("logs", "f-bad", "-f", "--exit-status", timeout=60)
    assert followed.returncode == 3 and " step=5 " in followed.stdout


def test_watch_logs_and_stop_use_the_inventory_the_run_was_launched_from(lab: Lab) -> None:
    lab.launch("nographs", "i1")
    watched = lab.dfo("watch", "i1", "--until-decided", "--json", inventory=False, timeout=90)
    assert watched.returncode == 0, watched.stderr  # no -i: the registry remembers lab's inventory file
    assert json.loads(watched.stdout.splitlines()[-1])["decision"] == "steady"
    lab.inventory.write_text(lab.inventory.read_text() + "\n# edited\n")
    logs = lab.dfo("logs", "i1", "-n", "2", inventory=False)
    assert logs.returncode == 0 and f"{lab.inventory} changed since i1 was launched" in logs.stderr
    lab.inventory.rename(lab.inventory.with_suffix(".moved"))
    stopped = lab.dfo("stop", "i1", inventory=False)
    assert stopped.returncode == 2 and "which is gone" in stopped.stderr and "-i" in stopped.stderr
    lab.inventory.with_suffix(".moved").rename(lab.inventory)


def events_of(process: subprocess.Popen) -> list[dict]:
    return [json.loads(line) for line in process.stdout.read().splitlines() if line.startswith("{")]


def first_line(process: subprocess.Popen, *, timeout: float) -> str:
    """The first line `process` writes on stdout (a pipe), waiting at most `timeout` seconds for it."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output within {timeout} s"
    return process.stdout.readline()


def test_two_watchers_store_every_step_once_fall_back_once_and_the_second_takes_over_a_killed_first(lab: Lab) -> None:
    lab.launch("longcrash", "w2", "--chain", "longcrash,nographs")
    first = lab.popen("watch", "w2", "--json")
    try:
        wait_for(lambda: lab.store().claims(), timeout=60, what="the first watcher's claim")
        second = lab.popen("watch", "w2", "--json")  # to the end of the chain's runs
        head = first_line(second, timeout=60)  # attached while the first lives (a dead owner's claim is taken at once)
        wait_for(lambda: len(lab.store().samples("w2")) >= 100, timeout=60, what="steps stored")
        os.kill(first.pid, signal.SIGKILL)  # its lease is not given back: the second sees its pid gone
        out, err = second.communicate(timeout=120)
    finally:
        first.kill()
    assert second.returncode == 0, err[-2000:] + out[-2000:]
    events = [json.loads(line) for line in (head + out).splitlines() if line.startswith("{")]
    attached = next(e for e in events if e.get("kind") == "attached" and e["run"] == "w2")
    assert attached["owner"] is False and "claimed_by" in attached  # it only watched while the first lived
    assert any(e.get("kind") == "took_over" for e in events)
    final = events[-1]
    assert (final["run"], final["action"], final["ended"]["state"]) == ("w2.2-nographs", "keep", "exited")
    assert final["steady_tok_s"] is not None  # steady, then it finished
    with lab.store() as store:
        assert [r.name for r in store.list_runs()] == ["w2", "w2.2-nographs"]  # one fallback, not two
        stored = [s["step"] for s in store.samples("w2")]
    assert stored == lab.log_steps("w2") and len(stored) == 1000  # every step once: none twice, none lost


def test_a_stop_during_a_watch_is_no_crash_and_launches_nothing(lab: Lab) -> None:
    lab.launch("silent", "s1")
    watcher = lab.popen("watch", "s1", "--json")
    try:
        wait_for(lambda: lab.store().claims(), timeout=60, what="the watcher's claim")
        stopped = lab.dfo("stop", "s1", "--grace", "5", "--json")
        assert stopped.returncode == 0 and json.loads(stopped.stdout)["exit_code"] == 143
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err[-2000:]
    final = json.loads(out.splitlines()[-1])
    assert (final["decision"], final["action"], final["ended"]["state"]) == ("stopped", "none", "stopped")
    assert list(lab.runs()) == ["s1"]


@pytest.mark.parametrize("variant, status, verdict", [
    ("nographs", 0, "steady"), ("failing", 1, "crash"),
    pytest.param("silent", 1, "stall", marks=pytest.mark.stall_floor(3)),  # stalls 3 s after its 3 steps
])
def test_launch_watch_exit_status_follows_the_chains_final_verdict(lab: Lab, variant: str, status: int, verdict: str) -> None:
    done = lab.dfo("launch", "--host", "ct_a", "--variant", variant, "--name", f"x-{variant}", "--no-preflight",
                   "--chain", variant, "--watch", timeout=120)
    assert done.returncode == status, done.stderr + done.stdout[-1500:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"x-{variant}: x-{variant} {verdict}"), last
    how = {"steady": "; exited 0 (", "crash": "; exited 3 (", "stall": "; stopped 143 ("}[verdict]
    assert how in last, last


@pytest.mark.timeout(600)
def test_resume_continues_a_stopped_trainer_from_its_checkpoint_step(lab: Lab) -> None:
    lab.launch("eager", "r1", "--set", "steps=100000", "--set", "log_every=1")
    wait_for(lambda: len(lab.log_steps("r1")) >= 5, timeout=300, what="the trainer's first steps")
    assert json.loads(lab.dfo("stop", "r1", "--grace", "60", "--json").stdout)["exit_code"] == 75
    checkpoint = int(re.findall(r"event=checkpoint step=(\d+)", lab.container.path("/workspace/logs/r1.log").read_text())[-1])

    with lab.store() as store:
        real = store.get_run("r1").trainer_hash
        store.update_run("r1", trainer_hash="0" * 64)
    refused = lab.dfo("resume", "r1")
    assert refused.returncode == 1 and "trainer package changed" in refused.stderr and "--force" in refused.stderr
    with lab.store() as store:
        store.update_run("r1", trainer_hash=real)

    resumed = lab.dfo("resume", "r1", "--json")
    assert resumed.returncode == 0, resumed.stderr
    answer = json.loads(resumed.stdout)  # events.ResumeAnswer: the shape of a multi-node run's too
    assert list(answer) == ["kind", "at", "run", "resumed_from", "target", "pid", "log", "nodes", "next"]
    name = answer["run"]
    assert name == "r1.2-eager" and answer["kind"] == "resumed" and answer["resumed_from"] == "r1"
    assert [node["run"] for node in answer["nodes"]] == [name] and answer["nodes"][0]["pid"] == answer["pid"]
    wait_for(lambda: lab.log_steps(name), timeout=300, what="the resumed run's first step")
    assert lab.log_steps(name)[0] == checkpoint + 1  # it goes on from the checkpoint, not from step 1
    with lab.store() as store:
        assert store.get_run(name).parent == "r1"
        # the registry's record of it is another kind, its own shape (the same kind had two shapes)
        [record] = [e["data"] for e in store.events(name, kind="resumed_from")]
        assert record["from_run"] == "r1" and record["checkpoint"].endswith("checkpoint.pt") and "resumed_from" not in record
    again = lab.dfo("resume", name)
    assert again.returncode == 1 and "still running" in again.stderr
    lab.launch("short", "r2")
    wait_for(lambda: lab.container.path("/workspace/logs/r2.log.exit").exists(), timeout=60, what="r2 to end")
    lab.runs()
    nothing = lab.dfo("resume", "r2")
    assert nothing.returncode == 1 and "nothing to resume" in nothing.stderr


def test_two_batch_processes_run_a_cell_once_and_the_second_takes_over_a_killed_first(lab: Lab, tmp_path: Path) -> None:
    experiments = tmp_path / "one.yaml"
    experiments.write_text("batch: b2\ntargets: [ct_a]\nmatrix: {variant: [longrun]}\nstop_when: {steps: 900}\nfallback: false\n")
    text = lab.inventory.read_text().replace("  longcrash:", f"  longrun:\n    command: {PY} /workspace/scripts/steady_trainer.py 2000 0.02\n  longcrash:")
    lab.inventory.write_text(text)
    first = lab.popen("batch", str(experiments), "--poll", "0.3", "--json")
    try:
        wait_for(lambda: len(lab.store().samples("b2.longrun.ct_a.r1")) >= 50, timeout=90, what="the first batch's run")
        second = lab.popen("batch", str(experiments), "--poll", "0.3", "--json")
        time.sleep(4)  # it finds the cell claimed and only watches
        with lab.store() as store:
            assert [run.name for run in store.list_runs()] == ["b2.longrun.ct_a.r1"]
        os.kill(first.pid, signal.SIGKILL)
        out, err = second.communicate(timeout=120)
    finally:
        first.kill()
    assert second.returncode == 0, err[-2000:] + out[-2000:]
    [cell] = json.loads(out)["cells"]
    assert cell["state"] == "done" and cell["runs"] == ["b2.longrun.ct_a.r1"]  # launched once, finished by the second
    with lab.store() as store:
        stored = [s["step"] for s in store.samples("b2.longrun.ct_a.r1")]
    assert stored == sorted(set(stored)) and stored[-1] >= 900  # no step stored twice


def open_intents(lab: Lab) -> list:
    with lab.store() as store:
        return store.open_intents()


@pytest.mark.parametrize("variant, point", [("failing", "recorded"), ("trees", "stopped")])
def test_a_fallback_left_half_done_by_a_killed_dfo_is_finished_once_by_two_racing_watches(lab: Lab, variant: str,
                                                                                          point: str) -> None:
    # failing: exits 3 by itself, dfo killed once the fallback is recorded; trees: crashes and lives on, dfo
    # killed once it has stopped it. Either way the run has ended and its successor is not launched yet.
    killed = lab.dfo("launch", "--host", "ct_a", "--variant", variant, "--name", "hk", "--no-preflight",
                     "--chain", f"{variant},nographs", "--watch", "--until-decided", "--json", timeout=120,
                     DFO_TEST_FALLBACK_EXIT_AT=point)
    assert killed.returncode == 137, killed.stderr + killed.stdout[-2000:]  # dfo died inside the fallback
    runs = lab.runs()
    assert list(runs) == ["hk"] and runs["hk"]["state"] == {"recorded": "crashed", "stopped": "stopped"}[point]
    [intent] = open_intents(lab)
    assert (intent.subject, intent.data["run"], intent.data["name"]) == ("hk", "hk", "hk.2-nographs")

    # two dfo finish it at once (one names the run, one watches "every active run"): one successor, both follow it
    racers = [lab.popen("watch", "hk", "--until-decided", "--json"), lab.popen("watch", "--until-decided", "--json")]
    outs = [racer.communicate(timeout=180) for racer in racers]
    for racer, (out, err) in zip(racers, outs):
        assert racer.returncode == 0, err[-2000:] + out[-3000:]
        final = json.loads(out.splitlines()[-1])
        assert (final["run"], final["decision"]) == ("hk.2-nographs", "steady"), out[-3000:]
    runs = lab.runs()
    assert list(runs) == ["hk", "hk.2-nographs"] and runs["hk.2-nographs"]["parent"] == "hk"  # launched once
    assert lab.container.path("/workspace/logs/hk.2-nographs.log").read_text().count("event=start") == 1
    assert open_intents(lab) == []
    again = lab.dfo("watch", "hk", "--until-decided", "--json", timeout=120)  # done: nothing more launches
    assert again.returncode == 0, again.stderr + again.stdout[-2000:]
    assert list(lab.runs()) == ["hk", "hk.2-nographs"]


@pytest.mark.parametrize("point", ["launching", "launch_started"])
def test_a_fallback_killed_inside_its_successors_launch_adopts_only_a_started_successor(lab: Lab, point: str) -> None:
    # launching: the successor's registry row exists (`launching`), nothing started on the container;
    # launch_started: its process started, dfo killed before recording it as running
    killed = lab.dfo("launch", "--host", "ct_a", "--variant", "failing", "--name", "hl", "--no-preflight",
                     "--chain", "failing,nographs", "--watch", "--until-decided", "--json", timeout=120,
                     DFO_TEST_FALLBACK_EXIT_AT=point)
    assert killed.returncode == 137, killed.stderr + killed.stdout[-2000:]  # dfo died inside the successor's launch
    with lab.store() as store:
        half = store.get_run("hl.2-nographs")
        assert (half.state, half.pid) == ("launching", None)
    [intent] = open_intents(lab)
    assert intent.data["name"] == "hl.2-nographs"

    racers = [lab.popen("watch", "hl", "--until-decided", "--json"), lab.popen("watch", "--until-decided", "--json")]
    outs = [racer.communicate(timeout=180) for racer in racers]
    successor = {"launching": "hl.2-nographs-2", "launch_started": "hl.2-nographs"}[point]
    for racer, (out, err) in zip(racers, outs):
        assert racer.returncode == 0, err[-2000:] + out[-3000:]
        final = json.loads(out.splitlines()[-1])
        assert (final["run"], final["decision"]) == (successor, "steady"), out[-3000:]
    runs = lab.runs()
    assert runs[successor]["parent"] == "hl" and open_intents(lab) == []
    logs = lab.container.path("/workspace/logs")
    assert (logs / f"{successor}.log").read_text().count("event=start") == 1  # started once
    if point == "launching":  # the half-launched row is marked failed, nothing of it left on the container
        assert list(runs) == ["hl", "hl.2-nographs", "hl.2-nographs-2"]
        assert runs["hl.2-nographs"]["state"] == "failed"
        assert not (logs / "hl.2-nographs.log").exists()
    else:  # the successor that really started is adopted, nothing launched beside it
        assert list(runs) == ["hl", "hl.2-nographs"]


@pytest.mark.parametrize("variant, point", [("failing", "recorded"), ("trees", "stopped"), ("failing", "launching")])
def test_a_batch_killed_inside_a_cells_fallback_is_finished_once_by_the_next_dfo_batch(lab: Lab, tmp_path: Path,
                                                                                       variant: str, point: str) -> None:
    # a batch cell's fallback is `dfo watch`'s: recorded as an intent, carried out once; the batch that dies
    # inside it leaves the intent open and the same file run again finishes it before it goes on
    experiments = tmp_path / "fb.yaml"
    experiments.write_text(f"batch: fb\ntargets: [ct_a]\nmatrix: {{variant: [{variant}]}}\nfallback: [{variant}, nographs]\n")
    root = f"fb.{variant}.ct_a.r1"
    killed = lab.dfo("batch", str(experiments), "--poll", "0.3", "--json", timeout=120, DFO_TEST_FALLBACK_EXIT_AT=point)
    assert killed.returncode == 137, killed.stderr[-2000:] + killed.stdout[-2000:]  # dfo died inside the fallback
    [intent] = open_intents(lab)
    assert (intent.subject, intent.data["run"], intent.data["name"]) == (root, root, f"{root}.2-nographs")

    again = lab.dfo("batch", str(experiments), "--poll", "0.3", "--json", timeout=180)
    assert again.returncode == 0, again.stderr[-2000:] + again.stdout[-2000:]
    [cell] = json.loads(again.stdout)["cells"]
    successor = f"{root}.2-nographs" + ("-2" if point == "launching" else "")  # a half-launched row is passed by
    assert (cell["state"], cell["runs"]) == ("done", [root, successor]), cell
    assert open_intents(lab) == []
    runs = lab.runs()
    assert runs[successor]["parent"] == root and runs[root]["state"] == {"stopped": "stopped"}.get(point, "crashed")
    assert lab.container.path(f"/workspace/logs/{successor}.log").read_text().count("event=start") == 1  # launched once
    if point == "launching":
        assert runs[f"{root}.2-nographs"]["state"] == "failed"


def test_a_successor_whose_name_was_taken_is_retried_as_the_next_suffix_not_a_suffix_of_a_suffix(lab: Lab) -> None:
    lab.launch("short", "hn.2-nographs")  # someone's own run holds the rule's name: the successor is `-2`
    killed = lab.dfo("launch", "--host", "ct_a", "--variant", "failing", "--name", "hn", "--no-preflight",
                     "--chain", "failing,nographs", "--watch", "--until-decided", "--json", timeout=120,
                     DFO_TEST_FALLBACK_EXIT_AT="launching")
    assert killed.returncode == 137, killed.stderr + killed.stdout[-2000:]  # dfo died inside `-2`'s launch
    with lab.store() as store:
        assert store.get_run("hn.2-nographs-2").state == "launching"
    watched = lab.dfo("watch", "hn", "--until-decided", "--json", timeout=180)
    assert watched.returncode == 0, watched.stderr[-2000:] + watched.stdout[-3000:]
    final = json.loads(watched.stdout.splitlines()[-1])
    assert (final["run"], final["decision"]) == ("hn.2-nographs-3", "steady"), watched.stdout[-3000:]
    runs = lab.runs()
    assert sorted(runs) == ["hn", "hn.2-nographs", "hn.2-nographs-2", "hn.2-nographs-3"]
    assert runs["hn.2-nographs-2"]["state"] == "failed" and runs["hn.2-nographs-3"]["parent"] == "hn"


def test_a_run_that_ends_between_stops_identity_check_and_its_signal_is_recorded_with_its_own_end(lab: Lab,
                                                                                                  tmp_path: Path) -> None:
    lab.launch("gated", "g1")
    paused = tmp_path / "paused"
    stopper = lab.popen("stop", "g1", "--grace", "5", "--json", DFO_TEST_PAUSE_AT="identified",
                        DFO_TEST_PAUSE_FILE=str(paused))
    try:
        wait_for(paused.exists, timeout=60, what="dfo stop past its identity check")  # the run was alive then
        lab.container.path(GATE).touch()  # now it ends on its own: exit 3
        wait_for(lambda: lab.container.path("/workspace/logs/g1.log.exit").exists(), timeout=30, what="the run's end")
        paused.unlink()  # stop goes on to its signal
        out, err = stopper.communicate(timeout=90)
    finally:
        stopper.kill()
    assert stopper.returncode == 0, err
    assert json.loads(out) == {"run": "g1", "state": "crashed", "exit_code": 3, "signal": None}  # not `stopped`
    run = lab.runs()["g1"]
    assert (run["state"], run["exit_code"]) == ("crashed", 3)
    with lab.store() as store:
        assert store.get_run("g1").stop_requested_at is None  # no stop reached it: a watch reads its crash
        [ended] = store.events("g1", kind="ended")
    assert ended["data"]["why"] == "exited on its own before stop signalled it"


@pytest.mark.parametrize("point", ["after_start", "before_start"])
def test_a_successor_whose_start_got_no_answer_is_adopted_if_it_runs_and_launched_again_only_if_not(lab: Lab,
                                                                                                   point: str) -> None:
    # the successor's start times out: after_start, the run started and its PID never came back; before_start,
    # the word to start never went out. Its row is `unconfirmed` (no PID); the fallback stays open.
    first = lab.dfo("launch", "--host", "ct_a", "--variant", "failing", "--name", "hu", "--no-preflight",
                    "--chain", "failing,nographs", "--watch", "--until-decided", "--json", timeout=120,
                    DFO_TEST_START_TIMEOUT_AT=point)
    assert "the start of hu.2-nographs got no answer" in first.stdout, first.stderr[-2000:] + first.stdout[-3000:]
    assert "the fallback stays open: `dfo watch hu` adopts hu.2-nographs if it runs" in first.stdout  # the command
    with lab.store() as store:
        unseen = store.get_run("hu.2-nographs")
        assert (unseen.state, unseen.pid) == ("unconfirmed", None)
    [intent] = open_intents(lab)
    assert intent.data["run"] == "hu"

    watched = lab.dfo("watch", "hu", "--until-decided", "--json", timeout=180)
    assert watched.returncode == 0, watched.stderr[-2000:] + watched.stdout[-3000:]
    successor = {"after_start": "hu.2-nographs", "before_start": "hu.2-nographs-2"}[point]
    final = json.loads(watched.stdout.splitlines()[-1])
    assert (final["run"], final["decision"]) == (successor, "steady"), watched.stdout[-3000:]
    runs = lab.runs()
    assert open_intents(lab) == [] and runs[successor]["parent"] == "hu"
    logs = lab.container.path("/workspace/logs")
    starts = sum((logs / f"{name}.log").read_text().count("event=start") for name in runs
                 if name != "hu" and (logs / f"{name}.log").exists())
    assert starts == 1  # one successor ran: the one that started is adopted, never a second one beside it
    if point == "before_start":
        assert list(runs) == ["hu", "hu.2-nographs", "hu.2-nographs-2"] and runs["hu.2-nographs"]["state"] == "failed"
    else:
        assert list(runs) == ["hu", "hu.2-nographs"]


def ctrl_c_during_a_fallback(lab: Lab, tmp_path: Path, argv: list[str], root: str, successor: str, presses: int, *,
                             waits_s: float = 2) -> str:
    """Run `dfo ARGV` until its fallback of `root` is under way (its stop held after its identity check, before
    its signal), then Ctrl-C it `presses` times (real SIGINTs). Once: it waits for the fallback (still there
    `waits_s` later), carries it to its end and exits 130. Twice: it leaves at once (130), with the run not
    signalled, `successor` not launched and the intent open. Returns what dfo said on stderr."""
    paused, said = tmp_path / "paused", tmp_path / "stderr"
    with said.open("w") as stderr:
        dfo = subprocess.Popen([DFO, *argv, "-i", str(lab.inventory)], stdout=subprocess.DEVNULL, stderr=stderr,
                               env=lab.env(DFO_TEST_PAUSE_AT="identified", DFO_TEST_PAUSE_FILE=str(paused)))
    try:
        wait_for(paused.exists, timeout=120, what="the fallback under way")
        dfo.send_signal(signal.SIGINT)  # Ctrl-C
        wait_for(lambda: "interrupted: finishing" in said.read_text(), timeout=30, what="the line about the fallback")
        time.sleep(waits_s)
        assert dfo.poll() is None  # it waits for the fallback
        if presses == 2:
            dfo.send_signal(signal.SIGINT)
            assert dfo.wait(timeout=15) == 130  # left at once
            assert "left half done" in said.read_text()
            assert "tls_crash.py" in lab.container.attach("ps", "-eo", "args").stdout  # Ctrl-C stopped no run
            with lab.store() as store:
                assert store.get_run(root).stop_requested_at is None and store.find_run(successor) is None
            [intent] = open_intents(lab)
            assert intent.data["run"] == root
        paused.unlink()  # (twice: nobody is waiting any more)
        if presses == 1:
            assert dfo.wait(timeout=120) == 130  # once the fallback is done
            with lab.store() as store:  # carried to its end: the run stopped, its successor started and recorded
                assert (store.get_run(root).state, store.get_run(successor).state) == ("stopped", "running")
            assert open_intents(lab) == []
    finally:
        dfo.kill()
        paused.unlink(missing_ok=True)
    return said.read_text()


def finishing_line(said: str) -> str:
    [line] = [line for line in said.splitlines() if "finishing" in line]
    return line


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_a_batch_fallback_says_what_it_finishes_and_a_second_leaves_it_to_the_next_batch(
        lab: Lab, tmp_path: Path, presses: int) -> None:
    experiments = tmp_path / "cc.yaml"
    experiments.write_text("batch: cc\ntargets: [ct_a]\nmatrix: {variant: [trees]}\nfallback: [trees, nographs]\n")
    root, successor = "cc.trees.ct_a.r1", "cc.trees.ct_a.r1.2-nographs"
    said = ctrl_c_during_a_fallback(lab, tmp_path, ["batch", str(experiments), "--poll", "0.3", "--json"], root,
                                    successor, presses)
    line = finishing_line(said)
    assert f"finishing the fallback of {root} to nographs (cell trees.ct_a.r1) first" in line
    assert line.endswith(f"Ctrl-C again leaves it to the next `dfo batch {experiments}`")  # never `dfo watch`
    again = lab.dfo("batch", str(experiments), "--poll", "0.3", "--json", timeout=180)
    assert again.returncode == 0, again.stderr[-2000:] + again.stdout[-2000:]
    [cell] = json.loads(again.stdout)["cells"]
    assert (cell["state"], cell["runs"]) == ("done", [root, successor]), cell


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_a_watch_fallback_says_what_it_finishes_and_a_second_leaves_it_to_the_next_watch(
        lab: Lab, tmp_path: Path, presses: int) -> None:
    # before: one line saying nothing of the fallback, 5 s of silence, then the fallback cut off mid-way
    said = ctrl_c_during_a_fallback(lab, tmp_path, ["launch", "--host", "ct_a", "--variant", "trees", "--name", "cw",
                                                    "--no-preflight", "--chain", "trees,nographs", "--watch", "--json"],
                                    "cw", "cw.2-nographs", presses, waits_s=6)
    assert finishing_line(said) == ("interrupted: finishing the fallback of cw to nographs first; "
                                    "Ctrl-C again leaves it to the next `dfo watch`"), said
    if presses == 2:
        assert "the fallback of cw to nographs is left half done; the next `dfo watch` finishes it" in said
    else:
        assert "stopped watching; the runs go on" in said


def dead_launcher() -> str:
    """The `host:pid` of a dfo that has gone (a process of this host that has ended)."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    return f"{socket.gethostname()}:{ended.pid}"


def test_dfo_runs_looks_for_an_unsettled_start_on_a_stopped_container_once_then_says_when_until_recheck(
        lab: Lab, sshd) -> None:
    # a start that got no answer: `unconfirmed`, no PID, as runs._abandon leaves it; a launch whose dfo died before
    # recording it: `launching`, its launcher gone (before, looked at on every dfo runs); then the container stops
    with lab.store() as store:
        for name, state, owner in (("ls", "unconfirmed", None), ("ll", "launching", dead_launcher())):
            store.add_run(Run(name=name, target="ct_a", host="pve1", variant="gated", state=state, owner=owner,
                              workspace="/workspace", log_path=f"/workspace/logs/{name}.log",
                              exit_path=f"/workspace/logs/{name}.log.exit", inventory_path=str(lab.inventory)))
    lab.container.stop()
    first = lab.dfo("runs", "--json", inventory=False)
    assert first.returncode == 0 and "could not look at ct_a" in first.stderr, first.stderr
    rows = {row["name"]: row for row in json.loads(first.stdout)}
    assert [(rows[n]["state"], rows[n]["pid"]) for n in ("ls", "ll")] == [("unconfirmed", None), ("launching", None)]
    assert rows["ls"]["checked_at"] and rows["ll"]["checked_at"]
    connections = sshd.accepted_connections()
    started = time.monotonic()
    second = lab.dfo("runs", inventory=False, COLUMNS="200")
    assert second.returncode == 0, second.stderr
    assert sshd.accepted_connections() == connections and time.monotonic() - started < 10  # no look this time
    for name, state in (("ls", "unconfirmed"), ("ll", "launching")):
        checked = datetime.fromisoformat(rows[name]["checked_at"]).astimezone().strftime("%H:%M:%S")
        [line] = [line for line in second.stdout.splitlines() if line.startswith(f"{name} ")]
        assert f"{state}, checked {checked}" in line, second.stdout
    said = " ".join(second.stderr.split())
    assert "2 runs whose start was never settled not looked for again (ls (unconfirmed), ll (launching))" in said, said
    assert f"their target did not answer at {checked}" in said and "dfo runs --recheck" in said, said
    again = lab.dfo("runs", "--recheck", "--json", inventory=False)  # looks now: still out of reach, tried again
    assert sshd.accepted_connections() > connections and "could not look at ct_a" in again.stderr, again.stderr
    assert json.loads(again.stdout)[0]["checked_at"] > rows["ls"]["checked_at"]
    lab.container.start()
    assert [lab.runs()[name]["state"] for name in ("ls", "ll")] == ["unconfirmed", "launching"]  # not due yet: as they were
    for name in ("ls", "ll"):
        assert lab.dfo("runs", name, "--recheck", inventory=False).stdout.count("state:    failed") == 1  # none started


@pytest.mark.start_grace(40)
def test_dfo_stop_right_after_a_start_that_got_no_answer_waits_for_the_run_and_stops_it_or_says_it_never_started(
        lab: Lab) -> None:
    # the start script waits 10 s before it starts the run; dfo gives up on its answer after 1 s: `unconfirmed`, no PID
    launched = lab.dfo("launch", "--host", "ct_a", "--variant", "gated", "--name", "slow", "--no-preflight",
                       DFO_TEST_SLOW_START="slow:10")
    assert launched.returncode == 1, launched.stderr
    # the run and its target named once (before: "pve1: the launch script gave no start within 1s" alone, then
    # "slow: the start of slow on ct_a got no answer (ct_a: ...); left `lost`: slow on ct_a, which may ...")
    said = " ".join(launched.stderr.split())
    assert ("slow: the start on ct_a got no answer (the launch script gave no start within 1s); "
            "left `unconfirmed`: it may still come up") in said, said
    assert said.count("ct_a") == 1, said
    assert (f"`dfo runs slow` or `dfo watch slow` looks for it by its exit file: adopted if it runs, marked failed if "
            f"nothing of it shows within watch.start_grace_s ({lab.start_grace_s:g} s); `dfo stop slow` stops it") in said, said
    with lab.store() as store:
        assert (store.get_run("slow").state, store.get_run("slow").pid) == ("unconfirmed", None)
    stopped = lab.dfo("stop", "slow", "--grace", "5", "--json", inventory=False)  # before: "not running (state lost)"
    assert stopped.returncode == 0, stopped.stderr
    assert "slow: its start got no answer; looking for it for up to" in stopped.stderr
    assert (json.loads(stopped.stdout)["state"], json.loads(stopped.stdout)["signal"]) == ("stopped", "TERM")
    assert "/workspace/go" not in lab.container.attach("ps", "-eo", "args").stdout  # nothing of it left running

    # a start that got no answer with 2 s of its grace left and never shows: looked for until the grace is over
    with lab.store() as store:
        store.add_run(Run(name="never", target="ct_a", host="pve1", variant="gated", state="unconfirmed", workspace="/workspace",
                          log_path="/workspace/logs/never.log", exit_path="/workspace/logs/never.log.exit",
                          ended_at=format_ts(time.time() - lab.start_grace_s + 2), inventory_path=str(lab.inventory)))
    started = time.monotonic()
    said = lab.dfo("stop", "never", inventory=False)
    assert said.returncode == 0, said.stderr
    assert said.stdout.strip() == "never never started (its start got no answer; no process found); nothing to stop"
    assert time.monotonic() - started >= 1.5 and lab.runs()["never"]["state"] == "failed"


def test_a_start_that_shows_only_after_its_grace_is_adopted_by_the_next_look_and_stopped_by_dfo_stop(lab: Lab) -> None:
    # the start script waits 30 s before it starts the run; dfo gives up on its answer after 1 s, and its grace is
    # made over at once (as on a machine slower than watch.start_grace_s): marked failed, then the run comes up.
    # Before, it ran on untracked: `dfo runs --recheck` did not look, `dfo stop` said it never started. (12 s
    # were too few on a loaded machine: the run was up before the first `dfo runs` looked.)
    launched = lab.dfo("launch", "--host", "ct_a", "--variant", "gated", "--name", "late", "--no-preflight",
                       DFO_TEST_SLOW_START="late:30")
    assert launched.returncode == 1, launched.stderr
    with lab.store() as store:
        store.update_run("late", ended_at=format_ts(time.time() - lab.start_grace_s - 1))
    assert json.loads(lab.dfo("runs", "late", "--json", inventory=False).stdout)["state"] == "failed"
    looks = []

    def adopted() -> bool:  # looked for again until the start script (12 s) has started it
        looks.append(lab.dfo("runs", "--recheck", "--json", inventory=False))
        return [row["state"] for row in json.loads(looks[-1].stdout) if row["name"] == "late"] == ["running"]

    wait_for(adopted, timeout=90, what="the late start adopted")
    again = looks[-1]
    [row] = [row for row in json.loads(again.stdout) if row["name"] == "late"]
    assert row["pid"] is not None, again.stderr
    assert ("note: late was marked failed (nothing of it showed within watch.start_grace_s) but its run started "
            f"after all: now running, PID {row['pid']}; `dfo stop late` stops it") in " ".join(again.stderr.split())
    stopped = lab.dfo("stop", "late", "--grace", "5", "--json", inventory=False)
    assert (json.loads(stopped.stdout)["state"], json.loads(stopped.stdout)["signal"]) == ("stopped", "TERM")
    assert GATE not in lab.container.attach("ps", "-eo", "args").stdout  # nothing of it left running


def test_a_batch_adopts_a_successor_whose_slow_start_shows_within_its_grace_instead_of_launching_another(
        lab: Lab, tmp_path: Path) -> None:
    experiments = tmp_path / "slow.yaml"
    experiments.write_text("batch: sl\ntargets: [ct_a]\nmatrix: {variant: [failing]}\nfallback: [failing, short]\n")
    root, successor = "sl.failing.ct_a.r1", "sl.failing.ct_a.r1.2-short"
    # the successor's start script waits 6 s before it starts the run; dfo gives up on its answer after 1 s (and
    # 2 s for the channel to close)
    done = lab.dfo("batch", str(experiments), "--poll", "0.3", "--json", timeout=120,
                   DFO_TEST_SLOW_START=f"{successor}:6")
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    [cell] = json.loads(done.stdout)["cells"]
    assert (cell["state"], cell["runs"]) == ("done", [root, successor]), cell
    runs = lab.runs()
    assert list(runs) == [root, successor] and runs[successor]["state"] == "exited"  # adopted, none beside it
    # adopted within its grace, never marked failed: its process found by its exit file path, or (this run lasts
    # about a second, so under load it may end between two looks) its end read from its exit file
    with lab.store() as store:
        [gave_up, resolved, *_] = store.events(successor)
    assert gave_up["kind"] == "launch_failed" and "no start within" in gave_up["data"]["error"], gave_up
    assert resolved["kind"] == "launch_resolved" and resolved["data"]["how"] in {
        "found by its exit file path", "found ended by its exit file"}, resolved
    logs = sorted(path.name for path in lab.container.path("/workspace/logs").glob("sl.*.log"))
    assert logs == sorted([f"{root}.log", f"{successor}.log"])


def test_dfo_watch_leaves_a_batch_cells_open_fallback_to_dfo_batch_naming_the_command(lab: Lab, tmp_path: Path) -> None:
    # carried out by `dfo watch`, the successor would run outside the batch's GPU ledger (a batch that gave the
    # cell up has handed its GPUs on): the watch names the command that finishes it, and launches nothing
    # trees: crashes and lives on, so the watch cannot settle it as ended; the batch is killed with its lease on the
    # chain held (15 s): before, the watch waited that lease out, then said left_to_batch a second time
    experiments = tmp_path / "wb.yaml"
    experiments.write_text("batch: wb\ntargets: [ct_a]\nmatrix: {variant: [trees]}\nfallback: [trees, short]\n")
    root = "wb.trees.ct_a.r1"
    killed = lab.dfo("batch", str(experiments), "--poll", "0.3", "--json", timeout=120, DFO_TEST_FALLBACK_EXIT_AT="recorded")
    assert killed.returncode == 137, killed.stderr[-2000:] + killed.stdout[-2000:]
    started = time.monotonic()
    watched = lab.dfo("watch", "--until-decided", "--json", timeout=60)
    took = time.monotonic() - started
    [left] = [event for event in map(json.loads, watched.stdout.splitlines()) if event["kind"] == "left_to_batch"]
    assert (left["run"], left["batch"], left["command"]) == (root, "wb", f"dfo batch {experiments}"), watched.stdout
    assert took < 10, f"{took:.1f} s: the watch waited out the dead batch's lease"
    assert list(lab.runs()) == [root] and [intent.data["run"] for intent in open_intents(lab)] == [root]
    shown = lab.dfo("watch", root, "--until-decided", timeout=60)
    assert shown.stdout.count(f"{root}: a run of batch wb: its fallback is left to `dfo batch {experiments}`") == 1, \
        shown.stdout

    again = lab.dfo("batch", str(experiments), "--poll", "0.3", "--json", timeout=120)
    assert again.returncode == 0, again.stderr[-2000:] + again.stdout[-2000:]
    [cell] = json.loads(again.stdout)["cells"]
    assert (cell["state"], cell["runs"]) == ("done", [root, f"{root}.2-short"]) and open_intents(lab) == []


def test_a_watch_of_a_slow_start_within_its_grace_waits_for_the_run_instead_of_judging_a_crash(lab: Lab) -> None:
    # the start script brings the run up 7 s after it began, dfo gave up on its answer after 1 s (2 s more for the
    # channel to close; the lab's grace is 8 s from then): watched at once, its row is `unconfirmed` (no PID) and
    # nothing is found yet; within watch.start_grace_s the watch looks again until it shows (as a fallback
    # finishing does) instead of following it without a PID, which reads as a crash
    launched = lab.dfo("launch", "--host", "ct_a", "--variant", "short", "--name", "sw", "--no-preflight",
                       DFO_TEST_SLOW_START="sw:7")
    with lab.store() as store:
        assert launched.returncode != 0 and store.get_run("sw").state == "unconfirmed", launched.stderr
    watched = lab.dfo("watch", "sw", "--until-decided", "--json", timeout=60)
    [decision] = [event for event in map(json.loads, watched.stdout.splitlines()) if event["kind"] == "decision"][-1:]
    assert decision["decision"]["decision"] == "exited", watched.stdout[-2000:]
    assert lab.runs()["sw"]["state"] == "exited"



def test_dfo_runs_says_an_unconfirmed_start_was_not_looked_for_only_when_its_target_was_not_looked_at(lab: Lab) -> None:
    # its target did not answer a minute ago (checked_at), so it is not due; an active run on the same target
    # has the target looked at anyway, which settles it (nothing of it runs: failed): no note that it was not
    with lab.store() as store:
        store.add_run(Run(name="lq", target="ct_a", host="pve1", variant="gated", state="unconfirmed", workspace="/workspace",
                          log_path="/workspace/logs/lq.log", exit_path="/workspace/logs/lq.log.exit",
                          inventory_path=str(lab.inventory), ended_at="2026-01-01T00:00:00+00:00",
                          checked_at=datetime.now().astimezone().isoformat()))
    lab.launch("gated", "la")
    shown = lab.dfo("runs", inventory=False, COLUMNS="200")
    assert shown.returncode == 0, shown.stderr
    assert lab.runs()["lq"]["state"] == "failed"
    assert "not looked for again" not in shown.stderr, shown.stderr
