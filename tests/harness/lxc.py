"""Real, privileged LXC containers for tests, built the way docs/design.md records: no template, a hand-made
rootfs, busybox init, the host's /usr (and /etc/alternatives) bound read-only, no network. The `pct` stand-in (bin/pct) drives them
exactly as Proxmox's pct drives its containers (`lxc-attach -n VMID --keep-env`).

Inside, the test interpreter's directories (sys.base_prefix, sys.prefix) and the repo checkout are bound
read-only at the same paths, and tests/harness/bin lies over /usr/local/sbin, so `nvidia-smi` is the
stand-in reading the container's own /run/nvidia-smi-standin.json.

It only creates, starts, stops and destroys containers under the LXCPATH it is given; it never touches
the system's /var/lib/lxc.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from . import HARNESS_DIR, STANDIN_BIN
from .nvidia_smi import NvidiaSmiState, idle_gpus

REPO_ROOT = HARNESS_DIR.parents[1]
INITTAB = "::sysinit:/bin/true\n::respawn:/usr/bin/sleep 2147483647\n"
ROOTFS_DIRS = ("etc", "root", "tmp", "workspace", "dev", "proc", "sys", "usr", "run")
LXC_TIMEOUT_S = 30


def host_dirs_to_bind() -> list[Path]:
    """Directories the container needs at the same path as on the host: the running interpreter and
    venv, and the repo checkout. Nested ones are dropped (a plain bind already shows their contents)."""
    candidates = sorted({Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), REPO_ROOT})
    kept: list[Path] = []
    for path in candidates:
        if not any(path.is_relative_to(parent) for parent in kept) and not path.is_relative_to("/usr"):
            kept.append(path)
    return kept


class LxcContainer:
    """One container `vmid` under `lxcpath` (LXCPATH/VMID/config and LXCPATH/VMID/rootfs).

    `netns`: the network namespace of the "host" that owns it (lxc reaches a container's monitor through
    an abstract socket, which only that namespace sees); None for the test machine itself.
    `network`: lxc.net.0.type: `empty` (default: a namespace of its own with only loopback) or `none` (the
    owning host's network namespace and addresses: a stand-in for a Proxmox container's own bridged
    address, used by the multi-node tests, whose containers must reach each other)."""

    def __init__(self, lxcpath: Path, vmid: int, hostname: str | None = None, netns: str | None = None,
                 network: str = "empty") -> None:
        assert network in ("empty", "none"), network
        self.lxcpath = Path(lxcpath)
        self.netns = netns
        self.network = network
        self.vmid = vmid
        self.hostname = hostname or f"ct{vmid}"
        self.dir = self.lxcpath / str(vmid)
        self.rootfs = self.dir / "rootfs"
        self.config_path = self.dir / "config"

    @property
    def name(self) -> str:
        return str(self.vmid)

    def path(self, inside: str) -> Path:
        """Where a path inside the container lies on the host (for files the rootfs itself holds)."""
        return self.rootfs / inside.lstrip("/")

    def nvidia_smi(self, gpus=None, mode: str = "ok") -> NvidiaSmiState:
        """(Re)write the container's nvidia-smi stand-in state; the default is two idle H200s."""
        return NvidiaSmiState(self.path("/run/nvidia-smi-standin.json"), idle_gpus(2) if gpus is None else gpus, mode)

    def create(self) -> "LxcContainer":
        self._make_rootfs()
        self.config_path.write_text(self._config_text())
        return self

    def _make_rootfs(self) -> None:
        root = self.rootfs
        for name in ROOTFS_DIRS:
            (root / name).mkdir(parents=True, exist_ok=True)
        (root / "tmp").chmod(0o1777)
        for name in ("bin", "sbin", "lib", "lib64"):
            if not (root / name).is_symlink():
                (root / name).symlink_to(f"usr/{name}")
        etc = root / "etc"
        (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
        (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
        (etc / "hostname").write_text(self.hostname + "\n")
        (etc / "inittab").write_text(INITTAB)
        for shared in ("/etc/ld.so.cache", "/etc/nsswitch.conf", "/etc/localtime"):
            if Path(shared).exists():
                shutil.copy(shared, etc, follow_symlinks=True)

    def _config_text(self) -> str:
        lines = [
            f"lxc.uts.name = {self.hostname}",
            f"lxc.rootfs.path = dir:{self.rootfs}",
            f"lxc.net.0.type = {self.network}",
            "lxc.apparmor.profile = unconfined",
            "lxc.autodev = 1",
            "lxc.mount.auto = cgroup:mixed proc:mixed sys:ro",
            # as in a Proxmox container: POSIX semaphores and shared memory (procsplit's queues need them)
            "lxc.mount.entry = tmpfs dev/shm tmpfs rw,nosuid,nodev,mode=1777,create=dir 0 0",
            "lxc.mount.entry = /usr usr none ro,bind 0 0",
            "lxc.mount.entry = /etc/alternatives etc/alternatives none ro,bind,create=dir 0 0",  # awk, which, ...
            f"lxc.mount.entry = {STANDIN_BIN} usr/local/sbin none ro,bind 0 0",
        ]
        for path in host_dirs_to_bind():
            lines.append(f"lxc.mount.entry = {path} {str(path).lstrip('/')} none ro,bind,create=dir 0 0")
        lines.append("lxc.init.cmd = /usr/bin/busybox init")
        return "\n".join(lines) + "\n"

    def lxc(self, *argv: str, timeout: float = LXC_TIMEOUT_S) -> subprocess.CompletedProcess:
        """Run an lxc-* tool in the owning host's network namespace."""
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=timeout)

    def start(self) -> "LxcContainer":
        result = self.lxc("lxc-start", "-P", str(self.lxcpath), "-n", self.name, "-d", "-o", str(self.dir / "lxc.log"))
        if result.returncode != 0 or not self.wait_state("RUNNING"):
            log = (self.dir / "lxc.log").read_text(errors="replace")[-2000:] if (self.dir / "lxc.log").exists() else ""
            raise RuntimeError(f"container {self.vmid} did not start: {result.stderr.strip()}\n{log}")
        return self

    def stop(self) -> None:
        """Kill the container (lxc-stop -k); a stopped one stays stopped."""
        if self.state() == "RUNNING":
            self.lxc("lxc-stop", "-P", str(self.lxcpath), "-n", self.name, "-k")
            self.wait_state("STOPPED")

    def state(self) -> str:
        result = self.lxc("lxc-info", "-P", str(self.lxcpath), "-n", self.name, "-s", "-H")
        return result.stdout.strip() if result.returncode == 0 else "MISSING"

    def wait_state(self, state: str, timeout_s: float = 10) -> bool:
        result = self.lxc("lxc-wait", "-P", str(self.lxcpath), "-n", self.name, "-s", state, "-t", str(int(timeout_s)))
        return result.returncode == 0

    def attach(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run argv inside the container directly (for test set-up and assertions, not for code under test)."""
        return self.lxc("lxc-attach", "-P", str(self.lxcpath), "-n", self.name, "--clear-env", "--", *argv, timeout=timeout)

    def destroy(self) -> None:
        """Stop the container and remove its directory (the rootfs holds no mounts once it is stopped)."""
        self.stop()
        if self.state() == "RUNNING":
            raise RuntimeError(f"container {self.vmid} would not stop; leaving {self.dir} in place")
        shutil.rmtree(self.dir, ignore_errors=True)


class ContainerFactory:
    """Makes containers with fresh VMIDs (from 200 up) under one LXCPATH and destroys them all at the end."""

    def __init__(self, lxcpath: Path, netns: str | None = None) -> None:
        self.lxcpath = Path(lxcpath)
        self.netns = netns
        self.lxcpath.mkdir(parents=True, exist_ok=True)
        self.containers: list[LxcContainer] = []

    def next_vmid(self) -> int:
        taken = {int(p.name) for p in self.lxcpath.iterdir() if p.name.isdigit()}
        return next(vmid for vmid in range(200, 1_000_000) if vmid not in taken)

    def __call__(self, vmid: int | None = None, *, start: bool = True, gpus=None, network: str = "empty") -> LxcContainer:
        container = LxcContainer(self.lxcpath, vmid or self.next_vmid(), netns=self.netns, network=network).create()
        self.containers.append(container)
        container.nvidia_smi(gpus)
        if start:
            container.start()
        return container

    def destroy_all(self) -> None:
        errors = []
        for container in self.containers:
            try:
                container.destroy()
            except Exception as exc:  # keep tearing the others down
                errors.append(exc)
        self.containers.clear()
        if errors:
            raise errors[0]
