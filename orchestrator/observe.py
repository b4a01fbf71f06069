"""Watching containers from the workstation: one agent channel per container, turned into Observations.

An Observer keeps one long-lived channel (`target.stream(agent_cmd)`) to the agent in one container, tells it
which runs to follow (`follow()` may be called at any time, e.g. when a fallback launches a new run), and
puts Observations on a queue that several observers can share, so the watch loop multiplexes containers by
reading one queue (one reader thread per channel). It tracks each run's offset so a log line is reported
once, never twice, never lost: a partial last line is held back until its newline; after a dropped channel
(EOF, error, or no heartbeat for `heartbeat_timeout`) it reconnects with exponential backoff, re-follows from
the stored offsets and reports the gap. A PollObserver gives the same Observations from one `agent --once`
round trip per interval, for hosts where a long-lived channel is not wanted.

What it must not do: parse metric lines, decide anything, touch the store, or signal a run. Closing an
observer closes its channel (the agent then exits); the runs it watched keep running.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field

from orchestrator.agent.protocol import MAX_OFFSET, FrameDecoder, ProtocolError, Record, gpu_sample, read_number
from orchestrator.logfmt import MAX_TS
from orchestrator.errors import CommandTimeout, DfoError
from orchestrator.remote.base import Stream, Target
from orchestrator.words import counted, plural

MAX_PARTIAL_LINE = 1024 * 1024  # a "line" with no newline after this many bytes is reported as it is
READ_SLICE_S = 0.5  # how long one read waits, so close() and heartbeat checks are prompt

GPU_KEYS = ("index", "mem_used_mib", "mem_total_mib", "util_pct")
EXIT_CODES = (-(2**31), 2**31 - 1)

KINDS = ("connected", "lines", "truncated", "proc", "gpu", "gpu_error", "disconnected", "gap", "error")


@dataclass(frozen=True)
class Observation:
    """One thing dfo learnt about a container or one of its runs.

    kind:
      connected     the agent answered (data: its hello: version, pid, ts, python)
      lines         complete new log lines of `run` (lines, in order; offset: byte offset just past the last
                    one, which is where a later watch resumes; data: ident, the file's identity to store
                    with that offset)
      truncated     `run`'s log was truncated, replaced (rotated) or rewritten (truncated and regrown);
                    reading restarts at 0 (data: size, why, was: the offset reading had reached)
      proc          `run`'s process changed state (data: alive, exit_code or None, ended_at: the exit file's
                    mtime on the container's clock once it has one, else None)
      gpu           one GPU sample (data: ts, gpus: [{index, mem_used_mib, mem_total_mib, util_pct}])
      gpu_error     nvidia-smi failed or is missing (data: text, code)
      disconnected  the channel dropped; reconnecting (data: reason)
      gap           the channel is back after a drop (data: duration_s, the time without news)
      error         the agent or the byte stream reported a problem (data: text)
    """

    source: str
    kind: str
    run: str | None = None
    lines: tuple[str, ...] = ()
    offset: int | None = None
    data: dict = field(default_factory=dict)
    at: float = 0.0


@dataclass(frozen=True)
class FollowSpec:
    """What identifies a run to the agent: its log, exit file, PID and the PID's starttime."""

    run: str
    log: str
    exit: str | None = None
    pid: int | None = None
    starttime: int | None = None


class RunTracker:
    """One followed run on the workstation side: bytes consumed up to the last newline, the partial rest."""

    def __init__(self, spec: FollowSpec, offset: int, ident: dict | None = None) -> None:
        self.spec = spec
        self.consumed = offset  # byte offset just past the last complete line reported
        self.ident = ident  # the agent's identity of the file those bytes came from (device, inode, head hash)
        self.partial = b""  # bytes after `consumed` that do not yet end in a newline
        self.after_hole = False  # the agent skipped a hole: zeros that follow it are skipped too
        self.proc_state: tuple | None = None

    def follow_command(self) -> dict:
        """The agent command that resumes this run at its consumed offset (a held partial line is re-read),
        in the same file: the agent checks `ident` and starts again from 0 if the file is another one now."""
        self.partial = b""
        return {"cmd": "follow", **vars(self.spec), "offset": self.consumed, "ident": self.ident}

    def take(self, off: int, payload: bytes) -> tuple[list[str], str | None]:
        """Complete lines made by `payload` (starting at byte `off`), and a complaint if bytes were missed."""
        expected = self.consumed + len(self.partial)
        complaint = None
        if off < expected:  # already seen (a resend after a reconnect): keep only what is new
            payload = payload[expected - off :]
        elif off > expected:
            complaint = f"{self.spec.run}: {counted(off - expected, 'log byte')} at offset {expected} were never received"
            self.consumed, self.partial = off, b""
        if self.after_hole and payload:  # the zeros that pad a hole's last block are no text
            zeros = len(payload) - len(payload.lstrip(b"\0"))
            self.consumed, payload, self.after_hole = self.consumed + zeros, payload[zeros:], zeros == len(payload)
        return self.split_lines(self.partial + payload), complaint

    def skip(self, start: int, end: int) -> list[str]:
        """The agent skipped a hole from `start` to `end`: the partial line before it is a line of its own (when
        the hole began where reading had got to), and reading goes on at `end`."""
        before = self.partial.rstrip(b"\0") if start == self.consumed + len(self.partial) else b""
        lines = [before.decode("utf-8", errors="replace").rstrip("\r")] if before else []
        self.consumed, self.partial, self.after_hole = end, b"", True
        return lines

    def split_lines(self, data: bytes) -> list[str]:
        *complete, rest = data.split(b"\n")
        if len(rest) > MAX_PARTIAL_LINE:
            complete, rest = complete + [rest], b""
        self.consumed += len(data) - len(rest)
        self.partial = rest
        return [line.decode("utf-8", errors="replace").rstrip("\r") for line in complete]

    def restart(self) -> None:
        self.consumed, self.partial, self.ident, self.after_hole = 0, b"", None, False

    def proc_changed(self, alive: bool, exit_code: int | None) -> bool:
        changed = (alive, exit_code) != self.proc_state
        self.proc_state = (alive, exit_code)
        return changed


class ObserverBase:
    """What both observers share: the followed runs, the output queue, the background thread and the
    connected/disconnected bookkeeping that turns a drop into `disconnected` and then `gap`."""

    def __init__(self, target: Target, agent_cmd: list[str], *, sink: queue.Queue | None = None) -> None:
        self.target = target
        self.agent_cmd = list(agent_cmd)
        self.source = target.name
        self.observations: queue.Queue = sink if sink is not None else queue.Queue()
        self.runs: dict[str, RunTracker] = {}
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.connected = False
        self.last_news = time.time()  # when the channel last said anything
        self.lost_at: float | None = None  # last news before the current drop
        self.gpu_error: dict | None = None  # the last gpu_error reported, until a sample comes
        self.thread = threading.Thread(target=self._serve, name=f"observe-{self.source}", daemon=True)

    # -- public

    def start(self) -> "ObserverBase":
        self.thread.start()
        return self

    def follow(self, run: str, log: str, exit: str | None = None, pid: int | None = None,
               starttime: int | None = None, offset: int = 0, ident: dict | None = None) -> None:
        """Watch `run` from byte `offset` of its log (the offset of the last line already handled) if the log
        is still the file `ident` describes (as a `lines` observation gave it), else from 0."""
        with self.lock:
            self.runs[run] = RunTracker(FollowSpec(run, log, exit, pid, starttime), offset, ident)
            self._on_follow(self.runs[run].follow_command())

    def unfollow(self, run: str) -> None:
        with self.lock:
            if self.runs.pop(run, None) is not None:
                self._on_follow({"cmd": "unfollow", "run": run})

    def offsets(self) -> dict[str, int]:
        """Per run, the byte offset just past the last complete line reported (what to store to resume)."""
        with self.lock:
            return {run: tracker.consumed for run, tracker in self.runs.items()}

    def get(self, timeout: float | None = None) -> Observation | None:
        """The next Observation from this observer's queue, or None after `timeout` seconds."""
        try:
            return self.observations.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self, timeout: float = 5.0) -> None:
        """Stop watching (the runs keep running) and wait for the thread, which closes its channel within
        READ_SLICE_S. Idempotent."""
        self.stopping.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def __enter__(self) -> "ObserverBase":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- for subclasses

    def _serve(self) -> None:
        raise NotImplementedError

    def _on_follow(self, command: dict) -> None:
        """A follow/unfollow command was made (called with the lock held)."""

    def _resume_commands(self) -> list[dict]:
        with self.lock:
            return [tracker.follow_command() for tracker in self.runs.values()]

    def _emit(self, kind: str, run: str | None = None, **fields) -> None:
        self.observations.put(Observation(self.source, kind, run, at=time.time(), **fields))

    def _lost(self, reason: str) -> None:
        """The channel dropped or a round trip failed."""
        if self.connected or self.lost_at is None:
            self.lost_at = self.last_news
        self.connected = False
        self._emit("disconnected", data={"reason": reason})

    def _handle(self, record: Record) -> None:
        self.last_news = time.time()
        handler = getattr(self, "_on_" + record.type, None)
        if handler is None:
            return
        try:
            with self.lock:
                handler(record.header, record.payload)
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:  # a malformed record must not end the watch
            self._emit("error", data={"text": f"unreadable {record.type} record {str(record.header)[:300]}: {exc!r}"})

    def _on_hello(self, header: dict, payload: bytes | None) -> None:
        if self.connected:
            return
        self.connected = True
        self._emit("connected", data={**{k: v for k, v in header.items() if k != "t"}, "ts": _ts(header)})
        if self.lost_at is not None:
            self._emit("gap", data={"duration_s": round(self.last_news - self.lost_at, 3)})
            self.lost_at = None

    def _on_log(self, header: dict, payload: bytes | None) -> None:
        tracker = self.runs.get(header.get("run"))
        if tracker is None:
            return  # unfollowed while the record was on its way
        off = read_number(header.get("off"), 0, MAX_OFFSET, integer=True)
        if off is None:
            raise ValueError(f"off={str(header.get('off'))[:40]} is not an offset")
        skipped = _offset(header, "skipped")
        if skipped:  # a hole (sparse region) the agent skipped: it ends the line before it
            lines = tracker.skip(off - skipped, off)
            self._emit("error", tracker.spec.run, data={"text": (
                f"{tracker.spec.run}: a hole of {skipped:,} {plural(skipped, 'byte')} (a sparse region of zeros) at offset "
                f"{off - skipped:,} of the log was skipped, not read")})
            if lines:
                self._emit("lines", tracker.spec.run, lines=tuple(lines), offset=tracker.consumed,
                           data={"ident": tracker.ident})
            return
        lines, complaint = tracker.take(off, payload or b"")
        if isinstance(header.get("ident"), dict):
            tracker.ident = header["ident"]
        if complaint:
            self._emit("error", tracker.spec.run, data={"text": complaint})
        if lines:
            self._emit("lines", tracker.spec.run, lines=tuple(lines), offset=tracker.consumed,
                       data={"ident": tracker.ident})

    def _on_truncated(self, header: dict, payload: bytes | None) -> None:
        tracker = self.runs.get(header.get("run"))
        if tracker is not None:
            tracker.restart()
            self._emit("truncated", tracker.spec.run, data={"size": _offset(header, "size"), "why": header.get("why"),
                                                            "was": _offset(header, "was")})

    def _on_proc(self, header: dict, payload: bytes | None) -> None:
        tracker = self.runs.get(header.get("run"))
        alive, exit_code = bool(header.get("alive")), read_number(header.get("exit_code"), *EXIT_CODES, integer=True)
        if tracker is not None and tracker.proc_changed(alive, exit_code):
            ended_at = header.get("ended_at")
            self._emit("proc", tracker.spec.run, data={"alive": alive, "exit_code": exit_code,
                                                       "ended_at": ended_at if isinstance(ended_at, (int, float)) else None})

    def _on_gpu(self, header: dict, payload: bytes | None) -> None:
        self.gpu_error = None
        gpus = header.get("gpus") if isinstance(header.get("gpus"), list) else []
        samples = [gpu_sample([gpu.get(key) for key in GPU_KEYS]) for gpu in gpus if isinstance(gpu, dict)]
        self._emit("gpu", data={"ts": _ts(header), "gpus": [gpu for gpu in samples if gpu is not None]})

    def _on_gpu_error(self, header: dict, payload: bytes | None) -> None:
        error = {"text": header.get("text"), "code": read_number(header.get("code"), *EXIT_CODES, integer=True)}
        if error != self.gpu_error:  # poll mode repeats it every round trip; say it once
            self.gpu_error = error
            self._emit("gpu_error", data=error)

    def _on_error(self, header: dict, payload: bytes | None) -> None:
        tracker = self.runs.get(header.get("run"))  # about one run's log (no regular file), else the channel
        self._emit("error", tracker.spec.run if tracker else None, data={"text": header.get("text")})


class Observer(ObserverBase):
    """Streams from one long-lived agent channel, reconnecting with exponential backoff when it drops."""

    def __init__(self, target: Target, agent_cmd: list[str], *, sink: queue.Queue | None = None,
                 heartbeat_timeout: float = 5.0, backoff_initial: float = 0.5, backoff_max: float = 30.0) -> None:
        super().__init__(target, agent_cmd, sink=sink)
        self.heartbeat_timeout = heartbeat_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stream: Stream | None = None

    def _serve(self) -> None:
        delay = self.backoff_initial
        while not self.stopping.is_set():
            reason = self._one_connection()
            if self.stopping.is_set():
                return
            if self.connected:
                delay = self.backoff_initial  # it worked for a while: start the backoff afresh
            self._lost(reason)
            self.stopping.wait(delay)
            delay = min(delay * 2, self.backoff_max)

    def _one_connection(self) -> str:
        """Open the channel, re-follow every run, pump records until it drops; why it dropped."""
        try:
            stream = self.target.stream(self.agent_cmd)
        except DfoError as exc:
            return str(exc)
        try:
            with self.lock:
                self.stream = stream
                self._write(b"".join(encode_command(c) for c in self._resume_commands()))
            return self._pump(stream)
        finally:
            with self.lock:
                self.stream = None
            close_quietly(stream)

    def _pump(self, stream: Stream) -> str:
        decoder = FrameDecoder()
        last_data = time.monotonic()
        while not self.stopping.is_set():
            try:
                data = stream.read(65536, timeout=READ_SLICE_S)
            except CommandTimeout:
                if time.monotonic() - last_data > self.heartbeat_timeout:
                    return f"no heartbeat from the agent for {self.heartbeat_timeout:g} s"
                continue
            except DfoError as exc:
                return str(exc)
            if not data:
                close_quietly(stream)  # closing gives its exit status a moment to arrive (exit_code never waits)
                return f"agent channel closed (exit {stream.exit_code()})"
            last_data = time.monotonic()
            try:
                records = decoder.feed(data)
            except ProtocolError as exc:
                self._emit("error", data={"text": str(exc)})
                return str(exc)
            for record in records:
                self._handle(record)
        return "closed"

    def _on_follow(self, command: dict) -> None:
        if self.stream is not None:
            self._write(encode_command(command))

    def _write(self, data: bytes) -> None:
        """Send commands; a dead channel is noticed (and healed) by the reader, so failures are ignored."""
        if not data or self.stream is None:
            return
        try:
            self.stream.write(data)
        except (DfoError, OSError):
            pass


class PollObserver(ObserverBase):
    """The same Observations from one `agent --once` round trip per `interval` seconds."""

    def __init__(self, target: Target, agent_cmd: list[str], *, interval: float = 5.0,
                 sink: queue.Queue | None = None, round_trip_timeout: float = 30.0) -> None:
        super().__init__(target, agent_cmd, sink=sink)
        self.interval = interval
        self.round_trip_timeout = round_trip_timeout

    def _serve(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
            except (DfoError, ProtocolError) as exc:
                self._lost(str(exc))
            self.stopping.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def poll_once(self) -> None:
        """One round trip: the agent's snapshot for every followed run, handled as it arrives."""
        commands = [json.dumps(c) for c in self._resume_commands()]
        deadline = time.monotonic() + self.round_trip_timeout
        decoder = FrameDecoder()
        with self.target.stream(self.agent_cmd + ["--once", *commands]) as stream:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommandTimeout(f"agent --once gave no full answer in {self.round_trip_timeout:g} s",
                                         where=self.source)
                data = stream.read(65536, timeout=left)
                if not data:
                    break
                for record in decoder.feed(data):
                    self._handle(record)
        if decoder.pending:
            raise ProtocolError(f"agent --once ended inside a record ({counted(decoder.pending, 'byte')} left over)")


def _ts(header: dict) -> float | None:
    """A record's `ts`, through the one numeric check (None unless a time in 1970..9999)."""
    return read_number(header.get("ts"), 0, MAX_TS)


def _offset(header: dict, key: str) -> int | None:
    return read_number(header.get(key), 0, MAX_OFFSET, integer=True)


def encode_command(command: dict) -> bytes:
    return json.dumps(command, separators=(",", ":")).encode() + b"\n"


def close_quietly(stream: Stream) -> None:
    """Close a channel that is already given up on: its own failure to close changes nothing."""
    try:
        stream.close()
    except (DfoError, OSError, ValueError):
        pass
