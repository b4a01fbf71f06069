"""A leak in time on real noise (tests/decide/realleak.py): a real log's level, played for five minutes and
leaking 0.1% a second, must not stay steady more than a minute after its declaration (issue 27's goal for a fast
leak); the same level without the leak must stay steady."""

import pytest
from realleak import held_steady_s, last_ts, leaking
from reallogs import labelled

from orchestrator.decide import replay_timeline

LOGS = {log.name: log for log in labelled()}
# compute-bound qwen3-8b-shape runs, under 1% noise: the level is pinned in a few lines, so is a fall
QUIET = ["qwen-thr-nographs-cold", "qwen-thr-notrees-cold", "qwen-thr-eager-cold", "qwen-ps-eager",
         "qwen-ps-nographs-1g"]


def replayed(name: str, rate_per_s: float) -> tuple[list, float]:
    lines, _ = leaking(LOGS[name], rate_per_s)
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
