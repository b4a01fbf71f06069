"""Shared pytest fixtures: a real sshd, a user-like ~/.ssh, LXC containers behind the pct stand-in, the
nvidia-smi stand-in's state, and network-namespace hosts. The machinery lives in tests/harness/."""

from __future__ import annotations

import os
import shutil

import pytest

from harness import write_inventory  # noqa: F401  (re-exported for tests that import it from here)
from harness.ssh_home import SshHome
from harness.sshd import SshServer

HOST_ALIAS = "testhost"


def _require_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root")


@pytest.fixture
def sshd(tmp_path_factory) -> SshServer:
    """A running OpenSSH server on a free 127.0.0.1 port, stopped (by PID) at teardown."""
    if not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("openssh-server is not installed (scripts/test.sh installs it)")
    server = SshServer(tmp_path_factory.mktemp("sshd"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def ssh_home(sshd, tmp_path_factory, monkeypatch) -> SshHome:
    """HOME pointed at a fresh directory whose ~/.ssh/config has `Host testhost` for the `sshd` fixture,
    with its key as ~/.ssh/id_ed25519 and its host key in ~/.ssh/known_hosts. ssh-agent is hidden."""
    home = SshHome(tmp_path_factory.mktemp("home"))
    home.add_host(HOST_ALIAS, sshd)
    monkeypatch.setenv("HOME", str(home.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home
