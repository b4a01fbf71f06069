"""What a decision says about a level shift (`level_shifts`): where the level moved, when the judge saw it,
both levels with the intervals they were declared with, and the precision; [] on a run with no shift."""

from probelogs import probes
from probelogs import timeline as probe_timeline
from reallogs import LEVEL_TOLERANCE, judge, labelled

from orchestrator.decide import DecideConfig, Decision, RunJudge, StepObs
from orchestrator.decide.replay import judged_lines

LOGS = {log.name: log for log in labelled()}
# steady at ~97.8k, declared 55 s in, then -14% to ~83.9k at step 615 (120 s) that holds (tests/data/probe/labels.csv)
SHIFT_LOG = next(probe for probe in probes() if probe.name == "late_drop-0")


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


def test_the_shift_log_records_both_levels_and_ends_on_the_new_one():
    decision = probe_timeline(SHIFT_LOG)[-1]
    shift = decision.evidence["steady"]["level_shifts"][0]
    assert abs(shift["from_tok_s"] / SHIFT_LOG.first_level - 1) < LEVEL_TOLERANCE
    assert abs(shift["declared_tok_s"] / SHIFT_LOG.level - 1) < LEVEL_TOLERANCE
    assert abs(shift["at_step"] - SHIFT_LOG.drop_step) <= 10 and decision.warmup_end_step >= shift["at_step"]
    assert abs(decision.steady_tok_s / SHIFT_LOG.level - 1) < LEVEL_TOLERANCE


def test_a_run_with_no_shift_has_none():
    assert judge(LOGS["tiny-nographs"]).level_shifts == []


def shown_at_each_step(log, **kwargs) -> list[tuple[int, Decision]]:
    """What the watch shows (the judge's decision) after each step line of `log`, replayed on its own clock."""
    judge_ = RunJudge(run=log.name, **kwargs)
    return [(obs.step, judge_.decision()) for _, obs in judged_lines(judge_, log.lines()) if isinstance(obs, StepObs)]


def test_while_a_shift_is_being_confirmed_the_figure_stays_the_level_before_it_with_its_interval():
    """late_drop-0 drops from ~97.8k to ~83.9k at step 615; the shift is recorded at step 690, ~16 s later.
    In between, the steady figure used to slide between the levels (on a real log, small-thr-eager's 56.8k ->
    47.5k) and its interval to widen (-26k..121k). Now, at every step line of that window, the figure is one of
    the two levels and its interval positive and narrower than the move; from a few lines after the drop the
    decision says a shift is suspected since the drop's block, with the new level as seen so far."""
    shown = shown_at_each_step(SHIFT_LOG)
    [shift] = shown[-1][1].level_shifts
    old, new = shift["from_tok_s"], shift["declared_tok_s"]
    window = [(step, d) for step, d in shown if shift["at_step"] <= step < shift["detected_step"]]
    assert len(window) >= 12  # a line every 5 steps, ~16 s
    for step, d in window:
        assert d.decision == "steady", (step, d.reason)
        assert min(abs(d.steady_tok_s / old - 1), abs(d.steady_tok_s / new - 1)) < LEVEL_TOLERANCE, (step, d.reason)
        lo, hi = d.interval
        assert 0 < lo <= d.steady_tok_s <= hi and hi - lo < old - new, (step, d.reason)
    first_step, first = next((step, d) for step, d in window if d.shift_suspected)
    assert first_step - shift["at_step"] <= 100 and all(d.shift_suspected for step, d in window if step >= first_step)
    assert first.shift_suspected["since_step"] == shift["at_step"] and abs(first.steady_tok_s - old) < 1
    assert abs(first.shift_suspected["to_tok_s"] / new - 1) < 0.10
    assert f"level shift suspected since step {shift['at_step']}: ~" in first.reason
    assert shown[-1][1].shift_suspected is None  # confirmed, then declared: no longer suspected


def test_a_drop_right_after_a_declaration_under_a_huge_minimum_is_recorded_as_a_shift():
    """min_steady_steps 25,000 (a user whose autotuning runs long), a line every 20 steps at 0.02 s a step,
    100k tok/s declared at step ~25,000, then 70k from 200 steps later. The suspicion used to lapse after ~10,000
    steps (the 100 blocks before the newest k were all at the new level for one k, and the next k was longer than
    the data after the cut); the re-run MSER then cut the 100k level as a warm-up and 70k became the figure with
    no shift recorded. Now the suspicion stays while the move holds, with the figure at 100k, until the new level
    spans the minimum evidence: then the shift is recorded with both levels and 70k declared."""
    import numpy as np

    rng = np.random.default_rng(0)
    judge_ = RunJudge(DecideConfig(min_steady_steps=25_000), run="big")
    drop_at = None
    shown = []
    for line in range(1, 3_001):
        step = line * 20
        level = 70_000 if drop_at is not None and step >= drop_at else 100_000
        decision = judge_.feed(StepObs(1_795_000_000.0 + step * 0.02, step, level * (1 + rng.normal(0, 0.03))))
        if decision.decision == "steady" and drop_at is None:
            drop_at = step + 200
        shown.append((step, decision))
    assert drop_at is not None and 25_000 <= drop_at - 200 < 26_000
    for step, decision in shown:
        if decision.decision == "steady" and not decision.level_shifts:  # the level declared first: 100k
            assert abs(decision.steady_tok_s / 100_000 - 1) < 0.01, (step, decision.reason)
            assert decision.shift_suspected or step < drop_at + 200, (step, decision.reason)
    [shift] = shown[-1][1].level_shifts
    assert shift["shape"] == "step" and abs(shift["at_step"] - drop_at) <= 40, shift
    assert abs(shift["from_tok_s"] / 100_000 - 1) < 0.01 and abs(shift["declared_tok_s"] / 70_000 - 1) < 0.01, shift
    assert shown[-1][1].decision == "steady" and abs(shown[-1][1].steady_tok_s / 70_000 - 1) < 0.01
