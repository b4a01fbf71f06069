"""Real trainer logs (tests/data/real/, labelled from plots before the detector saw them): each gets the
verdict a person reads, at the level a person reads, soon after its first step."""

import math
import re
import statistics
from pathlib import Path

import pytest
from reallogs import LEVEL_TOLERANCE, labelled, judge, score, timeline

from orchestrator.decide import DecideConfig, RunJudge, StepObs
from orchestrator.decide.replay import judged_lines

LOGS = labelled()
MAX_DECLARED_S = 120  # each log steady within 2 minutes of its first step line (the median goal is 60 s)
KNOWN_MISSES = {  # reported in docs/benchmarks.md; strict: the test fails once the detector gets them right
    "tiny-thr-eager-cpu": "+/-25% swings on a shared CPU (lag-1 0.72): a 5% trend over half the window stays "
                          "plausible for 134 s; then the precision is out of reach (~648 s needed, max_undecided_s "
                          "600): steady, noisy, at 6,301 (+1.6%), but 123 s after the first step (the bound is 120)",
    "small-ps-eager-1g": "a 23% shift (~57k -> ~44.5k, +/-15% swings) 16 s before the log ends at 39 s: the new "
                         "level has not held the 30-s minimum and still rises (42.5k at 24-29 s, 45.7k at 29-39 s; "
                         "trend +4.8%, 95% +0.4..+9.8%); undecided to its end (the label's caveat: a reader could "
                         "call it undecided too)",
}


def params():
    for log in LOGS:
        miss = KNOWN_MISSES.get(log.name)
        yield pytest.param(log, id=log.name, marks=[pytest.mark.xfail(strict=True, reason=miss)] if miss else [])


@pytest.mark.parametrize("log", list(params()))
def test_each_labelled_real_log_gets_its_verdict_at_its_level(log):
    decision = judge(log)
    row = score(log, decision)
    assert row["got"] == log.verdict, row["reason"]
    if log.verdict != "steady":
        return
    assert abs(row["level_error"]) <= LEVEL_TOLERANCE, row
    lo, hi = decision.interval
    assert lo <= decision.steady_tok_s <= hi  # the figure lies inside its own interval
    assert row["first_declared_s"] is not None and row["first_declared_s"] <= MAX_DECLARED_S


def steady_rows() -> tuple[list[dict], list[dict]]:
    rows = [score(log, judge(log)) for log in LOGS if log.verdict == "steady"]
    return rows, [row for row in rows if row["verdict_ok"] and row["level_ok"]]


# The first verdict (issue 27's goals): what `launch --watch --until-decided`, `stop_when: steady` and `notify`
# act on. Per steady-labelled log the first steady within 5% of the label and <= 60 s after the first step
# line, a median <= 30 s. Today's misses are strict xfails (each names what the rule does there, measured with
# the rule as it is): they fail once the rule gets them right, and then leave these lists.
FIRST_WITHIN_S, FIRST_MEDIAN_S = 60, 30
FIRST_LEVEL_MISSES = {
    "tiny-thr-trees-cpu": "declared at 8,662 (+6.9%) at 81.4 s, in one of its 6-10k swings",
    "tiny-thr-localtls-cpu": "declared at 7,386 (-5.3%) at 31.4 s, in one of its 5-10k swings",
    "tiny-thr-notrees-cpu": "declared at 7,313 (-7.4%) at 22.6 s, its first 20 s of swings quiet (IQR / median "
                            "within 5%), so 15 s suffice",
    "e2p2-ps-trees": "declared at 63,859 (+6.4%) at 19.8 s, on its ~64k regime (flat for 11 s, so quiet)",
    "small-ps-eager-1g": "never steady (the 23% drop 16 s before the log's end)",
}
FIRST_LATE = {  # seconds from the first step line to the first steady, today
    "small-ps-trees": 68.4, "small-thr-nographs-g1": 97.8, "small-ps-notrees-g1": 66.1,
    "tiny-thr-trees-cpu": 81.4, "tiny-thr-eager-cpu": 122.6, "e2e2-thr-nographs": 92.2,
    "e2e3-thr-nographs": 64.1, "e2p3-ps-trees": 82.5, "small-ps-eager-1g": None,
    "small-thr-eager": 61.7,  # its noisy level must be seen 15 s after the warm-up cut: not at 35.6 s, 2 s before its shift
}
STEADY_LOGS = [log for log in LOGS if log.verdict == "steady"]


def first_params(misses: dict, why):
    for log in STEADY_LOGS:
        marks = [pytest.mark.xfail(strict=True, reason=why(misses[log.name]))] if log.name in misses else []
        yield pytest.param(log, id=log.name, marks=marks)


def first_row(log) -> dict:
    changes = timeline(log)
    return score(log, changes[-1], changes)


@pytest.mark.parametrize("log", list(first_params(FIRST_LEVEL_MISSES, str)))
def test_the_first_steady_verdict_is_at_the_labelled_level(log):
    row = first_row(log)
    assert row["first_level"] is not None, row["reason"]
    assert abs(row["first_level_error"]) <= LEVEL_TOLERANCE, row


@pytest.mark.parametrize("log", list(first_params(
    FIRST_LATE, lambda s: f"first steady {s} s after the first step line" if s else "never steady")))
def test_the_first_steady_verdict_comes_within_a_minute_of_the_first_step(log):
    row = first_row(log)
    assert row["first_s"] is not None and row["first_s"] <= FIRST_WITHIN_S, row


@pytest.mark.xfail(strict=True, reason="median 44.3 s after the first step line (28 logs; a log never steady "
                                       "counts as never)")
def test_the_first_steady_verdicts_come_a_median_30_s_after_the_first_step():
    delays = sorted(math.inf if row["first_s"] is None else row["first_s"] for row in map(first_row, STEADY_LOGS))
    assert statistics.median(delays) <= FIRST_MEDIAN_S, delays


def test_the_corpus_is_steady_on_90_percent():  # 26 of 27 with the answer at the run's end (24 before)
    rows, right = steady_rows()
    assert len(rows) >= 16 and len(right) >= 0.9 * len(rows)


def test_the_steady_verdicts_come_a_median_minute_after_the_first_step():
    rows, right = steady_rows()
    assert len(right) >= len(rows) - len(KNOWN_MISSES)
    delays = sorted(row["first_declared_s"] for row in right)
    assert delays[len(delays) // 2] <= 60


def test_noise_is_reported_not_a_gate():
    noisy = [log for log in LOGS if log.noisy and log.name not in KNOWN_MISSES]
    assert noisy
    for log in noisy:
        decision = judge(log)
        assert decision.decision == "steady" and decision.noisy and decision.noise_rel > 0.10


def test_a_log_ending_with_the_trainers_checkpointed_stop_stays_steady_and_says_it_was_stopped():
    log = next(log for log in LOGS if log.name == "qwen-ps-eager-g0")
    assert any("event=done" in line and "reason=sigterm" in line for line in log.lines())
    decision = judge(log, exit_code=75)
    assert (decision.decision, decision.ended, decision.exit_code, decision.action) == ("steady", "stopped", 75, "keep")


@pytest.mark.parametrize("name", ["e2e2-thr-nographs", "e2p2-ps-trees"])
def test_the_e2e_logs_undecided_at_5_percent_are_steady_at_the_label_at_10_percent(name):
    """What a user gets from `watch: {precision: 0.10}` on the two logs the default precision left undecided
    while their chains ran (docs/benchmarks-archive.md, the e2e timeline of 2026-12-01). e2e2-thr-nographs is first declared at ~31 s at its
    level before the shift (43.6k), then re-declared at the level after it (the next test). Noisy as labelled:
    e2p2's regimes are; e2e2's level is not (its last 4 s at ~27k, "too short to call a new level", are a
    shift suspected at the log's end, not part of the level's noise)."""
    log = next(log for log in LOGS if log.name == name)
    decision = judge(log, config=DecideConfig(precision=0.10))
    row = score(log, decision)
    assert decision.decision == "steady" and decision.noisy == log.noisy, decision.reason
    assert abs(row["level_error"]) <= LEVEL_TOLERANCE, row
    assert row["first_declared_s"] <= 35, row  # a figure within the chain's 150 s


def test_a_20_percent_shift_at_a_coarse_precision_is_recorded_with_both_levels():
    """At `precision: 0.10` e2e2-thr-nographs is declared at its level before the shift (~44k, 31 s); the ~20%
    drop at 35 s re-opens the verdict once the new level has held 30 s, and the new level (~35.5k) is declared
    with the shift recorded (before the 15% cap, 3 x 10% = 30% let the figure slide to 35.2k with none)."""
    log = next(log for log in LOGS if log.name == "e2e2-thr-nographs")
    decision = judge(log, config=DecideConfig(precision=0.10))
    row = score(log, decision)
    (shift,) = decision.evidence["steady"]["level_shifts"]
    assert abs(shift["from_tok_s"] / 44_000 - 1) < LEVEL_TOLERANCE and abs(shift["declared_tok_s"] / 35_500 - 1) < LEVEL_TOLERANCE
    assert 1_300 <= shift["at_step"] <= 1_600 and decision.warmup_end_step >= shift["at_step"]  # labelled 1,460
    assert decision.decision == "steady" and abs(row["level_error"]) <= LEVEL_TOLERANCE
    assert row["first_declared_s"] <= 35 < 60 <= row["declared_s"] <= 75, row  # declared, re-opened, declared again


@pytest.mark.parametrize("name", ["e2e2-thr-nographs", "e2p2-ps-trees"])
def test_the_e2e_bench_inventory_ends_its_chains_on_the_labelled_level(name):
    """bench/h200-e2e.yaml (what bench/gpu_dfo_e2e.sh runs) caps the undecided time at 80 s of steps: both
    e2e logs, undecided at 5% within their chains, then end steady and noisy at their labelled level, with a
    figure inside its interval, early enough for the chain's 150 s (the fallback's first step came 39-59 s
    into it)."""
    from orchestrator.inventory import load_inventory
    from orchestrator.watch import config_from_inventory

    config = config_from_inventory(load_inventory(Path(__file__).resolve().parents[2] / "bench/h200-e2e.yaml"))
    log = next(log for log in LOGS if log.name == name)
    decision = judge(log, config=config)
    row = score(log, decision)
    assert decision.decision == "steady" and decision.noisy, decision.reason
    assert abs(row["level_error"]) <= LEVEL_TOLERANCE, row
    lo, hi = decision.interval
    assert lo <= decision.steady_tok_s <= hi
    assert row["first_declared_s"] <= 90, row


def test_a_noisy_launch_bound_log_gets_its_final_answer_once_the_precision_is_out_of_reach():
    log = next(log for log in LOGS if log.name == "e2e3-thr-nographs")  # +/-15-30% swings in 5-20-s waves
    decision = judge(log)
    row = score(log, decision)
    checks = decision.evidence["steady"]["checks"]
    assert decision.decision == "steady" and decision.noisy and abs(row["level_error"]) <= LEVEL_TOLERANCE
    assert checks["decided_by"] == "precision_out_of_reach" and checks["seconds_needed"] > 600
    assert row["first_declared_s"] < 90  # not max_undecided_s (600 s): the log has 79 s of steps
    assert "precision 5% out of reach" in decision.reason and "max_undecided_s is 600" in decision.reason


@pytest.mark.parametrize("log", [log for log in LOGS if log.verdict == "steady"], ids=lambda log: log.name)
def test_no_steady_line_names_a_warm_up_end_after_the_step_it_was_declared_at(log):
    """Once steady, the re-run MSER moves the warm-up cut later as data come (e2p-ps2-trees: declared at step
    920 with the cut at 521, the cut at 1,161 from step 2,100). The reason (the watch's line, dfo replay's) said
    "after warm-up ending at step 1161" beside "steady at step 920"; now a cut named there is the declaration's,
    and a later one comes as the steps the figure is over."""
    decision = judge(log)
    if decision.decision != "steady":
        return  # a known miss (above)
    declared = decision.evidence["steady_declared_step"]
    assert decision.evidence["steady_declared_warmup_end_step"] <= declared
    for mention in re.finditer(r"warm-up ending at step (\d+)", decision.reason):
        assert int(mention[1]) <= declared, decision.reason
    first, last = decision.evidence["steady"]["figure_steps"]
    assert decision.warmup_end_step <= first <= last <= decision.evidence["last_step"]


def test_every_warming_up_line_says_what_holds_the_verdict_back():
    """The watch's line 3 while undecided names what is missing. On the block where every check first held,
    one block before the declaration (confirm_blocks is 2), it read "warming up:  (warm-up end at block 25 of
    44)" (e2p-ps2-trees at step 900; 43 step lines of 21 real logs); now "the checks hold on 1 block in a
    row, 2 needed"."""
    empty = []
    for log in LOGS:
        judge_ = RunJudge(run=log.name)
        for _, obs in judged_lines(judge_, log.lines()):
            reason = judge_.decision().reason if isinstance(obs, StepObs) else ""
            if reason.startswith("warming up:") and not re.match(r"warming up: \w", reason):
                empty.append((log.name, obs.step, reason))
    assert not empty, empty[:3]
    assert any(log.name == "e2p-ps2-trees" for log in LOGS)


@pytest.mark.parametrize("name", ["e2e2-thr-nographs", "e2p3-ps-trees"])
def test_a_fallback_run_stopped_before_its_checks_held_ends_steady_at_its_level(name):
    """dfo's e2e fallback runs, stopped by the chain's cleanup (`.exit`: 75) at 92 and 83 s: live, both stayed
    undecided to the stop (e2e2: a 20% shift at 35 s, the trend over the ~35.5k after it still -8.9..+6.5%;
    e2p3: regimes of ~45k/65k/80k, 5% projected within 250-650 s). No more steps can narrow the checks once the
    run has ended, so the answer max_undecided_s would give comes then: steady, noisy, at the labelled level."""
    log = next(log for log in LOGS if log.name == name)
    live = judge(log, exit_code=None)
    assert live.decision == "undecided", live.reason
    decision = judge(log)  # with the .exit file, as `dfo replay` reads it
    row = score(log, decision)
    assert (decision.decision, decision.ended, decision.exit_code, decision.noisy) == ("steady", "stopped", 75, True)
    assert decision.evidence["steady"]["checks"]["decided_by"] == "run_ended"
    assert "the run ended before precision 5% was reached" in decision.reason
    assert abs(row["level_error"]) <= LEVEL_TOLERANCE, row
    lo, hi = decision.interval
    assert lo <= decision.steady_tok_s <= hi and lo <= log.level <= hi
    assert decision.evidence["steady_declared_step"] == decision.evidence["last_step"]


# The crash a person reads from each crash-labelled real log's traceback (its labels.csv note), by its signature's
# name in docs/design.md's table: the H200 runs of the threads topology with CUDA graphs, where the first step fails
REAL_CRASH_SIGNATURES = {
    "small-thr-localtls-g1": "cuda_capture_unsupported",  # `operation failed due to a previous error during capture`
    "small-thr-trees-h200": "cuda_capture_unsupported",  # the same text, from plain trees in two threads
    "small-thr-notrees-h200": "cudagraph_static_ptr",  # `assert dst.data_ptr() == src.data_ptr()`, a bare AssertionError
}


def test_each_real_crash_log_is_named_by_the_signature_its_traceback_shows():
    crashes = {log.name: log for log in LOGS if log.verdict == "crash"}
    assert set(crashes) == set(REAL_CRASH_SIGNATURES)  # every crash-labelled log has its expected signature here
    for name, log in crashes.items():
        decision = judge(log)
        assert (decision.decision, decision.signature) == ("crash", REAL_CRASH_SIGNATURES[name]), (name, decision.reason)
