"""A scripted, in-memory Target for tests of dfo's logic (not of its remote layer).

`ScriptedTarget` implements orchestrator/remote/base.py's Target: each command a test expects is answered from a
script of rules (a pattern over the command's shell form, and what it answers: a Reply, a callable, or an
exception such as CommandTimeout), in this process, at once. It records every call, so a test asserts what dfo
sent and in what order, and a command nobody scripted fails the test with that command named (never a silent
exit 0). Files `put` or `put_bytes` land in `files`.

What it is for: the logic above the remote layer (how dfo reads an answer, maps a failure, retries, renders),
where starting an sshd, a container and real processes costs seconds per test and adds nothing the test checks.
What it is not for: the remote layer itself (quoting, channels, timeouts, pct's texts) and the end-to-end paths:
those keep the real sshd, the real LXC containers and the stand-ins of tests/harness (tests/harness/README.md).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Union

from orchestrator.errors import CommandFailed, CommandTimeout
from orchestrator.remote.base import DEFAULT_TIMEOUT, Command, Result, Stream, Target, render


@dataclass(frozen=True)
class Reply:
    """What a scripted command answers."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0


@dataclass(frozen=True)
class Call:
    """One command dfo sent: its shell form, stdin, environment and timeout."""

    command: str
    input: bytes | None = None
    env: dict[str, str] | None = None
    timeout: float | None = None


Answer = Union[Reply, BaseException, Callable[[Call], Union[Reply, BaseException]]]


@dataclass
class Rule:
    pattern: re.Pattern
    answer: Answer
    times: int | None = None  # how many calls it answers (None: any number)
    used: int = 0


class NotScripted(AssertionError):
    """dfo sent a command the test did not script: a test's mistake or a change of behaviour, never an answer."""


@dataclass
class ScriptedTarget(Target):
    """A Target whose commands are answered from rules, first matching rule first (see the module docstring)."""

    name: str = "scripted"
    rules: list[Rule] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    streams: list["ScriptedStream"] = field(default_factory=list)
    closed: bool = False

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stream_rules: list[tuple[re.Pattern, Callable[[Call], "ScriptedStream"]]] = []

    # ---- scripting
    def on(self, pattern: str, answer: Answer, *, times: int | None = None) -> "ScriptedTarget":
        """Answer commands whose shell form matches `pattern` (re.search) with `answer`; chainable."""
        self.rules.append(Rule(re.compile(pattern, re.S), answer, times))
        return self

    def on_stream(self, pattern: str, make: Callable[[Call], "ScriptedStream"]) -> "ScriptedTarget":
        """Open a stream for commands matching `pattern` with `make(call)`."""
        self._stream_rules.append((re.compile(pattern, re.S), make))
        return self

    def sent(self, pattern: str = "") -> list[str]:
        """The shell form of every command sent so far that matches `pattern`."""
        return [call.command for call in self.calls if re.search(pattern, call.command, re.S)]

    # ---- Target
    def run(self, cmd: Command, *, timeout: float = DEFAULT_TIMEOUT, input: bytes | None = None, check: bool = False,
            env: dict[str, str] | None = None) -> Result:
        call = Call(render(cmd), input, dict(env) if env else None, timeout)
        started = time.monotonic()
        answer = self._answer(call)
        if callable(answer) and not isinstance(answer, BaseException):
            answer = answer(call)
        if isinstance(answer, BaseException):
            raise answer
        result = Result(call.command, answer.exit_code, answer.stdout, answer.stderr, time.monotonic() - started)
        if check and result.failed:
            raise CommandFailed(result, where=self.name)
        return result

    def put(self, local: Path, remote: str, *, mode: int = 0o644, timeout: float = 120.0) -> None:
        self.put_bytes(Path(local).read_bytes(), remote, mode=mode, timeout=timeout)

    def put_bytes(self, data: bytes, remote: str, *, mode: int = 0o600, timeout: float = 60.0) -> None:
        with self._lock:
            self.calls.append(Call(f"put {remote}", None, None, timeout))
            self.files[remote] = (bytes(data), mode)

    def stream(self, cmd: Command) -> "ScriptedStream":
        call = Call(render(cmd))
        with self._lock:
            self.calls.append(call)
            make = next((make for pattern, make in self._stream_rules if pattern.search(call.command)), None)
        if make is None:
            raise NotScripted(f"{self.name}: no stream scripted for: {call.command}")
        opened = make(call)
        self.streams.append(opened)
        return opened

    def close(self) -> None:
        self.closed = True

    def _answer(self, call: Call) -> Answer:
        with self._lock:
            self.calls.append(call)
            for rule in self.rules:
                if (rule.times is None or rule.used < rule.times) and rule.pattern.search(call.command):
                    rule.used += 1
                    return rule.answer
        raise NotScripted(f"{self.name}: no rule answers: {call.command}")


class ScriptedStream(Stream):
    """A stream that gives `output` (bytes, read in order) and then ends with `exit_code`; what dfo writes to it
    is kept in `written`. `feed(data)` adds output while it is open; `end(code)` ends it."""

    def __init__(self, output: bytes = b"", exit_code: int | None = None) -> None:
        self._buffer = bytearray(output)
        self._code = exit_code
        self._ended = exit_code is not None
        self._changed = threading.Condition()
        self.written = bytearray()
        self.closed = False

    def feed(self, data: bytes) -> None:
        with self._changed:
            self._buffer += data
            self._changed.notify_all()

    def end(self, exit_code: int = 0) -> None:
        with self._changed:
            self._code, self._ended = exit_code, True
            self._changed.notify_all()

    def read(self, n: int = 65536, timeout: float | None = None) -> bytes:
        with self._changed:
            if not self._buffer and not self._ended and not self.closed:
                self._changed.wait(timeout)
                if not self._buffer and not self._ended and not self.closed:
                    raise CommandTimeout(f"scripted stream: nothing within {timeout}s")
            data = bytes(self._buffer[:n])
            del self._buffer[:n]
            return data

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    def exit_code(self) -> int | None:
        return self._code if self._ended and not self._buffer else None
