"""What decide/ is fed: typed observations of one run, each carrying the time it refers to.

The caller's clock enters only as data (`TickObs(now)`), so the same code judges a live run and a
recorded log. This module does no I/O and reads no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..logfmt import EventRecord, Record, StepRecord


@dataclass(frozen=True)
class StepObs:
    """One metric line: training step `step` ran at `tok_s` tokens/s (all drafters together)."""

    ts: float
    step: int
    tok_s: float
    loss: float | None = None
    phase: str = "train"  # warmup | train | eval | checkpoint
    active: str | None = None  # "7/8" when the trainer reports it
    mem_gb: float | None = None  # the trainer's peak memory allocated (GB), when its line says it

    @property
    def loss_is_bad(self) -> bool:
        return self.loss is not None and not math.isfinite(self.loss)


@dataclass(frozen=True)
class LineObs:
    """A free-text line (warning, traceback line, print)."""

    ts: float
    text: str


@dataclass(frozen=True)
class EventObs:
    """A non-step logfmt event (start, compile, eval, checkpoint, done, error) with its fields."""

    ts: float
    event: str
    fields: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExitObs:
    """The run's process ended with exit status `code` (from the exit file; -1: gone without one).
    `stop_requested`: dfo or the user asked it to stop before it ended (the registry's stop intent); the
    same as a StopRequested observation just before the exit."""

    ts: float
    code: int
    stop_requested: bool = False


@dataclass(frozen=True)
class StopRequested:
    """dfo (a fallback, a batch) or the user (`dfo stop`) asked the run to stop at `ts`: whatever it does
    next (exit 75 after a checkpoint, 143, 137 after a SIGKILL, a traceback on the way out, silence) is a
    stop, never a crash or a stall."""

    ts: float
    by: str = "user"


@dataclass(frozen=True)
class GpuObs:
    """One GPU sample: `gpus` holds {index, mem_used_mib, mem_total_mib, util_pct} per GPU."""

    ts: float
    gpus: tuple[dict, ...]


@dataclass(frozen=True)
class TickObs:
    """The caller's clock: nothing happened up to `now` (lets stall rules fire on silence)."""

    now: float


Observation = StepObs | LineObs | EventObs | ExitObs | StopRequested | GpuObs | TickObs


def observation_from_record(record: Record, fallback_ts: float) -> StepObs | LineObs | EventObs:
    """Turn a logfmt/regex record into an observation; lines without a time take `fallback_ts`."""
    if isinstance(record, StepRecord):
        return StepObs(record.ts, record.step, record.tok_s, record.loss, record.phase, record.active, record.mem_gb)
    if isinstance(record, EventRecord):
        return EventObs(record.ts, record.event, dict(record.fields))
    return LineObs(record.ts if record.ts is not None else fallback_ts, record.text)
