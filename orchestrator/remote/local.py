"""LocalTarget: run commands on this machine with subprocess, with the same contract as a remote target.

Every command starts in its own session, so a timeout kills its whole process group (a shell script's
children included) and raises CommandTimeout. `put` copies then verifies the size and sha256.

This module must not import any networking library and must never leave a timed-out process running.
"""

from __future__ import annotations

import hashlib
import os
import selectors
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ..errors import CommandFailed, CommandTimeout, TransferError
from .base import DEFAULT_TIMEOUT, Command, Result, Stream, Target, as_argv, render

KILL_GRACE_S = 2.0


class LocalTarget(Target):
    """This machine. `name` is what messages call it."""

    def __init__(self, name: str = "local") -> None:
        self.name = name

    def run(
        self,
        cmd: Command,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        input: bytes | None = None,
        check: bool = False,
        env: dict[str, str] | None = None,
    ) -> Result:
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                as_argv(cmd),
                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **env} if env else None,
                start_new_session=True,
            )
        except OSError as exc:  # as a shell reports it: 127 not found, 126 not executable
            result = Result(render(cmd), 127 if isinstance(exc, FileNotFoundError) else 126, "",
                            f"{as_argv(cmd)[0]}: {exc.strerror}\n", time.monotonic() - started)
            if check:
                raise CommandFailed(result, where=self.name) from None
            return result
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise CommandTimeout(f"{render(cmd)[:120]} ran past its {timeout:g}s timeout", where=self.name) from None
        result = Result(
            command=render(cmd),
            exit_code=proc.returncode,
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            duration_s=time.monotonic() - started,
        )
        if check and result.failed:
            raise CommandFailed(result, where=self.name)
        return result

    def put(self, local: Path, remote: str, *, mode: int = 0o644, timeout: float = 120.0) -> None:
        try:
            shutil.copyfile(local, remote)
            os.chmod(remote, mode)
        except OSError as exc:
            raise TransferError(f"copy {local} -> {remote} failed: {exc.strerror}", where=self.name) from None
        if file_sha256(Path(remote)) != file_sha256(Path(local)):
            raise TransferError(f"{remote} differs from {local} after the copy", where=self.name)

    def stream(self, cmd: Command) -> "LocalStream":
        proc = subprocess.Popen(
            as_argv(cmd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return LocalStream(proc, where=self.name)


class LocalStream(Stream):
    """A local long-lived process: non-blocking reads of stdout with a timeout, writes to stdin."""

    def __init__(self, proc: subprocess.Popen, *, where: str) -> None:
        self._proc = proc
        self._where = where
        os.set_blocking(proc.stdout.fileno(), False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(proc.stdout, selectors.EVENT_READ)

    def read(self, n: int = 65536, timeout: float | None = None) -> bytes:
        if not self._selector.select(timeout):
            raise CommandTimeout(f"no output within {timeout:g}s", where=self._where)
        return os.read(self._proc.stdout.fileno(), n)

    def write(self, data: bytes) -> None:
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def close(self) -> None:
        if self._proc.stdin and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(self._proc, drain=False)
        self._selector.close()
        self._proc.stdout.close()

    def exit_code(self) -> int | None:
        return self._proc.poll()


def _kill_group(proc: subprocess.Popen, *, drain: bool = True) -> None:
    """SIGKILL the process group the command leads, then reap it (draining its pipes unless a Stream owns them)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        if drain:
            proc.communicate(timeout=KILL_GRACE_S)
        else:
            proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:  # a descendant left the group and holds the pipes open
        proc.kill()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
