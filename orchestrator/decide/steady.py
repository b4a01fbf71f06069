"""Online warm-up truncation and steady-state detection over per-step throughput.

The rule (docs/decisions.md has the reasoning and the evidence):
1. Steps marked eval/checkpoint/warmup are dropped; the rest form blocks of `block_size` steps whose
   MEDIANS are the series (a single-step dip cannot move a block median). Steps are counted by the step
   numbers the trainer reports: a line covers the steps since the previous line (its tok_s is the mean over
   that logging interval, by the metric-line contract), so a trainer logging every 10 steps closes a block
   with each line, one logging every step with every 5th line. Every rule below then sees the same number
   of blocks, each worth at least `block_size` steps, whatever the logging interval.
2. On every new block, MSER over the block medians picks the truncation point d*; it is accepted only in
   the first half of the series and with at least `min_blocks_after_warmup` blocks after it.
3. After d*: first- vs second-half medians within `stable_rel`, IQR/median <= `max_iqr_rel`, the Theil-Sen
   slope moves the level by <= `stable_rel` over the window (projected over at least
   `drift_horizon_blocks`, so a slow leak is not taken for a level), the newest block lies inside the window's
   Tukey fence, and the 95% interval's half-width is within `max_interval_rel` of the level. Steady once every check (and the minimum steps AND seconds since the first step) holds for
   `confirm_blocks` consecutive new blocks. Undecided beats wrong.
4. The steady figure is the median of the raw steps after d*; its 95% interval comes from batch means.
5. Once steady, `shift_blocks` block medians in a row more than `shift_rel` away on one side re-open the
   verdict: the analysis restarts at the shift (a recompile, throttling, an over-long autotuning stretch).

Cost: work happens once per block, on at most `ANALYSIS_BLOCKS` recent blocks, with prefix sums for MSER
and a bounded Theil-Sen sample. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import fmean, median, quantiles

from .config import DecideConfig
from .observations import StepObs

DROPPED_PHASES = frozenset({"eval", "checkpoint", "warmup"})
ANALYSIS_BLOCKS = 400  # a run not settled after 400 blocks is judged on its most recent 400 only
THEIL_SEN_POINTS = 40  # slopes over at most 40 evenly spaced points: 780 pairs
MAX_ESTIMATE_BLOCKS = 200  # the steady figure stops being refined after 200 blocks past d*
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145)


@dataclass
class SteadyEstimate:
    """The current answer: steady or not, and when steady the figure, its interval and the evidence."""

    steady: bool = False
    tok_s: float | None = None
    interval: tuple[float, float] | None = None
    warmup_end_step: int | None = None
    declared_step: int | None = None
    declared_ts: float | None = None
    reason: str = "waiting for steps"
    evidence: dict = field(default_factory=dict)


def mser_truncation(prefix1: list[float], prefix2: list[float], start: int, end: int, min_after: int) -> int | None:
    """MSER: the d in [start, end - min_after] minimising SSE(Y[d:end]) / (end - d)^2, from prefix sums."""
    best_d, best_stat = None, math.inf
    for d in range(start, end - min_after + 1):
        count = end - d
        s1 = prefix1[end] - prefix1[d]
        s2 = prefix2[end] - prefix2[d]
        stat = max(s2 - s1 * s1 / count, 0.0) / (count * count)
        if stat < best_stat:
            best_d, best_stat = d, stat
    return best_d


def theil_sen_slope(values: list[float]) -> float:
    """Median of pairwise slopes over at most THEIL_SEN_POINTS evenly spaced points (index units)."""
    n = len(values)
    if n < 2:
        return 0.0
    stride = max(1, math.ceil(n / THEIL_SEN_POINTS))
    points = [(i, values[i]) for i in range(0, n, stride)]
    slopes = [(yj - yi) / (j - i) for a, (i, yi) in enumerate(points) for (j, yj) in points[a + 1 :]]
    return median(slopes)


def batch_means_interval(values: list[float]) -> tuple[float, float]:
    """95% interval of the level from contiguous batch means (at most 10 batches, t quantiles)."""
    batches = min(10, len(values) // 2)
    if batches < 2:
        return (min(values), max(values))
    size = len(values) // batches
    tail = values[len(values) - batches * size :]
    means = [fmean(tail[i * size : (i + 1) * size]) for i in range(batches)]
    centre = fmean(means)
    spread = math.sqrt(math.fsum((m - centre) ** 2 for m in means) / (batches - 1) / batches)
    t = T_975[min(batches - 2, len(T_975) - 1)]
    return (centre - t * spread, centre + t * spread)


def stability_checks(window: list[float], config: DecideConfig) -> dict:
    """The checks of rule 3 over the block medians after d*; `ok` when all of them pass."""
    level = median(window)
    half = len(window) // 2
    halves_rel = abs(median(window[half:]) - median(window[:half])) / level
    q1, _, q3 = quantiles(window, n=4)
    iqr_rel = (q3 - q1) / level
    horizon = max(len(window) - 1, config.drift_horizon_blocks)
    drift_rel = abs(theil_sen_slope(window)) * horizon / level
    lo, hi = batch_means_interval(window)
    precision_rel = (hi - lo) / 2 / level
    reach = max(1.5 * (q3 - q1), 0.01 * level)
    newest_inside = q1 - reach <= window[-1] <= q3 + reach
    ok = (
        halves_rel <= config.stable_rel
        and iqr_rel <= config.max_iqr_rel
        and drift_rel <= config.stable_rel
        and newest_inside
        and precision_rel <= config.max_interval_rel
    )
    return {
        "ok": ok,
        "halves_rel": round(halves_rel, 4),
        "iqr_rel": round(iqr_rel, 4),
        "drift_rel": round(drift_rel, 4),
        "newest_block_inside": newest_inside,
        "interval_half_width_rel": round(precision_rel, 4),
    }


class SteadyDetector:
    """Feed StepObs in step order; read `estimate`. Work is done once per completed block."""

    def __init__(self, config: DecideConfig) -> None:
        self.config = config
        self.estimate = SteadyEstimate()
        self.first_step: int | None = None
        self.first_ts: float | None = None
        self.last_step: int | None = None
        self.last_ts: float | None = None
        self._pending: list[float] = []
        self._pending_first_step: int | None = None
        self._pending_steps = 0  # steps the pending lines stand for, by their step numbers
        self._raw: list[list[float]] = []  # raw tok/s of each block
        self._block_first_step: list[int] = []
        self._medians: list[float] = []
        self._prefix1: list[float] = [0.0]
        self._prefix2: list[float] = [0.0]
        self._good_blocks_in_a_row = 0
        self._scale: float | None = None
        self._truncation: int | None = None
        self._origin = 0  # analysis starts here (moves on a level shift)
        self.shifts: list[dict] = []

    def feed(self, obs: StepObs) -> bool:
        """Take one step; True when the estimate changed (a block completed)."""
        if self.last_step is not None and obs.step <= self.last_step:
            return False
        if self.first_step is None:
            self.first_step, self.first_ts = obs.step, obs.ts
        covered = obs.step - self.last_step if self.last_step is not None else 1  # steps this line stands for
        self.last_step, self.last_ts = obs.step, obs.ts
        if obs.phase in DROPPED_PHASES or not (math.isfinite(obs.tok_s) and obs.tok_s > 0):
            return False
        if not self._pending:
            self._pending_first_step, self._pending_steps = obs.step - covered + 1, 0
        self._pending.append(obs.tok_s)
        self._pending_steps += covered
        if self._pending_steps < self.config.block_size:
            return False
        self._close_block()
        return True

    def _close_block(self) -> None:
        block, self._pending = self._pending, []
        block_median = median(block)
        self._scale = self._scale or block_median
        scaled = block_median / self._scale  # prefix sums of squares stay well-conditioned
        self._raw.append(block)
        self._block_first_step.append(self._pending_first_step or 0)
        self._medians.append(block_median)
        self._prefix1.append(self._prefix1[-1] + scaled)
        self._prefix2.append(self._prefix2[-1] + scaled * scaled)
        if self.estimate.steady and not self._level_shifted():
            self._refine()
        elif not self.estimate.steady:
            self._analyse()

    def _level_shifted(self) -> bool:
        recent = self._medians[-self.config.shift_blocks :]
        level = self.estimate.tok_s
        if len(self._medians) - self._truncation < self.config.shift_blocks:
            return False
        high = all(m > level * (1 + self.config.shift_rel) for m in recent)
        low = all(m < level * (1 - self.config.shift_rel) for m in recent)
        if not (high or low):
            return False
        self._origin = len(self._medians) - self.config.shift_blocks
        self.shifts.append({"from_tok_s": level, "to_tok_s": median(recent), "at_step": self._block_first_step[self._origin]})
        self.estimate = SteadyEstimate(reason=f"level shifted from {level:,.0f} to {median(recent):,.0f} tok/s; re-estimating")
        self._good_blocks_in_a_row, self._truncation = 0, None
        self._analyse()
        return True

    def _minimums_met(self) -> tuple[bool, str]:
        steps = self.last_step - self.first_step
        seconds = self.last_ts - self.first_ts
        if steps < self.config.min_steady_steps or seconds < self.config.min_steady_seconds:
            return False, (
                f"{steps} steps / {seconds:.0f} s since the first step "
                f"(need {self.config.min_steady_steps} / {self.config.min_steady_seconds:.0f})"
            )
        return True, ""

    def _analyse(self) -> None:
        n = len(self._medians)
        start = max(self._origin, n - ANALYSIS_BLOCKS)
        need_after = self.config.min_blocks_after_warmup
        d = mser_truncation(self._prefix1, self._prefix2, start, n, need_after) if n - start >= need_after else None
        if d is None or d - start > (n - start) // 2:
            self._good_blocks_in_a_row = 0
            self._undecided(f"warming up: {n} blocks, no warm-up end with {need_after} blocks after it yet", d)
            return
        checks = stability_checks(self._medians[d:], self.config)
        minimums_ok, minimums_why = self._minimums_met()
        self._good_blocks_in_a_row = self._good_blocks_in_a_row + 1 if checks["ok"] and minimums_ok else 0
        if self._good_blocks_in_a_row < self.config.confirm_blocks:
            why = "not stable yet" if not checks["ok"] else minimums_why or "confirming"
            self._undecided(f"warming up: {why} (warm-up end at block {d} of {n})", d, checks)
            return
        self._truncation = d
        self._refine(checks)
        self.estimate.steady = True
        self.estimate.declared_step, self.estimate.declared_ts = self.last_step, self.last_ts

    def _undecided(self, reason: str, d: int | None, checks: dict | None = None) -> None:
        if self.shifts:
            reason += f" after a level shift at step {self.shifts[-1]['at_step']}"
        self.estimate.reason = reason
        self.estimate.evidence = {"blocks": len(self._medians), "truncation_block": d, "checks": checks}
        if self.shifts:
            self.estimate.evidence["level_shifts"] = self.shifts

    def _refine(self, checks: dict | None = None) -> None:
        d = self._truncation
        if len(self._medians) - d > MAX_ESTIMATE_BLOCKS and self.estimate.tok_s is not None:
            return
        raw_after = [value for block in self._raw[d:] for value in block]
        steady_tok_s = median(raw_after)
        lo, hi = batch_means_interval(self._medians[d:])
        self.estimate.tok_s = steady_tok_s
        self.estimate.interval = (lo, hi)
        self.estimate.warmup_end_step = self._block_first_step[d]
        self.estimate.reason = (
            f"steady at {steady_tok_s:,.0f} tok/s (95% {lo:,.0f}..{hi:,.0f}) after warm-up ending at step "
            f"{self._block_first_step[d]}"
        )
        self.estimate.evidence = {
            "blocks": len(self._medians),
            "truncation_block": d,
            "steps_used": self.last_step - self._block_first_step[d] + 1,  # by step number
            "lines_used": len(raw_after),
            "steps_used_from": self._block_first_step[d],
            "checks": checks if checks is not None else self.estimate.evidence.get("checks"),
        }
        if self.shifts:
            self.estimate.evidence["level_shifts"] = self.shifts
