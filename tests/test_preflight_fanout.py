"""Preflight of 4 targets on 4 hosts runs in parallel, one SSH connection per host."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from orchestrator.connections import Connections
from orchestrator.inventory import load_inventory
from orchestrator.preflight import preflight
from preflight_fleet import fleet

pytestmark = [pytest.mark.lxc, pytest.mark.slow]
PYTHON_DELAY_S = 2.5  # each target's python check sleeps this long: checked one after another, 4 take >= 10 s


@pytest.fixture
def four_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if os.geteuid() != 0 or not shutil.which("lxc-start") or not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("needs root, lxc and openssh-server")
    with fleet(tmp_path, 4, python="/workspace/slow-python") as hosts:
        for container in hosts.containers:
            slow = container.path("/workspace/slow-python")
            slow.write_text(f'#!/bin/sh\nsleep {PYTHON_DELAY_S}\nexec python3 "$@"\n')
            slow.chmod(0o755)
        monkeypatch.setenv("HOME", str(hosts.home.home))
        monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
        yield hosts


def test_four_targets_on_four_hosts_are_checked_at_once(four_hosts) -> None:
    started = time.monotonic()
    with Connections(load_inventory(four_hosts.inventory)) as connections:
        reports = preflight(connections, four_hosts.targets)
    elapsed = time.monotonic() - started
    assert [report.target for report in reports] == four_hosts.targets
    assert all(report.ok for report in reports), [r.to_json() for r in reports if not r.ok]
    assert elapsed < 4 * PYTHON_DELAY_S  # the sleeps overlapped: targets were checked at the same time
    assert [server.accepted_connections() for server in four_hosts.servers] == [1, 1, 1, 1]
