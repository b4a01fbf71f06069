"""Leaks in time, drops and unmarked pauses on real noise: a labelled real log of tests/data/real/ after its
warm-up, played forward, then backward, then forward again (no jump where one pass meets the next) to
`duration_s` seconds after its first step line, its throughput times exp(-rate x seconds since its warm-up
ended). Each line keeps its tokens and takes longer by the same factor, as a throttled or leaking run's would.

tracegen's `fast_leak` and tests/data/probe's leaks put AR(1) noise on a smooth curve. A real launch-bound run
swings +/-10-20% over 10-30 s, and those swings are what a leak must be seen through: on real noise the decline
rule (docs/decisions.md, point 6b) behaves differently from the generated traces. With `rate` 0 the same
construction is the control: a real level held for the whole duration, which must stay steady. With `drop`, a
level shift on real noise: the level falls by a fraction at a given second and holds there. With `pauses`,
unmarked eval pauses on real noise.
Tests and bench/decide_traces.py import this file."""

from __future__ import annotations

import math
from typing import NamedTuple

from reallogs import RealLog

from orchestrator.logfmt import StepRecord, format_ts, parse_logfmt, parse_ts


def _rewrite(line: str, ts: float, step: int, tok_s: float) -> str:
    """`line` with its ts, step and tok_s replaced (every other field kept)."""
    fields = []
    for field in line.split(" "):
        key = field.split("=", 1)[0]
        if key == "ts":
            field = f"ts={format_ts(ts)}"
        elif key == "step":
            field = f"step={step}"
        elif key == "tok_s":
            field = f"tok_s={tok_s:.1f}"
        fields.append(field)
    return " ".join(fields)


class Played(NamedTuple):
    lines: list[str]
    leak_from_s: float  # seconds after the first step line: the warm-up end, where the replayed lines begin
    paused_s: float  # the unmarked pauses' seconds in all (`pauses`)


def played(log: RealLog, rate_per_s: float = 0.0, duration_s: float = 300.0, drop: tuple[float, float] | None = None,
           pauses: tuple[float, float] | None = None) -> Played:
    """The log's lines up to its warm-up end (`holds_from_step`), then its later step lines replayed as the
    module says, to `duration_s` seconds after the first step line, leaking `rate_per_s` (0.001: 0.1% a second)
    from the warm-up end. `drop` (seconds after the first step line, fraction): from then on the throughput is
    that much lower, a level shift that holds. `pauses` (every s, pause s): from the warm-up end, an unmarked
    pause (an eval the trainer does not mark) every so many seconds: no line during it, and the line after it
    carries it, its tokens over its wall time, as trainer/replica.py computes tok_s. An `event=exit` line is left
    out: the run goes on."""
    lines = log.lines()
    steps = [(i, record) for i, line in enumerate(lines)
             if isinstance(record := parse_logfmt(line), StepRecord) and record.ts is not None]
    head = next(i for i, record in steps if record.step >= log.holds_from_step)
    head_steps = [record for i, record in steps if i < head]
    if not head_steps:
        raise ValueError(f"{log.name}: no step line before its warm-up end (step {log.holds_from_step})")
    body = [(record.ts - before.ts, record.step - before.step, lines[i])
            for (_, before), (i, record) in zip(steps, steps[1:]) if i >= head]
    out = [line for line in lines[:head] if "event=exit" not in line]
    first_ts, ts, step = head_steps[0].ts, head_steps[-1].ts, head_steps[-1].step
    start = ts
    next_pause = start + pauses[0] if pauses else math.inf
    paused = 0.0
    k = 0
    while ts - first_ts < duration_s:
        lap, at = divmod(k, len(body))
        seconds, steps_in_line, line = body[at if lap % 2 == 0 else len(body) - 1 - at]
        factor = math.exp(-rate_per_s * (ts - start))
        if drop is not None and ts - first_ts >= drop[0]:
            factor *= 1 - drop[1]
        seconds /= factor
        pause = 0.0
        if pauses and ts >= next_pause:
            pause, next_pause = pauses[1], next_pause + pauses[0]
        ts += seconds + pause
        step += steps_in_line
        paused += pause
        out.append(_rewrite(line, ts, step, parse_logfmt(line).tok_s * factor * seconds / (seconds + pause)))
        k += 1
    return Played(out, start - first_ts, paused)


def held_steady_s(changes: list, end_ts: float) -> float:
    """Seconds a timeline (replay_timeline's) held a steady verdict, summed over its declarations (each until the
    next change, the last until `end_ts`, the log's last step, on parse_ts's clock)."""
    held = 0.0
    for decision, after in zip(changes, [*changes[1:], None]):
        if decision.decision == "steady" and decision.at_ts:
            until = parse_ts(after.at_ts) if after is not None and after.at_ts else end_ts
            held += max(0.0, until - parse_ts(decision.at_ts))
    return held


def last_ts(lines: list[str]) -> float:
    """The newest timestamp of a log's lines."""
    return max(record.ts for line in lines if (record := parse_logfmt(line)).ts is not None)
