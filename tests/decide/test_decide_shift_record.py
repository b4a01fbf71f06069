"""What a decision says about a level shift (`level_shifts`): where the level moved, when the judge saw it,
both levels with the intervals they were declared with, and the precision; [] on a run with no shift."""

from reallogs import LEVEL_TOLERANCE, judge, labelled

from orchestrator.decide import DecideConfig

LOGS = {log.name: log for log in labelled()}


def test_a_shift_seen_before_its_new_level_holds_records_both_moments_and_both_intervals():
    decision = judge(LOGS["e2e2-thr-nographs"], config=DecideConfig(precision=0.10))
    [shift] = decision.level_shifts
    assert shift["at_step"] < shift["detected_step"] < shift["declared_step"] and shift["precision"] == 0.10
    assert shift["detected_at"] < shift["declared_at"]
    lo, hi = shift["from_interval"]  # the level before, as it was declared (~44k at 31 s)
    assert lo < shift["from_tok_s"] < hi and abs(shift["from_tok_s"] / 44_000 - 1) < LEVEL_TOLERANCE
    lo, hi = shift["declared_interval"]
    assert lo < shift["declared_tok_s"] < hi and abs(shift["declared_tok_s"] / 35_500 - 1) < LEVEL_TOLERANCE
    assert decision.evidence["steady"]["level_shifts"][0]["at_step"] == shift["at_step"]  # the detector's own record


def test_a_run_with_no_shift_has_none():
    assert judge(LOGS["tiny-nographs"]).level_shifts == []
