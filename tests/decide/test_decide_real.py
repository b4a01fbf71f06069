"""Real trainer logs (tests/data/real/, labelled from plots before the detector saw them): each gets the
verdict a person reads, at the level a person reads, soon after its first step."""

import pytest
from reallogs import LEVEL_TOLERANCE, labelled, judge, score

LOGS = labelled()
MAX_DECLARED_S = 120  # each log steady within 2 minutes of its first step line (the median goal is 60 s)


@pytest.mark.parametrize("log", LOGS, ids=[log.name for log in LOGS])
def test_each_labelled_real_log_gets_its_verdict_at_its_level(log):
    decision = judge(log)
    row = score(log, decision)
    assert (row["got"], log.verdict) == (log.verdict, log.verdict), row["reason"]
    assert abs(row["level_error"]) <= LEVEL_TOLERANCE, row
    lo, hi = decision.interval
    assert lo <= decision.steady_tok_s <= hi  # the figure lies inside its own interval
    assert row["first_declared_s"] is not None and row["first_declared_s"] <= MAX_DECLARED_S


def test_the_corpus_is_steady_a_median_minute_after_the_first_step():
    rows = sorted(score(log, judge(log))["first_declared_s"] for log in LOGS)
    assert len(rows) >= 5 and rows[len(rows) // 2] <= 60


def test_noise_is_reported_not_a_gate():
    noisy = [log for log in LOGS if log.noisy]
    assert noisy
    for log in noisy:
        decision = judge(log)
        assert decision.decision == "steady" and decision.noisy and decision.noise_rel > 0.10


def test_the_shift_log_records_both_levels_and_ends_on_the_new_one():
    log = next(log for log in LOGS if log.name == "small-thr-eager")
    decision = judge(log)
    shift = decision.evidence["steady"]["level_shifts"][0]
    assert shift["from_tok_s"] > 50_000 and abs(shift["declared_tok_s"] / 40_500 - 1) < LEVEL_TOLERANCE
    assert 1_700 <= shift["at_step"] <= 2_000 and decision.warmup_end_step >= shift["at_step"]
    assert abs(decision.steady_tok_s / 40_500 - 1) < LEVEL_TOLERANCE
