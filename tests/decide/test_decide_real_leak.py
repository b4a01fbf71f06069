"""Leaks and drops on real noise (tests/decide/realleak.py): a real log's level, played for five minutes and
leaking 0.1% a second, must not stay steady more than a minute after its declaration (issue 27's goal for a fast
leak); the same level without the leak must stay steady; a 12% drop that holds must be re-opened and the new
level declared within a minute (issue 27's goal for a drop after the declaration)."""

import pytest
from realleak import held_steady_s, last_ts, played
from reallogs import first_step_ts, labelled

from orchestrator.decide import replay_timeline
from orchestrator.logfmt import parse_ts

LOGS = {log.name: log for log in labelled()}
# compute-bound qwen3-8b-shape runs, under 1% noise: the level is pinned in a few lines, so is a fall
QUIET = ["qwen-thr-nographs-cold", "qwen-thr-notrees-cold", "qwen-thr-eager-cold", "qwen-ps-eager",
         "qwen-ps-nographs-1g"]


def replayed(name: str, rate_per_s: float) -> tuple[list, float]:
    lines = played(LOGS[name], rate_per_s).lines
    return replay_timeline(lines, run=name), last_ts(lines)


@pytest.mark.parametrize("name", QUIET)
def test_a_quiet_real_run_leaking_a_tenth_of_a_percent_a_second_is_reopened_within_a_minute(name):
    """The decline rule looked for the newest 15 s only after the re-run warm-up cut, which a leak keeps moving
    later (its start looks like a warm-up's tail) until fewer than 15 s were left after it: the fall was never
    looked at, and these runs stayed steady 59-288 s after their declaration (qwen-thr-eager-cold to the end of
    its five minutes, 23% down). The newest 15 s are now taken after the declaration's cut: 52-54 s."""
    changes, end_ts = replayed(name, 0.001)
    assert changes[-1].decision != "steady", changes[-1].reason
    assert held_steady_s(changes, end_ts) <= 60, [(c.decision, c.at_ts) for c in changes]
    assert any(shift["shape"] == "decline" for shift in changes[-1].level_shifts)


@pytest.mark.parametrize("name", QUIET)
def test_the_same_real_level_without_a_leak_stays_steady_for_five_minutes(name):
    changes, _ = replayed(name, 0.0)
    assert [c.decision for c in changes[1:]] == ["steady", "steady"], [(c.decision, c.reason) for c in changes]
    assert not changes[-1].level_shifts


@pytest.mark.xfail(strict=True, reason="known limit: a noisy run's real swings (+/-10-20% over 10-30 s) hide a "
                   "0.1%/s leak for more than a minute after the declaration (docs/decisions.md, point 6b)")
def test_a_noisy_real_run_leaking_a_tenth_of_a_percent_a_second_is_reopened_within_a_minute():
    changes, end_ts = replayed("e2p-ps2-trees", 0.001)
    assert held_steady_s(changes, end_ts) <= 60


def after_a_drop(name: str, rel: float = 0.12, at_s: float = 150.0) -> tuple[list, float, float]:
    """The timeline of `name`'s level dropping by `rel` at `at_s` s and holding 180 s; the drop's moment on the
    timeline's clock, and the new level."""
    lines = played(LOGS[name], duration_s=at_s + 180, drop=(at_s, rel)).lines
    return replay_timeline(lines, run=name), first_step_ts(lines) + at_s, LOGS[name].level * (1 - rel)


@pytest.mark.parametrize("name", QUIET)
def test_a_quiet_real_run_whose_level_drops_12_percent_is_reopened_and_the_new_level_declared_within_a_minute(name):
    """Issue 27's goal for a drop after the declaration, on real noise: 17-19 s on these runs."""
    changes, drop_ts, new_level = after_a_drop(name)
    before = [c for c in changes if parse_ts(c.at_ts) < drop_ts]
    assert before[-1].decision == "steady" and abs(before[-1].steady_tok_s / LOGS[name].level - 1) <= 0.05
    declared = next(parse_ts(c.at_ts) - drop_ts for c in changes[:-1] if parse_ts(c.at_ts) >= drop_ts
                    and c.decision == "steady" and abs(c.steady_tok_s / new_level - 1) <= 0.05)
    assert declared <= 60, declared
    end = changes[-1]
    assert end.decision == "steady" and abs(end.steady_tok_s / new_level - 1) <= 0.05, end.reason
    assert [shift["shape"] for shift in end.level_shifts] == ["step"]


@pytest.mark.xfail(strict=True, reason="known limit: on a run whose noise is above the quiet bound a 12% drop is "
                   "under the 15% shift threshold, and the decline rule does not take it for a fall either: the "
                   "figure slides to a blend of both levels (+3.9% of the new one after 180 s), never re-opened")
def test_a_noisier_real_run_whose_level_drops_12_percent_is_reopened():
    changes, drop_ts, _ = after_a_drop("e2p-ps2-trees")
    assert any(c.decision != "steady" for c in changes[1:] if parse_ts(c.at_ts) >= drop_ts)


@pytest.mark.parametrize("name", [*QUIET, "small-ps-trees", "small-thr-nographs-g1"])
def test_unmarked_eval_pauses_on_real_noise_give_the_training_rate_and_the_wall_clock_rate_beside_it(name):
    """A 10-s pause every 40 s that the trainer does not mark, the line after it carrying it in its tok_s: the
    figure is the one the same run gives without pauses (the quiet runs within 0.1%, the two noisy ones 0.7% and
    1.1%), every pause is counted, and the wall-clock rate is the figure x trained / elapsed seconds."""
    plain = replay_timeline(played(LOGS[name]).lines, run=name)[-1]
    run = played(LOGS[name], pauses=(40.0, 10.0))
    paused = replay_timeline(run.lines, run=name)[-1]
    assert paused.decision == "steady" and paused.rate == "train", paused.reason
    assert abs(paused.steady_tok_s / plain.steady_tok_s - 1) <= 0.02, (paused.steady_tok_s, plain.steady_tok_s)
    pauses = paused.evidence["steady"]["pauses"]
    assert pauses["lines"] == round(run.paused_s / 10.0), pauses
    elapsed = last_ts(run.lines) - first_step_ts(run.lines)
    assert abs(pauses["wall_tok_s"] / (plain.steady_tok_s * (1 - run.paused_s / elapsed)) - 1) <= 0.02, pauses
