"""A launch in one remote invocation: the preflight, the launch's probe and the detached start in one script.

On a Proxmox node every `pct` call starts a Perl program that loads the PVE modules (about half a second)
and every SSH exec is a round trip, so a launch asks a container everything at once. The script
(plan_script) runs preflight's checks (preflight.inside_script) and the launch's probe (is the log name
free, is the trainer package there, python and torch: with a gate the preflight's one python answers torch
too), prints READY and waits for one line on its stdin.
dfo reads the rows with preflight's own code and judges them with preflight.blocking (the one rule for what
refuses a run); while the script waits it pushes the package if that is missing; then it answers
`start N` followed by N bytes of secrets (the caller's start script writes them to a 0600 file: never on a
command line), or `no`. Anything else starts nothing: no answer (dfo died, the connection dropped, or
REPLY_TIMEOUT_S passed: EOF or timeout on the script's stdin), or any other line. The container's state
comes with the answer: a stopped or missing container fails `pct exec` with pct's own message, which
PctTarget maps, so no `pct status` goes first.

Remote commands per launch: one (two when a default run name is already taken on the target), plus the
push when the package changed. This module composes and parses; the start script is the caller's
(runs.start_script), and it records nothing (runs.launch does).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

from .errors import CommandTimeout, DfoError, RefusedError, RemoteError
from .inventory import TargetSpec
from .package import parse_probe
from .preflight import (
    SECTION,
    Check,
    PreflightFailed,
    TargetReport,
    blocking,
    inside_script,
    inside_timeout,
    report_for,
    split_sections,
)
from .remote.base import Result, Stream, Target
from .remote.local import LocalTarget
from .remote.pct import PctTarget

READY = "@@dfo-plan ready"
PROBE = "probe"
REPLY_TIMEOUT_S = 600
"""How long the script waits for dfo's word (a push of the package happens meanwhile), then starts nothing."""
PROBE_TIMEOUT_S = 60.0
EXIT_WAIT_S = 5.0
SECRETS_FROM_STDIN = 'head -c "$n"'
"""What the start script reads its secrets with: the N bytes after dfo's `start N` line."""
ALWAYS_JUDGED = ("ssh", "container")
CALLS_PER_CONNECTION = 1
"""Launch calls open at once over one SSH connection. OpenSSH's default MaxSessions is 10 channels per
connection: remote/ssh.py keeps 8 for short commands (a push during a call uses those) and leaves 2 for
streams, one of them the watch agent's; a launch call is a stream, so it takes the other. Launches to
containers of one host wait their turn (each is one pct start-up and one script); other hosts' do not."""
_turns: "weakref.WeakKeyDictionary[Target, threading.BoundedSemaphore]" = weakref.WeakKeyDictionary()
_turns_lock = threading.Lock()
GROUP_CALLS_PER_CONNECTION = 2
"""Calls of one multi-node launch open at once over one SSH connection (every node waits for dfo's word until
all are prepared): the 2 channels ssh.py leaves for streams (no watch agent is open on it during a launch)."""
_group: "contextvars.ContextVar[GroupTurns | None]" = contextvars.ContextVar("dfo_launch_group", default=None)


@dataclass(frozen=True)
class Gate:
    """The preflight a launch runs in its own call: the target's inventory entry, the failed checks it lets
    pass (e.g. preflight.TOLERABLE_WHEN_BUSY for --force), and, for a fallback, the only checks that may
    refuse besides ssh and container (None: all of them)."""

    spec: TargetSpec
    tolerate: tuple[str, ...] = ()
    judged: tuple[str, ...] | None = None
    nvidia_smi_timeout: float = 10.0

    def refusals(self, report: TargetReport) -> list[Check]:
        """The failed checks that refuse the launch (preflight.blocking, narrowed to `judged`)."""
        failed = blocking(report, self.spec, tolerate=self.tolerate)
        if self.judged is None:
            return failed
        return [check for check in failed if check.name in (*ALWAYS_JUDGED, *self.judged)]


def plan_script(checks: str, start: str) -> str:
    """`checks` (stdin closed for them), READY, then `start` only after dfo's `start N` line; N is in $n."""
    return "\n".join(
        [
            "exec 2>&1",
            f"{{\n{checks}\n}} </dev/null",
            f"echo '{READY}'",
            f"reply=$(timeout -k 2 {REPLY_TIMEOUT_S} sh -c 'IFS= read -r l && printf %s \"$l\"')",
            "n=${reply#start }",
            'case $reply in "start "*) ;; *) echo started=no; exit 0 ;; esac',
            'case $n in "" | *[!0-9]*) echo started=no; exit 0 ;; esac',
            start,
        ]
    )


def probe_section(probe: str) -> str:
    """The launch's probe lines (`key=value`) as a section of their own."""
    return f"{probe.rstrip()}\necho '{SECTION}{PROBE}' 0"


class PlanCall:
    """One plan script running on `target`: `findings` (its output up to READY) once the checks are in,
    then exactly one of start() or cancel()."""

    def __init__(self, target: Target, script: str, *, timeout: float) -> None:
        self.target = target
        self._closed = False
        self._turns = _group.get() or SingleTurns()
        if not self._turns.acquire(target, timeout):
            raise CommandTimeout(f"no free SSH session for the launch script within {timeout:g}s", where=target.name)
        try:
            self._stream: Stream = target.stream(script, merge_stderr=True) if isinstance(target, PctTarget) else target.stream(script)
            self.findings = self._read(until=READY, timeout=timeout)
        except BaseException:
            self._close()
            raise

    def start(self, secrets: bytes, *, timeout: float) -> Result:
        """Answer `start N` + the secrets; the start script's output and exit code."""
        started = time.monotonic()
        try:
            self._stream.write(f"start {len(secrets)}\n".encode() + secrets)
            output = self._read(until=None, timeout=timeout)
            return Result("launch start", self._exit_code(), output, "", time.monotonic() - started)
        finally:
            self._close()

    def cancel(self) -> None:
        """Answer `no` (the script starts nothing and ends); idempotent, never raises."""
        if self._closed:
            return
        try:
            self._stream.write(b"no\n")
        except (DfoError, OSError):
            pass  # gone already: it starts nothing without an answer either
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if hasattr(self, "_stream"):
                self._stream.close()
        except (DfoError, OSError):
            pass
        finally:
            self._turns.release(self.target)

    def _read(self, *, until: str | None, timeout: float) -> str:
        """Output up to the line `until` (without it), or to the end when `until` is None."""
        deadline = time.monotonic() + timeout
        marker = f"\n{until}\n".encode() if until else None
        data = b"\n"
        while marker is None or marker not in data:
            remaining = deadline - time.monotonic()
            try:
                chunk = self._stream.read(timeout=max(remaining, 0.01)) if remaining > 0 else None
            except CommandTimeout:
                chunk = None
            if chunk is None:
                raise CommandTimeout(f"the launch script gave no {'findings' if until else 'start'} within {timeout:g}s",
                                     where=self.target.name)
            if not chunk:
                if until is None:
                    break
                self._ended_early(data[1:].decode(errors="replace"))
            data += chunk
        return (data.split(marker, 1)[0] if marker else data)[1:].decode(errors="replace")

    def _ended_early(self, output: str) -> None:
        result = Result("launch script", self._exit_code(), "", output, 0.0)
        if isinstance(self.target, PctTarget):
            self.target.raise_for_pct(result)  # ContainerNotRunning / ContainerMissing / no pct on the host
        raise RemoteError(f"the launch script ended before its checks: {result.tail(3) or f'exit {result.exit_code}'}",
                          where=self.target.name)

    def _exit_code(self) -> int:
        code = self._stream.wait_exit(EXIT_WAIT_S)
        return -1 if code is None else code


def connection_of(target: Target) -> Target:
    """The host Target whose connection `target`'s commands go over (a container's host, else itself)."""
    return target.inner if isinstance(target, PctTarget) else target


def _turn_on(target: Target) -> threading.BoundedSemaphore:
    """The semaphore of the connection `target` runs over (none to speak of on this machine)."""
    host = connection_of(target)
    size = 1_000 if isinstance(host, LocalTarget) else CALLS_PER_CONNECTION
    with _turns_lock:
        return _turns.setdefault(host, threading.BoundedSemaphore(size))


class SingleTurns:
    """A launch call's turn on its connection: taken for the call, given back when it ends."""

    def acquire(self, target: Target, timeout: float) -> bool:
        return _turn_on(target).acquire(timeout=timeout)

    def release(self, target: Target) -> None:
        _turn_on(target).release()


class GroupTurns:
    """The turns of one multi-node launch (one_turn_per_connection): each connection's turn taken by the group's
    first call over it and given back when its last one ends, so the group's calls over one connection (two
    containers of one Proxmox host) never wait on one another, as they did on main until the 130 s timeout."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}  # id(connection) -> the group's calls open over it

    def acquire(self, target: Target, timeout: float) -> bool:
        key = id(connection_of(target))
        if not self.held.get(key) and not _turn_on(target).acquire(timeout=timeout):
            return False
        self.held[key] = self.held.get(key, 0) + 1
        return True

    def release(self, target: Target) -> None:
        key = id(connection_of(target))
        self.held[key] -= 1
        if not self.held[key]:
            _turn_on(target).release()


@contextlib.contextmanager
def one_turn_per_connection(targets: Sequence[Target], names: Sequence[str]) -> Iterator[None]:
    """Launch calls made inside it (on this thread) share one turn per connection (GroupTurns): a multi-node
    launch prepares every node, each call waiting for dfo's word, before it starts any. Refused at once
    (RefusedError naming the fix) when more of `targets` (named `names`) share one SSH connection than it carries
    launch calls at once (GROUP_CALLS_PER_CONNECTION)."""
    per_connection: dict[int, list[str]] = {}
    for target, name in zip(targets, names):
        if not isinstance(connection_of(target), LocalTarget):
            per_connection.setdefault(id(connection_of(target)), []).append(name)
    for sharing in per_connection.values():
        if len(sharing) > GROUP_CALLS_PER_CONNECTION:
            raise RefusedError(f"{len(sharing)} nodes of one launch share one SSH connection ({', '.join(sharing)}): "
                               f"it carries {GROUP_CALLS_PER_CONNECTION} launch calls at once (OpenSSH's MaxSessions "
                               f"is 10, dfo keeps 8 for commands); nothing was started",
                               hint=f"give at most {GROUP_CALLS_PER_CONNECTION} containers of one host to one launch")
    token = _group.set(GroupTurns())
    try:
        yield
    finally:
        _group.reset(token)


@dataclass
class Opened:
    """A plan script waiting for dfo's word: the call, the preflight's rows (None without a gate), the probe."""

    call: PlanCall
    report: TargetReport | None
    probe: dict[str, str]


def open_plan(target: Target, gate: Gate | None, *, probe: str, start: str) -> Opened:
    """Run the plan script up to its findings. With a gate, its preflight refusing raises PreflightFailed
    (with every row; the script was told `no`). Without one, errors reaching the target propagate."""
    if gate is None:
        call = PlanCall(target, plan_script(probe_section(probe), start), timeout=PROBE_TIMEOUT_S)
        return Opened(call, None, probe_of(call.findings))
    checks = f"{inside_script(gate.spec, gate.nvidia_smi_timeout, torch_found=True)}\n{probe_section(probe)}"
    calls: list[PlanCall] = []

    def answer(container: Target) -> str:
        calls.append(PlanCall(container, plan_script(checks, start), timeout=inside_timeout(gate.nvidia_smi_timeout) + PROBE_TIMEOUT_S))
        return calls[0].findings

    host = target.inner if isinstance(target, PctTarget) else target
    report = report_for(gate.spec, host, target, answer, gate.nvidia_smi_timeout)
    refusals = gate.refusals(report)
    if refusals or not calls:
        for call in calls:
            call.cancel()
        raise PreflightFailed(report, refusals or [check for check in report.checks if not check.ok])
    return Opened(calls[0], report, probe_of(calls[0].findings))


def probe_of(findings: str) -> dict[str, str]:
    """The probe section's `key=value` lines; with a gate, `torch` comes from the preflight's python section
    (one interpreter answers both: the probe is then written with package.probe_script(..., torch=False))."""
    sections = split_sections(findings)
    probe = parse_probe(sections.get(PROBE, (1, ""))[1])
    if probe.get("python") == "ok" and "torch" not in probe and "python" in sections:
        probe["torch"] = parse_probe(sections["python"][1]).get("torch", "missing")
    return probe
