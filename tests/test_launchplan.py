"""A launch in one remote call (orchestrator/launchplan.py): preflight, probe and detached start in one script
per target, counted from sshd's own log; a refusal, a lost dfo or a wrong answer starts nothing."""

from __future__ import annotations

import importlib.metadata
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import cli, write_inventory
from harness.nvidia_smi import Gpu
from harness.sshd import SshServer
from orchestrator.batch import launcher
from orchestrator.experiments import parse_experiments
from orchestrator.connections import Connections
from orchestrator.errors import RefusedError
from orchestrator.inventory import load_inventory
from orchestrator import launchplan
from orchestrator.launchplan import Gate, PlanCall, open_plan, plan_script
from orchestrator.package import build_package, package_files
from orchestrator.preflight import CHECKS, PreflightFailed, preflight
from orchestrator.remote.local import LocalTarget
from orchestrator.runs import RunSpec, launch, spec_for
from orchestrator.store import Store

SECRET = "tok-93Kd-secret"


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ------------------------------------------------------------------------------------ the script on its own

def started_file_script(path: Path) -> str:
    return plan_script("echo checked", f"echo started > {path}; echo pid=1")


@pytest.mark.parametrize("answer", [b"no\n", b"start\n", b"start 1x\n", b"startle 0\n", b""])
def test_only_the_exact_start_word_starts_anything(tmp_path: Path, answer: bytes) -> None:
    marker = tmp_path / "started"
    call = PlanCall(LocalTarget("here"), started_file_script(marker), timeout=10)
    assert call.findings.strip() == "checked"
    call._stream.write(answer)
    call._close()  # dfo goes away: stdin closes, the script reads EOF
    time.sleep(0.3)
    assert not marker.exists()


def test_no_answer_within_the_reply_timeout_starts_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(launchplan, "REPLY_TIMEOUT_S", 1)  # a dfo that hangs with the channel still open
    marker = tmp_path / "started"
    call = PlanCall(LocalTarget("here"), started_file_script(marker), timeout=10)
    started = time.monotonic()
    assert call._read(until=None, timeout=10).strip() == "started=no"  # the script gave up on its own
    assert time.monotonic() - started < 5 and not marker.exists()
    call._close()


def test_start_passes_the_secrets_on_stdin_and_returns_the_output(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    call = PlanCall(LocalTarget("here"), plan_script("echo checked", f'head -c "$n" > {secrets}; echo pid=7'), timeout=10)
    result = call.start(b"TOKEN='x y'\n", timeout=10)
    assert (result.exit_code, result.stdout.strip()) == (0, "pid=7")
    assert secrets.read_bytes() == b"TOKEN='x y'\n"


# ------------------------------------------------------------------------------------ through sshd and pct

@pytest.fixture
def lab(tmp_path, sshd, ssh_home, containers):
    running, stopped = containers(), containers(start=False)
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0, "python": sys.executable},
        "hosts": {"pve1": {"address": "testhost", "containers": {
            "ct_a": {"ctid": running.vmid, "gpus": [0]},
            "ct_off": {"ctid": stopped.vmid},
        }}},
        "variants": {"sleeper": {"command": 'case "$DFO_TEST_TOKEN" in tok-*-secret) echo secret-ok;; esac; sleep 30'}},
        "secrets": ["DFO_TEST_TOKEN"],
    })
    return inventory, running, stopped


def dfo(inventory: Path, state: Path, *args: str) -> cli.Ran:
    return cli.dfo(*args, "-i", str(inventory), env={"DFO_HOME": str(state), "DFO_TEST_TOKEN": SECRET})


@pytest.mark.lxc
@pytest.mark.slow
def test_preflight_and_launch_cost_one_remote_command_each(lab, sshd, tmp_path) -> None:
    inventory, running, _ = lab
    before = sshd.commands_started()
    checked = dfo(inventory, tmp_path / "state", "preflight", "--host", "ct_a", "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert sshd.commands_started() - before == 1  # was 2: `pct status`, then the script in the container

    before = sshd.commands_started()
    launched = dfo(inventory, tmp_path / "state", "launch", "--host", "ct_a", "--variant", "sleeper", "--name", "s1", "--json")
    assert launched.returncode == 0, launched.stderr
    assert sshd.commands_started() - before == 1  # was 4: pct status, preflight script, launch probe, start
    log = running.path("/workspace/logs/s1.log")
    wait_for(lambda: "secret-ok" in log.read_text(), what="the run with its secret")
    ps = running.attach("ps", "-eo", "args").stdout
    assert "sleep 30" in ps and SECRET not in ps
    assert not list(running.path("/workspace/.dfo/secrets").iterdir())
    assert dfo(inventory, tmp_path / "state", "stop", "s1", "--grace", "2").returncode == 0


@pytest.mark.lxc
@pytest.mark.slow
def test_a_refused_launch_reports_every_row_in_one_command_and_starts_nothing(lab, sshd, tmp_path) -> None:
    inventory, running, _ = lab
    running.nvidia_smi([Gpu(0, memory_used_mib=70000, utilization_pct=99)])
    inv = load_inventory(inventory)
    spec = spec_for(inv, "ct_a", "sleeper")
    before = sshd.commands_started()
    with Connections(inv) as connections, Store(tmp_path / "dfo.db") as store:
        with pytest.raises(PreflightFailed) as refused:
            launch(connections.container("ct_a"), spec, store, name="busy1", gate=Gate(inv.target("ct_a")))
        assert store.list_runs() == []
    assert sshd.commands_started() - before == 1
    rows = {check.name: check for check in refused.value.report.checks}
    assert list(rows) == list(CHECKS) and rows["python"].ok and rows["workspace"].ok  # every row, as preflight gives
    assert [check.name for check in refused.value.failed] == ["gpus_idle"]
    assert "GPU 0 70000 MiB 99%" in str(refused.value) and "--force" in str(refused.value)
    time.sleep(0.3)
    assert not running.path("/workspace/logs/busy1.log").exists()
    assert "sleep 30" not in running.attach("ps", "-eo", "args").stdout


@pytest.mark.lxc
@pytest.mark.slow
def test_a_stopped_container_is_told_by_pct_exec_itself(lab, sshd, tmp_path) -> None:
    inventory, _, stopped = lab
    inv = load_inventory(inventory)
    before = sshd.commands_started()
    with Connections(inv) as connections:
        (report,) = preflight(connections, ["ct_off"])
        with Store(tmp_path / "dfo.db") as store, pytest.raises(PreflightFailed) as refused:
            launch(connections.container("ct_off"), spec_for(inv, "ct_off", "sleeper"), store, name="off1", gate=Gate(inv.target("ct_off")))
    assert sshd.commands_started() - before == 2  # one each: no `pct status` before them
    for rows in (report.checks, refused.value.report.checks):
        container = next(check for check in rows if check.name == "container")
        assert (container.ok, container.detail) == (False, f"ct {stopped.vmid} is stopped (run `pct start {stopped.vmid}` on host pve1)")
        assert next(check for check in rows if check.name == "nvidia_smi").detail == "skipped: container failed"


@pytest.mark.lxc
@pytest.mark.slow
def test_a_dfo_that_goes_away_before_its_word_starts_nothing(lab, sshd, tmp_path) -> None:
    inventory, running, _ = lab
    inv = load_inventory(inventory)
    marker = "/workspace/started-anyway"
    with Connections(inv) as connections:
        opened = open_plan(connections.container("ct_a"), Gate(inv.target("ct_a")), probe="echo log=free",
                           start=f"touch {marker}; echo pid=1")
        assert opened.report.ok and opened.probe == {"log": "free"}
        opened.call._close()  # the channel closes without an answer, as when dfo is killed or the link drops
    wait_for(lambda: "sh -c" not in running.attach("ps", "-eo", "args").stdout, what="the script to end")
    assert not running.path(marker).exists()


@pytest.mark.lxc
@pytest.mark.slow
def test_a_builtin_launch_with_the_package_in_place_is_one_command(lab, sshd, tmp_path) -> None:
    inventory, running, _ = lab
    trainer = tmp_path / "src" / "trainer"
    trainer.mkdir(parents=True)
    (trainer / "__init__.py").write_text("")
    (trainer / "__main__.py").write_text("import sys, time\nprint('argv', *sys.argv[1:], flush=True)\ntime.sleep(30)\n")
    package = build_package(package_files(trainer, tmp_path / "no-agent.py"))
    inv = load_inventory(inventory)
    spec = RunSpec(target="ct_a", host="pve1", workspace="/workspace", python=sys.executable, variant="eager", compile="eager")
    with Connections(inv) as connections, Store(tmp_path / "dfo.db") as store:
        target, gate = connections.container("ct_a"), Gate(inv.target("ct_a"))
        first = launch(target, spec, store, name="b1", package=package, gate=gate)
        before = sshd.commands_started()
        second = launch(target, spec, store, name="b2", package=package, gate=gate)
        assert sshd.commands_started() - before == 1
    assert first.push.transferred and not second.push.transferred
    wait_for(lambda: "argv --run-name b2 --variant eager" in running.path("/workspace/logs/b2.log").read_text(), what="b2's trainer")
    for launched in (first, second):
        running.attach("kill", "-TERM", "--", f"-{launched.run.pid}")


@pytest.mark.lxc
@pytest.mark.slow
def test_a_batch_on_one_stock_node_starts_every_container_within_its_ssh_session_limit(tmp_path, ssh_home, containers, pct_standin_env) -> None:
    """OpenSSH allows 10 channels per connection by default; 12 containers launched at once over one
    connection, while a watch agent's stream is open, must all start (each launch call is a channel)."""
    node = SshServer(tmp_path / "node", env=dict(pct_standin_env), max_sessions=10).start()
    try:
        ssh_home.add_host("stocknode", node)
        made = [containers() for _ in range(12)]
        inventory = load_inventory(write_inventory(tmp_path, {
            "defaults": {"min_free_disk_gb": 0, "python": sys.executable},
            "hosts": {"pve1": {"address": "stocknode", "containers": {f"c{k}": {"ctid": c.vmid} for k, c in enumerate(made)}}},
            "variants": {"sleeper": {"command": "sleep 5"}},
        }))
        plan = parse_experiments(f"batch: many\ntargets: [{', '.join(f'c{k}' for k in range(12))}]\nmatrix: {{variant: [sleeper]}}\n", inventory)
        with Connections(inventory) as connections, Store(tmp_path / "dfo.db") as store:
            agent = connections.container("c0").stream("cat")  # a watch agent's channel, held open meanwhile
            try:
                start = launcher(plan, inventory, connections, store)
                with ThreadPoolExecutor(max_workers=12) as pool:
                    started = list(pool.map(lambda cell: start(cell, (), cell.variant, cell.run_name("many")), plan.cells))
            finally:
                agent.close()
            assert sorted(run.name for run in store.list_runs()) == sorted(started) and len(started) == 12
    finally:
        node.kill_sessions()
        node.stop()


def counting_python(container, real_python: str) -> tuple[str, Path]:
    """A python in `container` that notes every start (its argv) in a log, then runs `real_python`."""
    starts = container.path("/workspace/python-starts")
    standin = container.path("/workspace/counting-python")
    standin.write_text(f'#!/bin/sh\necho "start $1 $2" | head -n 1 >> /workspace/python-starts\nexec {real_python} "$@"\n')
    standin.chmod(0o755)
    return "/workspace/counting-python", starts


def tiny_package(tmp_path: Path):
    trainer = tmp_path / "src" / "trainer"
    trainer.mkdir(parents=True)
    (trainer / "__init__.py").write_text("")
    (trainer / "__main__.py").write_text("import time\ntime.sleep(30)\n")
    return build_package(package_files(trainer, tmp_path / "no-agent.py"))


@pytest.mark.lxc
@pytest.mark.slow
def test_a_gated_launch_asks_one_python_for_the_row_and_for_torch(tmp_path, sshd, ssh_home, containers) -> None:
    running = containers()
    python, starts = counting_python(running, sys.executable)
    inv = load_inventory(write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0, "python": python},
        "hosts": {"pve1": {"address": "testhost", "containers": {"ct_a": {"ctid": running.vmid}}}},
        "variants": {"eager": {"compile": "eager"}},
    }))
    package = tiny_package(tmp_path)
    spec = spec_for(inv, "ct_a", "eager")
    with Connections(inv) as connections, Store(tmp_path / "dfo.db") as store:
        target, gate = connections.container("ct_a"), Gate(inv.target("ct_a"))
        first = launch(target, spec, store, name="p1", package=package, gate=gate)
        starts.write_text("")
        second = launch(target, spec, store, name="p2", package=package, gate=gate)
    checks = [line for line in starts.read_text().splitlines() if line != "start -m trainer"]
    assert len(checks) == 1, checks  # was 2: the python row's interpreter, then the probe's torch check
    python_row = next(check for check in second.preflight.checks if check.name == "python")
    version = ".".join(map(str, sys.version_info[:3]))
    assert (python_row.ok, python_row.detail) == (True, f"{python} {version}, torch {importlib.metadata.version('torch')}")
    assert second.push.python_found and second.push.torch_found and not second.push.transferred
    for launched in (first, second):
        running.attach("kill", "-TERM", "--", f"-{launched.run.pid}")


@pytest.mark.lxc
@pytest.mark.slow
def test_a_gated_launch_of_a_python_without_torch_is_refused_and_starts_nothing(tmp_path, sshd, ssh_home, containers) -> None:
    running = containers()
    python, _ = counting_python(running, "/usr/bin/python3")  # the system python: no torch
    inv = load_inventory(write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0, "python": python},
        "hosts": {"pve1": {"address": "testhost", "containers": {"ct_a": {"ctid": running.vmid}}}},
        "variants": {"eager": {"compile": "eager"}},
    }))
    with Connections(inv) as connections, Store(tmp_path / "dfo.db") as store:
        with pytest.raises(RefusedError, match="has no torch"):
            launch(connections.container("ct_a"), spec_for(inv, "ct_a", "eager"), store, name="nt1",
                   package=tiny_package(tmp_path), gate=Gate(inv.target("ct_a")))
        assert store.list_runs() == []
    assert not running.path("/workspace/logs/nt1.log").exists()
    assert not running.path("/workspace/.dfo/pkg").exists()  # refused before the push
