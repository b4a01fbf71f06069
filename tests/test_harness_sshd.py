"""The sshd fixture itself, checked with the real OpenSSH client: it listens, authenticates the test key,
puts the stand-ins on the session PATH, logs each accepted connection, restarts with the same host key."""

from __future__ import annotations

import subprocess

import pytest

from harness import STANDIN_BIN


def ssh(home, *remote: str, alias: str = "testhost") -> subprocess.CompletedProcess:
    """Run the OpenSSH client as the test user would (~/.ssh/config of the fake HOME)."""
    argv = ["ssh", "-F", str(home.config_path), "-o", f"UserKnownHostsFile={home.known_hosts}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", alias, *remote]
    return subprocess.run(argv, capture_output=True, text=True, timeout=20)


def test_client_logs_in_through_config_alias_with_standins_on_path(ssh_home, sshd):
    result = ssh(ssh_home, "echo $PATH; whoami")
    assert result.returncode == 0, result.stderr
    path, user = result.stdout.split()
    entries = path.split(":")
    assert entries.index(str(STANDIN_BIN)) < entries.index("/usr/bin")  # stand-ins shadow system tools
    assert user == "root"
    assert sshd.accepted_connections() == 1


def test_wrong_client_key_is_rejected(ssh_home):
    ssh_home.wrong_client_key()
    result = ssh(ssh_home, "true")
    assert result.returncode == 255
    assert "Permission denied" in result.stderr


def test_restart_keeps_address_and_host_key(ssh_home, sshd):
    old_pid, old_key = sshd.pid, sshd.host_key_pub
    sshd.restart()
    assert sshd.pid != old_pid and sshd.host_key_pub == old_key
    assert ssh(ssh_home, "true").returncode == 0


def test_stopped_server_refuses_connections(ssh_home, sshd):
    sshd.stop()
    result = ssh(ssh_home, "true")
    assert result.returncode == 255
    assert "refused" in result.stderr


@pytest.mark.lxc
def test_pct_standin_reaches_containers_through_an_ssh_session(ssh_home, container):
    result = ssh(ssh_home, f"pct status {container.name}; pct exec {container.name} -- nvidia-smi -L")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == ["status: running", f"GPU 0: NVIDIA H200 (UUID: {container.nvidia_smi().gpus[0].uuid})"]
