"""replay(): the log's own clock, the verdict held at its end, and the step where it was first reached."""

import numpy as np
from tracegen import CRASH_TEXTS, step_line, thread_traceback

from orchestrator.decide import replay, replay_timeline

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


def shifted_log(drop=0.3, at=300, steps=600):
    """100k tok/s, a step a second, then `drop` of it from step `at` on (a neighbour took half the GPU)."""
    rng = np.random.default_rng(4)
    return [step_line(T0 + s, s, 100_000 * (1 - drop * (s >= at)) * (1 + rng.normal(0, 0.01)), 2.0)
            for s in range(1, steps + 1)]


def test_the_timeline_lists_each_verdict_as_a_watcher_saw_it_and_ends_on_the_final_one():
    """A 30% drop at step 300 of a quiet run: steady at ~100k, re-opened, steady at ~70k; each entry is the
    decision as it stood then (its step, time and figure), the last the one replay() returns."""
    changes = replay_timeline(shifted_log(), run="r")
    final = replay(shifted_log(), run="r")
    assert changes[-1].to_json() == final.to_json()
    assert changes[0].decision == "undecided"
    steady = [d for d in changes if d.decision == "steady"]
    assert len(steady) == 3 and steady[0].at_step < 300 <= steady[1].at_step == steady[2].at_step  # the final last
    assert abs(steady[0].steady_tok_s / 100_000 - 1) < 0.02 and abs(steady[1].steady_tok_s / 70_000 - 1) < 0.02
    assert steady[0].interval[0] <= steady[0].steady_tok_s <= steady[0].interval[1]
    assert [d.at_ts for d in steady] == sorted(d.at_ts for d in steady)
    keys = [(d.decision, d.at_step if d.decision == "steady" else None) for d in changes[:-1]]
    assert all(a != b for a, b in zip(keys, keys[1:]))  # each entry before the final one a change


def test_a_figure_refining_under_one_declaration_is_not_a_change_but_a_crash_and_an_ending_are():
    """Each change is kept as it was when it came (the figure a watcher would have acted on); the final verdict
    follows it, the same verdict when nothing changed since, with the figure as it stands at the end."""
    frames, exception = CRASH_TEXTS["cudagraph_overwritten"]
    lines = steady_log(400) + thread_traceback(frames, exception, "Thread-2 (drafter)")
    held = replay_timeline(steady_log(400))
    assert [d.decision for d in held] == ["undecided", "steady", "steady"]
    assert held[1].at_step == held[2].at_step and held[1].evidence["last_step"] < held[2].evidence["last_step"] == 400
    assert [d.decision for d in replay_timeline(lines)] == ["undecided", "steady", "crash", "crash"]
    ended = replay_timeline(steady_log(400), exit_code=0)
    assert [(d.decision, d.ended) for d in ended] == [("undecided", None), ("steady", None), ("steady", "exited")]
