"""`dfo preflight` as a user runs it (the console script) against a real sshd, judged by sshd's own log:
one connection per host per invocation, nothing at all sent for a bad name, and a down or unauthorised host
reported as one plain line within the connect timeout. Targets here run on the host (ctid: null), so no
container is needed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness import write_inventory
from harness.cli import DFO, dfo  # HOME is the test's ssh_home



def host_inventory(tmp_path: Path, hosts: dict, connect_timeout: float = 10) -> Path:
    """Targets on the hosts themselves (no pct), with a workspace and python that exist there."""
    (tmp_path / "ws").mkdir(exist_ok=True)
    defaults = {"min_free_disk_gb": 0, "workspace": str(tmp_path / "ws"), "python": sys.executable, "connect_timeout": connect_timeout}
    return write_inventory(tmp_path, {"defaults": defaults, "hosts": hosts})


def checks_of(result: subprocess.CompletedProcess) -> dict[str, dict[str, dict]]:
    return {report["target"]: {c["name"]: c for c in report["checks"]} for report in json.loads(result.stdout)}


def test_one_invocation_opens_one_connection_per_host(tmp_path: Path, sshd, ssh_home) -> None:
    containers = {"box_a": {"ctid": None}, "box_b": {"ctid": None}}
    inventory = host_inventory(tmp_path, {"pve1": {"address": "testhost", "containers": containers}})
    result = dfo("preflight", "--host", "box_a", "--host", "box_b", "-i", str(inventory), "--json")
    checks = checks_of(result)
    assert checks["box_a"]["ssh"]["ok"] and checks["box_b"]["workspace"]["ok"], result.stdout
    assert checks["box_a"]["python"]["ok"] and "torch" in checks["box_a"]["python"]["detail"]
    assert sshd.accepted_connections() == 1  # two targets, four round trips, one SSH connection


def test_a_target_name_with_shell_metacharacters_sends_nothing(tmp_path: Path, sshd, ssh_home) -> None:
    inventory = host_inventory(tmp_path, {"pve1": {"address": "testhost", "containers": {"box_a": {"ctid": None}}}})
    result = dfo("preflight", "--host", "box_a", "--host", "box_a;touch /tmp/dfo-pwned", "-i", str(inventory))
    assert result.returncode == 2 and "invalid target 'box_a;touch /tmp/dfo-pwned'" in result.stderr
    assert "Connection from" not in sshd.log_path.read_text()  # not even the valid target's host was reached
    assert not Path("/tmp/dfo-pwned").exists()


def test_a_silent_host_is_one_plain_line_within_the_connect_timeout(tmp_path: Path, ssh_home) -> None:
    with socket.socket() as silent:  # accepts TCP (backlog) but never speaks SSH
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        hosts = {"pve9": {"address": "127.0.0.1", "port": port, "containers": {"box9": {"ctid": None}}}}
        started = time.monotonic()
        result = dfo("preflight", "--host", "box9", "-i", str(host_inventory(tmp_path, hosts, connect_timeout=1)), "--json")
        elapsed = time.monotonic() - started
    assert result.returncode == 1 and elapsed < 8, elapsed  # 1 s timeout plus dfo's own start-up
    detail = checks_of(result)["box9"]["ssh"]["detail"]
    assert detail.startswith(f"pve9: no SSH answer from 127.0.0.1:{port} within 1s (check that the host is up")
    assert result.stderr == "" and "Traceback" not in result.stdout  # paramiko's own log stays quiet


def test_a_rejected_key_is_an_auth_failure_naming_the_fix(tmp_path: Path, sshd, ssh_home) -> None:
    ssh_home.wrong_client_key()
    inventory = host_inventory(tmp_path, {"pve1": {"address": "testhost", "containers": {"box_a": {"ctid": None}}}})
    result = dfo("preflight", "--host", "box_a", "-i", str(inventory), "--json")
    ssh = checks_of(result)["box_a"]["ssh"]
    assert result.returncode == 1 and not ssh["ok"]
    assert f"root@127.0.0.1:{sshd.port} rejected our keys" in ssh["detail"] and "authorized_keys" in ssh["detail"]


def test_hostkey_trust_of_a_down_host_names_the_host_and_the_fix(tmp_path: Path, ssh_home) -> None:
    from harness.sshd import free_port

    port = free_port()
    inventory = host_inventory(tmp_path, {"pve1": {"address": "127.0.0.1", "port": port, "containers": {"box_a": {"ctid": None}}}})
    result = dfo("hostkey", "trust", "pve1", "-i", str(inventory))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"dfo: error: pve1: connection to 127.0.0.1:{port} refused (check that sshd runs there and the port is right)\n"


def test_a_changed_host_key_is_refused_loudly_even_with_accept_new(tmp_path: Path, sshd, ssh_home) -> None:
    ssh_home.wrong_known_hosts("testhost")
    before = ssh_home.known_hosts.read_text()
    inventory = host_inventory(tmp_path, {"pve1": {"address": "testhost", "containers": {"box_a": {"ctid": None}}}})
    result = dfo("preflight", "--host", "box_a", "-i", str(inventory), "--json", "--accept-new-host-key")
    detail = checks_of(result)["box_a"]["ssh"]["detail"]
    assert result.returncode == 1 and detail.startswith(f"pve1: HOST KEY CHANGED for [127.0.0.1]:{sshd.port}")
    assert "man-in-the-middle" in detail and "ssh-keygen -R" in detail
    assert ssh_home.known_hosts.read_text() == before and sshd.accepted_connections() == 0


def test_the_changed_key_hint_removes_the_right_known_hosts_entry(tmp_path: Path, sshd, ssh_home) -> None:
    ssh_home.wrong_known_hosts("testhost")
    inventory = host_inventory(tmp_path, {"pve1": {"address": "testhost", "containers": {"box_a": {"ctid": None}}}})
    detail = checks_of(dfo("preflight", "--host", "box_a", "-i", str(inventory), "--json"))["box_a"]["ssh"]["detail"]
    hint = detail.split("run `", 1)[1].split("`", 1)[0]
    assert hint.startswith("ssh-keygen -R ")
    subprocess.run(hint, shell=True, check=True, capture_output=True, timeout=30)  # what the user is told to run
    assert ssh_home.known_hosts.read_text().strip() == ""


def test_ctrl_c_during_a_slow_connect_ends_dfo_at_once(tmp_path: Path, ssh_home) -> None:
    import signal

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        silent.settimeout(30)
        hosts = {"pve9": {"address": "127.0.0.1", "port": silent.getsockname()[1], "containers": {"box9": {"ctid": None}}}}
        inventory = host_inventory(tmp_path, hosts, connect_timeout=60)
        env = {k: v for k, v in os.environ.items() if k != "DFO_INVENTORY"}
        proc = subprocess.Popen([DFO, "preflight", "--host", "box9", "-i", str(inventory)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            peer, _ = silent.accept()  # dfo is now waiting for an SSH banner that never comes
            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=20)
            peer.close()
        finally:
            proc.kill()
    assert proc.returncode == 130 and time.monotonic() - started < 5, stderr
    assert "Traceback" not in stderr
