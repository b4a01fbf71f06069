"""`dfo watch` end to end through a real sshd and a real LXC container behind the pct stand-in: a chain whose
first variant dies with the cudagraph_tls traceback while its process lives on falls back to a variant that
reaches steady state; the watch survives sshd being killed and restarted (nothing lost, nothing doubled)
while nvidia-smi hangs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness import cli, write_inventory
from harness.lxc import LxcContainer
from orchestrator.connections import Connections
from orchestrator.decide import DecideConfig
from orchestrator.inventory import load_inventory
from orchestrator.runs import launch, spec_for, stop
from orchestrator.store import Store
from orchestrator.watch import Watcher
from test_events import CONTRACT, OPTIONAL_KEYS
from test_watch import FAST_WATCH, PY, run_until, write_trainers

pytestmark = [pytest.mark.lxc, pytest.mark.slow]

DECISION_KEYS = {"decision", "run", "at_step", "at_ts", "signature", "steady_tok_s", "warmup_end_step", "action", "next_run"}


@pytest.fixture
def lab(tmp_path, sshd, ssh_home, container: LxcContainer):
    commands = write_trainers(container.path("/workspace/scripts"))
    inside = {name: command.replace(str(container.path("/workspace/scripts")), "/workspace/scripts")
              for name, command in commands.items()}
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0},
        "hosts": {"pve1": {"address": "testhost", "containers": {
            "ct_a": {"ctid": container.vmid, "gpus": [0], "python": PY}}}},
        "variants": {name: {"command": command} for name, command in inside.items()},
        "fallback": ["trees", "nographs"],
        "watch": FAST_WATCH,
    })
    state = tmp_path / "state"
    yield inventory, state
    with Connections(load_inventory(inventory)) as connections, Store(state / "dfo.db") as store:
        for run in store.list_runs(active=True):
            stop(connections.container(run.target), store, run.name, grace_s=2)


def dfo(inventory: Path, state: Path, *args: str, timeout: float = 90) -> cli.Ran:
    return cli.dfo(*args, "-i", str(inventory), env={"DFO_HOME": str(state)}, timeout=timeout)


def processes(container: LxcContainer) -> str:
    return container.attach("ps", "-eo", "args").stdout


def test_tls_crash_with_live_process_is_stopped_and_the_chain_ends_steady(lab, container) -> None:
    inventory, state = lab
    launched = dfo(inventory, state, "launch", "--host", "ct_a", "--variant", "trees", "--name", "c1", "--no-preflight")
    assert launched.returncode == 0, launched.stderr

    watched = dfo(inventory, state, "watch", "c1", "--until-decided", "--json", timeout=120)
    assert watched.returncode == 0, watched.stderr + watched.stdout[-2000:]
    objects = [json.loads(line) for line in watched.stdout.splitlines()]
    assert all("kind" in o for o in objects)  # every JSON line says what it is
    events = [o for o in objects if o["kind"] != "final"]
    finals = [o for o in objects if o["kind"] == "final"]
    for e in events:  # the typed events still write the keys (and order) of the JSON contract
        expected = CONTRACT.get(e["kind"]) or (["at", "run", "chain", "text"] if "run" in e else ["at", "target", "text"])
        assert list(e) == ["kind", *[k for k in expected if k in e or k not in OPTIONAL_KEYS]], e
    assert {"attached", "step", "decision", "acting", "stopped", "fell_back", "gpu"} <= {e["kind"] for e in events}

    [crash] = [e["decision"] for e in events if e["kind"] == "decision" and e["run"] == "c1"
               and e["decision"]["decision"] == "crash"]  # said once; its successor is the fell_back event's
    assert DECISION_KEYS <= set(crash)
    assert (crash["decision"], crash["signature"], crash["action"]) == ("crash", "cudagraph_tls", "fallback")
    assert [(e["run"], e["next_run"]) for e in events if e["kind"] == "fell_back"] == [("c1", "c1.2-nographs")]
    assert crash["evidence"]["thread"].startswith("Thread-2")  # a worker thread died; the PID lived on

    [final] = finals
    assert DECISION_KEYS <= set(final)
    assert (final["run"], final["decision"], final["action"], final["chain"]) == ("c1.2-nographs", "steady", "keep", "c1")
    assert 980 < final["steady_tok_s"] < 1020 and final["at_ts"].endswith("Z")

    ps = processes(container)
    assert "tls_crash.py" not in ps  # the crashed-but-alive run was stopped inside the container
    assert "dfo_agent.py" not in ps  # and the watch left no agent behind
    with Store(state / "dfo.db") as store:
        assert store.get_run("c1").state == "stopped"
        assert store.get_run("c1.2-nographs").parent == "c1"
        assert store.gpu_samples(target="ct_a")  # the stand-in's GPUs were sampled over the same channel


def test_sshd_outage_mid_watch_loses_doubles_and_stalls_nothing_while_nvidia_smi_hangs(lab, container, sshd) -> None:
    inventory_path, state = lab
    container.nvidia_smi(mode="hang")
    inventory = load_inventory(inventory_path)
    with Connections(inventory) as connections, Store(state / "dfo.db") as store:
        spec = spec_for(inventory, "ct_a", "nographs")
        launch(connections.container("ct_a"), spec, store, name="s1")
        # A 2 s stall floor: were the watch's clock to run while the channel is down, this outage would be a stall.
        config = DecideConfig(stall_floor_s=2, min_steady_steps=40, min_steady_seconds=1, first_step_grace_s=60)
        watcher = Watcher(inventory, connections, store, decide_config=config, heartbeat_timeout=3)
        try:
            watcher.attach("s1")
            events = run_until(watcher, lambda w: len(store.samples("s1")) >= 30)
            sshd.kill_sessions()  # the channel goes, and the host refuses connections for a while
            sshd.stop()
            time.sleep(3)
            sshd.start()
            events += run_until(watcher, lambda w: w.runs()[0].alive is False and w.settled(), timeout=60)
        finally:
            watcher.close()
        log = container.path("/workspace/logs/s1.log").read_text().splitlines()
        logged = [int(line.split(" step=")[1].split()[0]) for line in log if " event=step " in line]
        stored = [sample["step"] for sample in store.samples("s1")]
        assert stored == logged and len(logged) == 400
        kinds = [e.kind for e in events]
        assert "disconnected" in kinds and "gap" in kinds
        assert max(e.duration_s for e in events if e.kind == "gap") > 3
        assert store.get_run("s1").decision["decision"] in ("steady", "exited")
        assert store.get_run("s1").decision["action"] == "keep"
