"""Preflight and PctTarget through a real sshd and real LXC containers behind the pct stand-in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import write_inventory
from harness.cli import Ran, dfo
from harness.nvidia_smi import Gpu
from harness.sshd import free_port
from orchestrator.connections import Connections
from orchestrator.errors import ContainerMissing, ContainerNotRunning
from orchestrator.inventory import load_inventory
from orchestrator.preflight import preflight
from orchestrator.remote.pct import PctTarget

pytestmark = pytest.mark.lxc


def pve_inventory(tmp_path: Path, containers: dict, *, extra_hosts: dict | None = None) -> object:
    hosts = {"pve1": {"address": "testhost", "containers": containers}, **(extra_hosts or {})}
    return load_inventory(write_inventory(tmp_path, {"defaults": {"min_free_disk_gb": 0}, "hosts": hosts}))


def rows(report) -> dict[str, tuple[bool, str]]:
    return {check.name: (check.ok, check.detail) for check in report.checks}


@pytest.mark.slow
def test_two_targets_on_one_host_share_one_connection(tmp_path: Path, sshd, ssh_home, containers) -> None:
    running = containers()
    running.nvidia_smi([Gpu(0), Gpu(1, memory_used_mib=70000, utilization_pct=99)])
    stopped = containers(start=False)
    inventory = pve_inventory(
        tmp_path,
        {"ct_a": {"ctid": running.vmid, "gpus": [0]}, "ct_b": {"ctid": stopped.vmid}, "ct_c": {"ctid": running.vmid, "gpus": [0, 1]}},
    )
    with Connections(inventory) as connections:
        a, b, c = preflight(connections, ["ct_a", "ct_b", "ct_c"])
    assert a.ok, rows(a)
    assert rows(a)["container"] == (True, f"ct {running.vmid} running")
    assert rows(a)["python"][0] and "torch" in rows(a)["python"][1]
    assert rows(b)["ssh"][0] and rows(b)["container"] == (
        False,
        f"ct {stopped.vmid} is stopped (run `pct start {stopped.vmid}` on host pve1)",
    )
    assert rows(b)["nvidia_smi"] == (False, "skipped: container failed")
    assert rows(c)["gpus_idle"] == (False, "busy: GPU 1 70000 MiB 99% (limits 1024 MiB, 10%)")
    assert sshd.accepted_connections() == 1  # three targets, six round trips, one SSH connection


def test_missing_container_and_unwritable_workspace(tmp_path: Path, sshd, ssh_home, containers) -> None:
    running = containers()
    inventory = pve_inventory(tmp_path, {"gone": {"ctid": 999}, "ro": {"ctid": running.vmid, "workspace": "/usr"}})
    with Connections(inventory) as connections:
        gone, read_only = preflight(connections, ["gone", "ro"])
    ok, detail = rows(gone)["container"]
    assert not ok and "container 999 does not exist on host pve1" in detail and "pct list" in detail
    assert rows(read_only)["workspace"] == (False, "/usr is not writable (unwritable)")
    assert rows(read_only)["nvidia_smi"][0]


def test_a_down_host_does_not_hide_the_others(tmp_path: Path, sshd, ssh_home, containers) -> None:
    running = containers()
    down = {"address": "127.0.0.1", "port": free_port(), "containers": {"ct_down": {"ctid": 300}}}
    inventory = pve_inventory(tmp_path, {"ct_up": {"ctid": running.vmid}}, extra_hosts={"pve9": down})
    with Connections(inventory) as connections:
        down_report, up_report = preflight(connections, ["ct_down", "ct_up"])
    ok, detail = rows(down_report)["ssh"]
    assert not ok and detail.startswith("pve9: ")
    assert [check.skipped for check in down_report.checks[1:]] == [True] * 6
    assert up_report.ok, rows(up_report)


def host_commands(host, monkeypatch) -> list:
    """Record every argv `host` runs from now on (in host.calls)."""
    host.calls = []
    real_run = host.run

    def recording_run(cmd, **kwargs):
        host.calls.append(list(cmd) if not isinstance(cmd, str) else [cmd])
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(host, "run", recording_run)
    return host.calls


@pytest.mark.slow
def test_pct_put_verifies_inside_and_maps_pct_errors(tmp_path: Path, sshd, ssh_home, containers, monkeypatch) -> None:
    running, stopped = containers(), containers(start=False)
    source = tmp_path / "payload.bin"
    source.write_bytes(b"dfo" * 10000)
    with Connections(pve_inventory(tmp_path, {})) as connections:
        host = connections.host("pve1")
        inside = PctTarget(host, running.vmid, name="ct_a")
        inside.put(source, "/workspace/payload.bin", mode=0o600)
        assert running.path("/workspace/payload.bin").read_bytes() == source.read_bytes()
        assert inside.run(["stat", "-c", "%a", "/workspace/payload.bin"]).stdout.strip() == "600"
        host_commands(host, monkeypatch)
        inside.put(source, "/workspace/again.bin")
        (staged_path,) = [argv[-1] for argv in host.calls if argv[:2] == ["rm", "-f"]]
        assert staged_path.startswith("/tmp/dfo-push.") and host.run(["test", "-e", staged_path]).exit_code == 1
        assert inside.status() == "running"
        with pytest.raises(ContainerNotRunning, match=f"pct start {stopped.vmid}"):
            PctTarget(host, stopped.vmid, name="ct_b").put(source, "/workspace/payload.bin")
        with pytest.raises(ContainerMissing):
            PctTarget(host, 998, name="ct_x").run(["true"])


@pytest.mark.slow
def test_unknown_host_key_is_refused_until_trusted(tmp_path: Path, sshd, ssh_home, containers) -> None:
    running = containers()
    pve1 = {"address": "testhost", "containers": {"ct_a": {"ctid": running.vmid}}}
    inventory = write_inventory(tmp_path, {"defaults": {"min_free_disk_gb": 0}, "hosts": {"pve1": pve1}})
    ssh_home.empty_known_hosts()

    def preflight_cli(*extra: str) -> tuple[int, dict]:
        result = dfo_cli("preflight", "--host", "ct_a", "-i", str(inventory), "--json", *extra)
        return result.returncode, {c["name"]: c for c in json.loads(result.stdout)[0]["checks"]}

    rc, checks = preflight_cli()
    assert rc == 1 and not checks["ssh"]["ok"] and "dfo hostkey trust pve1" in checks["ssh"]["detail"]
    assert ssh_home.known_hosts.read_text() == ""  # refused, nothing recorded

    trusted = dfo_cli("hostkey", "trust", "pve1", "-i", str(inventory))
    assert trusted.returncode == 0 and "recorded host key of pve1 (testhost): SHA256:" in trusted.stdout
    assert preflight_cli()[0] == 0

    ssh_home.empty_known_hosts()
    assert preflight_cli("--accept-new-host-key")[0] == 0
    assert ssh_home.known_hosts.read_text().strip()


def dfo_cli(*args: str) -> Ran:
    return dfo(*args)  # HOME is the test's ssh_home
