"""A fleet of N "hosts" for the fan-out benchmark: each its own real sshd with one LXC container `ctK`.

With `netns=True` (root, iproute2) each host is a network namespace of its own (tests/harness/netns.py:
address from 198.18.0.0/15, sshd on port 22, its own containers, all with ctid 200 as on separate Proxmox
nodes); otherwise each is an sshd on its own loopback port. Hosts are reached through ~/.ssh/config
aliases `hostK` in a fresh SshHome. It only creates what it later removes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from harness import write_inventory
from harness.lxc import ContainerFactory, LxcContainer
from harness.netns import NetnsHosts, remove_stale_namespaces
from harness.ssh_home import SshHome
from harness.sshd import SshServer


@dataclass
class Fleet:
    inventory: Path
    home: SshHome
    servers: list[SshServer]
    containers: list[LxcContainer]
    kind: str

    @property
    def targets(self) -> list[str]:
        return [f"ct{k}" for k in range(1, len(self.servers) + 1)]


@contextlib.contextmanager
def fleet(workdir: Path, count: int, *, netns: bool = False, python: str = "python3",
          env: dict[str, str] | None = None) -> Iterator[Fleet]:
    """Start `count` hosts; the caller points $HOME at `fleet.home.home` before connecting. `env` reaches every
    SSH session (e.g. PCT_STANDIN_START_S for the pct stand-in)."""
    home = SshHome(workdir / "home")
    with contextlib.ExitStack() as teardown:
        if netns:
            servers, containers = _netns_hosts(workdir, count, teardown, env or {})
        else:
            servers, containers = _loopback_hosts(workdir, count, teardown, env or {})
        hosts = {}
        for k, (server, container) in enumerate(zip(servers, containers), start=1):
            home.add_host(f"host{k}", server)
            hosts[f"host{k}"] = {"address": f"host{k}", "containers": {f"ct{k}": {"ctid": container.vmid}}}
        data = {"defaults": {"min_free_disk_gb": 0, "python": python}, "hosts": hosts}
        yield Fleet(write_inventory(workdir, data), home, servers, containers, "netns" if netns else "loopback")


def _netns_hosts(workdir: Path, count: int, teardown: contextlib.ExitStack, env: dict[str, str]):
    remove_stale_namespaces()
    factory = NetnsHosts(workdir / "netns", env=env)
    teardown.callback(factory.destroy_all)
    hosts = factory(count)
    return [host.server for host in hosts], [host.containers(200) for host in hosts]


def _loopback_hosts(workdir: Path, count: int, teardown: contextlib.ExitStack, env: dict[str, str]):
    lxc_path = workdir / "lxc"
    pct_env = {**env, "PCT_STANDIN_LXCPATH": str(lxc_path), "PCT_STANDIN_NODE": "fleet"}
    factory = ContainerFactory(lxc_path)
    teardown.callback(factory.destroy_all)
    containers = [factory() for _ in range(count)]
    servers = []
    for k in range(1, count + 1):
        server = SshServer(workdir / f"sshd{k}", env=pct_env).start()
        teardown.callback(server.stop)
        servers.append(server)
    return servers, containers
