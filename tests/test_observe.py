"""The workstation side of watching: the Observer and PollObserver over a real agent process (LocalTarget)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.agent import agent as agent_module
from orchestrator.errors import ConnectError
from orchestrator.observe import Observation, Observer, PollObserver
from orchestrator.remote.local import LocalTarget

AGENT_CMD = [sys.executable, agent_module.__file__]


class Collected:
    """Everything an observer reported, and waiting for something in particular."""

    def __init__(self, observer) -> None:
        self.observer = observer
        self.seen: list[Observation] = []

    def until(self, done, timeout: float = 5.0) -> list[Observation]:
        deadline = time.monotonic() + timeout
        while not done(self):
            assert time.monotonic() < deadline, f"never happened; last observations: {self.seen[-5:]}"
            observation = self.observer.get(timeout=0.1)
            if observation is not None:
                self.seen.append(observation)
        return self.seen

    def kinds(self, kind: str) -> list[Observation]:
        return [o for o in self.seen if o.kind == kind]

    def lines(self, run: str) -> list[str]:
        return [line for o in self.kinds("lines") if o.run == run for line in o.lines]


@pytest.fixture
def observe():
    """observe(observer) starts it and returns its Collected; every observer is closed at teardown."""
    started = []

    def start(observer) -> Collected:
        started.append(observer.start())
        return Collected(observer)

    yield start
    for observer in started:
        observer.close()


class LineWriter:
    """A thread appending `n` numbered lines to a log, one every `every` seconds, like a training run."""

    def __init__(self, log: Path, n: int, every: float) -> None:
        self.log, self.n, self.every = log, n, every
        self.thread = threading.Thread(target=self.write, daemon=True)

    def write(self) -> None:
        with open(self.log, "ab", buffering=0) as f:
            for i in range(self.n):
                f.write(b"step %d\n" % i)
                time.sleep(self.every)

    def expected(self) -> list[str]:
        return ["step %d" % i for i in range(self.n)]


def agent_gone(pid: int, timeout: float = 10.0) -> bool:
    """True once the agent `pid` has exited (gone, or a zombie awaiting its reaper) within `timeout`.

    A dropped channel's agent sees its stdin close only when the sshd process holding the pipe's other end
    goes; on a loaded machine that takes a moment, so the check waits rather than looking once. A pid
    reused by another program counts as gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return True
        if state == "Z" or agent_module.__file__.encode() not in cmdline:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def test_new_lines_reach_the_observer_within_a_second_and_partial_lines_wait(observe, tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"")
    seen = observe(Observer(LocalTarget("ct1"), AGENT_CMD))
    seen.observer.follow("r1", str(log))
    seen.until(lambda s: s.kinds("connected"))
    time.sleep(0.3)
    with open(log, "ab", buffering=0) as writer:
        written_at = time.time()
        writer.write(b"step 1 tok_s=5\nstep 2 ha")
        seen.until(lambda s: s.lines("r1"))
        assert seen.kinds("lines")[0].at - written_at < 1.0
        time.sleep(0.6)
        assert seen.lines("r1") == ["step 1 tok_s=5"]  # the half line is held back
        writer.write(b"lf\n\xff\xfe bad bytes\r\n")
    seen.until(lambda s: len(s.lines("r1")) == 3)
    assert seen.lines("r1") == ["step 1 tok_s=5", "step 2 half", "\ufffd\ufffd bad bytes"]
    assert seen.kinds("lines")[-1].offset == log.stat().st_size
    assert seen.observer.offsets() == {"r1": log.stat().st_size}


def test_a_killed_channel_reconnects_and_resumes_without_loss_or_duplicates(observe, tmp_path):
    log = tmp_path / "run.log"
    writer = LineWriter(log, n=150, every=0.02)
    seen = observe(Observer(LocalTarget("ct1"), AGENT_CMD, backoff_initial=0.2))
    seen.observer.follow("r1", str(log))
    writer.thread.start()
    for drop in range(2):
        seen.until(lambda s: len(s.kinds("connected")) == drop + 1)
        time.sleep(0.6)
        os.kill(seen.kinds("connected")[-1].data["pid"], signal.SIGKILL)  # the channel dies mid-stream
    seen.until(lambda s: len(s.lines("r1")) >= writer.n, timeout=15)
    assert seen.lines("r1") == writer.expected()
    gaps = seen.kinds("gap")
    assert len(gaps) == 2 and all(0 < g.data["duration_s"] < 5 for g in gaps)
    assert len(seen.kinds("disconnected")) == 2


def test_a_silent_channel_is_taken_as_dead_after_missing_heartbeats(observe, tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"before\n")
    seen = observe(Observer(LocalTarget("ct1"), AGENT_CMD, heartbeat_timeout=1.5, backoff_initial=0.1))
    seen.observer.follow("r1", str(log))
    seen.until(lambda s: s.lines("r1"))
    os.kill(seen.kinds("connected")[0].data["pid"], signal.SIGSTOP)  # a hung channel: open, but silent
    with open(log, "ab") as f:
        f.write(b"during\n")
    seen.until(lambda s: len(s.kinds("connected")) == 2, timeout=8)
    assert "no heartbeat" in seen.kinds("disconnected")[0].data["reason"]
    seen.until(lambda s: len(s.lines("r1")) == 2)
    assert seen.lines("r1") == ["before", "during"]


class FlakyTarget(LocalTarget):
    """A LocalTarget whose first `failures` stream() calls fail the way an unreachable host does."""

    def __init__(self, failures: int) -> None:
        super().__init__("flaky")
        self.failures = failures
        self.attempts: list[float] = []

    def stream(self, cmd):
        self.attempts.append(time.monotonic())
        if len(self.attempts) <= self.failures:
            raise ConnectError("connection refused", where=self.name)
        return super().stream(cmd)


def test_connect_failures_are_retried_with_growing_backoff(observe, tmp_path):
    target = FlakyTarget(failures=3)
    seen = observe(Observer(target, AGENT_CMD, backoff_initial=0.1, backoff_max=1.0))
    seen.until(lambda s: s.kinds("connected"), timeout=5)
    waits = [b - a for a, b in zip(target.attempts, target.attempts[1:])]
    assert waits == sorted(waits) and waits[-1] >= 0.35
    assert [o.data["reason"] for o in seen.kinds("disconnected")] == ["flaky: connection refused"] * 3


def test_runs_can_be_followed_while_watching_and_resume_from_stored_offsets(observe, tmp_path):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_bytes(b"a1\na2\n")
    second.write_bytes(b"b1\nb2\nb3\n")
    seen = observe(Observer(LocalTarget("ct1"), AGENT_CMD))
    seen.observer.follow("a", str(first))
    seen.until(lambda s: len(s.lines("a")) == 2)
    seen.observer.follow("b", str(second), offset=3)  # a fallback run, its first line handled earlier
    seen.until(lambda s: len(s.lines("b")) == 2)
    assert seen.lines("b") == ["b2", "b3"]
    seen.observer.unfollow("a")
    time.sleep(0.3)
    with open(first, "ab") as f:
        f.write(b"a3\n")
    time.sleep(0.8)
    assert seen.lines("a") == ["a1", "a2"]


def test_a_truncated_log_restarts_from_zero_with_an_event(observe, tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"first life 1\nfirst life 2\n")
    seen = observe(Observer(LocalTarget("ct1"), AGENT_CMD))
    seen.observer.follow("r1", str(log))
    seen.until(lambda s: len(s.lines("r1")) == 2)
    log.write_bytes(b"second life\n")
    seen.until(lambda s: len(s.lines("r1")) == 3)
    assert seen.kinds("truncated")[0].data == {"size": 12, "why": "truncated", "was": 26}
    assert seen.lines("r1")[-1] == "second life"


def test_poll_mode_reports_the_same_lines_and_the_exit(observe, tmp_path):
    log, exit_file = tmp_path / "run.log", tmp_path / "run.exit"
    writer = LineWriter(log, n=40, every=0.02)
    seen = observe(PollObserver(LocalTarget("ct1"), AGENT_CMD, interval=0.4))
    seen.observer.follow("r1", str(log), exit=str(exit_file))
    writer.thread.start()
    writer.thread.join(10)
    exit_file.write_text("1\n")
    seen.until(lambda s: s.kinds("proc") and s.kinds("proc")[-1].data["exit_code"] == 1)
    seen.until(lambda s: len(s.lines("r1")) >= writer.n)
    assert seen.lines("r1") == writer.expected()
    # a state is reported when it changes: "not alive, no exit status yet" (unless the load delays the first
    # poll past the exit file), then the exit status, once
    reports = [o.data for o in seen.kinds("proc")]
    assert reports[-1] == {"alive": False, "exit_code": 1, "ended_at": exit_file.stat().st_mtime}  # when it ended
    assert reports[:-1] in ([], [{"alive": False, "exit_code": None, "ended_at": None}]), reports
    assert len(seen.kinds("connected")) == 1 and len(seen.kinds("gpu_error")) == 1
