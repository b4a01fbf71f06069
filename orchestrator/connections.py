"""Connections: the one host Target per host for one dfo invocation, and the container Targets on top.

A host's Target (LocalTarget, or SshTarget with its one kept-open connection) is created on first use,
cached and shared by every container on that host and every thread. `container(name)` wraps it in a
PctTarget, or returns the host itself for a target with `ctid: null`.

This module must not run commands itself; it only builds and caches targets.
"""

from __future__ import annotations

import threading

from .inventory import Inventory
from .names import check_name
from .remote.base import Target
from .remote.local import LocalTarget
from .remote.pct import PctTarget


class Connections:
    """Per-invocation cache of host targets. Use as a context manager so every connection is closed."""

    def __init__(self, inventory: Inventory, *, accept_new_host_keys: bool = False, offer_accept_new: bool = False) -> None:
        """`offer_accept_new`: the command has --accept-new-host-key (an unknown host key's hint names it)."""
        self.inventory = inventory
        self.accept_new_host_keys = accept_new_host_keys
        self.offer_accept_new = offer_accept_new
        self._hosts: dict[str, Target] = {}
        self._lock = threading.Lock()
        self._host_locks: dict[str, threading.Lock] = {}

    def host(self, host_name: str) -> Target:
        """The cached Target of host `host_name` (created on first use; hosts open in parallel)."""
        with self._lock:
            host_lock = self._host_locks.setdefault(host_name, threading.Lock())
        with host_lock:
            if host_name not in self._hosts:
                self._hosts[host_name] = self._open(host_name)
            return self._hosts[host_name]

    def container(self, target_name: str) -> Target:
        """The Target that runs commands inside `target_name` (a container name from the inventory)."""
        spec = self.inventory.target(check_name(target_name, "target"))
        host = self.host(spec.host)
        if spec.ctid is None:
            return host
        return PctTarget(host, spec.ctid, name=spec.name)

    def _open(self, host_name: str) -> Target:
        host = self.inventory.hosts[host_name]
        if host.transport == "local":
            return LocalTarget(host_name)
        from .remote.ssh import SshTarget  # paramiko is loaded only when a host needs it

        return SshTarget(
            host_name,
            host.address,
            port=host.port,
            user=self.inventory.ssh_user(host_name),
            connect_timeout=self.inventory.defaults.connect_timeout,
            accept_new_host_key=self.accept_new_host_keys,
            offer_accept_new=self.offer_accept_new,
        )

    def close(self) -> None:
        with self._lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for target in hosts:
            target.close()

    def __enter__(self) -> "Connections":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
