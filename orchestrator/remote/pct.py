"""PctTarget: a Proxmox LXC container reached through another target's `pct` (`pct exec CTID -- argv`).

pct's own failures exit 255 like ssh's do, so they are told apart by their stderr text and mapped to
ContainerMissing / ContainerNotRunning with a message naming the fix. That mapping is also how a caller learns
a container's state without a `pct status` of its own: every pct call costs a Perl start-up on the node. `put` stages the file on the host,
`pct push`es it and verifies the result inside the container, because a failed push can exit 0.

This module must not import any networking library: it only composes commands for the inner target.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from ..errors import CommandFailed, ContainerError, ContainerMissing, ContainerNotRunning, TransferError
from .base import DEFAULT_TIMEOUT, Command, Result, Stream, Target, as_argv, env_argv
from .local import file_sha256

MISSING_RE = re.compile(r"Configuration file '[^']*' does not exist")
NOT_RUNNING_RE = re.compile(r"container '\d+' not running!|can only push files to a running CT")
STATUS_RE = re.compile(r"^status:\s*(\S+)", re.MULTILINE)
PCT_NOT_FOUND_RE = re.compile(r"\bpct: (?:command )?not found|^pct: No such file or directory", re.MULTILINE)
EXIT_NOT_FOUND = 127
STATUS_TIMEOUT = 30.0


class PctTarget(Target):
    """Container `ctid` on the host `inner` reaches. `name` is the container's inventory name."""

    def __init__(self, inner: Target, ctid: int, name: str | None = None) -> None:
        self.inner = inner
        self.ctid = int(ctid)
        self.name = name or f"{inner.name}/{ctid}"

    def exec_argv(self, cmd: Command) -> list[str]:
        """The host-side argv that runs `cmd` inside the container."""
        return ["pct", "exec", str(self.ctid), "--", *as_argv(cmd)]

    def run(
        self,
        cmd: Command,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        input: bytes | None = None,
        check: bool = False,
        env: dict[str, str] | None = None,
    ) -> Result:
        inner_cmd = [*env_argv(env), *as_argv(cmd)]  # set inside: pct exec does not forward the caller's environment reliably
        result = self.inner.run(self.exec_argv(inner_cmd), timeout=timeout, input=input)
        self.raise_for_pct(result)
        if check and result.failed:
            raise CommandFailed(result, where=self.name)
        return result

    def raise_for_pct(self, result: Result) -> None:
        """Raise ContainerMissing / ContainerNotRunning (or ContainerError: no pct on the host) when pct itself,
        not the command, failed."""
        if result.ok:
            return
        host = self.inner.name
        if result.exit_code == EXIT_NOT_FOUND and PCT_NOT_FOUND_RE.search(result.stderr):
            raise ContainerError(
                f"host {host} has no `pct` command, so container {self.ctid} cannot be reached",
                where=self.name,
                hint="is it a Proxmox host? for a plain machine set `ctid: null` in the inventory",
            )
        if MISSING_RE.search(result.stderr):
            raise ContainerMissing(
                f"container {self.ctid} does not exist on host {host}",
                where=self.name,
                hint=f"check the ctid in the inventory against `pct list` on {host}",
            )
        if NOT_RUNNING_RE.search(result.stderr):
            raise ContainerNotRunning(
                f"container {self.ctid} is not running", where=self.name, hint=f"run `pct start {self.ctid}` on host {host}"
            )

    def status(self, *, timeout: float = STATUS_TIMEOUT) -> str:
        """'running' or 'stopped' (pct status); ContainerMissing when there is no such container."""
        result = self.inner.run(["pct", "status", str(self.ctid)], timeout=timeout)
        self.raise_for_pct(result)
        match = STATUS_RE.search(result.stdout)
        if result.failed or not match:
            raise CommandFailed(result, where=self.inner.name, what=f"pct status {self.ctid}")
        return match.group(1)

    def put(self, local: Path, remote: str, *, mode: int = 0o644, timeout: float = 120.0) -> None:
        staged = self.inner.run(["mktemp", "/tmp/dfo-push.XXXXXXXX"], timeout=timeout, check=True).stdout.strip()
        try:
            self.inner.put(local, staged, mode=0o600, timeout=timeout)
            push = self.inner.run(
                ["pct", "push", str(self.ctid), staged, remote, "--perms", f"{mode:o}"], timeout=timeout
            )
            self.raise_for_pct(push)
            if push.failed:
                raise TransferError(f"pct push to {remote} failed: {push.tail(3)}", where=self.name)
        finally:
            self.inner.run(["rm", "-f", staged], timeout=timeout)
        self._verify(local, remote, timeout)

    def _verify(self, local: Path, remote: str, timeout: float) -> None:
        script = f"sha256sum < {shlex.quote(remote)} 2>/dev/null || wc -c < {shlex.quote(remote)}"  # stdin: no name escaping
        found = self.run(script, timeout=timeout).stdout.split()
        expected = (file_sha256(local), str(Path(local).stat().st_size))
        if not found or found[0] not in expected:
            raise TransferError(
                f"{remote} did not arrive intact (pct push exited 0)", where=self.name, hint="check free space in the container"
            )

    def stream(self, cmd: Command, *, merge_stderr: bool = False) -> Stream:
        """`merge_stderr`: pct's own stderr (and the command's) comes on the stream's stdout, so that a caller
        can map pct's messages (raise_for_pct) from what it read when the stream ended early."""
        argv = self.exec_argv(cmd)
        return self.inner.stream(f"{shlex.join(argv)} 2>&1" if merge_stderr else argv)
