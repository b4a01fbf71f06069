"""The labelled real trainer logs of tests/data/real/: loading, replaying and scoring them.

labels.csv (written before the detector saw the logs, from plots) gives per log the verdict a person reads,
the level, and the step from which it holds. Tests and bench/decide_traces.py import this file.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tracegen import changes_of, first_steady  # what `--until-decided`, `stop_when: steady` and `notify` act on

from orchestrator.commands.replay import read_exit_code
from orchestrator.decide import Decision, replay, replay_timeline
from orchestrator.logfmt import StepRecord, parse_logfmt, parse_ts

REAL_DIR = Path(__file__).resolve().parents[1] / "data" / "real"
LEVEL_TOLERANCE = 0.05  # the figure within 5% of the level a person reads


@dataclass(frozen=True)
class RealLog:
    name: str
    path: Path
    verdict: str
    level: float
    holds_from_step: int
    noisy: bool
    note: str

    def lines(self) -> list[str]:
        return self.path.read_text(encoding="utf-8", errors="replace").splitlines()


def labelled() -> list[RealLog]:
    with (REAL_DIR / "labels.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [
        RealLog(row["file"].removesuffix(".log"), REAL_DIR / row["file"], row["verdict"], float(row["level_tok_s"]),
                int(row["holds_from_step"]), row["noisy"] == "yes", row["what the plot shows"])
        for row in rows
    ]


def first_step_ts(lines: list[str]) -> float | None:
    for line in lines:
        record = parse_logfmt(line)
        if isinstance(record, StepRecord) and record.ts is not None:
            return record.ts
    return None


def judge(log: RealLog, **kwargs) -> Decision:
    """What `dfo replay LOG` says: with the exit status of the log's `.exit` file when it has one (the e2e
    fallback runs: 75, stopped by the chain's cleanup), unless `exit_code` is given."""
    if not kwargs:
        return timeline(log)[-1]
    return replay(log.lines(), run=log.name, **{"exit_code": read_exit_code(log.path), **kwargs})


def timeline(log: RealLog, **kwargs) -> list[Decision]:
    """What `dfo replay LOG --timeline` says: every change of verdict, the final one (judge's) last."""
    if not kwargs:
        return _timeline(log)
    return replay_timeline(log.lines(), run=log.name, **{"exit_code": read_exit_code(log.path), **kwargs})


@cache
def _timeline(log: RealLog) -> list[Decision]:  # the tests ask several questions of the same replay
    return replay_timeline(log.lines(), run=log.name, exit_code=read_exit_code(log.path))


def _ts(text: str | None) -> float | None:
    return parse_ts(text) if text else None


def score(log: RealLog, decision: Decision, changes: list[Decision] | None = None) -> dict:
    """Verdict right, level error, and seconds from the first step line to the first steady declaration
    (`first_declared_s`) and to the declaration of the level held at the end (`declared_s`). With the log's
    timeline (`changes`, replay_timeline's), the first steady verdict too: its figure (`first_level`), its
    error against the label (`first_level_error`, `first_level_ok`) and its seconds after the first step
    line (`first_s`: the same moment as `first_declared_s`)."""
    lines = log.lines()
    t0 = first_step_ts(lines)
    level_error = decision.steady_tok_s / log.level - 1 if decision.steady_tok_s is not None and log.level else None
    steady = decision.evidence.get("steady") or {}
    shifts = steady.get("level_shifts") or []
    declared_ts = _ts(decision.evidence.get("steady_declared_at"))
    first_ts = _ts(decision.evidence.get("first_steady_declared_at")) or declared_ts
    return {
        "name": log.name,
        "want": log.verdict,
        "got": decision.decision,
        "verdict_ok": decision.decision == log.verdict,
        "level": decision.steady_tok_s,
        "label_level": log.level,
        "level_error": level_error,
        "level_ok": abs(level_error) <= LEVEL_TOLERANCE if level_error is not None else log.verdict != "steady",
        "noise_rel": decision.noise_rel,
        "noisy": decision.noisy,
        "interval": decision.interval,
        "first_declared_s": first_ts - t0 if first_ts is not None and t0 is not None else None,
        "declared_s": declared_ts - t0 if declared_ts is not None and t0 is not None else None,
        "shifts": len(shifts),
        "reason": decision.reason,
        **(score_first(log, changes, t0) if changes is not None else {}),
    }


def score_first(log: RealLog, changes: list[Decision], t0: float | None) -> dict:
    first = first_steady(changes)
    level = first.steady_tok_s if first is not None else None
    error = level / log.level - 1 if level is not None and log.level else None
    return {
        "first_level": level,
        "first_level_error": error,
        "first_level_ok": error is not None and abs(error) <= LEVEL_TOLERANCE,
        "first_s": _ts(first.at_ts) - t0 if first is not None and first.at_ts and t0 is not None else None,
        "changes": changes_of(changes),  # verdict changes after the first line's
    }
