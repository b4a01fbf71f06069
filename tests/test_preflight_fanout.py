"""Preflight of 4 targets on 4 hosts (network namespaces, own sshd each) runs in parallel, one connection each."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness import write_inventory
from orchestrator.connections import Connections
from orchestrator.inventory import load_inventory
from orchestrator.preflight import preflight

pytestmark = [pytest.mark.netns, pytest.mark.lxc, pytest.mark.slow]
PYTHON_DELAY_S = 2.5  # each target's python check sleeps this long: checked one after another, 4 take >= 10 s
SLOW_PYTHON = f'#!/bin/sh\nsleep {PYTHON_DELAY_S}\nexec python3 "$@"\n'


def test_four_targets_on_four_hosts_are_checked_at_once(tmp_path: Path, netns_hosts) -> None:
    hosts = netns_hosts(4)
    inventory_hosts = {}
    for k, host in enumerate(hosts):
        container = host.containers(200)  # the same ctid on every node, as on separate Proxmox nodes
        container.path("/workspace/slow-python").write_text(SLOW_PYTHON)
        container.path("/workspace/slow-python").chmod(0o755)
        inventory_hosts[f"pve{k}"] = {"address": f"nshost{k}", "containers": {f"ct{k}": {"ctid": 200}}}
    defaults = {"min_free_disk_gb": 0, "python": "/workspace/slow-python"}
    inventory = load_inventory(write_inventory(tmp_path, {"defaults": defaults, "hosts": inventory_hosts}))
    targets = [f"ct{k}" for k in range(4)]

    started = time.monotonic()
    with Connections(inventory) as connections:
        reports = preflight(connections, targets)
    elapsed = time.monotonic() - started

    assert [report.target for report in reports] == targets
    assert all(report.ok for report in reports), [r.to_json() for r in reports if not r.ok]
    assert all(f"root@nshost{k} authenticated" in reports[k].checks[0].detail for k in range(4))
    assert elapsed < 4 * PYTHON_DELAY_S  # the sleeps overlapped: targets were checked at the same time
    assert [host.server.accepted_connections() for host in hosts] == [1, 1, 1, 1]  # sshd's own log
