"""Several SSH hosts on one machine, each in its own network namespace: a command reaches all of them at
once over SshTarget, each answering from its own address, and nothing is left behind afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.netns import ip
from orchestrator.remote.ssh import SshTarget

pytestmark = pytest.mark.netns


def test_command_runs_on_three_namespace_hosts_in_parallel(netns_hosts):
    hosts = netns_hosts(3)
    targets = [SshTarget(f"pve{i}", f"nshost{i}") for i in range(3)]

    def own_address(target: SshTarget) -> str:
        return target.run("ip -4 -o addr show dev eth0 | awk '{print $4}'", timeout=10, check=True).stdout.strip()

    with ThreadPoolExecutor(3) as pool:
        addresses = list(pool.map(own_address, targets))
    assert addresses == [f"{host.address}/32" for host in hosts]
    assert all(host.server.accepted_connections() == 1 for host in hosts)
    for target in targets:
        target.close()


def test_teardown_removes_namespaces_and_links(netns_hosts):
    host = netns_hosts(1)[0]
    assert host.ns in ip("netns", "list").stdout
    host.destroy()
    assert host.ns not in ip("netns", "list").stdout
    assert host.veth not in ip("-o", "link", "show").stdout
    assert host.address not in ip("route", "show").stdout


@pytest.mark.lxc
def test_each_namespace_host_sees_only_its_own_containers(netns_hosts):
    first, second = netns_hosts(2)
    first.containers(200)
    second.containers(200, start=False)
    statuses = [SshTarget(f"pve{i}", f"nshost{i}").run("pct status 200; pct list | wc -l", timeout=20).stdout
                for i in range(2)]
    assert statuses == ["status: running\n2\n", "status: stopped\n2\n"]
