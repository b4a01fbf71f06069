"""The words dfo's lifecycle is written in: a run's verdict, the action on it, a run's state, a batch cell's state.

StrEnums, so each member is also the plain string stored in the registry and printed in JSON
(`Verdict.CRASH == "crash"`): the registry's contents and docs/design.md's JSON shapes do not change. Every
module that asks "does this verdict fall back?" or "has this run ended?" asks these enums, never a string
list of its own. This module imports nothing of dfo's (decide/, the store and the CLI all use it).
"""

from __future__ import annotations

from enum import StrEnum


class Verdict(StrEnum):
    """What decide/ says of a run (docs/design.md "Decisions")."""

    UNDECIDED = "undecided"
    STEADY = "steady"
    DRIFTING = "drifting"  # still trending when watch.max_undecided_s ran out
    CRASH = "crash"
    STALL = "stall"
    TOO_SLOW = "too_slow"
    STOPPED = "stopped"  # dfo or the user stopped it (143, or the trainer's checkpointed 75)
    EXITED = "exited"

    def falls_back(self) -> bool:
        """A failure that `dfo watch` answers with the chain's next variant."""
        return self in (Verdict.CRASH, Verdict.STALL, Verdict.TOO_SLOW)

    def is_final(self) -> bool:
        """Nothing later changes it (steady can still turn into too_slow or crash while the run goes on)."""
        return self in (Verdict.CRASH, Verdict.STALL, Verdict.TOO_SLOW, Verdict.STOPPED, Verdict.EXITED)

    def is_failure(self) -> bool:
        """A chain ending on this verdict makes `dfo watch` / `launch --watch` exit non-zero."""
        return self in (Verdict.CRASH, Verdict.STALL, Verdict.TOO_SLOW, Verdict.UNDECIDED, Verdict.DRIFTING)

    @classmethod
    def of(cls, text: str | None) -> "Verdict":
        """The verdict of a decision's text (None or unknown text: undecided)."""
        try:
            return cls(text)
        except ValueError:
            return cls.UNDECIDED


class Action(StrEnum):
    """What dfo does about a verdict (docs/design.md's decision `action`): keep the variant (steady), fall back to the
    chain's next one, stop the run (a failure with nothing left to fall back to), or nothing."""

    KEEP = "keep"
    FALLBACK = "fallback"
    STOP = "stop"
    NONE = "none"

    def acts(self) -> bool:
        """dfo does something to the run: stops it (and, for a fallback, launches the next variant)."""
        return self in (Action.FALLBACK, Action.STOP)

    @classmethod
    def of(cls, text: str | None) -> "Action":
        """The action of a decision's text (None or unknown text: none)."""
        try:
            return cls(text)
        except ValueError:
            return cls.NONE


class RunState(StrEnum):
    """A run's row in the registry. Changed only by Store.transition, each change guarded by the states it may
    come from (`UPDATE ... WHERE state IN (...)`), so one end seen by two dfo is recorded once, and of two dfo
    that find one unconfirmed start, one records it running.

        launching --start seen--> running --exit file--> exited (0) | crashed (!= 0)
            |   |                    |--dfo stop-------> stopped
            |   |                    +--gone, no exit file--> lost (it had a PID: SIGKILL, OOM killer, restart)
            |   +--start got no answer--> unconfirmed (launched, not yet confirmed; no PID: looked for by its exit
            |                             file path during watch.start_grace_s from when dfo gave up on the answer)
            |                                 --found--> running | --end found--> exited ... | --grace over,
            |                                 nothing found--> failed
            +--dfo died before the start, nothing found--> failed

    Three kinds of state: active (launching, running: a process dfo is starting or knows the PID of; what
    `dfo runs --active`, `dfo stop --all` and a watch of no names take), unconfirmed (neither: no process known,
    no end recorded; a look settles it), and terminal (everything else).
    """

    LAUNCHING = "launching"
    UNCONFIRMED = "unconfirmed"  # the start got no answer: it may run or not; looked for until its grace is over
    RUNNING = "running"
    EXITED = "exited"
    CRASHED = "crashed"
    STOPPED = "stopped"
    LOST = "lost"  # it had a PID, and its process is gone without an exit file
    FAILED = "failed"  # the launch never started the run (dfo died or was refused before the start)

    def is_terminal(self) -> bool:
        """An outcome is recorded: not active, and not unconfirmed (whose outcome a look is still to find)."""
        return self not in (RunState.LAUNCHING, RunState.UNCONFIRMED, RunState.RUNNING)

    def is_active(self) -> bool:
        return self in RunState.active()

    @classmethod
    def active(cls) -> tuple["RunState", ...]:
        """A process dfo is starting (launching) or has the PID of (running). Not unconfirmed: no process is known
        (it has no PID to stop or follow), so what acts on active runs looks for it first (runs.resolve_launch)."""
        return cls.LAUNCHING, cls.RUNNING

    @classmethod
    def unsettled(cls) -> tuple["RunState", ...]:
        """Before a start was seen: launching, unconfirmed (its start got no answer: for watch.start_grace_s),
        failed (a slow start may still bring it up): what `running` follows."""
        return cls.LAUNCHING, cls.UNCONFIRMED, cls.FAILED

    @classmethod
    def endable(cls) -> tuple["RunState", ...]:
        """What an end (its exit file, a stop) is recorded from: every state but an end already recorded (lost
        is one: its process was seen gone with no exit file, which never comes after)."""
        return cls.LAUNCHING, cls.RUNNING, cls.UNCONFIRMED, cls.FAILED

    @classmethod
    def after_exit(cls, code: int | None) -> "RunState":
        """The state an exit status gives (None: no exit status at all)."""
        if code is None:
            return cls.LOST
        return cls.EXITED if code == 0 else cls.CRASHED


class CellState(StrEnum):
    """A batch cell: pending --launch--> running --stop_when, or the chain ends--> done | failed.
    `error`: it could not start (refused, unreachable), or its fallback could not be carried out (left open);
    the next invocation tries it again (finishing that fallback first)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    ERROR = "error"

    def is_final(self) -> bool:
        return self in (CellState.DONE, CellState.FAILED)
