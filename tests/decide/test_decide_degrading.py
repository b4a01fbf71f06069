"""A run that degrades after it was declared steady: dfo notices and says so.

A slow leak in time (throttling, a memory leak slowing the allocator, a neighbour ramping up) moves the newest
blocks and the ones before them together, so the level-shift rule never saw it: the verdict stayed `steady`
while the level fell, its figure the mean since the warm-up. Now a fall beyond the precision across the figure's
window re-opens it (`level_shifts` records it with `shape: decline`), and a new level is declared only once it
holds flat (docs/decisions.md, point 6b)."""

import math
import re

import pytest
from reallogs import first_step_ts, judge, labelled
from tracegen import make_trace, score

from orchestrator.decide import DecideConfig, RunJudge, StepObs, replay
from orchestrator.decide.replay import judged_lines
from orchestrator.events import LevelShift
from orchestrator.logfmt import parse_ts

LOGS = {log.name: log for log in labelled()}
STEP = re.compile(r"^ts=(\S+) event=step .*?tok_s=([\d.]+)")


def leaking(lines: list[str], from_s: float, per_s: float) -> list[str]:
    """A real log whose throughput falls by `per_s` (relative, per second) from `from_s` seconds after its
    first step line on: the same cadence, noise and dips, with a leak in time on top."""
    t0 = first_step_ts(lines)
    out = []
    for line in lines:
        found = STEP.search(line)
        if found:
            factor = math.exp(-per_s * max(0.0, parse_ts(found[1]) - t0 - from_s))
            line = line.replace(f"tok_s={found[2]}", f"tok_s={float(found[2]) * factor:.1f}", 1)
        out.append(line)
    return out


def watched(lines: list[str], **kwargs):
    """The decision after each step line, as `dfo watch` would hold it: (seconds since the first step, decision)."""
    judge_ = RunJudge(run="r", **kwargs)
    t0 = first_step_ts(lines)
    return [(obs.ts - t0, judge_.decision()) for _, obs in judged_lines(judge_, lines) if isinstance(obs, StepObs)]


def test_a_leak_starting_after_the_declaration_re_opens_the_verdict_and_says_how_fast_it_falls():
    """tiny-nographs (5,000 tok/s with single-line dips to 2-3k, 313 s, a line every 10 steps) declared steady at
    16 s; here its throughput then falls 0.1% a second from 60 s on (6% a minute). Before, it stayed `steady`
    to its end, the figure sliding with the mean (4,067 at the end, with the level at ~3,700); now the fall is
    recorded as a decline and the verdict re-opened, and the unchanged log records none."""
    lines = LOGS["tiny-nographs"].lines()
    shown = watched(leaking(lines, 60.0, 0.001))
    first = next(seconds for seconds, d in shown if d.decision == "steady")
    assert first < 60  # declared before the leak began, as on the real log
    seen = next((seconds, d) for seconds, d in shown if d.level_shifts)
    seconds, decision = seen
    [decline] = decision.level_shifts
    assert decline["shape"] == "decline" and seconds < 200, (seconds, decline)
    assert decision.decision == "undecided" and decision.reason.startswith("degrading: the level fell -") and "per minute): ~" in decision.reason, decision.reason
    # a fall beyond p whose interval excludes none (it had to exclude -p: seen ~30 s later)
    assert decline["rel_per_min"] < -0.03 and decline["change_rel"] < -0.05 and decline["change_rel_95"][1] < 0, decline
    assert decline["to_tok_s"] < 0.95 * decline["from_tok_s"] and abs(decline["from_tok_s"] / 4_950 - 1) < 0.05
    end = shown[-1][1]
    assert end.decision == "undecided" and end.steady_tok_s is None and end.reason.startswith("degrading: "), end.reason
    line = LevelShift.describe(end.level_shifts[0])
    assert line.startswith("decline (-") and "per minute) over the steps from" in line and "verdict re-opened" in line, line
    unchanged = judge(LOGS["tiny-nographs"])
    assert unchanged.decision == "steady" and unchanged.level_shifts == []


@pytest.mark.parametrize("seed", [1005, 1011, 1012, 1022, 1027])
def test_fast_leaks_declared_steady_early_do_not_stay_steady(seed):
    """tracegen's fast_leak (a step every 0.02-0.05 s, -0.05..-0.2% a second under 5-12% noise) is declared steady
    on a 30-40-s window where the leak moves the level 1-4% (a known gap, docs/benchmarks-archive.md Round 5). These five
    seeds (150-250 s of steps) stayed `steady` to their end (18 of 30 on seeds 1000-1029 did); now the decline
    re-opens them and they end as labelled: undecided (max_undecided_s not reached)."""
    trace = make_trace("fast_leak", seed)
    decision = replay(trace.lines, **trace.replay_kwargs())
    assert score(trace, decision)["verdict_ok"], decision.reason
    assert [s["shape"] for s in decision.level_shifts][-1:] == ["decline"], decision.level_shifts


def decline_params():
    for log in LOGS.values():
        for precision in (0.03, 0.05, 0.10):
            marks = [pytest.mark.xfail(strict=True, reason=(
                "its dip to ~4.2k over its last ~20 s after a slow creep down: -3.8% over 173 s (95% -7.1..-0.7%), "
                "a fall beyond 3% whose interval excludes 0, on every look for 5 s; the decline rule asked for its "
                "interval below -p for 30 s, which held a leak of 0.1%/s steady 100-160 s"))] if (
                log.name, precision) == ("tiny-nographs", 0.03) else []
            yield pytest.param(log, precision, id=f"{log.name}-{precision}", marks=marks)


@pytest.mark.parametrize("log,precision", list(decline_params()))
def test_no_real_log_records_a_decline(log, precision):
    """The real logs' slow swings (+/-10-15% for 10-30 s on busy hosts) and the tiny CPU runs' creep are not
    declines, at 3%, 5% or 10% (but tiny-nographs at 3%, above): a fall must exceed p across at least 60 s, the
    newest 15 s be p / 2 below the figure, on every look for 5 s."""
    decision = judge(log, config=DecideConfig(precision=precision))
    assert [s for s in decision.level_shifts if s["shape"] == "decline"] == [], decision.reason


# ---------------------------------------------------------------- memory climbing toward OOM

H200_MIB = 143_771  # nvidia-smi's memory.total of an H200


def with_gpu_samples(lines: list[str], used_mib) -> list:
    """A real log's observations with a GPU sample every second in between, as `dfo watch` feeds them
    (nvidia-smi -lms 1000): used_mib(seconds since the first step line) -> GPU 0's memory.used."""
    from orchestrator.decide import GpuObs
    from orchestrator.decide.replay import judged_lines as _  # noqa: F401 (the same parser as replay)
    from orchestrator.logfmt import make_parser
    from orchestrator.decide import observation_from_record

    t0, parse, out = first_step_ts(lines), make_parser(None), []
    next_sample = t0
    for line in lines:
        record = parse(line)
        ts = getattr(record, "ts", None)
        if ts is None:
            continue
        while next_sample <= ts:
            gpu = {"index": 0, "mem_used_mib": float(used_mib(next_sample - t0)), "mem_total_mib": H200_MIB, "util_pct": 97}
            out.append(GpuObs(next_sample, (gpu,)))
            next_sample += 1.0
        out.append(observation_from_record(record, ts))
    return out


def fed(observations):
    judge_ = RunJudge(run="qwen")
    t0 = next(o.ts for o in observations if isinstance(o, StepObs))
    shown = [(getattr(o, "ts", t0) - t0, judge_.feed(o)) for o in observations]
    return judge_, shown


def staircase(start_s: float, mib_per_s: float, every_s: float = 4.0):
    """The caching allocator's growth: memory.used jumps by a segment every few seconds, flat in between."""
    return lambda t: 31_250 + (math.floor(max(0.0, t - start_s) / every_s) * every_s * mib_per_s if t >= start_s else 0)


def test_gpu_memory_climbing_after_the_declaration_is_said_beside_the_steady_figure():
    """qwen-ps-eager (6,915 tok/s, a line every ~1.5 s, declared at ~15 s) with GPU 0's memory.used sampled every
    second: flat at 30.5 GiB, then from 60 s on +40 MiB a second in 160-MiB steps (a tensor kept per step).
    Before, the verdict said `steady` with nothing about it until the out-of-memory crash; now, ~1.5 GiB up
    and still climbing on every look for 30 s, the decision says `degrading` (which GPU, how fast, full when)
    and the reason says it, while the verdict and its figure stay the run's (the throughput is steady)."""
    lines = LOGS["qwen-ps-eager"].lines()
    judge_, shown = fed(with_gpu_samples(lines, staircase(60.0, 40.0)))
    flagged = [(s, d) for s, d in shown if d.degrading is not None]
    assert flagged, shown[-1][1].reason
    seconds, first = flagged[0]
    # (the rate is taken from the declaration on: declared at ~15 s, not ~19 s, it starts with 4 s more of flat
    # samples and is flagged at ~152 s, not ~139 s)
    assert 60 + 30 < seconds < 160 and first.decision == "steady", (seconds, first.reason)
    degrading = first.degrading
    assert degrading["what"] == "gpu_memory" and degrading["gpu"] == 0 and degrading["total_gib"] == round(H200_MIB / 1024, 2)
    # the rate is taken over the samples since the declaration (~15 s), the first ~45 s of them flat: below the
    # climb's own 2.34 GiB/min (it read 1.8-2.8 while the declaration came at ~49 s)
    assert 1.4 < degrading["gib_per_min"] < 2.8 and degrading["now_gib"] - degrading["from_gib"] >= 1.4
    assert 40 * 60 < degrading["full_in_s"] < 80 * 60  # (140 - 32) GiB at ~2.3 GiB/min
    assert "; degrading: GPU 0 memory 30.5 -> " in first.reason and "an out-of-memory crash is likely" in first.reason
    end = shown[-1][1]
    assert end.decision == "steady" and abs(end.steady_tok_s / 6_915 - 1) < 0.05 and end.degrading is not None
    assert end.to_json()["degrading"]["what"] == "gpu_memory"


@pytest.mark.parametrize("used", [
    staircase(1e9, 0.0),  # flat
    lambda t: 31_250 + (2_048 if t >= 90 else 0),  # one step up of 2 GiB (an eval's buffers), then flat
    lambda t: 20_000 + min(t, 45.0) * 250,  # growing through the warm-up only, flat from 45 s
    lambda t: 31_250 + (t % 20 < 10) * 1_536,  # 1.5 GiB taken and given back every 20 s
])
def test_memory_that_does_not_keep_climbing_is_not_degrading(used):
    _, shown = fed(with_gpu_samples(LOGS["qwen-ps-eager"].lines(), used))
    assert all(d.degrading is None for _, d in shown) and shown[-1][1].decision == "steady"


def test_the_trainers_own_memory_figure_climbing_is_said_by_dfo_replay_too():
    """Without GPU samples (`dfo replay` of a log): the trainer's mem_gb (its peak allocated) climbing from
    0.79 GB by 10 MB a second from 60 s on (tiny-nographs, declared at 30 s) is said the same way, with no
    total and so no time to full."""
    lines, t0 = LOGS["tiny-nographs"].lines(), first_step_ts(LOGS["tiny-nographs"].lines())

    def climbing(line):
        found = STEP.search(line)
        if not found:
            return line
        seconds = parse_ts(found[1]) - t0
        return line.replace("mem_gb=0.79", f"mem_gb={0.79 + max(0.0, seconds - 60) * 0.01:.2f}")

    decision = replay([climbing(line) for line in lines], run="tiny")
    assert decision.decision == "steady" and decision.degrading["what"] == "memory_peak", decision.reason
    assert decision.degrading["full_in_s"] is None and 0.4 < decision.degrading["gib_per_min"] < 0.7
    assert "degrading: the trainer's peak memory (mem_gb) 0.7 -> " in decision.reason
    assert replay(lines, run="tiny").degrading is None


def test_memory_starting_to_climb_is_news_to_the_watch():
    """`dfo watch` records and sends a decision only when its key changes (decide.decision_key); the verdict
    and figure stay when memory climbs, so `degrading` is part of the key: else the watch's view, its --json
    decisions and the registry kept the decision from before the climb."""
    from orchestrator.decide import decision_key

    _, shown = fed(with_gpu_samples(LOGS["qwen-ps-eager"].lines(), staircase(60.0, 40.0)))
    before = next(d for _, d in shown if d.decision == "steady")
    after = next(d for _, d in shown if d.degrading is not None)
    assert (before.decision, before.action) == (after.decision, after.action)
    assert decision_key(before) != decision_key(after)


def test_memory_still_climbing_when_the_run_ends_is_kept_in_its_last_decision():
    """`degrading` is null once the run ended (it says what happens now), so the decision `dfo watch` ends on (its
    `final` line, the stored decision, `dfo replay` with the exit status) said nothing of a climb that went on
    to the end; now `degrading_at_end` keeps its measure then, and the reason says it. tiny-nographs with its
    mem_gb climbing 10 MB a second from 60 s, exiting 0; the same log without the climb keeps null."""
    lines, t0 = LOGS["tiny-nographs"].lines(), first_step_ts(LOGS["tiny-nographs"].lines())

    def climbing(line):
        found = STEP.search(line)
        if not found:
            return line
        return line.replace("mem_gb=0.79", f"mem_gb={0.79 + max(0.0, parse_ts(found[1]) - t0 - 60) * 0.01:.2f}")

    decision = replay([climbing(line) for line in lines], run="tiny", exit_code=0)
    assert (decision.decision, decision.ended, decision.degrading) == ("steady", "exited", None)
    assert decision.degrading_at_end["what"] == "memory_peak" and 0.4 < decision.degrading_at_end["gib_per_min"] < 0.7
    assert decision.reason.endswith(f"; then exited 0; memory was climbing: the trainer's peak memory (mem_gb) 0.7 -> "
                                    f"{decision.degrading_at_end['now_gib']:,.1f} GiB since "
                                    f"{decision.degrading_at_end['since_at']} (+0.56 GiB/min)"), decision.reason
    assert decision.to_json()["degrading_at_end"] == decision.degrading_at_end
    unchanged = replay(lines, run="tiny", exit_code=0)
    assert unchanged.degrading_at_end is None and "memory was climbing" not in unchanged.reason


def test_a_crash_after_gpu_memory_climbed_says_the_climb():
    """qwen-ps-eager with GPU 0 climbing 40 MiB/s from 60 s (said as `degrading` at ~144 s), then the trainer's
    CUDA out-of-memory error: the crash verdict keeps the climb that led to it in `degrading_at_end` and its
    reason; before, the crash said nothing of it (`degrading` is null on a crash)."""
    from orchestrator.decide import LineObs

    judge_, shown = fed(with_gpu_samples(LOGS["qwen-ps-eager"].lines(), staircase(60.0, 40.0)))
    assert shown[-1][1].degrading is not None
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB"
    crash = judge_.feed(LineObs(judge_.now + 1, oom))
    assert (crash.decision, crash.signature, crash.degrading) == ("crash", "cuda_oom", None), crash.reason
    assert crash.degrading_at_end["what"] == "gpu_memory" and crash.degrading_at_end["gpu"] == 0
    assert "; memory was climbing: GPU 0 memory 30.5 -> " in crash.reason and re.search(r"\(\+[12]\.\d+ GiB/min\)", crash.reason), crash.reason
