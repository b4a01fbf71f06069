"""A fleet of N "hosts" for fan-out tests and the benchmark: one real sshd and one LXC container each.

Each host is its own sshd on a loopback port (its own process, host key and connection), reached through
an ~/.ssh/config alias `hostK`, with one container `ctK` behind the pct stand-in. Needs root and LXC.
It only creates what it later removes (containers under its own LXCPATH, sshd processes by PID).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from harness import write_inventory
from harness.lxc import ContainerFactory, LxcContainer
from harness.ssh_home import SshHome
from harness.sshd import SshServer


@dataclass
class Fleet:
    inventory: Path
    home: SshHome
    servers: list[SshServer]
    containers: list[LxcContainer]

    @property
    def targets(self) -> list[str]:
        return [f"ct{k}" for k in range(1, len(self.servers) + 1)]


@contextlib.contextmanager
def fleet(workdir: Path, count: int, *, python: str = "python3") -> Iterator[Fleet]:
    """Start `count` hosts; the caller points $HOME at `fleet.home.home` before connecting."""
    lxc_path = workdir / "lxc"
    pct_env = {"PCT_STANDIN_LXCPATH": str(lxc_path), "PCT_STANDIN_NODE": "fleet"}
    factory = ContainerFactory(lxc_path)
    home = SshHome(workdir / "home")
    servers: list[SshServer] = []
    try:
        containers = [factory() for _ in range(count)]
        hosts = {}
        for k, container in enumerate(containers, start=1):
            server = SshServer(workdir / f"sshd{k}", env=pct_env).start()
            servers.append(server)
            home.add_host(f"host{k}", server)
            hosts[f"host{k}"] = {"address": f"host{k}", "containers": {f"ct{k}": {"ctid": container.vmid}}}
        data = {"defaults": {"min_free_disk_gb": 0, "python": python}, "hosts": hosts}
        yield Fleet(write_inventory(workdir, data), home, servers, containers)
    finally:
        for server in servers:
            server.stop()
        factory.destroy_all()
