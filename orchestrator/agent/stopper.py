"""dfo's stop program: runs inside the container for one `dfo stop`, checks the run's identity and signals it.

Sent by orchestrator/runs.py as `PYTHON -c SOURCE --pid PID --starttime TICKS --exit-file FILE --grace S` over
one stream (no file is left behind). The identity check and every signal happen in this one process, so a PID
the kernel gives to another process between them is never signalled:

1. It opens a pidfd on PID (where the kernel and Python have them: Linux 5.3, Python 3.9), then reads the
   process's /proc/PID/stat and cmdline: its start time must be the recorded one and its command line must
   name the run's exit file (the wrapper's). It prints `identity=ok|gone|reused` (with `started=` and
   `cmdline=`), and with `ok` waits for dfo's word on stdin: `stop` (dfo recorded the stop request) or end of
   input (dfo went away: nothing is signalled; `signal=withheld`). The pidfd is held meanwhile, so however long
   dfo takes, what is signalled is still the process that was checked.
2. The wrapper (the group's leader) alone in its group is writing the run's exit status, or, right after a
   launch, about to start the run: it gets SETTLE_S to do either, and a run that ended is never signalled
   (`signal=none`).
3. SIGTERM goes to the run's process group: through the leader's pidfd with PIDFD_SIGNAL_PROCESS_GROUP (Linux
   6.9), which reaches only the group of the process whose identity was checked, whatever became of the PID
   number since; elsewhere by the PID number, right after a look that the number is still the run's (its start
   time again), racing only within microseconds. `term=sent`, then `waiting=SECONDS` about every second until
   the group is gone (`signal=TERM`) or `--grace` is over: then SIGKILL the same way (`signal=KILL`).
   End of input while it waits (dfo interrupted, or its connection gone) ends this program and nothing more is
   signalled: the run goes on checkpointing, and no SIGKILL follows.
4. `exit=` the run's exit file, read last.

A group is the run's while its leader is the run's process (the pidfd answers; by number: the start time
matches) or no process holds the PID number at all: the kernel does not give a number out while a group still
uses it as its ID, so processes in group PID are then the run's own, left behind by its leader.

What it must not do: import anything outside the standard library (it runs on the container's python, 3.8 or
newer), signal anything before its identity check passed and dfo said `stop`, or outlive dfo's stream.
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import signal
import sys
import time

SETTLE_S = 10.0  # how long a wrapper alone in its group gets (runs.KILL_SETTLE_S)
POLL_S = 0.2
FIRST_POLL_S = 0.01
SAY_EVERY_S = 1.0
WORD_TIMEOUT_S = 150.0  # how long it waits for dfo's word (longer than faults.PAUSE_MAX_S, a test's pause)
PIDFD_SIGNAL_PROCESS_GROUP = 4  # linux/pidfd.h, Linux 6.9


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def stat_fields(stat: str) -> list:
    """/proc/PID/stat fields 3.. (the comm field may hold spaces and parentheses)."""
    return stat.rpartition(")")[2].split()


def starttime(stat: str):
    fields = stat_fields(stat)
    return int(fields[19]) if len(fields) > 19 else None


def live(stat: str) -> bool:
    fields = stat_fields(stat)
    return bool(fields) and fields[0] not in ("Z", "X")


def open_pidfd(pid: int):
    """A pidfd on PID, or None where there are none (old Python or kernel) or no such process."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def pidfd_alive(fd) -> bool:
    try:
        signal.pidfd_send_signal(fd, 0)
    except OSError:
        return False
    return True


class Run:
    """The run's process group: PID with its recorded start time, and the pidfd on it when there is one."""

    def __init__(self, pid: int, started, fd) -> None:
        self.pid, self.started, self.fd = pid, started, fd
        self.group_flag = fd is not None  # PIDFD_SIGNAL_PROCESS_GROUP: until the kernel says it lacks it

    def holds_number(self):
        """True: PID is still the run's leader; False: another process has the number; None: nobody does."""
        stat = read_text("/proc/%d/stat" % self.pid)
        if not stat:
            return None
        return starttime(stat) == self.started

    def members(self) -> list:
        """Live processes of the run's group."""
        if self.holds_number() is False:
            return []  # the number is another process's now: the run's group is gone
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            stat = read_text("/proc/%s/stat" % entry)
            fields = stat_fields(stat)
            if len(fields) > 2 and fields[2] == str(self.pid) and live(stat):
                found.append(int(entry))
        return found

    def signal(self, sig: int) -> bool:
        """Signal the run's group; False if it is gone."""
        if self.group_flag:
            try:
                signal.pidfd_send_signal(self.fd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
                return True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    return False  # ESRCH: no process is left in the group of the process the pidfd names
                self.group_flag = False  # a kernel before 6.9
        if not self.members():
            return False
        try:
            os.killpg(self.pid, sig)  # microseconds after the look that the group is still the run's
        except OSError:
            return False
        return True


def identify(pid: int, started, exit_file: str):
    """(identity, stat, cmdline, Run or None): `ok`, `gone` (ended before or while it looked) or `reused`."""
    fd = open_pidfd(pid)
    stat = read_text("/proc/%d/stat" % pid)
    cmdline = read_text("/proc/%d/cmdline" % pid).replace("\0", " ").replace("\n", " ")
    now = starttime(stat)
    again = read_text("/proc/%d/stat" % pid)  # a process that ended while it looked reads as a zombie, or not at all
    still = live(again) and starttime(again) == now and (fd is None or pidfd_alive(fd))
    if not stat or not live(stat) or (exit_file not in cmdline and started in (None, now) and not still):
        return "gone", stat, cmdline, None  # ended before the look, or while it looked (its cmdline then reads empty)
    if (started is not None and now != started) or exit_file not in cmdline:
        return "reused", stat, cmdline, None
    return "ok", stat, cmdline, Run(pid, now, fd)


class Dfo:
    """dfo's end of the stream: its word on stdin, and whether it is still there."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.gone = False

    def word(self, timeout: float):
        """The next line dfo sent ('' when it is gone), or None if none came within `timeout`."""
        if self.gone or not select.select([self.fd], [], [], max(0.0, timeout))[0]:
            return "" if self.gone else None
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(self.fd, 1)
            if not chunk:
                self.gone = True
                return line.decode("ascii", "replace").strip()
            line += chunk
        return line.decode("ascii", "replace").strip()

    def sleep(self, seconds: float) -> bool:
        """Wait `seconds`, or until dfo goes away (False)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.word(end - time.monotonic()) == "" and self.gone:
                return False
        return True


def wait_gone(run: Run, dfo: Dfo, seconds: float, *, say_waiting: bool = False):
    """Until the group is gone (True), `seconds` are over (False) or dfo went away (None)."""
    start = time.monotonic()
    said, poll = start, FIRST_POLL_S  # most runs end within milliseconds of their signal: look soon, then less often
    while run.members():
        now = time.monotonic()
        if now - start >= seconds:
            return False
        if say_waiting and now - said >= SAY_EVERY_S:
            say("waiting=%.1f" % (now - start))
            said = now
        if not dfo.sleep(min(poll, start + seconds - now)):
            return None
        poll = min(POLL_S, 2 * poll)
    return True


def stop(args, dfo: Dfo) -> None:
    identity, stat, cmdline, run = identify(args.pid, args.starttime, args.exit_file)
    say("identity=" + identity)
    say("started=%s" % starttime(stat))
    say("cmdline=" + cmdline.strip())
    if run is None:
        return
    if dfo.word(args.word_timeout) != "stop":
        say("signal=withheld")  # dfo went away, or said nothing: nothing is signalled
        return
    settle_end = time.monotonic() + args.settle
    while time.monotonic() < settle_end:
        members = run.members()
        if not members or any(pid != run.pid for pid in members):
            break
        if not dfo.sleep(POLL_S):  # the wrapper alone: writing the run's exit status, or about to start it
            return
    if not run.members() or not run.signal(signal.SIGTERM):
        say("signal=none")
        return
    say("term=sent")
    done = wait_gone(run, dfo, args.grace, say_waiting=True)
    if done is None:
        return  # dfo went away: the run goes on (checkpointing); no SIGKILL
    if done:
        say("signal=TERM")
        return
    run.signal(signal.SIGKILL)
    say("signal=KILL")
    wait_gone(run, dfo, args.settle)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dfo-stop")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--starttime", type=lambda text: None if text == "none" else int(text), required=True)
    parser.add_argument("--exit-file", required=True)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--settle", type=float, default=SETTLE_S)
    parser.add_argument("--word-timeout", type=float, default=WORD_TIMEOUT_S)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only dfo's word or its going away decides
    try:
        stop(args, Dfo())
    finally:
        say("exit=" + read_text(args.exit_file).strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
