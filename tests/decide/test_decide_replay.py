"""replay(): the log's own clock, the verdict held at its end, and the step where it was first reached."""

import numpy as np
from tracegen import CRASH_TEXTS, step_line, thread_traceback

from orchestrator.decide import replay

T0 = 1_795_000_000.0
CHAIN = ("trees", "notrees", "nographs", "eager")


def steady_log(steps=300, first=1, t0=T0):
    rng = np.random.default_rng(3)
    return [step_line(t0 + s, s, 100_000 * (1 + rng.normal(0, 0.01)), 2.0) for s in range(first, first + steps)]


def test_a_gap_in_the_log_is_a_stall_when_the_watcher_would_have_declared_it():
    lines = steady_log(100) + steady_log(50, first=101, t0=T0 + 1000)  # 900 s of silence after step 100
    decision = replay(lines, run="r", variant="trees", chain=CHAIN)
    assert (decision.decision, decision.at_step, decision.next_variant) == ("stall", 100, "notrees")
    assert decision.at_ts.startswith("2026-11-18T") and 119 < decision.evidence["silent_s"] < 123


def test_a_crash_after_steady_overrides_it_and_at_step_is_where_it_happened():
    frames, exception = CRASH_TEXTS["cudagraph_overwritten"]
    lines = steady_log(300) + thread_traceback(frames, exception, None) + steady_log(50, first=301, t0=T0 + 1)
    decision = replay(lines, run="r", variant="trees", chain=CHAIN)
    assert (decision.decision, decision.signature, decision.at_step) == ("crash", "cudagraph_overwritten", 300)
    assert decision.steady_tok_s is not None


def test_steady_at_step_is_where_steady_was_first_reached_not_the_log_end():
    decision = replay(steady_log(400), run="r")
    assert decision.decision == "steady" and decision.at_step < 200 and decision.evidence["last_step"] == 400


def test_a_log_without_timestamps_needs_a_line_interval():
    lines = [f"step {s} | {100_000 + (s % 7) * 100}.0 tok/s" for s in range(1, 400)]
    regex = r"step (?P<step>\d+) \| (?P<tok_s>[\d.]+) tok/s"
    assert replay(lines, regex=regex).decision == "undecided"
    assert replay(lines, regex=regex, line_interval_s=0.5).decision == "steady"


def test_the_end_clock_turns_silence_after_the_last_line_into_a_stall():
    assert replay(steady_log(20), end_ts=T0 + 20 + 60).decision == "undecided"
    assert replay(steady_log(20), end_ts=T0 + 20 + 200).decision == "stall"
