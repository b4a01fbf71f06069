#!/usr/bin/env python3
"""dfo's watch agent: runs inside a container while dfo watches, speaks framed records on stdout.

Shipped into containers as `dfo_agent.py` inside the trainer package and started over the kept-open
channel (`python3 dfo_agent.py`). It follows the watched logs from the offsets dfo gives it, reports a
run's process state (identity-checked by /proc/PID/stat starttime) and its exit file, samples the GPUs
with ONE long-lived `nvidia-smi -lms 1000`, and sends a heartbeat every second. Commands arrive on stdin,
one JSON object per line: {"cmd": "follow", "run", "log", "exit", "pid", "starttime", "offset", "ident"}
and {"cmd": "unfollow", "run"}. `ident` is the file identity the agent last reported with the bytes up to
`offset` (device, inode, hash of the first bytes): a log copytruncated, rotated or truncated and regrown
since is read again from 0 after a `truncated` record, never resumed at a stale offset. Only a regular file is
read (opened non-blocking: a FIFO at the path is named in an `error` record, never waited on), and a hole
(sparse region) in it is skipped, not read as zeros. `--once CMD...` prints one snapshot for the follow commands given as arguments
(`--once -`: read them from stdin) and exits: that is poll mode's single round trip.

What it must not do: import anything outside the standard library (it runs on whatever python3 the
container has, 3.8 or newer, as one file), open a port, spawn a process per update, or outlive dfo: when
stdin closes it kills its sampler and exits.

The record framing lives here because this file must stand alone; orchestrator/agent/protocol.py
re-exports `encode_record` and holds the decoder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import selectors
import signal
import stat
import subprocess
import sys
import time

AGENT_VERSION = 1
MAX_LOG_CHUNK = 64 * 1024  # bytes per `log` record: a flood arrives as many small records
HEAD_BYTES = 4096  # a log is identified by device, inode and the hash of (up to) this many first bytes
HOLE_MIN = MAX_LOG_CHUNK  # a sparse region this long (or longer) is skipped, never read as zeros
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY  # a FIFO at the log's path must not block the agent
FLOOD_BUDGET = 1024 * 1024  # bytes per run per tick: the rest waits a tick, so heartbeats keep flowing
ONCE_BUDGET = 8 * 1024 * 1024  # bytes per run in one --once snapshot; the next poll continues
TICK_S = 0.25
HEARTBEAT_S = 1.0
GPU_RETRY_S = 30.0
GPU_STALE_S = 15.0  # a sampler silent this long is taken as wedged
GPU_ONCE_TIMEOUT_S = 10.0
GPU_QUERY = "index,memory.used,memory.total,utilization.gpu"
GPU_SAMPLER = ["nvidia-smi", "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits", "-lms", "1000"]
GPU_ONCE = ["nvidia-smi", "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits"]


NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
MAX_NUMBER_CHARS = 100  # no meaningful figure is longer; int() of thousands of digits is slow or refused


def read_number(value, low: float, high: float, integer: bool = False):
    """The one numeric check for figures from outside dfo: a log line's fields (step, tok_s, ts, steps=),
    nvidia-smi's values, the agent protocol's numbers. `value` is text (ASCII digits only: no `²`, no other
    script's digits, no `_`; at most MAX_NUMBER_CHARS) or a JSON number; the result is finite, within
    low..high, and an int when `integer` (a float with no fraction counts). None for anything else: the
    caller counts the line as malformed, or the figure as unknown. Never raises."""
    if isinstance(value, str):
        text = value.strip()
        if len(text) > MAX_NUMBER_CHARS or not NUMBER_RE.fullmatch(text):
            return None
        number = int(text) if integer and text.lstrip("+-").isdigit() else float(text)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    else:
        return None
    if isinstance(number, float):
        if not math.isfinite(number) or (integer and not number.is_integer()):
            return None
        number = int(number) if integer else number
    elif not integer:
        if abs(number) > 2**1023:  # beyond any float: float() would raise
            return None
        number = float(number)
    return number if low <= number <= high else None


def encode_record(header: dict, payload: bytes | None = None) -> bytes:
    """One record: a JSON header line, then exactly header["len"] raw bytes when there is a payload."""
    if payload is not None:
        header = dict(header, len=len(payload))
    line = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii") + b"\n"
    return line + payload if payload is not None else line


# ---------------------------------------------------------------- process identity


MAX_PID = 2**22  # Linux's pid_max ceiling
MAX_OFFSET = 2**63 - 1  # a file offset (off_t)


def optional_int(value, high: int) -> int | None:
    """A command's optional integer field (pid, starttime): None when absent, ValueError when not 0..high."""
    if value is None:
        return None
    number = read_number(value, 0, high, integer=True)
    if number is None:
        raise ValueError("expected an integer in 0..%d, got %.40r" % (high, value))
    return number


def read_proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, starttime in clock ticks) of a live PID, or None if there is no such process."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[19])


def pid_is_run(pid: int | None, starttime: int | None) -> bool:
    """Whether PID still is the run's process: alive, not a zombie, and (if known) started when the run did."""
    if pid is None:
        return False
    stat = read_proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return starttime is None or stat[1] == starttime


def read_exit_code(path: str | None) -> int | None:
    """The integer in the run's exit file, or None while the file is absent or still empty."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            text = f.read().strip()
    except OSError:
        return None
    return read_number(text.decode("ascii", "replace"), -(2**31), 2**31 - 1, integer=True)


# ---------------------------------------------------------------- following one run


def head_digest(fd: int, size: int) -> str | None:
    """sha256 (hex) of the first `size` bytes of the open file, or None if it has fewer or cannot be read."""
    try:
        data = os.pread(fd, size, 0)
    except OSError:
        return None
    return hashlib.sha256(data).hexdigest() if len(data) == size else None


def log_ident(fd: int, offset: int) -> dict:
    """What identifies the open file read up to `offset`: device, inode, and the hash of its first bytes (up
    to HEAD_BYTES, never past what was read), so a copytruncate, a rotation or a truncate-and-regrow is told
    from the same file having grown."""
    st = os.fstat(fd)
    head = min(offset, HEAD_BYTES)
    return {"dev": st.st_dev, "ino": st.st_ino, "head": head, "sha": head_digest(fd, head) if head else None}


def file_kind(mode: int) -> str:
    """`a FIFO`, `a directory`, ...: what a path that is no regular file is."""
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def same_file(fd: int, st: os.stat_result | None) -> bool:
    if st is None:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


class Follow:
    """One watched run: where its log has been read to, which file that was (held open, as `tail -F` does),
    and the process state last reported."""

    def __init__(self, cmd: dict) -> None:
        self.run = str(cmd["run"])
        self.log = str(cmd["log"])
        self.exit = cmd.get("exit")
        self.pid = optional_int(cmd.get("pid"), MAX_PID)
        self.starttime = optional_int(cmd.get("starttime"), MAX_OFFSET)
        self.offset = optional_int(cmd.get("offset"), MAX_OFFSET) or 0
        ident = cmd.get("ident")
        self.ident: dict | None = ident if isinstance(ident, dict) else None  # of the file read up to offset
        self.fd: int | None = None  # that file, open
        self.reported: tuple | None = None
        self.problem: str | None = None  # why the log's path cannot be read now (said once, in an `error`)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except (OSError, TypeError):  # TypeError: os is gone at interpreter exit
                pass

    def changed(self, st: os.stat_result) -> str | None:
        """Why the file at the log's path is no longer the one read up to the offset (None: it is). Called
        with that file open when it has the identity's device and inode."""
        ident = self.ident
        if ident is not None and (ident.get("dev"), ident.get("ino")) != (st.st_dev, st.st_ino):
            return "replaced"
        if st.st_size < self.offset:
            return "truncated"
        if ident is None:
            return None
        head = ident.get("head") or 0
        if head and (self.fd is None or head_digest(self.fd, head) != ident.get("sha")):
            return "rewritten"
        return None

    def log_records(self, budget: int) -> list[bytes]:
        """Records for what the log gained since the offset (at most `budget` bytes). When the path names
        another file now (rotated), the old one is read to its end first, for as long as the new one is
        empty (a trainer that never reopens its log goes on writing there); then, as when the file was
        truncated or rewritten, a `truncated` record and the new file from 0."""
        try:
            st: os.stat_result | None = os.stat(self.log)
        except OSError:
            st = None
        if self.fd is not None and not same_file(self.fd, st):
            records = self.read_chunks(budget)
            if records or st is None or st.st_size == 0:
                return records
            self.close()
        if st is None:
            return []
        records = self.problem_records(st)
        if records or not self.open(st):
            return records
        why = self.changed(st)
        if why:
            records.append(encode_record({"t": "truncated", "run": self.run, "size": st.st_size, "why": why,
                                          "was": self.offset}))
            self.offset, self.ident = 0, None
        if self.ident is None or self.ident["head"] < min(self.offset, HEAD_BYTES):
            self.ident = log_ident(self.fd, self.offset)
        if st.st_size > self.offset:
            records.extend(self.read_chunks(min(st.st_size - self.offset, budget)))
        return records

    def problem_records(self, st: os.stat_result) -> list[bytes]:
        """An `error` record naming the problem when the log's path is no regular file (a FIFO would block
        open(), a device or a directory is no log), once per change of it; nothing is read from it."""
        problem = None if stat.S_ISREG(st.st_mode) else "is %s, not a regular file: not read" % file_kind(st.st_mode)
        if problem == self.problem:
            return []
        self.problem = problem
        if problem is None:
            return []
        return [encode_record({"t": "error", "run": self.run, "text": "%s: the log %s" % (self.run, problem)})]

    def open(self, st: os.stat_result) -> bool:
        """Hold the file the path names (the one `st` describes); False if it cannot be opened as that file.
        Opened non-blocking, and checked to be a regular file again once open (the path may change between)."""
        if self.fd is not None:
            return True
        try:
            fd = os.open(self.log, OPEN_FLAGS)
        except OSError:
            return False  # unreadable for now (permissions, removed meanwhile): the next tick retries
        if not same_file(fd, st) or not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)  # replaced between stat and open: the next tick sees the new one
            return False
        self.fd = fd
        return True

    def next_data(self) -> int:
        """Where the next bytes worth reading begin: the offset, or past a hole (a sparse region, which reads
        as zeros) of at least HOLE_MIN bytes; a filesystem that cannot tell (no SEEK_DATA) has none."""
        try:
            data = os.lseek(self.fd, self.offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                return self.offset
            data = os.fstat(self.fd).st_size  # a hole from here to the end
        except AttributeError:  # no SEEK_DATA on this platform
            return self.offset
        return data if data - self.offset >= HOLE_MIN else self.offset

    def read_chunks(self, want: int) -> list[bytes]:
        records = []
        try:
            while want > 0:
                data_at = self.next_data()
                if data_at > self.offset:  # said in a record of its own, and not counted against `want`
                    records.append(encode_record({"t": "log", "run": self.run, "off": data_at, "ident": self.ident,
                                                  "skipped": data_at - self.offset}, b""))
                    self.offset = data_at
                data = os.pread(self.fd, min(want, MAX_LOG_CHUNK, self.data_end()), self.offset)
                if not data:
                    break
                self.offset += len(data)
                want -= len(data)
                if self.ident is None or self.ident["head"] < HEAD_BYTES:
                    self.ident = log_ident(self.fd, self.offset)
                records.append(encode_record({"t": "log", "run": self.run, "off": self.offset - len(data),
                                              "ident": self.ident}, data))
        except OSError:
            pass  # an I/O error: the next tick retries
        return records

    def data_end(self) -> int:
        """How many bytes from the offset are data before the next hole (a large number where unknown)."""
        try:
            hole = os.lseek(self.fd, self.offset, os.SEEK_HOLE)
        except (OSError, AttributeError):
            return MAX_LOG_CHUNK
        return hole - self.offset if hole > self.offset else MAX_LOG_CHUNK

    def proc_record(self, always: bool = False) -> bytes | None:
        """A `proc` record when the run's state changed since the last one (or always, for a snapshot)."""
        exit_code = read_exit_code(self.exit)
        alive = exit_code is None and pid_is_run(self.pid, self.starttime)
        if not alive and exit_code is None:
            exit_code = read_exit_code(self.exit)  # the wrapper writes it just before its PID goes away
        state = (alive, exit_code)
        if state == self.reported and not always:
            return None
        self.reported = state
        record = {"t": "proc", "run": self.run, "alive": alive, "exit_code": exit_code}
        if exit_code is not None:  # when the run ended: the exit file's mtime (the wrapper wrote it as it ended)
            try:
                record["ended_at"] = os.stat(self.exit).st_mtime
            except OSError:
                pass
        return encode_record(record)


# ---------------------------------------------------------------- GPU sampling


GPU_RANGES = {"index": 1023, "mem_used_mib": 2**40, "mem_total_mib": 2**40, "util_pct": 100}  # 0..this


def gpu_sample(values) -> dict | None:
    """{index, mem_used_mib, mem_total_mib, util_pct} from four raw values (nvidia-smi's text or the agent's
    JSON numbers), each through read_number: a value out of range or unreadable ([N/A], `inf`, garbage) is
    None (unknown); None for the whole sample when its index is, or when there are not four values."""
    if len(values) != len(GPU_RANGES):
        return None
    gpu = {key: read_number(value, 0, high) for (key, high), value in zip(GPU_RANGES.items(), values)}
    if gpu["index"] is None or not gpu["index"].is_integer():
        return None
    return {key: None if value is None else int(value) for key, value in gpu.items()}


def parse_gpu_line(line: str) -> dict | None:
    """`0, 1024, 143771, 37` -> {index, mem_used_mib, mem_total_mib, util_pct}; None if not such a line."""
    return gpu_sample(line.split(","))


def gpu_record(gpus: list) -> bytes:
    return encode_record({"t": "gpu", "ts": time.time(), "gpus": gpus})


def gpu_error_record(text: str, code: int | None) -> bytes:
    return encode_record({"t": "gpu_error", "text": text.strip()[:500] or "nvidia-smi failed", "code": code})


def kill_with_parent() -> None:
    """In the sampler's child: ask Linux to SIGKILL it if the agent dies without cleaning up."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class GpuSampler:
    """The one long-lived nvidia-smi: lines become `gpu` records, failures a rare retry and a `gpu_error`."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.buffer = b""
        self.group: list = []
        self.group_at = 0.0
        self.last_sample = 0.0
        self.junk: list = []
        self.retry_at = 0.0

    def start(self, now: float) -> bytes | None:
        """Start nvidia-smi if it is not running and a retry is due; a `gpu_error` if it cannot start."""
        if self.proc is not None or now < self.retry_at:
            return None
        self.buffer, self.group, self.junk = b"", [], []
        try:
            self.proc = subprocess.Popen(
                GPU_SAMPLER, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                preexec_fn=kill_with_parent,
            )
        except OSError as exc:
            self.retry_at = now + GPU_RETRY_S
            return gpu_error_record("cannot start nvidia-smi: %s" % exc.strerror, 127)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.last_sample = now
        return None

    def fileno(self) -> int | None:
        return self.proc.stdout.fileno() if self.proc is not None else None

    def on_readable(self, now: float) -> list[bytes]:
        """Read what nvidia-smi printed; at EOF, reap it and report why it stopped."""
        try:
            data = os.read(self.fileno(), 65536)
        except BlockingIOError:
            return []
        if not data:
            return self.stopped(now)
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        records = []
        for raw in lines:
            records.extend(self.on_line(raw.decode("utf-8", "replace"), now))
        return records

    def on_line(self, line: str, now: float) -> list[bytes]:
        if not line.strip():
            return []
        gpu = parse_gpu_line(line)
        if gpu is None:
            self.junk = self.junk[-4:] + [line.strip()[:200]]  # what it said last, for the gpu_error
            return []
        records = []
        if self.group and gpu["index"] <= self.group[-1]["index"]:
            records.append(self.flush())  # the index went back: a new sample began
        if not self.group:
            self.group_at = now
        self.group.append(gpu)
        self.last_sample = now
        return records

    def flush(self) -> bytes:
        record, self.group = gpu_record(self.group), []
        return record

    def on_tick(self, now: float) -> list[bytes]:
        """Finish a sample whose lines all arrived; report and stop a sampler that went silent."""
        if self.group and now - self.group_at >= TICK_S:
            return [self.flush()]
        if self.proc is not None and now - self.last_sample > GPU_STALE_S:
            self.stop()
            self.retry_at = now + GPU_RETRY_S
            return [gpu_error_record("nvidia-smi gave no sample for %d s (wedged driver?)" % GPU_STALE_S, None)]
        return []

    def stopped(self, now: float) -> list[bytes]:
        code = self.proc.wait(timeout=5)
        self.proc.stdout.close()
        self.proc = None
        self.retry_at = now + GPU_RETRY_S
        records = [self.flush()] if self.group else []
        text = " ".join(self.junk) or "nvidia-smi exited"
        return records + [gpu_error_record(text, code)]

    def stop(self) -> None:
        """Kill the sampler and reap it. Idempotent."""
        if self.proc is None:
            return
        self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # stuck in the driver; PDEATHSIG or init reaps it
        self.proc.stdout.close()
        self.proc = None


def gpu_snapshot() -> bytes:
    """One nvidia-smi sample with a timeout, for --once."""
    try:
        done = subprocess.run(
            GPU_ONCE, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            timeout=GPU_ONCE_TIMEOUT_S,
        )
    except OSError as exc:
        return gpu_error_record("cannot start nvidia-smi: %s" % exc.strerror, 127)
    except subprocess.TimeoutExpired:
        return gpu_error_record("nvidia-smi gave no answer in %d s (wedged driver?)" % GPU_ONCE_TIMEOUT_S, None)
    text = done.stdout.decode("utf-8", "replace")
    gpus = [parse_gpu_line(line) for line in text.splitlines() if line.strip()]
    if done.returncode != 0 or not gpus or None in gpus:
        return gpu_error_record(text, done.returncode)
    return gpu_record(gpus)


# ---------------------------------------------------------------- the agent


def hello_record() -> bytes:
    return encode_record(
        {"t": "hello", "version": AGENT_VERSION, "pid": os.getpid(), "ts": time.time(),
         "python": "%d.%d" % sys.version_info[:2]}
    )


class Agent:
    """The streaming agent: commands in on stdin, records out on stdout, until stdin closes."""

    def __init__(self, stdin_fd: int, out) -> None:
        self.stdin_fd = stdin_fd
        self.out = out
        self.follows: dict = {}
        self.sampler = GpuSampler()
        self.selector = selectors.DefaultSelector()
        self.sampler_fd: int | None = None
        self.command_buffer = b""
        self.next_heartbeat = 0.0

    def send(self, records: list) -> None:
        if records:
            self.out.write(b"".join(r for r in records if r))
            self.out.flush()

    def run(self) -> int:
        self.selector.register(self.stdin_fd, selectors.EVENT_READ)
        try:
            self.send([hello_record()])
            while self.step():
                pass
        except (BrokenPipeError, ConnectionResetError):
            pass  # dfo went away mid-write: same as stdin closing
        finally:
            self.sampler.stop()
        return 0

    def step(self) -> bool:
        """One turn of the loop; False once stdin closed."""
        now = time.time()
        self.send([self.sampler.start(now)])
        self.watch_sampler_fd()
        backlog = self.send_progress(now)
        for key, _ in self.selector.select(0 if backlog else TICK_S):
            if key.fd == self.stdin_fd:
                if not self.read_commands():
                    return False
            else:
                self.send(self.sampler.on_readable(time.time()))
        self.watch_sampler_fd()  # a sampler that stopped leaves the selector before its fd number is reused
        return True

    def watch_sampler_fd(self) -> None:
        fd = self.sampler.fileno()
        if fd == self.sampler_fd:
            return
        if self.sampler_fd is not None:
            self.selector.unregister(self.sampler_fd)
        if fd is not None:
            self.selector.register(fd, selectors.EVENT_READ)
        self.sampler_fd = fd

    def send_progress(self, now: float) -> bool:
        """Log bytes, process changes, finished GPU samples and the heartbeat; True if a log has more."""
        records = []
        backlog = False
        for follow in list(self.follows.values()):
            records.extend(follow.log_records(FLOOD_BUDGET))
            records.append(follow.proc_record())
            backlog = backlog or self.has_more(follow)
        records.extend(self.sampler.on_tick(now))
        if now >= self.next_heartbeat:
            records.append(encode_record({"t": "hb", "ts": now}))
            self.next_heartbeat = now + HEARTBEAT_S
        self.send(records)
        return backlog

    @staticmethod
    def has_more(follow: Follow) -> bool:
        try:
            return os.stat(follow.log).st_size > follow.offset
        except OSError:
            return False

    def read_commands(self) -> bool:
        data = os.read(self.stdin_fd, 65536)
        if not data:
            return False
        self.command_buffer += data
        *lines, self.command_buffer = self.command_buffer.split(b"\n")
        self.send([self.apply(line) for line in lines if line.strip()])
        return True

    def apply(self, line: bytes) -> bytes | None:
        """Carry out one command line; an `error` record if it is not one."""
        try:
            cmd = json.loads(line)
            if cmd["cmd"] == "follow":
                self.follows[str(cmd["run"])] = Follow(cmd)
            elif cmd["cmd"] == "unfollow":
                self.follows.pop(str(cmd["run"]), None)
            else:
                raise ValueError("unknown command %r" % cmd["cmd"])
        except (ValueError, KeyError, TypeError) as exc:
            return encode_record({"t": "error", "text": "bad command %r: %s" % (line[:200], exc)})
        return None


def snapshot(commands: list) -> list:
    """--once: hello, each followed run's new log bytes and process state, one GPU sample."""
    records = [hello_record()]
    for line in commands:
        try:
            follow = Follow(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            records.append(encode_record({"t": "error", "text": "bad command %r: %s" % (line[:200], exc)}))
            continue
        records.extend(follow.log_records(ONCE_BUDGET))
        records.append(follow.proc_record(always=True))
    records.append(gpu_snapshot())
    return records


def exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through Agent.run's finally, which kills the sampler


def main(argv: list) -> int:
    out = sys.stdout.buffer
    if argv[:1] == ["--once"]:
        commands = argv[1:]
        if commands == ["-"]:
            commands = [line for line in sys.stdin.read().splitlines() if line.strip()]
        out.write(b"".join(snapshot(commands)))
        out.flush()
        return 0
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, exit_on_signal)
    return Agent(sys.stdin.fileno(), out).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
