"""The words dfo's lifecycle is written in: a run's verdict, a run's state, a batch cell's state.

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


class RunState(StrEnum):
    """A run's row in the registry.

        launching --start seen--> running --exit file--> exited (0) | crashed (!= 0)
            |                        +--dfo stop-------> stopped
            +--dfo died before the start, nothing found--> failed      (lost: the PID is gone, no exit file)
    """

    LAUNCHING = "launching"
    RUNNING = "running"
    EXITED = "exited"
    CRASHED = "crashed"
    STOPPED = "stopped"
    LOST = "lost"
    FAILED = "failed"  # the launch never started the run (dfo died or was refused before the start)

    def is_terminal(self) -> bool:
        return self not in (RunState.LAUNCHING, RunState.RUNNING)

    @classmethod
    def active(cls) -> tuple["RunState", ...]:
        return cls.LAUNCHING, cls.RUNNING

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
