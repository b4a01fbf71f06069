"""The labelled trace suite, replayed end to end: no premature steady, no false fallback, steady IS reached.

Seeds 1000-1001 are held out: the rules were tuned on seeds 0-29 (bench/decide_traces.py reports 500-529).
"""

import pytest
from tracegen import KINDS, STEADY_KINDS, suite, score

from orchestrator.decide import replay

HELD_OUT_SEEDS = range(1000, 1002)
MAX_DELAY_STEPS = 400  # steady within 400 steps of the true warm-up end (typical: ~135) ...
MAX_DELAY_S = 90  # ... or 90 s of the log's clock (a launch-bound run logs 7-20 steps a second)


@pytest.fixture(scope="module")
def scored():
    return [(trace, score(trace, replay(trace.lines, **trace.replay_kwargs()))) for trace in suite(HELD_OUT_SEEDS)]


@pytest.mark.slow
def test_every_trace_gets_its_labelled_verdict_signature_and_action(scored):
    wrong = [(row["kind"], row["seed"], row["got"], row["want"]) for _, row in scored if not row["verdict_ok"]]
    assert not wrong
    assert {trace.kind for trace, _ in scored} == set(KINDS)


@pytest.mark.slow
def test_no_premature_steady_and_no_false_fallback(scored):
    assert [row["kind"] for _, row in scored if row["premature"]] == []
    assert [row["kind"] for _, row in scored if row["false_fallback"]] == []


@pytest.mark.slow
def test_clean_traces_reach_steady_within_a_bounded_delay_on_the_right_level(scored):
    clean = [row for trace, row in scored if trace.kind in STEADY_KINDS]
    assert clean and all(row["steady_declared_step"] is not None for row in clean)
    assert all(row["delay_steps"] <= MAX_DELAY_STEPS or row["delay_s"] <= MAX_DELAY_S for row in clean)
    assert all(row["level_ok"] for _, row in scored)
