"""Steady state counted by the step numbers a trainer reports, not by its metric lines.

The built-in trainer logs every 10 steps (tok_s = the mean over those steps, by the metric-line contract).
The detector's blocks hold `block_size` steps by step number, so such a log closes a block with each line:
the labelled suite, logged every 10 steps, must reach the same verdicts with no premature steady.
"""

import dataclasses
import re

import numpy as np
from tracegen import STEADY_KINDS, score, step_line, suite

from orchestrator.decide import DecideConfig, StepObs, SteadyDetector, replay
from orchestrator.logfmt import parse_ts

HELD_OUT_SEEDS = range(1000, 1002)
STEP_LINE = re.compile(r"^ts=(\S+) event=step step=(\d+) tok_s=(\S+) loss=(\S+) .* phase=(\w+)$")
T0 = 1_795_000_000.0


def logged_every(trace, every: int):
    """`trace` as a trainer logging every `every` steps would write it: one line per `every` step lines (mean
    tok_s, the last step's number and time, a NaN loss kept), free text where it was."""
    lines, group = [], []

    def flush() -> None:
        if group:
            loss = next((g[3] for g in group if g[3] != g[3]), group[-1][3])
            lines.append(step_line(group[-1][0], group[-1][1], sum(g[2] for g in group) / len(group), loss, group[-1][4]))
            group.clear()

    for line in trace.lines:
        match = STEP_LINE.match(line)
        if match is None:
            flush()
            lines.append(line)
            continue
        row = (parse_ts(match[1]), int(match[2]), float(match[3]), float(match[4]), match[5])
        if group and group[-1][4] != row[4]:
            flush()
        group.append(row)
        if len(group) == every:
            flush()
    flush()
    return dataclasses.replace(trace, lines=lines)


def test_the_suite_logged_every_10_steps_gets_its_verdicts_without_premature_steady():
    traces = [logged_every(t, 10) for t in suite(HELD_OUT_SEEDS) if t.regex is None]
    rows = [score(t, replay(t.lines, **t.replay_kwargs())) for t in traces]
    assert [(r["kind"], r["got"], r["want"]) for r in rows if not r["verdict_ok"]] == []
    assert [r["kind"] for r in rows if r["premature"]] == []
    assert [r["kind"] for r in rows if r["false_fallback"]] == []
    steady = [r for t, r in zip(traces, rows) if t.kind in STEADY_KINDS]
    assert steady and all(r["steady_declared_step"] is not None and r["level_ok"] for r in steady)


def feed_lines(detector: SteadyDetector, values, every: int, line_s: float) -> int | None:
    """Lines every `every` steps, `line_s` seconds apart; the step at which steady was declared."""
    for i, value in enumerate(values):
        step = (i + 1) * every
        detector.feed(StepObs(T0 + i * line_s, step, float(value)))
        if detector.estimate.steady:
            return step
    return None


def test_a_trainer_logging_every_10_steps_is_judged_on_blocks_of_steps_not_of_lines():
    rng = np.random.default_rng(5)
    values = 1000 * (1 + rng.normal(0, 0.01, 200))
    detector = SteadyDetector(DecideConfig())
    declared = feed_lines(detector, values, every=10, line_s=3.0)  # a line every 3 s, each the mean of 10 steps
    assert declared is not None
    lines = declared // 10
    # the 30-s minimum holds, and lines count as the 10 steps each stands for (not as one step each)
    assert (lines - 1) * 3.0 >= DecideConfig().min_steady_seconds and lines < 30
    assert abs(detector.estimate.tok_s / 1000 - 1) < 0.01
    assert detector.estimate.evidence["steps_used"] >= 10 * detector.estimate.evidence["lines_used"] - 9
