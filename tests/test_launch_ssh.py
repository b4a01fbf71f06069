"""`dfo launch/runs/logs/stop/push` as a user runs them, through a real sshd and real LXC containers behind
the pct stand-in: the run survives the SSH server going away, refusals leave nothing behind, secrets stay secret."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import write_inventory
from harness.cli import DFO, Ran, dfo
from harness.lxc import LxcContainer
from harness.nvidia_smi import Gpu
from orchestrator.connections import Connections
from orchestrator.inventory import load_inventory
from orchestrator.package import build_package, package_files, push
from orchestrator.runs import STOP_MARGIN_S
from orchestrator.store import Store

pytestmark = [pytest.mark.lxc, pytest.mark.slow]

SECRET = "tok-7Hq2-Zz81-secret"
TICKER = 'case "$DFO_TEST_TOKEN" in tok-*-secret) echo secret-ok;; esac; i=0; while :; do echo tick-$i; i=$((i + 1)); sleep 0.1; done'
REPO = Path(__file__).resolve().parents[1]
HAS_TRAINER = (REPO / "trainer" / "__main__.py").exists()
STOP_LIMIT_S = 30 + STOP_MARGIN_S + 30  # --grace 30, dfo's own bound past the grace, connecting and starting dfo


@dataclass
class Lab:
    inventory: Path
    container: LxcContainer
    state: Path

    def dfo(self, *args: str, timeout: float = 90, env: dict[str, str] | None = None) -> Ran:
        env = {"DFO_HOME": str(self.state), "DFO_TEST_TOKEN": SECRET, **(env or {})}
        return dfo(*args, *(["-i", str(self.inventory)] if args[0] != "runs" else []), env=env, timeout=timeout)

    def follow(self, name: str) -> subprocess.Popen:
        env = {**os.environ, "DFO_HOME": str(self.state)}
        return subprocess.Popen([DFO, "logs", name, "-f", "-n", "1", "-i", str(self.inventory)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def log(self, name: str) -> Path:
        return self.container.path(f"/workspace/logs/{name}.log")


@pytest.fixture
def lab(tmp_path, sshd, ssh_home, containers) -> Lab:
    running, stopped = containers(), containers(start=False)
    containers_ = {
        "ct_a": {"ctid": running.vmid, "gpus": [0], "python": sys.executable},
        "ct_off": {"ctid": stopped.vmid},
        "ct_nopy": {"ctid": running.vmid, "python": "/nonexistent/python3"},
    }
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0},
        "hosts": {"pve1": {"address": "testhost", "containers": containers_}},
        "variants": {"ticker": {"command": TICKER}, "nographs": {"compile": "nographs", "preset": "tiny-cpu"},
                     "eager": {"compile": "eager", "preset": "tiny-cpu"}},
        "secrets": ["DFO_TEST_TOKEN"],
    })
    return Lab(inventory, running, tmp_path / "state")


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def last_tick(text: str) -> int:
    return max(int(line.split("-")[1]) for line in text.splitlines() if line.startswith("tick-"))


def test_run_survives_sshd_going_away_then_logs_and_stop_work(lab: Lab, sshd) -> None:
    launched = lab.dfo("launch", "--host", "ct_a", "--variant", "ticker", "--name", "t1", "--json")
    assert launched.returncode == 0, launched.stderr
    info = json.loads(launched.stdout)
    assert (info["run"], info["log"], info["next"]) == ("t1", "/workspace/logs/t1.log", "dfo watch t1")
    wait_for(lambda: "tick-3" in lab.log("t1").read_text(), what="the run's first lines")
    assert "secret-ok" in lab.log("t1").read_text()

    sshd.kill()  # the host's sshd vanishes: the detached run must not care
    before = last_tick(lab.log("t1").read_text())
    wait_for(lambda: last_tick(lab.log("t1").read_text()) > before + 5, what="the log to keep growing without sshd")
    sshd.start()

    tail = lab.dfo("logs", "t1", "-n", "3")
    assert tail.returncode == 0, tail.stderr
    assert len(tail.stdout.splitlines()) == 3 and last_tick(tail.stdout) > before + 5

    follower = lab.follow("t1")
    try:
        seen = ""
        while last_tick(seen or "tick-0") < before + 20:
            seen += follower.stdout.readline()
        follower.send_signal(signal.SIGINT)  # Ctrl-C ends dfo's following, never the run
        assert follower.wait(timeout=15) == 0
    finally:
        follower.kill()
    # the remote tail ends with the channel
    wait_for(lambda: "tail" not in lab.container.attach("ps", "-eo", "args").stdout, what="the remote tail to end")
    ps_inside = lab.container.attach("ps", "-eo", "args").stdout
    ps_host = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "tick-" in ps_inside and SECRET not in ps_inside + ps_host
    assert not list(lab.container.path("/workspace/.dfo/secrets").iterdir())

    listed = json.loads(lab.dfo("runs", "--json").stdout)
    assert [(r["name"], r["target"], r["state"]) for r in listed] == [("t1", "ct_a", "running")]

    stopped = lab.dfo("stop", "t1", "--grace", "5", "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout) == {"run": "t1", "state": "stopped", "exit_code": 143, "signal": "TERM"}
    assert lab.container.path("/workspace/logs/t1.log.exit").read_text().strip() == "143"
    assert "tick-" not in lab.container.attach("ps", "-eo", "args").stdout

    dump = "\n".join(sqlite3.connect(lab.state / "dfo.db").iterdump())
    assert SECRET not in dump + launched.stdout + launched.stderr + tail.stdout + stopped.stdout


def test_refusals_leave_nothing_started_or_written(lab: Lab) -> None:
    lab.container.nvidia_smi([Gpu(0, memory_used_mib=70000, utilization_pct=99)])
    busy = lab.dfo("launch", "--host", "ct_a", "--variant", "ticker", "--name", "busy1")
    assert busy.returncode == 1 and "busy" in busy.stderr and "--force" in busy.stderr
    off = lab.dfo("launch", "--host", "ct_off", "--variant", "ticker", "--name", "off1")
    assert off.returncode == 1 and "stopped" in off.stderr
    no_python = lab.dfo("launch", "--host", "ct_nopy", "--variant", "nographs", "--name", "nopy1", "--no-preflight")
    assert no_python.returncode == 1 and "/nonexistent/python3 not found in ct_nopy" in no_python.stderr
    bad = lab.dfo("launch", "--host", "ct_a", "--variant", "ticker", "--name", "x;reboot")
    assert bad.returncode == 2 and "invalid run name" in bad.stderr
    assert json.loads(lab.dfo("runs", "--json").stdout) == []
    assert not lab.container.path("/workspace/logs").exists() or not list(lab.container.path("/workspace/logs").iterdir())
    assert not lab.container.path("/workspace/.dfo").exists()  # no package, secrets file or half-sent archive either
    assert "tick-" not in lab.container.attach("ps", "-eo", "args").stdout

    forced = lab.dfo("launch", "--host", "ct_a", "--variant", "ticker", "--name", "busy1", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "busy" in forced.stderr and "dfo watch busy1" in forced.stdout
    again = lab.dfo("launch", "--host", "ct_a", "--variant", "ticker", "--name", "busy1", "--force")
    assert again.returncode == 1 and "already exists" in again.stderr
    assert lab.dfo("stop", "busy1", "--grace", "5").returncode == 0


def trainer_snapshot(tmp_path: Path) -> Path:
    """A copy of this checkout's trainer/ for dfo to package (through PYTHONPATH), so that someone editing
    trainer/ while the test runs cannot change the package between the launch and the push."""
    snapshot = tmp_path / "snapshot"
    shutil.copytree(REPO / "trainer", snapshot / "trainer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return snapshot


def container_report(lab: Lab, name: str) -> str:
    """What a failure message needs: the log's tail, the container's processes, the machine's load."""
    log = lab.log(name)
    ps = lab.container.attach("ps", "-eo", "pid,pgid,stat,etime,args").stdout
    return f"load {os.getloadavg()}\n--- ps in the container\n{ps}\n--- log tail\n{log.read_text()[-3000:] if log.exists() else '(no log)'}"


@pytest.mark.skipif(not HAS_TRAINER, reason="trainer/__main__.py is not there yet")
@pytest.mark.timeout(540)
def test_builtin_trainer_is_pushed_once_and_runs_in_the_container(lab: Lab, tmp_path: Path) -> None:
    snapshot = trainer_snapshot(tmp_path)
    expected = build_package(package_files(snapshot / "trainer")).sha256
    env = {"PYTHONPATH": str(snapshot)}
    # eager: a fresh container has a cold torch.compile cache (over 100 s of C++ builds on 2 cores)
    first = lab.dfo("launch", "--host", "ct_a", "--variant", "eager", "--name", "tr1", "--set", "steps=100000",
                    "--set", "log_every=1", "--json", env=env, timeout=180)
    assert first.returncode == 0, first.stderr
    launched = json.loads(first.stdout)
    assert (launched["pushed"], launched["trainer_hash"]) == (True, expected)
    try:
        deadline = time.monotonic() + 240  # a step within seconds on an idle machine; minutes under a full test run
        while "event=step" not in lab.log("tr1").read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "event=step" in lab.log("tr1").read_text(), container_report(lab, "tr1")
        pushed = lab.dfo("push", "--host", "ct_a", "--json", env=env)
        assert pushed.returncode == 0, pushed.stderr
        assert json.loads(pushed.stdout) == {"target": "ct_a", "hash": expected, "transferred": False, "bytes": 0,
                                             "replaced": False, "python_found": True, "torch_found": True}  # the
        # run's own __pycache__ is no change
    finally:
        started = time.monotonic()
        stopped = lab.dfo("stop", "tr1", "--grace", "30", "--json", timeout=STOP_LIMIT_S)
        took = time.monotonic() - started
    assert stopped.returncode == 0, f"{stopped.stderr}\n{container_report(lab, 'tr1')}"
    assert json.loads(stopped.stdout) == {"run": "tr1", "state": "stopped", "exit_code": 75, "signal": "TERM"}, (
        f"after {took:.0f} s\n{container_report(lab, 'tr1')}")


def test_push_through_ssh_and_pct_transfers_once(lab: Lab, tmp_path: Path) -> None:
    source = tmp_path / "src" / "trainer"
    source.mkdir(parents=True)
    (source / "__init__.py").write_text("VERSION = 1\n")
    package = build_package(package_files(source, tmp_path / "src" / "agent.py"))
    with Connections(load_inventory(lab.inventory)) as connections, Store.in_memory() as store:
        target = connections.container("ct_a")
        calls = []
        real_run, real_put = target.run, target.put
        target.run = lambda cmd, **kw: calls.append("run") or real_run(cmd, **kw)
        target.put = lambda local, remote, **kw: calls.append("put") or real_put(local, remote, **kw)
        first = push(target, "/workspace", package=package, store=store)
        assert first.transferred and "put" in calls
        assert lab.container.path(f"/workspace/.dfo/pkg/{package.sha256}/.complete").read_text() == package.sha256
        assert lab.container.path(f"/workspace/.dfo/pkg/{package.sha256}/trainer/__init__.py").read_text() == "VERSION = 1\n"
        calls.clear()
        second = push(target, "/workspace", package=package, store=store)
        assert not second.transferred and calls == ["run"]  # one round trip, nothing sent
        planted = lab.container.path(f"/workspace/.dfo/pkg/{package.sha256}/trainer/__init__.py")
        planted.write_text("VERSION = 666\n")  # changed in the container after the unpack: not used as it is
        third = push(target, "/workspace", package=package, store=store)
        assert third.transferred and third.replaced and planted.read_text() == "VERSION = 1\n"
