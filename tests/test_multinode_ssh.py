"""`dfo launch --host A --host B` through two real sshd "hosts" on loopback: one run on two nodes (tiny-cpu
procsplit over gloo), stopped as one, watched as one (the node that failed first named), and refusals that
leave nothing started anywhere. The targets are the hosts themselves (`ctid: null`): harness containers
have no network of their own (`lxc.net.0.type = empty`), so two of them cannot meet (docs/multinode.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from harness import write_inventory
from harness.cli import DFO, Ran, dfo
from harness.nvidia_smi import STATE_ENV, Gpu, NvidiaSmiState
from harness.sshd import SshServer



def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TwoHosts:
    def __init__(self, tmp_path: Path, inventory: Path, port: int) -> None:
        self.tmp, self.inventory, self.port, self.state = tmp_path, inventory, port, tmp_path / "state"

    def dfo(self, *args: str, timeout: float = 120, env: dict | None = None) -> Ran:
        return dfo(*args, "-i", str(self.inventory), env={"DFO_HOME": str(self.state), **(env or {})}, timeout=timeout)

    def launch(self, *args: str, timeout: float = 120, env: dict | None = None) -> Ran:
        return self.dfo("launch", "--name", "mn", "--master-addr", "127.0.0.1", "--master-port", str(self.port),
                        "--json", *args, timeout=timeout, env=env)

    def log(self, node: int) -> Path:
        return self.tmp / f"ws{node}" / "logs" / f"mn.node{node}.log"

    def runs(self) -> list[dict]:
        return json.loads(dfo("runs", "--json", env={"DFO_HOME": str(self.state)}).stdout)


@pytest.fixture
def hosts(tmp_path, sshd, ssh_home, pct_standin_env):
    second = SshServer(tmp_path / "sshd2", env=dict(pct_standin_env)).start()
    down = SshServer(tmp_path / "sshd3", env=dict(pct_standin_env)).start()
    ssh_home.add_host("testhost2", second)
    ssh_home.add_host("testhost3", down)
    down.stop()  # a host whose ssh is down: its node's preflight fails
    node = {"python": sys.executable}
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0},
        "hosts": {
            "pve0": {"address": "testhost", "containers": {"n0": {"ctid": None, "workspace": str(tmp_path / "ws0"), **node},
                                                           "n0b": {"ctid": None, "workspace": str(tmp_path / "ws0b"), **node},
                                                           "n0c": {"ctid": None, "workspace": str(tmp_path / "ws0c"), **node}}},
            "pve1": {"address": "testhost2", "containers": {"n1": {"ctid": None, "workspace": str(tmp_path / "ws1"), **node}}},
            "pve2": {"address": "testhost3", "containers": {"n2": {"ctid": None, "workspace": str(tmp_path / "ws2"), **node}}},
        },
        "variants": {
            "ps2": {"compile": "eager", "preset": "tiny-cpu", "topology": "procsplit", "nodes": 2,
                    "args": {"steps": 100000, "log_every": 5, "debug.step_sleep_s": 0.05}},
            "ps2fail": {"compile": "eager", "preset": "tiny-cpu", "topology": "procsplit",
                        "args": {"steps": 100000, "log_every": 5, "debug.step_sleep_s": 0.05,
                                 "debug.fail_at_step": 10, "debug.fail_drafter": 1}},
            "ps2ok": {"compile": "eager", "preset": "tiny-cpu", "topology": "procsplit",
                      "args": {"steps": 10, "log_every": 5}},
            "threaded": {"compile": "eager", "preset": "tiny-cpu"},
        },
        "fallback": ["ps2fail", "threaded", "ps2ok"],
        "signatures": [{"id": "injected", "pattern": "injected failure in drafter", "meaning": "a test's fault"}],
        "watch": {"start_grace_s": 8},  # a node whose start got no answer and never ran: marked failed 8 s on
    })
    yield TwoHosts(tmp_path, inventory, free_port())
    second.kill_sessions()
    second.stop()
    # a run a failed test left going (a node is detached from its ssh session): nothing of this test outlives it
    subprocess.run(["pkill", "-KILL", "-f", str(tmp_path)], check=False, timeout=30)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def has_steps(path: Path) -> bool:
    return path.exists() and "event=step" in path.read_text()


@pytest.fixture
def played_hosts(hosts):
    """`hosts` whose nodes' trainer is PLAYED_NODE (no torch): for the tests of what dfo does around a
    multinode fallback, not of what trains."""
    inventory = yaml.safe_load(hosts.inventory.read_text())
    python = str(played_python(hosts.tmp, PLAYED_NODE))
    for host in inventory["hosts"].values():
        for container in host["containers"].values():
            container["python"] = python
    hosts.inventory.write_text(yaml.safe_dump(inventory))
    return hosts


@pytest.mark.slow
def test_two_nodes_start_stop_and_resume_as_one_run(hosts):
    launched = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2")
    assert launched.returncode == 0, launched.stderr
    answer = json.loads(launched.stdout.splitlines()[0])
    assert answer["run"] == "mn" and answer["rendezvous"] == f"127.0.0.1:{hosts.port}"
    assert [(n["run"], n["target"]) for n in answer["nodes"]] == [("mn.node0", "n0"), ("mn.node1", "n1")]
    try:
        wait_for(lambda: has_steps(hosts.log(0)) and has_steps(hosts.log(1)), 120, "both nodes' step lines")
        start = hosts.log(1).read_text().split("event=start", 1)[1].splitlines()[0]
        assert "nnodes=2 node_rank=1" in start and f"rendezvous=127.0.0.1:{hosts.port}" in start
        assert {r["name"]: r["state"] for r in hosts.runs()} == {"mn.node0": "running", "mn.node1": "running"}
        shown = hosts.dfo("runs", "mn", "--json")
        assert [n["target"] for n in json.loads(shown.stdout)["nodes"]] == ["n0", "n1"], shown.stderr
    finally:
        stopped = hosts.dfo("stop", "mn", "--grace", "30", "--json")
    assert stopped.returncode == 0, stopped.stderr
    nodes = json.loads(stopped.stdout)["nodes"]
    assert [(n["run"], n["state"]) for n in nodes] == [("mn.node0", "stopped"), ("mn.node1", "stopped")]
    for node in (0, 1):  # every node checkpointed on SIGTERM: the stop reached all of them as one
        exit_file = Path(f"{hosts.log(node)}.exit")
        wait_for(exit_file.exists, 30, f"node {node}'s exit file")
        assert exit_file.read_text().strip() == "75"
        assert (hosts.tmp / f"ws{node}" / "runs" / f"mn.node{node}" / "checkpoint.pt").is_file()

    resumed = hosts.dfo("resume", "mn", "--json")
    assert resumed.returncode == 0, resumed.stderr
    answer = json.loads(resumed.stdout)
    assert answer["run"] == "mn.2-ps2" and [n["run"] for n in answer["nodes"]] == ["mn.2-ps2.node0", "mn.2-ps2.node1"]
    assert answer["kind"] == "resumed" and answer["target"] is None and answer["pid"] is None  # its nodes have them
    logs = [hosts.tmp / f"ws{node}" / "logs" / f"mn.2-ps2.node{node}.log" for node in (0, 1)]
    try:
        wait_for(lambda: all(has_steps(log) for log in logs), 120, "the resumed nodes' step lines")
        stopped_at = int(hosts.log(0).read_text().split("event=done step=")[1].split()[0])
        first = int(logs[0].read_text().split("event=step step=")[1].split()[0])
        assert stopped_at < first <= stopped_at + 5  # every node went on from its own checkpoint
    finally:
        assert hosts.dfo("stop", "mn.2-ps2", "--grace", "30").returncode == 0


@pytest.mark.slow
def test_two_containers_of_one_host_launch_as_one_run_over_its_one_connection(hosts):
    # both nodes' launch calls wait for dfo's word over the host's one connection: they share its turn (on main the
    # second waited for the first's, which waited for the second's start: "no free SSH session" after 130 s)
    launched = hosts.launch("--host", "n0", "--host", "n0b", "--variant", "ps2", timeout=100)
    assert launched.returncode == 0, launched.stderr
    logs = [hosts.tmp / where / "logs" / f"mn.node{rank}.log" for rank, where in enumerate(("ws0", "ws0b"))]
    try:
        assert [n["target"] for n in json.loads(launched.stdout.splitlines()[0])["nodes"]] == ["n0", "n0b"]
        wait_for(lambda: all(map(has_steps, logs)), 120, "both nodes' step lines")
    finally:
        stopped = hosts.dfo("stop", "mn", "--grace", "30", "--json")
    assert [n["state"] for n in json.loads(stopped.stdout)["nodes"]] == ["stopped", "stopped"], stopped.stderr


def test_three_containers_of_one_host_in_one_launch_are_refused_at_once_with_the_fix(hosts):
    refused = hosts.launch("--host", "n0", "--host", "n0b", "--host", "n0c", "--variant", "ps2ok", timeout=60)
    assert refused.returncode == 1
    assert ("3 nodes of one launch share one SSH connection (n0, n0b, n0c): it carries 2 launch calls at once"
            in refused.stderr), refused.stderr
    assert "give at most 2 containers of one host to one launch" in refused.stderr
    assert hosts.runs() == []  # nothing registered, nothing started


@pytest.mark.slow
def test_a_crash_on_one_node_is_the_runs_crash_naming_that_node(hosts):
    launched = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2fail")
    assert launched.returncode == 0, launched.stderr
    watched = hosts.dfo("watch", "mn", "--until-decided", "--no-fallback", timeout=240)
    assert watched.returncode == 1, watched.stdout + watched.stderr
    summary = watched.stdout.strip().splitlines()[-1]
    assert summary.startswith("mn: crash on node 1 (n1) first"), watched.stdout
    assert "node 0 (n0): peer_lost, a consequence" in summary


@pytest.mark.slow
def test_a_crashed_multinode_run_falls_back_on_every_node(hosts):
    watched = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2fail", "--watch", "--until-decided",
                           timeout=300)
    kinds = [json.loads(line) for line in watched.stdout.splitlines() if line.startswith("{")]
    fell = [k for k in kinds if k.get("kind") == "multinode_fell_back"]
    assert fell and fell[0]["next_run"] == "mn.2-ps2ok", watched.stdout[-3000:] + watched.stderr  # threaded skipped
    assert fell[0]["nodes"] == ["mn.2-ps2ok.node0", "mn.2-ps2ok.node1"]
    # the run's verdict line after its watch (events.MultinodeSummary): the node whose crash came first
    [summary] = [k for k in kinds if k.get("kind") == "multinode" and k["run"] == "mn"]
    assert list(summary) == ["kind", "at", "run", "chain", "nodes", "first_failed", "summary"]
    assert summary["first_failed"] == "mn.node1" and summary["summary"].startswith("mn: crash on node 1 (n1) first")
    assert watched.returncode == 0, watched.stdout[-3000:] + watched.stderr  # the successor finished on both
    for node in (0, 1):
        log = hosts.tmp / f"ws{node}" / "logs" / f"mn.2-ps2ok.node{node}.log"
        assert Path(f"{log}.exit").read_text().strip() == "0"
        assert "event=done step=10" in log.read_text()
    runs = {r["name"]: r for r in hosts.runs()}
    assert runs["mn.2-ps2ok.node1"]["parent"] == "mn.node1"  # each node the child of its predecessor
    from orchestrator.store import Store

    with Store(hosts.state / "dfo.db") as store:  # the registry's fell_back: the one shape a watch's has too
        [stored] = store.events("mn", kind="fell_back")
    assert stored["data"] == {"chain": "mn", "next_run": "mn.2-ps2ok", "variant": "ps2ok", "first_failed": "mn.node1",
                              "nodes": ["mn.2-ps2ok.node0", "mn.2-ps2ok.node1"], "rest": []}


def test_a_node_whose_preflight_fails_starts_nothing_anywhere(hosts):
    refused = hosts.launch("--host", "n0", "--host", "n2", "--variant", "ps2")
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert any("n2" in line or "testhost3" in line for line in lines), refused.stderr
    assert len(lines) <= 3, refused.stderr  # the error and its hint, no traceback
    assert not hosts.log(0).exists() and hosts.runs() == []


def test_every_node_that_refuses_is_named_in_one_line(hosts):
    (hosts.tmp / "ws1" / "logs").mkdir(parents=True)
    (hosts.tmp / "ws1" / "logs" / "mn.node2.log").write_text("")  # n1 would be node 2: its log exists
    refused = hosts.launch("--host", "n0", "--host", "n2", "--host", "n1", "--variant", "ps2fail")
    assert refused.returncode == 1
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "2 of 3 nodes refused, nothing was started: n2: " in lines[0], refused.stderr
    assert "; n1: " in lines[0] and "mn.node2.log already exists" in lines[0]
    assert not hosts.log(0).exists() and hosts.runs() == []


def test_a_taken_rendezvous_port_is_refused_before_anything_starts(hosts):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", hosts.port))
        squatter.listen()
        refused = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2")
    assert refused.returncode == 1
    assert f"rendezvous port {hosts.port} is already taken on n0" in refused.stderr
    assert "--master-port" in refused.stderr
    assert not hosts.log(0).exists() and not hosts.log(1).exists() and hosts.runs() == []


def test_a_variant_that_cannot_span_nodes_is_a_usage_error(hosts):
    refused = hosts.launch("--host", "n0", "--host", "n1", "--variant", "threaded")
    assert refused.returncode == 2 and "topology: procsplit" in refused.stderr
    refused = hosts.launch("--host", "n0", "--variant", "ps2")
    assert refused.returncode == 2 and "asks for 2 nodes, got 1 --host" in refused.stderr


def test_a_master_addr_with_shell_metacharacters_is_refused_before_any_connection(hosts):
    refused = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2", "--master-addr", "n0;touch /tmp/x")
    assert refused.returncode == 2
    assert "--master-addr 'n0;touch /tmp/x': expected an IP address or a host name" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) <= 2
    assert not hosts.log(0).exists() and not hosts.log(1).exists() and hosts.runs() == []


@pytest.mark.slow
@pytest.mark.lxc
def test_containers_on_two_netns_hosts_refuse_then_train_one_run_and_a_killed_node_is_named(tmp_path, netns_hosts, ssh_home):
    host0, host1 = netns_hosts(2)
    addr0, _ = netns_hosts.link(host0, host1)
    ct0, ct1 = host0.containers(network="none"), host1.containers(network="none")
    container = {"python": sys.executable}
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0},
        "hosts": {"pve0": {"address": "nshost0", "containers": {"ct0": {"ctid": ct0.vmid, **container}}},
                  "pve1": {"address": "nshost1", "containers": {"ct1": {"ctid": ct1.vmid, **container}}}},
        "variants": {"ps2": {"compile": "eager", "preset": "tiny-cpu", "topology": "procsplit", "nodes": 2,
                             "env": {"GLOO_SOCKET_IFNAME": "dfolink"},
                             "args": {"steps": 100000, "log_every": 5, "debug.step_sleep_s": 0.05}}},
    })
    lab = TwoHosts(tmp_path, inventory, 29500)
    launch = ("launch", "--host", "ct0", "--host", "ct1", "--variant", "ps2", "--name", "mn", "--master-addr", addr0)
    logs = [ct0.path("/workspace/logs/mn.node0.log"), ct1.path("/workspace/logs/mn.node1.log")]

    ct1.stop()  # node 1's container is down: its preflight refuses, and nothing starts on node 0 either
    refused = lab.dfo(*launch)
    assert refused.returncode == 1 and "ct1" in refused.stderr, refused.stderr
    assert not logs[0].exists() and lab.runs() == []
    ct1.start()

    squatter = subprocess.Popen(["ip", "netns", "exec", host0.ns, sys.executable, "-c",
                                 "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 29500)); s.listen(); "
                                 "print('up', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "up"
        refused = lab.dfo(*launch)
    finally:
        squatter.kill()
        squatter.wait(timeout=10)
    assert refused.returncode == 1 and "rendezvous port 29500 is already taken on ct0" in refused.stderr
    assert not logs[0].exists() and lab.runs() == []

    launched = lab.dfo(*launch, "--json")
    assert launched.returncode == 0, launched.stderr
    try:
        wait_for(lambda: all(has_steps(log) for log in logs), 120, "both containers' step lines")
    except AssertionError:
        raise AssertionError("\n".join(log.read_text()[-1500:] if log.exists() else f"{log}: none" for log in logs))
    node1 = logs[1].read_text()
    assert f"rendezvous={addr0}:29500" in node1 and "active=2/2" in node1
    drafter = next(line for line in node1.splitlines() if "event=compile" in line).split(" pid=")[1].split()[0]
    ct1.attach("kill", "-KILL", drafter)  # node 1's drafter dies mid-run
    watched = lab.dfo("watch", "mn", "--until-decided", "--no-fallback", timeout=240)
    assert watched.returncode == 1, watched.stdout + watched.stderr
    summary = watched.stdout.strip().splitlines()[-1]
    assert summary.startswith("mn: crash on node 1 (ct1) first"), watched.stdout
    assert "node 0 (ct0): peer_lost, a consequence" in summary


def popen_dfo(hosts: TwoHosts, *args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "DFO_HOME": str(hosts.state), **(env or {})}
    env.pop("DFO_INVENTORY", None)
    return subprocess.Popen([DFO, *args, "-i", str(hosts.inventory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def fell_back(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()
            if line.startswith("{") and json.loads(line).get("kind") == "multinode_fell_back"]


def events_but_steps(stdout: str) -> str:
    return "\n".join(line[:300] for line in stdout.splitlines() if '"step"' not in line and '"sample"' not in line)[:6000]


def open_intents(hosts: TwoHosts) -> list:
    from orchestrator.store import Store
    with Store(hosts.state / "dfo.db") as store:
        return store.open_intents()


@pytest.mark.slow
@pytest.mark.parametrize("point", ["recorded", "stopped"])
def test_a_multinode_fallback_left_half_done_by_a_killed_dfo_is_finished_once_by_two_racing_watches(played_hosts, point):
    hosts = played_hosts
    killed = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2fail", "--watch", "--until-decided",
                          "--json", timeout=300, env={"DFO_TEST_FALLBACK_EXIT_AT": point})
    assert killed.returncode == 137, killed.stdout[-3000:] + killed.stderr  # dfo died inside the fallback
    assert not fell_back(killed.stdout)
    assert sorted(r["name"] for r in hosts.runs()) == ["mn.node0", "mn.node1"]  # nothing launched yet
    [intent] = open_intents(hosts)
    assert (intent.subject, intent.data["run"], intent.data["variant"]) == ("mn", "mn", "ps2ok")

    # two dfo finish it at once (one names the run, one watches "every active run"): one fallback, both follow it.
    # The one that finishes it says it; the other says it too when it began before the finish closed the intent, and
    # when it began after (under load a racer's start lags by a second or more), it finds the successor as any active
    # run and follows it without saying a fallback it did not see: each says it at most once, one of them always
    racers = [popen_dfo(hosts, "watch", "mn", "--until-decided", "--json"),
              popen_dfo(hosts, "watch", "--until-decided", "--json")]
    outs = [racer.communicate(timeout=300) for racer in racers]
    said = "\n".join(f"--- racer {n}: exit {racer.returncode}, stderr:\n{err[-2000:]}\n--- stdout, no steps:\n"
                     f"{events_but_steps(out)[-3000:]}" for n, (racer, (out, err)) in enumerate(zip(racers, outs)))
    tellers = 0
    for racer, (out, err) in zip(racers, outs):
        assert racer.returncode == 0, said
        told = fell_back(out)
        assert len(told) <= 1, said
        tellers += len(told)
        for told in told:
            assert (told["next_run"], told["nodes"]) == ("mn.2-ps2ok", ["mn.2-ps2ok.node0", "mn.2-ps2ok.node1"]), said
        finals = {event["run"]: event["decision"] for event in map(json.loads, out.splitlines())
                  if event.get("kind") == "final"}
        assert finals.get("mn.2-ps2ok.node0") == finals.get("mn.2-ps2ok.node1") == "exited", said  # followed to its end
    assert tellers >= 1, said
    runs = {r["name"]: r for r in hosts.runs()}
    assert sorted(runs) == ["mn.2-ps2ok.node0", "mn.2-ps2ok.node1", "mn.node0", "mn.node1"]  # each node once
    assert runs["mn.2-ps2ok.node1"]["parent"] == "mn.node1"
    for node in (0, 1):
        log = hosts.tmp / f"ws{node}" / "logs" / f"mn.2-ps2ok.node{node}.log"
        assert log.read_text().count("event=start") == 1 and Path(f"{log}.exit").read_text().strip() == "0"
    assert open_intents(hosts) == []
    again = hosts.dfo("watch", "mn", "--until-decided", "--json", timeout=120)  # done: nothing more launches
    assert again.returncode == 0 and not fell_back(again.stdout), again.stdout[-2000:] + again.stderr
    assert len(hosts.runs()) == 4


@pytest.mark.slow
def test_a_multinode_fallback_killed_between_starting_its_nodes_is_relaunched_whole_once(played_hosts):
    hosts = played_hosts
    launched = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2fail")
    assert launched.returncode == 0, launched.stderr
    killed = hosts.dfo("watch", "mn", "--until-decided", "--json", timeout=300,
                       env={"DFO_TEST_FALLBACK_EXIT_AT": "node0_started"})
    assert killed.returncode == 137, killed.stdout[-3000:] + killed.stderr  # node 0 of the successor started, not 1
    partial = hosts.tmp / "ws0" / "logs" / "mn.2-ps2ok.node0.log"
    wait_for(lambda: partial.exists(), 30, "the half-launched successor's node 0")
    finished = hosts.dfo("watch", "mn", "--until-decided", "--json", timeout=300)
    assert finished.returncode == 0, events_but_steps(finished.stdout) + finished.stderr
    [told] = fell_back(finished.stdout)
    assert (told["next_run"], told["nodes"]) == ("mn.2-ps2ok-2", ["mn.2-ps2ok-2.node0", "mn.2-ps2ok-2.node1"])
    runs = {r["name"]: r for r in hosts.runs()}
    # the half-launched one: stopped, or ended on its own first (its played 10 steps need no peer: exited, under load)
    assert runs["mn.2-ps2ok.node0"]["state"] in ("stopped", "crashed", "exited")
    assert runs["mn.2-ps2ok.node1"]["state"] == "failed" and runs["mn.2-ps2ok.node1"]["pid"] is None  # never started
    for node in (0, 1):  # the whole successor trained to its end, each node started once
        log = hosts.tmp / f"ws{node}" / "logs" / f"mn.2-ps2ok-2.node{node}.log"
        assert log.read_text().count("event=start") == 1 and Path(f"{log}.exit").read_text().strip() == "0"
    assert open_intents(hosts) == []


@pytest.mark.slow
@pytest.mark.parametrize("point", ["after_start", "before_start"])
def test_a_multinode_successor_whose_starts_got_no_answer_is_adopted_if_it_runs_and_launched_again_only_if_not(
        played_hosts, point):
    hosts = played_hosts
    # the successor's starts time out on both nodes: after_start, the nodes started and their PIDs never came
    # back; before_start, the word to start never went out. Their rows are `unconfirmed` (no PID) and the fallback
    # stays open, as a single run's (before: closed as failed, with the nodes that ran stopped)
    first = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2fail", "--watch", "--until-decided",
                         timeout=300, env={"DFO_TEST_START_TIMEOUT_AT": point})
    # said by the watch that carried it out, as the run's action_error (a line on stderr when it came after the watch)
    failed = [event for event in map(json.loads, first.stdout.splitlines()) if event.get("kind") == "action_error"]
    assert [(event["run"], event["error"].split(" (")[0]) for event in failed] == [
        ("mn", "falling back failed: the start of mn.2-ps2ok got no answer")], events_but_steps(first.stdout) + first.stderr
    [intent] = open_intents(hosts)
    assert (intent.kind, intent.data["run"]) == ("multinode_fallback", "mn")
    from orchestrator.store import Store
    with Store(hosts.state / "dfo.db") as store:
        assert [(store.get_run(n).state, store.get_run(n).pid) for n in store.nodes_of("mn.2-ps2ok")] == [("unconfirmed", None)] * 2

    watched = hosts.dfo("watch", "mn", "--until-decided", "--json", timeout=180)  # looks for the nodes first
    assert watched.returncode == 0, events_but_steps(watched.stdout) + watched.stderr
    successor = {"after_start": "mn.2-ps2ok", "before_start": "mn.2-ps2ok-2"}[point]
    [told] = fell_back(watched.stdout)
    assert (told["next_run"], told["nodes"]) == (successor, [f"{successor}.node0", f"{successor}.node1"])
    for node in (0, 1):  # one successor ran on each node: the one that started adopted, never a second beside it
        logs = hosts.tmp / f"ws{node}" / "logs"
        assert sum(log.read_text().count("event=start") for log in logs.glob("mn.2-*.log")) == 1
        assert Path(f"{logs}/{successor}.node{node}.log.exit").read_text().strip() == "0"
    runs = {r["name"]: r for r in hosts.runs()}
    assert open_intents(hosts) == [] and runs[f"{successor}.node1"]["parent"] == "mn.node1"
    if point == "before_start":  # nothing of it ran: marked failed, passed by for -2
        assert [runs[f"mn.2-ps2ok.node{node}"]["state"] for node in (0, 1)] == ["failed", "failed"]
    else:
        assert sorted(runs) == ["mn.2-ps2ok.node0", "mn.2-ps2ok.node1", "mn.node0", "mn.node1"]


def hold_a_multinode_fallback(hosts: TwoHosts, said: Path) -> tuple[subprocess.Popen, Path]:
    """`dfo launch --watch --json` of `mn` (ps2fail on n0 and n1), its stderr to `said`, until its fallback to ps2ok
    has recorded the successor's nodes and is held there, none started (DFO_TEST_PAUSE_AT=nodes_recorded; the first
    launch's hold is let go at once). Returns the process and the pause file: removing it lets the launch go on."""
    paused = hosts.tmp / "paused"
    env = {**os.environ, "DFO_HOME": str(hosts.state), "DFO_TEST_PAUSE_AT": "nodes_recorded",
           "DFO_TEST_PAUSE_FILE": str(paused)}
    env.pop("DFO_INVENTORY", None)
    with said.open("w") as stderr:
        dfo = subprocess.Popen([DFO, "launch", "--name", "mn", "--master-addr", "127.0.0.1", "--master-port",
                                str(hosts.port), "--host", "n0", "--host", "n1", "--variant", "ps2fail", "--watch",
                                "--until-decided", "--json", "-i", str(hosts.inventory)],
                               stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    wait_for(paused.exists, 60, "the first launch to record its nodes")
    paused.unlink()
    wait_for(paused.exists, 180, "the fallback's launch to record its successor's nodes")
    return dfo, paused


@pytest.mark.slow
def test_ctrl_c_during_a_multinode_fallback_says_what_it_finishes_and_finishes_it_first(played_hosts):
    hosts = played_hosts
    # the fallback ran after the watch, on dfo's main thread: Ctrl-C there cut it off half way (its successor's
    # nodes recorded, none started) with only "interrupted: remote runs were left running"; it is finished
    # first and said as a single run's fallback is (a real SIGINT while its successor's launch is held), now by
    # the watch's one Ctrl-C path, the fallback being its lifecycle's
    said = hosts.tmp / "stderr"
    dfo, paused = hold_a_multinode_fallback(hosts, said)
    try:
        dfo.send_signal(signal.SIGINT)  # Ctrl-C
        wait_for(lambda: "interrupted: finishing" in said.read_text(), 30, "the line about the fallback")
        line = next(line for line in said.read_text().splitlines() if "finishing" in line)
        assert line == ("interrupted: finishing the fallback of mn to ps2ok first; Ctrl-C again leaves it to the "
                        "next `dfo watch`"), said.read_text()
        time.sleep(1)
        assert dfo.poll() is None  # it waits for the fallback
        paused.unlink()
        assert dfo.wait(timeout=60) == 130, said.read_text()
    finally:
        dfo.kill()
        hosts.dfo("stop", "mn.2-ps2ok", "--grace", "5")
    assert "stopped watching; the runs go on" in said.read_text()
    assert open_intents(hosts) == []  # carried to its end: every node of the successor started and recorded
    runs = {run["name"]: run for run in hosts.runs()}
    assert all(runs[f"mn.2-ps2ok.node{node}"]["pid"] is not None for node in (0, 1)), runs


@pytest.mark.slow
def test_a_second_ctrl_c_during_a_multinode_fallback_leaves_it_half_done_for_the_next_watch(played_hosts):
    # as a single run's: dfo leaves at once, nothing signalled, the intent open; the next `dfo watch mn` passes by
    # the successor whose nodes were recorded and never started, and launches it whole as `-2`
    hosts = played_hosts
    said = hosts.tmp / "stderr"
    dfo, paused = hold_a_multinode_fallback(hosts, said)
    try:
        dfo.send_signal(signal.SIGINT)
        wait_for(lambda: "interrupted: finishing" in said.read_text(), 30, "the line about the fallback")
        dfo.send_signal(signal.SIGINT)  # again
        assert dfo.wait(timeout=15) == 130, said.read_text()  # at once
    finally:
        dfo.kill()
        paused.unlink(missing_ok=True)
    assert "the fallback of mn to ps2ok is left half done; the next `dfo watch` finishes it" in said.read_text()
    [intent] = open_intents(hosts)
    assert (intent.kind, intent.data["run"], intent.data["variant"]) == ("multinode_fallback", "mn", "ps2ok")
    assert not any(hosts.tmp.glob("ws*/logs/mn.2-ps2ok.node*.log.exit"))  # none of the successor ran
    finished = hosts.dfo("watch", "mn", "--until-decided", "--json", timeout=300)
    assert finished.returncode == 0, events_but_steps(finished.stdout) + finished.stderr
    [told] = fell_back(finished.stdout)
    assert (told["next_run"], told["nodes"]) == ("mn.2-ps2ok-2", ["mn.2-ps2ok-2.node0", "mn.2-ps2ok-2.node1"])
    assert open_intents(hosts) == []


@pytest.mark.slow
def test_a_multinode_fallback_its_watch_left_half_done_is_finished_once_by_the_watch_that_takes_the_group_over(
        played_hosts):
    """Two `dfo watch mn`: the first holds the group and dies inside its fallback (its intent recorded, node 0 still
    running); the second, which only watched, takes the group over mid-watch and finishes that fallback itself as the
    watch's lifecycle (it was finished only by a `dfo watch` started after the first had died, before it watched),
    says it once, and follows the successor to its end: one successor run, the nodes' stops recorded once."""
    hosts = played_hosts
    launched = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2fail")
    assert launched.returncode == 0, launched.stderr
    first = popen_dfo(hosts, "watch", "mn", "--json", env={"DFO_TEST_FALLBACK_EXIT_AT": "recorded"})
    out, err = hosts.tmp / "second.out", hosts.tmp / "second.err"
    env = {**os.environ, "DFO_HOME": str(hosts.state)}
    env.pop("DFO_INVENTORY", None)
    try:
        from orchestrator.store import Store
        with Store(hosts.state / "dfo.db") as store:
            wait_for(lambda: len(store.claims()) == 2, 60, "the first watch's claims on both nodes' chains")
        with out.open("w") as stdout, err.open("w") as stderr:
            second = subprocess.Popen([DFO, "watch", "mn", "--json", "-i", str(hosts.inventory)],  # to every run's end
                                      stdout=stdout, stderr=stderr, env=env)
        first_out, first_err = first.communicate(timeout=180)
        assert first.returncode == 137, first_out[-3000:] + first_err  # died inside the fallback
        try:
            assert second.wait(timeout=240) == 0
        except (AssertionError, subprocess.TimeoutExpired):
            raise AssertionError(f"exit status {second.poll()}\n--- stderr:\n{err.read_text()[-3000:]}\n--- stdout, "
                                 f"no steps:\n{events_but_steps(out.read_text())[-5000:]}") from None
    finally:
        first.kill()
        if "second" in locals():
            second.kill()
    lines = json_lines(out)
    said = events_but_steps(out.read_text())[-5000:]
    successor = "mn.2-ps2ok"
    assert any(line["kind"] == "took_over" for line in lines), said  # it only watched until the first died
    [told] = [line for line in lines if line["kind"] == "multinode_fell_back"]
    assert (told["run"], told["next_run"], told["nodes"]) == ("mn", successor, [f"{successor}.node0", f"{successor}.node1"]), said
    finals = {line["chain"]: line["run"] for line in lines if line["kind"] == "final"}
    assert finals == {"mn.node0": f"{successor}.node0", "mn.node1": f"{successor}.node1"}, said
    assert open_intents(hosts) == []
    runs = {r["name"]: r for r in hosts.runs()}
    assert sorted(runs) == ["mn.2-ps2ok.node0", "mn.2-ps2ok.node1", "mn.node0", "mn.node1"], runs  # one successor
    for node in (0, 1):
        log = hosts.tmp / f"ws{node}" / "logs" / f"{successor}.node{node}.log"
        assert log.read_text().count("event=start") == 1 and Path(f"{log}.exit").read_text().strip() == "0"
    with Store(hosts.state / "dfo.db") as store:  # the first watch's stop of the crashed node is not recorded again
        assert len(store.events("mn.node1", kind="acting")) == 1, store.events("mn.node1")


def json_lines(path: Path) -> list[dict]:
    """The JSON lines a `dfo watch --json` wrote to `path` so far (a line still being written left out)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.startswith("{") and line.endswith("}")]


@pytest.mark.slow
def test_a_multinode_fallback_is_carried_out_while_the_watch_goes_on_following_another_run_and_its_successor(
        played_hosts):
    """One `dfo watch` follows a single-node run (`solo`, steady for minutes) and a multi-node run whose node 1
    crashes: the group's fallback is decided and carried out by the watch's lifecycle while the watch goes on, which
    then follows the successor's nodes to their verdict, `solo` still followed all along. Before, the group fell
    back only after the watch had ended, so a watch that also followed a run still going never fell back at all."""
    from test_watch import FAST_WATCH, STEADY_TRAINER

    hosts = played_hosts
    inventory = yaml.safe_load(hosts.inventory.read_text())
    (hosts.tmp / "steady.py").write_text(STEADY_TRAINER)
    inventory["variants"]["solo"] = {"command": f"{sys.executable} {hosts.tmp}/steady.py 100000 0.05"}
    inventory["watch"].update(FAST_WATCH)
    hosts.inventory.write_text(yaml.safe_dump(inventory))
    solo = hosts.dfo("launch", "--host", "n0b", "--variant", "solo", "--name", "solo")
    assert solo.returncode == 0, solo.stderr
    launched = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2fail")
    assert launched.returncode == 0, launched.stderr
    out, err = hosts.tmp / "watch.out", hosts.tmp / "watch.err"
    env = {**os.environ, "DFO_HOME": str(hosts.state)}
    env.pop("DFO_INVENTORY", None)
    with out.open("w") as stdout, err.open("w") as stderr:
        watch = subprocess.Popen([DFO, "watch", "solo", "mn", "--json", "-i", str(hosts.inventory)], stdout=stdout,
                                 stderr=stderr, env=env)

    def said() -> str:  # what the watch said, for a failure's message: its stderr first (a watch that died says why)
        return (f"exit status {watch.poll()}\n--- stderr:\n{err.read_text()[-4000:]}\n--- stdout, no steps:\n"
                f"{events_but_steps(out.read_text())[-4000:]}")

    def decided(run: str) -> bool:
        return any(line["kind"] == "decision" and line["run"] == run and line["decision"]["decision"] in (
            "steady", "exited") for line in json_lines(out))

    def told() -> list[dict]:
        return [line for line in json_lines(out) if line["kind"] == "multinode_fell_back"]

    successors = ["mn.2-ps2ok.node0", "mn.2-ps2ok.node1"]
    try:
        try:
            wait_for(lambda: told() or watch.poll() is not None, 150, "the multi-node fallback")
            assert watch.poll() is None, "the watch ended"
            [fell] = told()
            assert (fell["run"], fell["next_run"], fell["nodes"]) == ("mn", "mn.2-ps2ok", successors)
            wait_for(lambda: all(map(decided, successors)) or watch.poll() is not None, 120, "the successor's verdicts")
            assert watch.poll() is None, "the watch ended before `solo` did"
        except AssertionError as failed:
            raise AssertionError(f"{failed}\n{said()}") from None
        assert decided("solo"), said()  # followed all along, and still
        stopped = hosts.dfo("stop", "solo", "--grace", "5")
        assert stopped.returncode == 0, stopped.stderr
        assert watch.wait(timeout=60) == 0, said()  # every chain ended: solo stopped, the successor exited 0
    finally:
        watch.kill()
        hosts.dfo("stop", "solo", "--grace", "5")
        hosts.dfo("stop", "mn", "--grace", "5")
    lines = json_lines(out)
    finals = {line["chain"]: line["run"] for line in lines if line["kind"] == "final"}
    assert finals == {"solo": "solo", "mn.node0": successors[0], "mn.node1": successors[1]}, said()
    summaries = [line["run"] for line in lines if line["kind"] == "multinode"]
    assert summaries == ["mn", "mn.2-ps2ok"], said()  # one line on each multi-node run the watch followed
    assert not any(line["kind"] == "action_error" for line in lines), said()
    runs = {r["name"]: r for r in hosts.runs()}
    assert runs["mn.2-ps2ok.node1"]["parent"] == "mn.node1" and runs["mn.node0"]["state"] == "stopped", runs
    for node in (0, 1):  # each successor node ran once, to its end
        log = hosts.tmp / f"ws{node}" / "logs" / f"mn.2-ps2ok.node{node}.log"
        assert log.read_text().count("event=start") == 1 and Path(f"{log}.exit").read_text().strip() == "0"
    assert open_intents(hosts) == []


@pytest.mark.slow
def test_a_launch_whose_start_got_no_answer_on_one_node_names_that_node_and_what_was_left(hosts):
    # node 1's start script waits 4 s before it starts the run; dfo gives up on its answer after 1 s. The error
    # said "n1: the launch script gave no start within 1s": which run, which nodes started, what happens now?
    # The start grace is 30 s here, not the module's 8: on a loaded machine the launch's exit and the start of
    # `dfo stop` took the 8 s, and the stop found node 1 already up without saying it had looked for it
    inventory = yaml.safe_load(hosts.inventory.read_text())
    inventory["watch"]["start_grace_s"] = 30
    hosts.inventory.write_text(yaml.safe_dump(inventory))
    launched = hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2", "--no-preflight",
                            env={"DFO_TEST_SLOW_START": "mn.node1:4"})
    try:
        assert launched.returncode == 1, launched.stdout + launched.stderr
        said = " ".join(launched.stderr.split())
        assert "mn: the start of mn.node1 on n1 got no answer (pve1: the launch script gave no start within 1s)" in said, said
        assert re.search(r"started: mn\.node0 on n0 \(PID \d+\); left `unconfirmed`: mn\.node1 on n1, which may still come up",
                         said), said
        assert "`dfo runs mn` or `dfo watch mn` looks for it by its exit file" in said and "`dfo stop mn`" in said
        # stopped at once, node 1 is waited for until it shows (before: node 0 alone, node 1 left to come up)
        stopped = hosts.dfo("stop", "mn", "--grace", "5", "--json")
        assert stopped.returncode == 0, stopped.stderr
        assert "mn.node1: its start got no answer; looking for it for up to" in stopped.stderr
        assert [(n["run"], n["state"]) for n in json.loads(stopped.stdout)["nodes"]] == [
            ("mn.node0", "stopped"), ("mn.node1", "stopped")], stopped.stdout
    finally:
        hosts.dfo("stop", "mn", "--grace", "5")


def test_a_failed_launch_waits_for_a_node_whose_start_got_no_answer_only_the_inventorys_start_grace(hosts):
    # node 0's start script waits 30 s before it starts the run (dfo gives up on its answer after 1 s); node 1's
    # start is refused (its log appeared while the launch was held). Node 0 is looked for so it can be stopped:
    # for the inventory's watch.start_grace_s (3 s here), not a built-in 30 s
    inventory = yaml.safe_load(hosts.inventory.read_text())
    inventory["watch"]["start_grace_s"] = 3
    hosts.inventory.write_text(yaml.safe_dump(inventory))
    paused = hosts.tmp / "paused"
    launch = popen_dfo(hosts, "launch", "--name", "mn", "--master-addr", "127.0.0.1", "--master-port", str(hosts.port),
                       "--host", "n0", "--host", "n1", "--variant", "ps2",
                       env={"DFO_TEST_PAUSE_AT": "nodes_recorded", "DFO_TEST_PAUSE_FILE": str(paused),
                            "DFO_TEST_SLOW_START": "mn.node0:30"})
    try:
        wait_for(paused.exists, 60, "the launch to record its nodes")
        hosts.log(1).parent.mkdir(parents=True, exist_ok=True)
        hosts.log(1).write_text("someone else's\n")
        started = time.monotonic()
        paused.unlink()
        out, err = launch.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        launch.kill()
        shutil.rmtree(hosts.log(0).parent, ignore_errors=True)  # node 0's late start then finds no log directory
    assert launch.returncode == 1 and "mn.node1.log appeared on n1 meanwhile" in err, out + err
    # 20 s: the 3-s grace and a loaded machine's slack, well short of node 0's 30-s late start and a built-in 30 s
    assert took < 20, f"the failed launch took {took:.1f} s: node 0 was waited for longer than its 3 s grace"
    shown = json.loads(hosts.dfo("runs", "mn", "--json", "--no-refresh").stdout)
    assert [(n["name"], n["state"]) for n in shown["nodes"]] == [("mn.node0", "failed"), ("mn.node1", "failed")]


def test_nodes_not_started_after_a_failed_start_stay_listed_as_failed_saying_why(hosts):
    # held between recording the nodes and starting them, someone's log appears where node 0's goes: node 0's
    # start is refused (dfo never overwrites a log) and node 1 is never started. The run still names both.
    paused = hosts.tmp / "paused"
    launch = popen_dfo(hosts, "launch", "--name", "mn", "--master-addr", "127.0.0.1", "--master-port", str(hosts.port),
                       "--host", "n0", "--host", "n1", "--variant", "ps2",
                       env={"DFO_TEST_PAUSE_AT": "nodes_recorded", "DFO_TEST_PAUSE_FILE": str(paused)})
    try:
        wait_for(paused.exists, 60, "the launch to record its nodes")
        hosts.log(0).parent.mkdir(parents=True, exist_ok=True)
        hosts.log(0).write_text("someone else's\n")
        paused.unlink()
        out, err = launch.communicate(timeout=60)
    finally:
        launch.kill()
    assert launch.returncode == 1 and "mn.node0.log appeared on n0 meanwhile" in err, out + err
    assert hosts.log(0).read_text() == "someone else's\n" and not hosts.log(1).exists()

    shown = hosts.dfo("runs", "mn", "--json")  # before: UnknownRun, the nodes' rows were gone
    assert shown.returncode == 0, shown.stderr
    assert [(n["name"], n["state"]) for n in json.loads(shown.stdout)["nodes"]] == [
        ("mn.node0", "failed"), ("mn.node1", "failed")]
    why = hosts.dfo("runs", "mn.node1")
    assert "why:      not started: the start of mn.node0 before it failed" in why.stdout, why.stdout + why.stderr
    assert "appeared on n0 meanwhile" in json.loads(hosts.dfo("runs", "mn.node0", "--json").stdout)["launch_failed"]
    stopped = hosts.dfo("stop", "mn")
    assert stopped.returncode == 0 and "mn had already ended on every node" in stopped.stdout, stopped.stderr


# A node trainer played by a script (`PYTHON -m trainer` on both hosts runs it, see played_python): it steps
# --steps times and exits 0; the node whose --node-rank is debug.fail_drafter crashes (exit 1, the injected
# failure's words) at debug.fail_at_step; on SIGTERM it checkpoints and exits 75, as the built-in trainer does.
PLAYED_NODE = """\
import signal, sys, time
from datetime import datetime, timezone
argv = sys.argv[1:]
sets = dict(argv[i + 1].split("=", 1) for i, arg in enumerate(argv) if arg == "--set")
steps, rank = int(argv[argv.index("--steps") + 1]), int(argv[argv.index("--node-rank") + 1])
fail_at = int(sets["debug.fail_at_step"]) if sets.get("debug.fail_drafter") == str(rank) else 0
signal.signal(signal.SIGTERM, lambda *_: (print("event=checkpoint reason=sigterm", flush=True), sys.exit(75)))
print("ts=%s event=start" % datetime.now(timezone.utc).isoformat(), flush=True)
for step in range(1, steps + 1):
    ts = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    print(f"ts={ts} event=step step={step} tok_s={1000 + step % 3:.1f} loss=1.0", flush=True)
    if step == fail_at:
        print(f"RuntimeError: injected failure in drafter {rank}", file=sys.stderr, flush=True)
        sys.exit(1)
    time.sleep(0.05)
print(f"event=done step={steps} reason=finished", flush=True)
"""


def played_python(tmp_path: Path, script: str) -> Path:
    """A `python` whose `-m trainer` runs `script`, anything else the real interpreter."""
    (tmp_path / "node.py").write_text(script)
    python = tmp_path / "fakepython"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "trainer" ]; then shift 2; '
                      f'exec {sys.executable} {tmp_path}/node.py "$@"; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


@pytest.fixture
def gpu_hosts(tmp_path, sshd, ssh_home, pct_standin_env):
    """Two hosts listing GPUs 0 and 1 whose nvidia-smi (one stand-in state for both) shows GPU 0 busy with
    another tenant's work and GPU 1 idle; the variants are pinned to GPU 1 (CUDA_VISIBLE_DEVICES). Their
    trainer is PLAYED_NODE: what is tested is when dfo starts the successor, not what trains."""
    gpus = NvidiaSmiState(tmp_path / "gpus.json", [Gpu(0, memory_used_mib=40960, utilization_pct=87), Gpu(1)])
    servers = [SshServer(tmp_path / f"gpusshd{i}", env={**pct_standin_env, STATE_ENV: str(gpus.path)}).start()
               for i in (0, 1)]
    for i, server in enumerate(servers):
        ssh_home.add_host(f"gpuhost{i}", server)
    python = played_python(tmp_path, PLAYED_NODE)
    pinned = {"compile": "eager", "preset": "tiny-cpu", "topology": "procsplit", "env": {"CUDA_VISIBLE_DEVICES": "1"}}
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0},
        "hosts": {f"pve{i}": {"address": f"gpuhost{i}", "containers": {f"n{i}": {
            "ctid": None, "workspace": str(tmp_path / f"ws{i}"), "python": str(python), "gpus": [0, 1]}}}
            for i in (0, 1)},
        "variants": {
            "ps2fail": {**pinned, "args": {"steps": 100000, "log_every": 5,
                                           "debug.fail_at_step": 10, "debug.fail_drafter": 1}},
            "ps2ok": {**pinned, "args": {"steps": 10, "log_every": 5}},
        },
        "fallback": ["ps2fail", "ps2ok"],
        "signatures": [{"id": "injected", "pattern": "injected failure in drafter", "meaning": "a test's fault"}],
    })
    hosts = TwoHosts(tmp_path, inventory, free_port())
    hosts.gpus = gpus
    yield hosts
    for server in servers:
        server.kill_sessions()
        server.stop()


@pytest.mark.slow
def test_a_multinode_successor_waits_only_for_the_gpus_its_predecessor_used(gpu_hosts):
    # GPU 0 stays busy (not dfo's); the run used GPU 1 only, which is idle: the successor starts at once
    watched = gpu_hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2fail", "--no-preflight", "--watch",
                               "--until-decided", timeout=300)
    assert watched.returncode == 0, watched.stderr  # today: "GPUs of n0 are still busy" (GPU 0, not the run's)
    [told] = fell_back(watched.stdout)
    assert told["next_run"] == "mn.2-ps2ok", watched.stdout[-3000:]
    for node in (0, 1):
        log = gpu_hosts.tmp / f"ws{node}" / "logs" / f"mn.2-ps2ok.node{node}.log"
        assert Path(f"{log}.exit").read_text().strip() == "0"


@pytest.mark.slow
def test_a_multinode_successor_starts_once_the_gpus_its_predecessor_used_are_released(gpu_hosts):
    # GPU 1, the run's, still reads busy on both nodes when the fallback begins, and goes idle 4 s later
    gpu_hosts.gpus.set_load(1, memory_used_mib=40960, utilization_pct=90)
    released = []

    def release_later() -> None:
        wait_for(lambda: any(i.kind == "multinode_fallback" for i in open_intents(gpu_hosts)), 240, "the fallback")
        time.sleep(4)
        gpu_hosts.gpus.set_load(1, memory_used_mib=0, utilization_pct=0)
        released.append(time.time())

    releaser = threading.Thread(target=release_later, daemon=True)
    releaser.start()
    watched = gpu_hosts.launch("--host", "n0", "--host", "n1", "--variant", "ps2fail", "--no-preflight", "--watch",
                               "--until-decided", timeout=300)
    releaser.join(5)
    assert watched.returncode == 0, watched.stderr  # today: both nodes refuse at once and nothing waits
    [told] = fell_back(watched.stdout)
    assert told["next_run"] == "mn.2-ps2ok" and released, watched.stdout[-3000:]
    for node in (0, 1):
        log = gpu_hosts.tmp / f"ws{node}" / "logs" / f"mn.2-ps2ok.node{node}.log"
        assert log.stat().st_ctime >= released[0] - 1  # started after GPU 1 went idle, not before
        assert Path(f"{log}.exit").read_text().strip() == "0"


# A node trainer played by a script (`PYTHON -m trainer` on both hosts runs it): with `--steps 1000`, node 1 crashes
# (exit 3) after 5 steps while node 0 steps on, and on SIGTERM takes 12 s to write its checkpoint, then exits 75
# (the built-in trainer's checkpointed exit); with any other --steps, that many steps, then exit 0.
SLOW_CHECKPOINT_NODE = """\
import os, signal, sys, time
from datetime import datetime, timezone
argv = sys.argv[1:]
steps, rank, name = int(argv[argv.index("--steps") + 1]), int(argv[argv.index("--node-rank") + 1]), argv[argv.index("--run-name") + 1]
asked = []
signal.signal(signal.SIGTERM, lambda *_: asked.append(time.time()))
print("ts=%s event=start" % datetime.now(timezone.utc).isoformat(), flush=True)
step = 0
while step < (5 if rank == 1 and steps == 1000 else steps) and not asked:
    step += 1
    ts = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    print(f"ts={ts} event=step step={step} tok_s={1000 + step % 3:.1f} loss=1.0", flush=True)
    time.sleep(0.02)
if asked:
    print("writing the checkpoint", flush=True)
    time.sleep(12)
    open(f"{name}.checkpointed", "w").close()
    sys.exit(75)
sys.exit(3 if steps == 1000 else 0)
"""


@pytest.fixture
def slow_checkpoint_hosts(tmp_path, sshd, ssh_home, pct_standin_env):
    """Two hosts whose `python -m trainer` is SLOW_CHECKPOINT_NODE; the failing variant (`psx`) says
    stop_grace_s: 30, its successor (`psok`) runs 5 steps."""
    from test_watch import FAST_WATCH

    python = played_python(tmp_path, SLOW_CHECKPOINT_NODE)
    servers = [SshServer(tmp_path / f"cksshd{i}", env=dict(pct_standin_env)).start() for i in (0, 1)]
    for i, server in enumerate(servers):
        ssh_home.add_host(f"ckhost{i}", server)
    played = {"compile": "eager", "preset": "tiny-cpu", "topology": "procsplit"}
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0},
        "hosts": {f"pve{i}": {"address": f"ckhost{i}", "containers": {f"n{i}": {
            "ctid": None, "workspace": str(tmp_path / f"ws{i}"), "python": str(python)}}} for i in (0, 1)},
        "variants": {"psx": {**played, "args": {"steps": 1000}, "stop_grace_s": 30},
                     "psok": {**played, "args": {"steps": 5}}},
        "fallback": ["psx", "psok"],
        "watch": FAST_WATCH,
    })
    yield TwoHosts(tmp_path, inventory, free_port())
    for server in servers:
        server.kill_sessions()
        server.stop()


@pytest.mark.slow
def test_the_nodes_a_multinode_fallback_stops_get_their_variants_stop_grace_to_write_their_checkpoint(
        slow_checkpoint_hosts):
    """Node 1 crashes; node 0, still running, is stopped by the run's fallback and needs 12 s to write its checkpoint
    after its SIGTERM. Its variant's stop_grace_s (30 s) is what it gets, as `dfo stop` and a single run's fallback
    give (Inventory.stop_grace): it checkpoints and exits 75, then the successor runs on both nodes. It got a fixed
    10 s, then SIGKILL, and its checkpoint was lost. Meanwhile `dfo watch` says the wait as `dfo stop` does (after 1 s,
    then every 10 s; it said nothing: the watch's view had ended, as the fallback comes after it)."""
    hosts = slow_checkpoint_hosts
    watched = hosts.launch("--host", "n0", "--host", "n1", "--variant", "psx", "--no-preflight", "--watch",
                           "--until-decided", timeout=240)
    assert watched.returncode == 0, watched.stderr + events_but_steps(watched.stdout)
    [told] = fell_back(watched.stdout)
    assert told["next_run"] == "mn.2-psok", events_but_steps(watched.stdout)
    runs = {r["name"]: r for r in hosts.runs()}
    assert (runs["mn.node0"]["state"], runs["mn.node0"]["exit_code"]) == ("stopped", 75), runs["mn.node0"]
    assert (hosts.tmp / "ws0" / "mn.node0.checkpointed").exists()  # written 12 s after its SIGTERM
    assert runs["mn.node1"]["exit_code"] == 3 and runs["mn.2-psok.node1"]["exit_code"] == 0, (
        runs["mn.node1"], runs["mn.2-psok.node1"], events_but_steps(watched.stdout))
    said = [line for line in watched.stderr.splitlines() if "to checkpoint and exit" in line]
    ages = [int(re.search(r"\(SIGTERM sent (\d+) s ago;", line).group(1)) for line in said]
    # after 1 s, then 10 s on (the stop program reports about every second); the node exits ~12 s after its SIGTERM
    assert len(said) == 2 and ages[0] in (1, 2) and 10 <= ages[1] - ages[0] <= 11, watched.stderr
    assert all(line == f"waiting for run mn.node0 to checkpoint and exit (SIGTERM sent {age} s ago; SIGKILL at 30 s; "
                       "Ctrl-C finishes this fallback first)" for line, age in zip(said, ages)), said
