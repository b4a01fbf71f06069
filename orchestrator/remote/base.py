"""The one small interface for "somewhere a command runs".

A Target runs a command (an argument list, quoted here, or a POSIX sh script) with a timeout and returns a
Result; puts a file; and opens a long-lived Stream (for the watch agent). Implementations nest:
LocalTarget (subprocess), SshTarget (one kept-open paramiko connection per host, a channel per command) and
PctTarget (wraps any other target: `pct exec CTID -- ...`).

This module imports no networking library and never raises a library's exception.
"""

from __future__ import annotations

import re
import shlex
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

Command = Union[Sequence[str], str]
"""An argument list (each element quoted before it reaches a shell) or a POSIX sh script (run by `sh -c`)."""

DEFAULT_TIMEOUT = 30.0
EXIT_POLL_S = 0.01


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_argv(env: dict[str, str] | None) -> list[str]:
    """`env KEY=VALUE ...` words that set `env` for the command after them ([] for none). Names are checked, so
    none can pass for an option of env(1) or a shell word."""
    for key in env or {}:
        if not ENV_NAME.fullmatch(key):
            raise ValueError(f"invalid environment variable name {key!r}")
    return ["env", *(f"{key}={value}" for key, value in env.items())] if env else []


def render(cmd: Command) -> str:
    """The shell form of a command: a list is quoted element by element; a script is passed to `sh -c`."""
    if isinstance(cmd, str):
        return "sh -c " + shlex.quote(cmd)
    return shlex.join(list(cmd))


def as_argv(cmd: Command) -> list[str]:
    """The argv form: a script becomes ["sh", "-c", script]."""
    if isinstance(cmd, str):
        return ["sh", "-c", cmd]
    return list(cmd)


@dataclass(frozen=True)
class Result:
    """What a finished command left: exit code, decoded output and how long it took."""

    command: str
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def failed(self) -> bool:
        return not self.ok

    def tail(self, n: int = 10) -> str:
        """The last n lines of stderr and stdout together (stderr first: that is where errors usually are)."""
        lines = (self.stderr.rstrip("\n").splitlines() if self.stderr.strip() else []) + (
            self.stdout.rstrip("\n").splitlines() if self.stdout.strip() else []
        )
        return "\n".join(lines[-n:])

    def __repr__(self) -> str:
        return f"<Result exit={self.exit_code} {self.duration_s:.2f}s {self.command[:60]!r}>"


class Stream(ABC):
    """A long-lived command: read its stdout incrementally, write to its stdin, close it.

    Closing a stream ends the remote command (its stdin closes and the channel goes away); it never
    signals anything else on the remote side.
    """

    @abstractmethod
    def read(self, n: int = 65536, timeout: float | None = None) -> bytes:
        """Up to n bytes of stdout; b"" at EOF. Raises CommandTimeout if nothing came within `timeout`."""

    @abstractmethod
    def write(self, data: bytes) -> None:
        """Send bytes to the command's stdin."""

    @abstractmethod
    def close(self) -> None:
        """Close stdin and the channel. Idempotent."""

    @abstractmethod
    def exit_code(self) -> int | None:
        """The command's exit code once it ended, else None. Never waits."""

    def wait_exit(self, timeout: float) -> int | None:
        """The command's exit code, waiting up to `timeout` for it to end (or for its status to arrive); None
        if it did not within `timeout`."""
        deadline = time.monotonic() + timeout
        while (code := self.exit_code()) is None and time.monotonic() < deadline:
            time.sleep(EXIT_POLL_S)
        return code

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Target(ABC):
    """Somewhere commands run. `name` is what error messages call it (a host or container name)."""

    name: str

    @abstractmethod
    def run(
        self,
        cmd: Command,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        input: bytes | None = None,
        check: bool = False,
        env: dict[str, str] | None = None,
    ) -> Result:
        """Run to completion. check=True raises CommandFailed on a non-zero exit. Past `timeout`: CommandTimeout.

        `env` sets variables for the command (never put secrets here: they may appear in argv; write them to a
        file with `put_bytes` instead)."""

    @abstractmethod
    def put(self, local: Path, remote: str, *, mode: int = 0o644, timeout: float = 120.0) -> None:
        """Copy a local file to `remote` (parent directory must exist). Raises TransferError if it did not arrive."""

    def put_bytes(self, data: bytes, remote: str, *, mode: int = 0o600, timeout: float = 60.0) -> None:
        """Write bytes to a remote file with `mode`, without the bytes ever being on a command line."""
        script = f"umask 077; cat > {shlex.quote(remote)}.tmp && chmod {mode:o} {shlex.quote(remote)}.tmp && mv {shlex.quote(remote)}.tmp {shlex.quote(remote)}"
        self.run(script, input=data, timeout=timeout, check=True)

    @abstractmethod
    def stream(self, cmd: Command) -> Stream:
        """Start a long-lived command and return its Stream."""

    def close(self) -> None:
        """Release connections. Idempotent."""
