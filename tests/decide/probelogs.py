"""The probe logs of tests/data/probe/ (tests/data/probe/make_probes.py): loading, replaying and scoring them
against issue 27's goals, one set per shape. Tests and bench/decide_traces.py import this file."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tracegen import LEVEL_TOLERANCE, changes_of, first_steady

from orchestrator.decide import Decision, replay_timeline
from orchestrator.logfmt import parse_ts

PROBE_DIR = Path(__file__).resolve().parents[1] / "data" / "probe"


def _number(text: str) -> float | None:
    return float(text) if text else None


@dataclass(frozen=True)
class ProbeLog:
    name: str
    shape: str
    verdict: str  # steady | not_steady, at the log's end
    level: float | None  # the level at the end, and the step it holds from
    holds_from_step: int | None
    first_level: float | None  # the level the first steady verdict should give, and the earliest step for it
    first_from_step: int | None
    drop_step: int | None
    drop_s: float | None  # seconds after the first step line
    wall_level: float | None  # eval_pauses: the wall-clock rate beside the training rate (`level`)
    level_tolerance: float  # how near the figure at the end must be to `level` (or `wall_level`)
    first_within_s: float | None
    reopen_within_s: float | None
    held_steady_max_s: float | None
    note: str

    @property
    def path(self) -> Path:
        return PROBE_DIR / f"{self.name}.log"

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines()


@cache
def probes() -> tuple[ProbeLog, ...]:
    with (PROBE_DIR / "labels.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    integer = lambda text: int(text) if text else None  # noqa: E731
    return tuple(
        ProbeLog(row["file"].removesuffix(".log"), row["shape"], row["verdict"], _number(row["level_tok_s"]),
                 integer(row["holds_from_step"]), _number(row["first_level_tok_s"]), integer(row["first_from_step"]),
                 integer(row["drop_step"]), _number(row["drop_s"]), _number(row["wall_tok_s"]),
                 float(row["level_tolerance"]),
                 _number(row["first_within_s"]), _number(row["reopen_within_s"]), _number(row["held_steady_max_s"]),
                 row["note"])
        for row in rows
    )


def shapes() -> list[str]:
    return list(dict.fromkeys(probe.shape for probe in probes()))


@cache
def timeline(probe: ProbeLog) -> tuple[Decision, ...]:
    return tuple(replay_timeline(probe.lines(), run=probe.name))


def _within(value: float | None, level: float | None, tolerance: float = LEVEL_TOLERANCE) -> bool:
    return value is not None and level is not None and abs(value / level - 1) <= tolerance


def score(probe: ProbeLog) -> dict:
    """The probe's timeline against its labels: the first steady verdict (level error, seconds after the first
    step line, premature), the verdict and figure at the end, when the verdict re-opened after a drop, and the
    seconds a steady verdict was held in all."""
    changes = timeline(probe)
    final = changes[-1]
    t0 = parse_ts(next(line for line in probe.lines() if "event=step" in line).split()[0].removeprefix("ts="))
    at = lambda decision: parse_ts(decision.at_ts) - t0 if decision.at_ts else None  # noqa: E731
    first = first_steady(list(changes))
    first_s = at(first) if first is not None else None
    premature = first is not None and (probe.first_from_step is None or first.at_step < probe.first_from_step)
    reopened_s = None
    if probe.drop_step is not None and first is not None and first.at_step < probe.drop_step:
        after = [d for d in changes if d is not first and d.at_step is not None and d.at_step >= probe.drop_step]
        reopened_s = at(after[0]) - probe.drop_s if after else None
    end_s = max(at(d) or 0.0 for d in changes)
    last_step_s = parse_ts(probe.lines()[-1].split()[0].removeprefix("ts=")) - t0
    held = 0.0
    for decision, after in zip(changes, [*changes[1:], None]):
        if decision.decision == "steady":
            held += (at(after) if after is not None else max(end_s, last_step_s)) - at(decision)
    figure = final.steady_tok_s if final.decision == "steady" else None
    return {
        "name": probe.name,
        "shape": probe.shape,
        "got": final.decision,
        "final_ok": (final.decision == "steady") == (probe.verdict == "steady"),
        "level": figure,
        "level_error": figure / probe.level - 1 if figure is not None and probe.level else None,
        "level_ok": _within(figure, probe.level, probe.level_tolerance)
        or _within(figure, probe.wall_level, probe.level_tolerance),
        "wall_error": figure / probe.wall_level - 1 if figure is not None and probe.wall_level else None,
        "first_level": first.steady_tok_s if first is not None else None,
        "first_level_error": first.steady_tok_s / probe.first_level - 1 if first is not None and probe.first_level else None,
        "first_level_ok": _within(first.steady_tok_s if first is not None else None, probe.first_level),
        "first_s": first_s,
        "first_in_time": first_s is not None and (probe.first_within_s is None or first_s <= probe.first_within_s),
        "premature": premature,
        "reopened_s": reopened_s,
        "shift_recorded": bool(final.level_shifts),
        "held_steady_s": held,
        "changes": changes_of(changes),  # verdict changes after the first line's
    }
