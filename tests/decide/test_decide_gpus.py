"""The idle-GPU detector on synthetic GPU samples, and the verdicts that name the GPU that went idle first."""

from __future__ import annotations

from orchestrator.decide import ExitObs, GpuObs, RunJudge, StepObs
from orchestrator.decide.gpus import IdleGpuDetector, first_idle_gpu
from orchestrator.logfmt import format_ts

T0 = 1_800_000_000.0


def sample(t: float, *utils: float) -> GpuObs:
    return GpuObs(T0 + t, tuple({"index": i, "mem_used_mib": 40000, "mem_total_mib": 143771, "util_pct": u}
                                for i, u in enumerate(utils)))


def trace(*rows: tuple[float, ...]) -> list[GpuObs]:
    """One sample per second; row k = the utilisations of GPU 0, 1, ... at second k."""
    return [sample(k, *row) for k, row in enumerate(rows)]


def test_gpu_that_drops_to_zero_while_the_other_stays_busy_is_flagged_with_its_first_idle_time():
    samples = trace((90, 85), (92, 88), (100, 0), (100, 0), (100, 1), (100, 0))
    idle = first_idle_gpu(samples)
    assert (idle.index, idle.since, idle.flagged_at, idle.busy) == (1, T0 + 2, T0 + 4, (0,))
    assert idle.describe() == f"GPU 1 went idle first at {format_ts(T0 + 2)} (GPU 0 still busy)"


def test_short_dips_gpus_idle_together_and_never_busy_gpus_are_not_flagged():
    assert first_idle_gpu(trace((90, 85), (90, 0), (90, 0), (90, 80), (90, 0))) is None  # 2 samples only
    assert first_idle_gpu(trace((90, 85), (0, 0), (0, 0), (0, 0), (0, 0))) is None  # the whole run stopped
    assert first_idle_gpu(trace((90, 0), (90, 0), (90, 0), (90, 0))) is None  # GPU 1 never worked
    assert first_idle_gpu(trace((90, 85), (90, 3), (90, 0), (90, 2))) is not None  # ~0 counts as idle


def test_the_earliest_of_two_idle_gpus_is_named_and_recovery_clears_a_flag():
    samples = trace((80, 80, 80), (80, 0, 80), (80, 0, 80), (80, 0, 0), (80, 0, 0), (80, 0, 0))
    detector = IdleGpuDetector()
    for obs in samples:
        detector.feed(obs)
    assert sorted((g.index, g.since) for g in detector.flagged.values()) == [(1, T0 + 1), (2, T0 + 3)]
    assert (detector.first().index, detector.first().busy) == (1, (0,))
    detector = IdleGpuDetector()
    flags = [detector.feed(obs) for obs in trace((80, 80), (80, 0), (80, 0), (80, 0), (80, 70))]
    assert [len(f) for f in flags] == [0, 0, 0, 1, 0] and detector.first() is None  # it got busy again


def test_a_flag_survives_the_others_going_idle_when_the_run_dies():
    samples = trace((90, 85), (100, 0), (100, 0), (100, 0), (0, 0), (0, 0))
    assert first_idle_gpu(samples).index == 1


def test_crash_reason_and_evidence_name_the_gpu_that_went_idle_first():
    judge = RunJudge(run="r1")
    judge.observe(StepObs(T0, 20, 50_000.0, 3.0))
    for obs in trace((90, 85), (100, 0), (100, 0), (100, 0)):
        judge.observe(obs)
    decision = judge.feed(ExitObs(T0 + 5, 1))
    assert decision.decision == "crash"
    assert decision.reason.endswith(f"GPU 1 went idle first at {format_ts(T0 + 1)} (GPU 0 still busy)")
    assert decision.evidence["gpu_idle_first"]["gpu"] == 1
    healthy = RunJudge(run="r2")
    healthy.observe(StepObs(T0, 20, 50_000.0, 3.0))
    for obs in trace((90, 85), (0, 0), (0, 0), (0, 0)):
        healthy.observe(obs)
    assert "gpu_idle_first" not in healthy.feed(ExitObs(T0 + 5, 1)).evidence
