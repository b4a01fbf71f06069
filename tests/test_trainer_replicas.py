"""The multi-GPU checks on CPU "devices": the done line reports every replica's weights hash (threads and
procsplit), and debug.fail_idle_s makes one drafter stop working before it raises, so the run ends non-zero
only after that pause (on a GPU machine: that drafter's GPU goes idle first)."""

from __future__ import annotations

import time

import pytest

from trainer_helpers import run_trainer

TWO_CPU_DRAFTERS = ("--set", "run.drafters=cpu,cpu")


def hashes(done_fields: dict) -> list[str]:
    return done_fields["replica_hashes"].split(",")


@pytest.mark.slow
def test_threaded_done_line_reports_equal_hashes_per_replica(tmp_path):
    result = run_trainer(tmp_path, "hashes", *TWO_CPU_DRAFTERS, "--steps", "6", "--log-every", "3", timeout=120)
    assert result.code == 0, result.stderr[-2000:]
    done = result.events("done")[0].fields
    first, second = hashes(done)
    assert first == second and len(first) == 12 and done["replicas"] == "identical"
    other_seed = run_trainer(tmp_path, "seed7", *TWO_CPU_DRAFTERS, "--steps", "6", "--set", "run.seed=7",
                             timeout=120)
    assert hashes(other_seed.events("done")[0].fields)[0] != first  # the hash follows the weights


@pytest.mark.slow
def test_procsplit_done_line_reports_one_hash_per_rank(procsplit_two_drafter_run):
    result = procsplit_two_drafter_run  # procsplit, *TWO_CPU_DRAFTERS (tests/conftest.py; test_procsplit.py's run)
    assert result.code == 0, result.stderr[-3000:]
    done = result.events("done")[0].fields
    assert len(hashes(done)) == 2 and len(set(hashes(done))) == 1 and done["replicas"] == "identical"


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["threads", "procsplit"])
def test_fail_idle_s_pauses_the_failing_drafter_then_the_run_exits_1(tmp_path, topology):
    started = time.monotonic()
    result = run_trainer(tmp_path, "idle", "--topology", topology, *TWO_CPU_DRAFTERS, "--steps", "50",
                         "--log-every", "1", "--set", "debug.fail_at_step=3", "--set", "debug.fail_drafter=1",
                         "--set", "debug.fail_idle_s=4", timeout=240)
    assert result.code == 1, result.stderr[-3000:]
    assert "injected failure in drafter 1" in result.stderr
    assert "drafter1" in result.events("error")[0].fields["reason"]
    steps = result.steps
    assert steps and max(s.step for s in steps) <= 4  # drafter 0 waits for its peer: no step runs past it
    last_step_ts = steps[-1].ts
    error_ts = result.events("error")[0].ts
    assert error_ts - last_step_ts >= 3.5  # the pause happened between the last step and the failure
    assert time.monotonic() - started >= 4
