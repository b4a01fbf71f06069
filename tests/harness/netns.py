"""Several "hosts" on one machine: network namespaces of the test's own making, each joined to the root
namespace by a veth pair and running its own sshd on port 22 of an address from 198.18.0.0/15.

Addresses from that range are assigned only inside these namespaces; the root namespace gets nothing but
address-less veth ends and /32 routes to them (its replies leave from its own primary address). Everything
is named `dfot<pid>...` so that teardown, and the clean-up of sessions that crashed, touch only ours.
It must never change any interface, route or namespace it did not create.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path

from .lxc import ContainerFactory
from .sshd import SshServer

PREFIX = "dfot"
IP_TIMEOUT_S = 10


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


class NetnsHost:
    """Namespace `ns` with `address` on its eth0, reachable from the root namespace through `veth`.

    Like a Proxmox node it has containers of its own: `containers(...)` makes them under this host's
    LXCPATH, started inside its namespace, and its sshd's `pct` sees those and no others."""

    def __init__(self, index: int, workdir: Path, env: dict[str, str] | None = None) -> None:
        tag = os.getpid()
        self.ns = f"{PREFIX}{tag}-{index}"
        self.veth = f"{PREFIX}{tag % 100000}v{index}"[:15]
        self.address = f"198.18.{tag % 250}.{index + 2}"
        self.workdir = Path(workdir)
        self.node = f"node{index}"
        self.containers = ContainerFactory(self.workdir / "lxc", netns=self.ns)
        self.env = {**(env or {}), "PCT_STANDIN_LXCPATH": str(self.containers.lxcpath), "PCT_STANDIN_NODE": self.node}
        self.server: SshServer | None = None

    def create(self) -> "NetnsHost":
        """Make the namespace, link and route, and start its sshd; on any failure undo what was made."""
        try:
            ip("netns", "add", self.ns)
            ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
            ip("-n", self.ns, "addr", "add", f"{self.address}/32", "dev", "eth0")
            ip("-n", self.ns, "link", "set", "lo", "up")
            ip("-n", self.ns, "link", "set", "eth0", "up")
            ip("-n", self.ns, "route", "add", "default", "dev", "eth0")
            ip("link", "set", self.veth, "up")
            ip("route", "add", f"{self.address}/32", "dev", self.veth)
            self.server = SshServer(self.workdir, host=self.address, port=22, netns=self.ns, env=self.env).start()
        except Exception:
            self.destroy()
            raise
        return self

    def destroy(self) -> None:
        """Destroy its containers, stop sshd, delete the veth pair (its route goes with it) and the namespace.
        Idempotent."""
        with contextlib.suppress(Exception):
            self.containers.destroy_all()
        if self.server is not None:
            self.server.stop()
            self.server = None
        ip("link", "del", self.veth, check=False)
        ip("netns", "del", self.ns, check=False)


def remove_stale_namespaces() -> None:
    """Delete namespaces that earlier test sessions (now dead) left behind after a crash."""
    listing = ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({PREFIX}(\d+)-\d+)", listing, re.MULTILINE):
        ns, pid = name
        if not Path(f"/proc/{pid}").exists():
            ip("netns", "del", ns, check=False)
    # a namespace takes its eth0 along when deleted, and the veth pair with it: no links to chase


class NetnsHosts:
    """Factory of NetnsHost; `destroy_all` tears every one down, carrying on past failures."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.env = env
        self.hosts: list[NetnsHost] = []

    def __call__(self, count: int) -> list[NetnsHost]:
        made = []
        for _ in range(count):
            host = NetnsHost(len(self.hosts), self.workdir / f"host{len(self.hosts)}", self.env)
            self.hosts.append(host)
            made.append(host.create())
        return made

    def link(self, a: NetnsHost, b: NetnsHost, name: str = "dfolink") -> tuple[str, str]:
        """A direct cable between two hosts: a veth pair whose ends are called `name` inside both namespaces,
        with addresses 198.19.<pid>.1/30 and .2/30 (the root namespace does not forward between hosts, so
        only such a link lets them, and their `network="none"` containers, reach each other). Returns the
        two addresses. The link goes with the namespaces."""
        tag = os.getpid()
        ends = [f"{PREFIX}{tag % 100000}a", f"{PREFIX}{tag % 100000}b"]
        addrs = [f"198.19.{tag % 250}.1", f"198.19.{tag % 250}.2"]
        ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        try:
            for end, host, addr in zip(ends, (a, b), addrs):
                ip("link", "set", end, "netns", host.ns)
                ip("-n", host.ns, "link", "set", end, "name", name)
                ip("-n", host.ns, "addr", "add", f"{addr}/30", "dev", name)
                ip("-n", host.ns, "link", "set", name, "up")
        except Exception:
            for end in ends:
                ip("link", "del", end, check=False)
            raise
        return addrs[0], addrs[1]

    def destroy_all(self) -> None:
        for host in reversed(self.hosts):
            with contextlib.suppress(Exception):
                host.destroy()
        self.hosts.clear()
