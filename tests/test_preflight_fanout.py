"""Preflight of 4 targets on 4 hosts (network namespaces, own sshd each) runs in parallel, one connection and
one remote command each; a batch's first runs (preflight + launch) cost one remote command per target too."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from harness import write_inventory
from harness.nvidia_smi import Gpu
from orchestrator.batch import launcher
from orchestrator.experiments import parse_experiments
from orchestrator.connections import Connections
from orchestrator.errors import RefusedError
from orchestrator.inventory import load_inventory
from orchestrator.preflight import preflight
from orchestrator.store import Store

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
    assert [host.server.commands_started() for host in hosts] == [1, 1, 1, 1]  # no `pct status` before the script


def test_a_batch_preflights_and_starts_its_first_runs_with_one_remote_command_per_target(tmp_path: Path, netns_hosts) -> None:
    hosts = netns_hosts(4)
    inventory_hosts = {}
    made = []
    for k, host in enumerate(hosts):
        made.append(host.containers(200))
        inventory_hosts[f"pve{k}"] = {"address": f"nshost{k}", "containers": {f"ct{k}": {"ctid": 200}}}
    data = {"defaults": {"min_free_disk_gb": 0, "python": sys.executable}, "hosts": inventory_hosts,
            "variants": {"sleeper": {"command": "sleep 5"}}}
    inventory = load_inventory(write_inventory(tmp_path, data))
    targets = [f"ct{k}" for k in range(4)]
    plan = parse_experiments(f"batch: fan\ntargets: [{', '.join(targets)}]\nmatrix: {{variant: [sleeper]}}\n", inventory)
    made[3].nvidia_smi([Gpu(0, memory_used_mib=9000), Gpu(1)])  # another tenant on ct3's GPU 0

    with Connections(inventory) as connections, Store(tmp_path / "dfo.db") as store:
        start = launcher(plan, inventory, connections, store)
        outcomes = []
        for cell in plan.cells:
            try:
                outcomes.append(start(cell, (), cell.variant, cell.run_name("fan")))
            except RefusedError as exc:
                outcomes.append(str(exc))
        started = [run.name for run in store.list_runs()]

    assert outcomes[:3] == [cell.run_name("fan") for cell in plan.cells[:3]] and sorted(started) == sorted(outcomes[:3])
    assert outcomes[3].startswith("preflight failed: gpus_idle: busy: GPU 0 9000 MiB")
    assert [host.server.commands_started() for host in hosts] == [1, 1, 1, 1]  # was 4 each: status, preflight, probe, start
