"""Online warm-up truncation and steady-state detection over per-step throughput, at a user-set precision.

Steady means "the level stopped moving", not "the noise is small" (docs/decisions.md has the reasoning and
the evidence). With p = `precision` (default 5%):
1. Steps marked eval/checkpoint/warmup are dropped; the rest form blocks of `block_size` steps (counted by
   the step numbers the trainer reports: a line stands for the steps since the previous line) whose MEDIANS
   are the series, so a single-step dip cannot move it. A line taking PAUSE_GAP_FACTOR x the usual seconds per
   step is an unmarked pause (an eval the trainer did not mark) and is dropped too (`_paused`): the figure is
   the training rate, and `pauses` counts them.
2. On every new block, MSER-5 over the block medians picks the truncation point d*; it is accepted only in
   the first 3/4 of the series (MSER_LATEST) and with at least `min_blocks_after_warmup` blocks after it, or
   QUIET_MIN_BLOCKS on a run that logs 2+ steps a line and is quiet after the cut (`_quiet_cut`).
3. After d*, both of:
   - no trend larger than p over the window is plausible: the Theil-Sen slope's 95% confidence interval
     (Sen 1968, its variance widened for the autocorrelation), projected over the window, lies within +/- p
     of the level (Mann-Kendall on the same points is reported beside it);
   - the level's 95% interval is within +/- p: the level is the mean of batch means, batches as long as the
     series' autocorrelation time, the interval from their spread with the effective sample size.
   The trend's horizon is trend_horizon_steps, or HORIZON_LINES lines where a line stands for 2+ steps
   (`_horizon_steps`: a line is one rate measurement), whichever is fewer steps.
   Steady once both hold, and the minimum steps AND seconds since the first step are met (no minimum steps
   on a quiet window of lines of 2+ steps each: its lines are the evidence, `_quiet_cut`; the seconds:
   QUIET_SECONDS_SHARE x min_steady_seconds on a quiet run, whose intervals vary within the precision and
   QUIET_REL, shift_hold_s on any other), for `confirm_blocks` consecutive new blocks. The dispersion of the interval throughputs (IQR / median,
   `noise_rel`) is reported, with `noisy` when it exceeds `noisy_rel`; it never blocks the verdict.
3b. No declaration (nor an early final answer) while the level moves inside the window after the cut: its
   change point's newer part (2+ blocks) beyond the shift threshold and WINDOW_SHIFT_Z standard errors from
   the older part keeps the run undecided until MSER's cut passes the move (`_moving`).
4. The figure is the mean of the batch means, the centre of its own interval.
5. Once steady, the median of the newest m blocks (m, 2m, 4m: m spans the minimum steps and seconds) further
   than min(1.6 p, 8%) on a quiet run, min(3 p, 15%) on any other, from the median of the blocks before them,
   and further than SHIFT_Z standard errors, is a level shift: the verdict re-opens, the analysis restarts at
   the shift, and `level_shifts` records both levels (the new one once declared). 3 p keeps a slow swing of a noisy run from being a shift at a
   fine precision; the 15% cap makes a move a person calls a shift one at a coarse precision too (at 10%,
   3 p would be 30%: a 20% drop would move the figure with no shift recorded).
   Until then the same test on fewer blocks (shift_blocks, 2x, 4x ... below the m above), with the newest
   shift_blocks blocks still beyond the threshold, makes the shift *suspected* from its change point on:
   the figure and its interval stay those of the level before it (a mean over both levels is neither, and
   its interval spans both) and `shift_suspected` says since when and the new level so far; a move that
   does not hold (a dip) clears it, and its blocks count again.
5b. Once steady, a decline (a leak in time, which moves the newest blocks and those before them together):
   the newest blocks (min_steady_seconds of them) more than p / 2 below the declared figure and the Theil-Sen
   slope across the window since the declaration's cut (>= DECLINE_MIN_SECONDS) beyond -p with its 95% interval
   below 0, on every look for DECLINE_HOLD_S, re-open the verdict (a level shift of shape `decline`); a new level is then declared
   only once the trend across 60-90 s is within p.
6. Never undecided forever: after `max_undecided_s` of steps (since the first step, or since a shift
   re-opened the verdict) the answer is final: steady, flagged noisy, with its wide interval when there is no
   trend (Mann-Kendall p >= 0.05, or a trend smaller than p), else drifting with the slope.
   The same answer comes sooner once p is out of reach: with the minimums met, MSER's cut accepted, a window
   of at least REACH_MIN_SECONDS after it, no trend by Mann-Kendall, a trend estimate within p and the trend
   projected over half the window (not the trend_horizon_steps floor), the checks' widths w (the level's
   half-width, the wider end of the trend's interval) shrink ~ 1/sqrt(time), so they fit p after about
   (seconds before the window) + window_s * (w / p)^2; when that exceeds max_undecided_s on confirm_blocks
   consecutive blocks, steady (noisy), `decided_by: precision_out_of_reach` with `seconds_needed`.
   And at the run's end (`conclude`: exit 0, or a stop), when no step will come to narrow the checks: the same
   answer under the same conditions but the projection, `decided_by: run_ended`.

Cost: the analysis runs once per block on at most `ANALYSIS_BLOCKS` recent blocks, with prefix sums for MSER
and Theil-Sen on at most `TREND_POINTS` points; once steady only the level and the shift test are updated.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from statistics import fmean, median, quantiles

from ..words import counted
from .config import DecideConfig
from .observations import StepObs

DROPPED_PHASES = frozenset({"eval", "checkpoint", "warmup"})
ANALYSIS_BLOCKS = 400  # a run not settled after 400 blocks is judged on its most recent 400 only
TREND_POINTS = 60  # Theil-Sen and Mann-Kendall over at most 60 evenly spaced batch means: 1770 pairs
TREND_HORIZON = 0.5  # the trend is projected from the window's centre (where its mean sits) to its newest block
MSER_LATEST = 0.75  # MSER's truncation point is accepted in the first 3/4 of the series (White: the first half)
SHIFT_Z = 4.0  # a level shift must stand this many standard errors out (checked on every block) ...
SHIFT_PRECISIONS = 1.6  # ... and move the level by more than 1.6x the precision ...
SHIFT_REL_MAX = 0.08  # ... or by 8%, whichever is less: a 10% move that holds is caught, measured low by the noise too
WINDOW_SHIFT_Z = 3.0  # before a declaration, a move by the shift threshold and 3 (not SHIFT_Z) standard errors
# inside the window is a shift (_window_shift): it only delays an answer, so it errs on the side of waiting
SHIFT_NOISY_PRECISIONS, SHIFT_NOISY_REL_MAX = 3.0, 0.15  # on a noisy run: 3x, 15% (its slow swings reach 14.5%)
QUIET_REL = 0.05  # a run whose intervals vary (IQR / median) within this and the precision is quiet
QUIET_SECONDS_SHARE = 0.8  # ... and needs 0.8 x min_steady_seconds since the first step (12 s at the default 15)
HORIZON_LINES = 15  # where a line stands for 2+ steps, the trend horizon is 150 steps or 15 lines, the fewer steps
SHIFT_BEFORE_BLOCKS = 100  # the level a shift is measured from: at most the 100 blocks before it
REFINE_BLOCKS = 2000  # once steady, the figure is the level of the (at most 2,000) blocks since the warm-up
TREND_P = 0.05  # Mann-Kendall: a trend is plausible at p < 0.05
MIN_BATCHES = 10  # batches are as long as the autocorrelation time, but there are at least 10 of them
MAX_LAG1 = 0.9  # autocorrelation estimates are clipped to [0, 0.9]: tau <= 19
REACH_MIN_SECONDS = 40.0  # the precision is judged out of reach only on a window this long after the warm-up
QUIET_MIN_BLOCKS = 4  # a quiet run logging 2+ steps a line: MSER's cut with 4 blocks after it will do (_quiet_cut)
PAUSE_GAP_FACTOR = 4.0  # a line taking 4x the usual seconds per step is an unmarked pause (_paused) ...
PAUSE_LINES, PAUSE_MIN_LINES = 50, 10  # ... the usual: the median of the last 50 lines, once there are 10
DECLINE_MIN_SECONDS = 60.0  # once steady, a decline is judged on a figure window this long (2+ slow swings)
DECLINE_Z = 1.644854  # ... with the slope's ONE-sided 95% bound below 0 (a fall is the question; two-sided held 63 s)
DECLINE_HOLD_S = 5.0  # ... and re-opens the verdict once it has held on every look this long
DECLINE_HOLD_MAX_S = 90.0  # after one, a new level must be flat across as long as the fall was seen, up to 90 s


@dataclass
class SteadyEstimate:
    """The current answer: steady, drifting or neither, and the figure, its interval and the evidence."""

    steady: bool = False
    tok_s: float | None = None
    interval: tuple[float, float] | None = None
    noise_rel: float | None = None
    noisy: bool = False
    warmup_end_step: int | None = None  # the warm-up cut now: once steady it only moves later, as data come
    declared_step: int | None = None
    declared_warmup_end_step: int | None = None  # the cut when the verdict was declared (declared_step)
    figure_steps: tuple[int, int] | None = None  # the steps the figure is the level of (first, last)
    declared_ts: float | None = None
    drifting: bool = False
    shift_suspected: dict | None = None  # steady, but a level shift not yet confirmed began: since_step, both levels
    reason: str = "waiting for steps"
    evidence: dict = field(default_factory=dict)


# ---------------------------------------------------------------- statistics (pure functions)


@lru_cache(maxsize=4096)
def _t_975(df_tenths: int) -> float:
    from scipy import stats  # here, not at the top: scipy.stats is ~0.9 s of every dfo command's start

    return float(stats.t.ppf(0.975, df_tenths / 10))


def t_975(df: float) -> float:
    """Student's t 97.5% quantile (scipy.stats.t), at df rounded to a tenth (cached: this runs on every block)."""
    return _t_975(max(1, round(df * 10)))


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


def stdev(values: list[float]) -> float:
    """Sample standard deviation (statistics.stdev is exact and 10x slower; this runs on every block)."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def lag1(values: list[float]) -> float:
    """Lag-1 autocorrelation, clipped to [0, MAX_LAG1] (a negative estimate is treated as none)."""
    n = len(values)
    if n < 3:
        return 0.0
    mean = sum(values) / n
    dev = [v - mean for v in values]
    denom = sum(d * d for d in dev)
    if denom <= 0:
        return 0.0
    r = sum(a * b for a, b in zip(dev, dev[1:])) / denom
    return min(max(r, 0.0), MAX_LAG1)


def autocorrelation_time(values: list[float]) -> float:
    """(1 + r) / (1 - r) for the lag-1 autocorrelation r: how many points carry one point's information."""
    r = lag1(values)
    return (1 + r) / (1 - r)


@dataclass(frozen=True)
class Level:
    """The level of a series: mean of batch means, its 95% interval, and what it was computed from."""

    mean: float
    lo: float
    hi: float
    batches: int
    batch_size: int
    n_eff: float
    means: list[float] = field(default_factory=list)

    @property
    def half_width_rel(self) -> float:
        return (self.hi - self.lo) / 2 / abs(self.mean) if self.mean else math.inf


def batch_means_level(values: list[float]) -> Level:
    """Batch means over the tail of `values`, batches as long as the autocorrelation time (so their means
    are close to independent), the effective number of batches from the batch means' own lag-1
    autocorrelation; the level is their mean, the centre of its t interval."""
    n = len(values)
    if n < 2:
        return Level(values[0], -math.inf, math.inf, 1, 1, 1.0, list(values)) if values else Level(math.nan, -math.inf, math.inf, 0, 0, 0.0)
    size = max(1, min(n // MIN_BATCHES, math.ceil(autocorrelation_time(values))))
    batches = n // size
    tail = values[n - batches * size :]
    means = [fmean(tail[i * size : (i + 1) * size]) for i in range(batches)]
    centre = fmean(means)
    r = lag1(means)
    n_eff = max(2.0, batches * (1 - r) / (1 + r))
    half = t_975(n_eff - 1) * stdev(means) / math.sqrt(n_eff)
    return Level(centre, centre - half, centre + half, batches, size, n_eff, means)


def _subsample(values: list[float]) -> tuple[list[int], list[float], int]:
    stride = max(1, math.ceil(len(values) / TREND_POINTS))
    index = list(range(0, len(values), stride))
    return index, [values[i] for i in index], stride


@dataclass(frozen=True)
class Trend:
    """Theil-Sen slope (per point of the input) with Sen's 95% interval, and Mann-Kendall's z and p."""

    slope: float
    lo: float
    hi: float
    mk_z: float
    mk_p: float


def trend(values: list[float], z: float = 1.959964) -> Trend:
    """Theil-Sen over at most TREND_POINTS evenly spaced points; Sen's rank interval (at +/- z: 95% two-sided by
    default) and Mann-Kendall's variance are widened by the subsample's autocorrelation time (Hamed and Rao's correction, AR(1) form)."""
    index, points, stride = _subsample(values)
    k = len(points)
    if k < 3:
        return Trend(0.0, -math.inf, math.inf, 0.0, 1.0)
    slopes, s = [], 0
    for a in range(k):
        for b in range(a + 1, k):
            diff = points[b] - points[a]
            slopes.append(diff / (index[b] - index[a]))
            s += (diff > 0) - (diff < 0)
    slopes.sort()
    slope = median(slopes)
    # the autocorrelation of the residuals around the line (a trend alone would look like autocorrelation),
    # raised to the subsample's stride, for an AR(1)-like series
    r = lag1([v - slope * i for i, v in enumerate(values)]) ** stride
    inflation = (1 + r) / (1 - r)
    var_s = k * (k - 1) * (2 * k + 5) / 18 * inflation
    big_n = len(slopes)
    c = z * math.sqrt(var_s)
    lo_rank, hi_rank = math.floor((big_n - c) / 2), math.ceil((big_n + c) / 2)
    lo = slopes[lo_rank] if lo_rank >= 0 else -math.inf
    hi = slopes[hi_rank - 1] if hi_rank <= big_n else math.inf
    z = (s - (s > 0) + (s < 0)) / math.sqrt(var_s) if s else 0.0
    return Trend(slope, lo, hi, z, math.erfc(abs(z) / math.sqrt(2)))


def shift_threshold(precision: float, noisy: bool = False) -> float:
    """The smallest move of the level (relative) that can be a level shift at this precision: on a quiet run
    (IQR / median of its intervals within the precision) 1.6 p up to 8% (a 10% move that holds is one a person
    calls a shift, and noise can make it measure a little less); on a noisy run 3 p up to 15%, as the real
    logs' slow swings reach 14.5% and their shifts are 17%+ (docs/decisions.md)."""
    return min(SHIFT_NOISY_PRECISIONS * precision, SHIFT_NOISY_REL_MAX) if noisy else min(
        SHIFT_PRECISIONS * precision, SHIFT_REL_MAX)


def figure_span(cut: int, figure_steps: tuple[int, int] | list[int], declared_step: int | None,
                declared_cut: int | None) -> str:
    """Where a steady figure comes from, for a person: after the warm-up cut while it is the declaration's;
    once the re-run MSER moved it later (point 2 of docs/decisions.md), the steps the figure is over now and
    the declaration as it was, so a cut later than the declared step reads as what it is, not a contradiction."""
    if declared_cut is None or cut == declared_cut:
        return f"after warm-up ending at step {cut}"
    first, last = figure_steps
    return (f"over steps {first}..{last} (declared at step {declared_step} with the warm-up ending at step "
            f"{declared_cut} then)")


def seconds_against(have: float, bound: float) -> tuple[str, str]:
    """Seconds `have` and the `bound` they are compared with, printed so the comparison reads as it came out:
    below the bound, `have` rounded down and the bound up (never "30 s (need 30)" at 29.6 s); at or past it,
    `have` up and the bound down. One decimal below 60 s, whole seconds from there."""
    digits = 1 if bound < 60 else 0
    scale = 10**digits
    down, up = (math.floor, math.ceil) if have < bound else (math.ceil, math.floor)
    # round(..., 9) first: 29.6 * 10 is 296.00000000000006, whose ceiling is not 296
    have_r, bound_r = down(round(have * scale, 9)) / scale, up(round(bound * scale, 9)) / scale
    return f"{have_r:,.{digits}f}".removesuffix(".0"), f"{bound_r:,.{digits}f}".removesuffix(".0")


def decline_text(decline: dict) -> str:
    """What a reason says of a decline (a level shift of shape `decline`, SteadyDetector._declined)."""
    lo, hi = decline["change_rel_95"]
    return (f"degrading: the level fell {decline['change_rel']:+.1%} over {decline['over_s']:.0f} s from step "
            f"{decline['at_step']} (95% {lo if lo is not None else -math.inf:+.1%}..{hi:+.1%}, "
            f"{decline['rel_per_min']:+.1%} per minute): ~{decline['to_tok_s']:,.0f} tok/s, declared steady at "
            f"{decline['from_tok_s']:,.0f}")


def noise_of(values: list[float]) -> float:
    """IQR / median of the interval throughputs: how much one logging interval varies from the next."""
    if len(values) < 4:
        return 0.0
    q1, q2, q3 = quantiles(values, n=4)
    return (q3 - q1) / q2 if q2 else 0.0


# ---------------------------------------------------------------- the detector


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
        self._block_ts: list[float] = []  # time of each block's last line
        self._medians: list[float] = []
        self._prefix1: list[float] = [0.0]
        self._prefix2: list[float] = [0.0]
        self._good_blocks_in_a_row = 0
        self._out_of_reach_in_a_row = 0  # consecutive analysed blocks on which the precision was out of reach
        self._scale: float | None = None
        self._truncation: int | None = None
        self._origin = 0  # analysis starts here (moves on a level shift)
        self._open_since: float | None = None  # the undecided clock: first step, or the last shift
        self._forced_noisy = False  # steady by max_undecided_s: noisy whatever the spread
        self._since_refine = 0
        self._suspect: int | None = None  # while steady: the block where a level shift not yet confirmed began
        self._declared_truncation = 0  # the warm-up cut (block) when steady was declared; _truncation moves later
        self._declared_tok_s = 0.0  # the figure when steady was declared
        self._declining_since: float | None = None  # since when every refine found the level fallen beyond p
        self._measured_lines = False  # the window after the cut logs 2+ steps a line (_analyse, _minimums_met)
        self.shifts: list[dict] = []
        self._gaps: list[float] = []  # seconds per step of the last PAUSE_LINES lines (_paused)
        self.pauses = {"lines": 0, "seconds": 0.0}  # unmarked pauses left out of the level, and their seconds

    def feed(self, obs: StepObs) -> bool:
        """Take one step; True when the estimate changed (a block completed)."""
        if self.last_step is not None and obs.step <= self.last_step:
            return False
        if self.first_step is None:
            self.first_step, self.first_ts, self._open_since = obs.step, obs.ts, obs.ts
        covered = obs.step - self.last_step if self.last_step is not None else 1  # steps this line stands for
        previous_ts = self.last_ts
        self.last_step, self.last_ts = obs.step, obs.ts
        if obs.phase in DROPPED_PHASES or not (math.isfinite(obs.tok_s) and obs.tok_s > 0):
            return False
        if previous_ts is not None and self._paused((obs.ts - previous_ts) / covered, covered):
            return False
        if not self._pending:
            self._pending_first_step, self._pending_steps = obs.step - covered + 1, 0
        self._pending.append(obs.tok_s)
        self._pending_steps += covered
        if self._pending_steps < self.config.block_size or self.estimate.drifting:
            return False
        self._close_block()
        return True

    def _paused(self, gap_per_step: float, covered: int) -> bool:
        """An unmarked pause (an eval or a checkpoint the trainer does not mark, a host's other work): a line whose
        seconds per step exceed PAUSE_GAP_FACTOR x the median of the last PAUSE_LINES lines' (after at least
        PAUSE_MIN_LINES of them); its tok_s carries the pause (its tokens over its wall time), so it is left out
        of the level like a marked eval, which makes the figure the training rate, and counted (`pauses`). Every
        line's gap joins the median, so a lasting slowdown of that size is a level again within PAUSE_LINES / 2
        lines."""
        gaps = self._gaps
        paused = (len(gaps) >= PAUSE_MIN_LINES and gap_per_step > 0
                  and gap_per_step > PAUSE_GAP_FACTOR * median(gaps))
        gaps.append(gap_per_step)
        if len(gaps) > PAUSE_LINES:
            del gaps[0]
        if paused:  # the pause: the line's seconds beyond what its steps usually take
            self.pauses["lines"] += 1
            self.pauses["seconds"] = round(self.pauses["seconds"] + (gap_per_step - median(gaps[:-1])) * covered, 1)
        return paused

    def _close_block(self) -> None:
        block, self._pending = self._pending, []
        block_median = median(block)
        self._scale = self._scale or block_median
        scaled = block_median / self._scale  # prefix sums of squares stay well-conditioned
        self._raw.append(block)
        self._block_first_step.append(self._pending_first_step or 0)
        self._block_ts.append(self.last_ts)
        self._medians.append(block_median)
        self._prefix1.append(self._prefix1[-1] + scaled)
        self._prefix2.append(self._prefix2[-1] + scaled * scaled)
        if self.estimate.steady and not self._level_shifted():
            suspect = self._suspected_shift()
            changed, self._suspect = suspect != self._suspect, suspect
            self._refine(force=changed)
        elif not self.estimate.steady:
            self._analyse()

    # ---- level shifts ----------------------------------------------------------------------------
    def _level_shifted(self) -> bool:
        shortest = self._blocks_holding_minimums()
        if shortest is None:
            return False
        for m in (shortest, 2 * shortest, 4 * shortest):
            moved = self._moved(m)
            if moved is None:
                return False  # too little of the old level before the newest m blocks
            if moved:
                self._reopen(self._change_point(max(self._truncation, len(self._medians) - 2 * m), len(self._medians)))
                return True
        return False

    def _moved(self, m: int) -> bool | None:
        """The shift test on the newest m blocks: their median further than the shift threshold and SHIFT_Z
        standard errors from the median of the (up to SHIFT_BEFORE_BLOCKS) blocks before them; None when too
        little of the old level lies before them."""
        n, d = len(self._medians), self._truncation
        if n - m - d < self.config.min_blocks_after_warmup:
            return None
        before = self._medians[max(d, n - m - SHIFT_BEFORE_BLOCKS) : n - m]
        level, recent = median(before), median(self._medians[n - m :])
        se = 1.25 * stdev(before) * math.sqrt(autocorrelation_time(before)) * math.sqrt(1 / m + 1 / len(before))
        gap = abs(recent - level)
        return gap > self._shift_threshold() * level and gap > SHIFT_Z * se

    def _quiet(self, noise_rel: float | None) -> bool:
        """A quiet run: its interval throughputs vary (IQR / median) within the precision and within QUIET_REL,
        so a few lines pin its level, and a move of 8% that holds is a move, not a swing (at a coarse precision
        a busy host's 10% swings are not quiet)."""
        return noise_rel is not None and noise_rel <= min(self.config.precision, QUIET_REL)

    def _shift_threshold(self) -> float:
        return shift_threshold(self.config.precision, noisy=not self._quiet(self.estimate.noise_rel))

    def _suspected_shift(self) -> int | None:
        """The block where a level shift not yet confirmed began: the shift test passed by the newest k blocks
        (k = shift_blocks, 2k, 4k, ...) for a k shorter than the confirmation's (the minimum evidence), placed
        by the change point of the last 2k blocks, while the newest shift_blocks blocks are still beyond the
        shift threshold from the level before it (a dip that is over is no shift); None when no such move is
        there. While one is suspected the steady figure stays the level before it (docs/decisions.md, point 6)."""
        n, d = len(self._medians), self._truncation
        threshold = self._shift_threshold()
        if self._suspect is not None and self._suspect > d:
            # a suspicion stays while its move holds, until the new level spans the minimum evidence and the shift
            # is confirmed: the ladder below can lose it (with min_steady_steps 25,000 the 100 blocks before the
            # newest k are all at the new level for some k, and the next k is too long), and once it lapsed the
            # re-run MSER cut the old level as a warm-up, the new level became the figure with no shift recorded
            before = median(self._medians[max(d, self._suspect - SHIFT_BEFORE_BLOCKS) : self._suspect])
            if abs(median(self._medians[n - self.config.shift_blocks :]) - before) > threshold * before:
                return self._suspect
        shortest = self._blocks_holding_minimums() or n - d
        k = self.config.shift_blocks
        while k < shortest:
            moved = self._moved(k)
            if moved is None:
                return None
            if moved:
                start = self._change_point(max(d, n - 2 * k), n)
                # a suspicion the warm-up cut has passed is gone (it would be measured against no blocks). The
                # cut stays 2+ blocks before a suspicion that starts 2+ blocks after it, as with shift_blocks >= 2;
                # with 1, a 2-block window cannot place the change point and starts it a block early, and the cut
                # can pass it (test_decide_steady: ..._the_warm_up_cut_has_passed_...); in principle also once
                # the suspicion lies REFINE_BLOCKS back, the start of the figure's window
                if self._suspect is not None and self._suspect > d:
                    start = min(self._suspect, start)
                before = median(self._medians[max(d, start - SHIFT_BEFORE_BLOCKS) : start])
                now = median(self._medians[n - self.config.shift_blocks :])
                return start if abs(now - before) > threshold * before else None
            k *= 2
        return None

    def _change_point(self, lo: int, hi: int) -> int:
        """Where in blocks [lo, hi) the level changed: the split minimising the two parts' summed squared
        deviations (from the prefix sums), each part at least 2 blocks."""
        p1, p2 = self._prefix1, self._prefix2

        def sse(a: int, b: int) -> float:
            return p2[b] - p2[a] - (p1[b] - p1[a]) ** 2 / (b - a)

        return min(range(lo + 2, hi - 1), key=lambda k: sse(lo, k) + sse(k, hi), default=lo)

    def _blocks_spanning(self, seconds: float, since: int) -> int | None:
        """The fewest newest blocks (at least shift_blocks) from block `since` on that span `seconds`; None when
        all of them do not."""
        n = len(self._medians)
        for m in range(self.config.shift_blocks, n - since):
            if self._block_ts[-1] - self._block_ts[n - m - 1] >= seconds:
                return m
        return None

    def _blocks_holding_minimums(self) -> int | None:
        """The fewest newest blocks that span min_steady_seconds and min_steady_steps (and shift_blocks): a
        new level must hold as long as the first one had to before it can replace it."""
        n = len(self._medians)
        last_step, last_ts = self.last_step, self._block_ts[-1]
        for m in range(self.config.shift_blocks, n - self._truncation):
            first = n - m
            if (last_ts - self._block_ts[first - 1] >= self.config.shift_hold_s
                    and last_step - self._block_first_step[first] + 1 >= self.config.min_steady_steps):
                return m
        return None

    def _reopen(self, origin: int) -> None:
        """The level moved at block `origin`: record both levels (block means on each side; the new level's
        declared figure is added once it holds) and analyse again from there."""
        old = fmean(self._medians[max(self._truncation, origin - SHIFT_BEFORE_BLOCKS) : origin] or [self.estimate.tok_s])
        recent = fmean(self._medians[origin:])
        self._restart(origin, {"shape": "step", "from_tok_s": round(old, 1), "to_tok_s": round(recent, 1)},
                      f"level shifted from {old:,.0f} to about {recent:,.0f} tok/s at step "
                      f"{self._block_first_step[origin]}; re-estimating")

    def _after_decline(self) -> bool:
        """A decline re-opened the verdict and no level has been declared since."""
        return bool(self.shifts) and self.shifts[-1]["shape"] == "decline" and self.shifts[-1]["declared_tok_s"] is None

    def _restart(self, origin: int, record: dict, reason: str) -> None:
        """Re-open the verdict: record the move (`record`: its shape and both levels; `to_tok_s` is the level
        when it was seen, `declared_tok_s` follows once a new level holds) and analyse again from block `origin`."""
        self._origin = origin
        self._open_since = self._block_ts[origin - 1] if origin > 0 else self.first_ts
        self.shifts.append({**record, "at_step": self._block_first_step[origin], "declared_tok_s": None,
                            "declared_step": None})
        self.estimate = SteadyEstimate(reason=reason)
        self._good_blocks_in_a_row = self._out_of_reach_in_a_row = 0
        self._declining_since = None
        self._truncation = self._suspect = None
        self._analyse()

    def _declined(self, first: int, end: int, level_of) -> bool:
        """Once steady: has the level fallen by more than p across the window since the declaration's cut
        (blocks [first, end), at least DECLINE_MIN_SECONDS long), a slow leak in time that the shift rule cannot
        see (it compares the newest blocks with the ones just before them, and a leak moves both)? The newest
        blocks spanning min_steady_seconds more than p / 2 below the declared figure, and the Theil-Sen slope over
        the window's batch means (`level_of()`: that Level), taken across the whole window, beyond -p with its
        one-sided 95% upper bound (DECLINE_Z) below 0, on every look for DECLINE_HOLD_S. (It asked for the interval below -p, the
        newest 30 s p below the figure and 30 s of looks: a leak of 0.1% a second, a fall of 6% a minute, was
        held steady 100-160 s after its declaration; now 54 s (median), at most 80.) Then the verdict re-opens (`_restart`),
        recorded as a level shift of shape `decline`, and the figure is no longer given for a level that is
        gone. True when it re-opened."""
        precision = self.config.precision
        start_ts = self._block_ts[first - 1] if first > 0 else self.first_ts
        seconds = self._block_ts[end - 1] - start_ts
        # counted from the declaration's cut, not the re-run one: a leak moves that one later and later (its start
        # looks like a warm-up's tail) until under 15 s are left after it, and the fall went unexamined
        recent_blocks = self._blocks_spanning(self.config.min_steady_seconds, first)
        recent = (median(self._medians[end - recent_blocks : end])
                  if recent_blocks is not None and end - recent_blocks > first else None)
        # the cheap test first: on a level run the newest blocks are where the figure is, and no slope is taken
        if seconds < DECLINE_MIN_SECONDS or recent is None or recent >= (1 - precision / 2) * self._declared_tok_s:
            self._declining_since = None
            return False
        level = level_of()
        slope = trend(level.means, z=DECLINE_Z)
        across = (len(level.means) - 1) / (abs(level.mean) or 1.0)
        change, hi = slope.slope * across, slope.hi * across
        falling = change < -precision and hi < 0
        self._declining_since = (self._declining_since or self.last_ts) if falling else None
        if self._declining_since is None or self.last_ts - self._declining_since < DECLINE_HOLD_S:
            return False
        per_min = change / seconds * 60
        lo_rel = slope.lo * across
        self._restart(first, {
            "shape": "decline", "from_tok_s": round(self._declared_tok_s, 1), "to_tok_s": round(recent, 1),
            "change_rel": round(change, 4), "change_rel_95": [round(lo_rel, 4), round(hi, 4)] if math.isfinite(lo_rel)
            else [None, round(hi, 4)], "rel_per_min": round(per_min, 4), "over_s": round(seconds, 1),
        }, "re-estimating")
        return True

    # ---- analysis before steady ---------------------------------------------------------------
    def _minimums_met(self, noise_rel: float | None = None, window_s: float | None = None) -> tuple[bool, str]:
        """min_steady_steps and QUIET_SECONDS_SHARE x min_steady_seconds since the first step on a quiet run (`noise_rel`,
        the window's IQR / median, within the precision; 12 s: docs/decisions.md point 4c), else shift_hold_s: its slow swings last 10-30 s,
        so 15 s of it cannot show their size (small-ps-eager-1g: +/-20% swings around 57k declared at 15.8 s,
        5 s before a 23% drop), while a quiet run is known to its precision in a few lines. On a run that is not
        quiet, the window after the warm-up cut (`window_s`) must itself span min_steady_seconds: the seconds since
        the first step count a warm-up MSER cuts off, and a noisy level seen for 10 s is one swing (small-thr-eager
        was declared at +39.7% on a 10-s window, 2 s before its shift at 37 s). A quiet window whose lines stand
        for 2+ steps each needs no min_steady_steps (`_quiet_cut`): at 5 steps a line every ~3 s, 60 steps were
        36 s of a level known to 0.2% from its 3rd line (the held-out quiet qwen3 logs: first steady 34-59 s). A
        min_steady_steps above its default (60) is a user's and holds on every run."""
        steps = self.last_step - self.first_step
        seconds = self.last_ts - self.first_ts
        noisy = not self._quiet(noise_rel)
        need_s = self.config.shift_hold_s if noisy else QUIET_SECONDS_SHARE * self.config.min_steady_seconds
        # a quiet window of lines of 2+ steps each: its lines, not its steps, are the evidence (_quiet_cut); a
        # min_steady_steps set above its default (a user's long autotuning) holds whatever the lines
        lines_suffice = (not noisy and self._measured_lines
                         and self.config.min_steady_steps <= DecideConfig.min_steady_steps)
        few_steps = steps < self.config.min_steady_steps and not lines_suffice
        if few_steps or seconds < need_s:
            have, need = seconds_against(seconds, need_s)
            return False, (f"{steps} steps / {have} s since the first step (need {self.config.min_steady_steps} / "
                           f"{need}{', noisy' if noisy else ''})")
        if noisy and window_s is not None and window_s < self.config.min_steady_seconds:
            have, need = seconds_against(window_s, self.config.min_steady_seconds)
            return False, f"the window after the warm-up spans {have} s (need {need}, noisy)"
        return True, ""

    def _horizon_steps(self, per_line: float) -> int:
        """The trend horizon in steps: trend_horizon_steps, or HORIZON_LINES lines where the window's lines stand
        for 2+ steps each (a line is one rate measurement over its steps: qwen3-8b-shape logs 5 steps a line
        every ~2.7 s, so 150 steps were 30 lines, ~80 s); a trace logging every step keeps 150 steps."""
        if per_line < 2:
            return self.config.trend_horizon_steps
        return min(self.config.trend_horizon_steps, math.ceil(HORIZON_LINES * per_line))

    def _window_stats(self, d: int) -> dict:
        """Level, trend and noise over the blocks from d on (at most the newest ANALYSIS_BLOCKS)."""
        n = len(self._medians)
        first = max(d, n - ANALYSIS_BLOCKS)
        window = self._medians[first:]
        level = batch_means_level(window)
        slope = trend(level.means)  # on the batch means: nearly independent points
        # in batch units: half the window, and at least the horizon (_horizon_steps: a slow leak in a short window)
        steps_per_batch = (self.last_step - self._block_first_step[first] + 1) / len(window) * level.batch_size
        across = len(level.means) - 1
        half_window = across * TREND_HORIZON
        scale = abs(level.mean) or 1.0
        start_ts = self._block_ts[first - 1] if first > 0 else self.first_ts
        seconds = self._block_ts[-1] - start_ts
        raw = [v for block in self._raw[first:] for v in block]
        steps_per_line = self._steps_per_line(first)
        horizon_steps = self._horizon_steps(steps_per_line)
        span = max(half_window, horizon_steps / steps_per_batch)
        noise = noise_of(raw)
        return {
            "first": first,
            "end": n,
            "level": level,
            "trend": slope,
            "trend_rel": slope.slope * span / scale,
            "trend_rel_interval": (slope.lo * span / scale, slope.hi * span / scale),
            # per second: the slope is per batch mean, each batch_size blocks of seconds / len(window) seconds
            "slope_tok_s_per_s": slope.slope * len(window) / (level.batch_size * seconds) if seconds > 0 else 0.0,
            "window_s": seconds,
            "start_ts": start_ts,  # where the window begins (the end of the block before it)
            "noise_rel": noise,
            "horizon_floor": span > half_window,  # projected over the horizon (_horizon_steps), not half the window
            "window_steps": self.last_step - self._block_first_step[first] + 1,
            "horizon_steps": horizon_steps,
            "steps_per_line": steps_per_line,
            # across the whole window (not projected from its centre): what a decline was found with (_declined)
            "trend_rel_across": (slope.lo * across / scale, slope.hi * across / scale),
        }

    def _checks(self, stats: dict) -> dict:
        precision = self.config.precision
        lo, hi = stats["trend_rel_interval"]
        level: Level = stats["level"]
        # "no trend beyond p over trend_horizon_steps" is judged on a window that long, never projected from a
        # shorter one: a flat stretch inside a slow leak looks level (docs/benchmarks-archive.md, Round 4, V4); unless
        # the projected interval is itself at most p wide (a run that steps slowly with little noise: two-sample
        # qwen3-8b-shape steps ~2.8 times a second, 150 steps are ~55 s after its warm-up; the leak V4 stopped
        # had a wide interval); or the run is quiet and logs 2+ steps a line (its trend interval, projected over
        # its horizon, within +/- p is evidence enough: the quiet probes and qwen3 logs, flat from their 3rd
        # line; the leak V4 and tracegen's drift 506, flat over 95 steps, log one step a line)
        long_enough = (stats["window_steps"] >= stats["horizon_steps"] or (hi - lo) <= precision
                       or (self._quiet(stats["noise_rel"]) and stats["steps_per_line"] >= 2))
        no_trend = long_enough and -precision <= lo and hi <= precision
        # after a decline re-opened the verdict, a new level is declared only once the test that found the decline
        # clears it: a window as long as the one the fall was measured over (60-90 s: 400 blocks of a fast run
        # logging each line as a block span ~100 s, the most the analysis sees), the
        # trend across all of it within +/- p (a leak that goes on looks level on the short tail MSER keeps, and
        # over a shorter window: it was declared steady again there)
        after_decline = self._after_decline()
        across_lo, across_hi = stats["trend_rel_across"]
        hold_s = min(max(DECLINE_MIN_SECONDS, self.shifts[-1]["over_s"]), DECLINE_HOLD_MAX_S) if after_decline else 0.0
        flat_across = stats["window_s"] >= hold_s and -precision <= across_lo and across_hi <= precision
        no_trend = no_trend and (flat_across or not after_decline)
        precise = level.half_width_rel <= precision
        extra = {"after_decline": True, "window_s": round(stats["window_s"], 1), "hold_s": round(hold_s, 1),
                 "trend_rel_across_95": [round(v, 4) if math.isfinite(v) else None for v in (across_lo, across_hi)],
                 "flat_across_window": flat_across} if after_decline else {}
        return {
            **extra,
            "ok": no_trend and precise,
            "precision": precision,
            "trend_rel": round(stats["trend_rel"], 4),
            "trend_rel_95": [round(lo, 4) if math.isfinite(lo) else None, round(hi, 4) if math.isfinite(hi) else None],
            "no_trend_beyond_precision": no_trend,
            "window_steps": stats["window_steps"],
            "trend_horizon_steps": stats["horizon_steps"],
            "mann_kendall_z": round(stats["trend"].mk_z, 2),
            "mann_kendall_p": round(stats["trend"].mk_p, 4),
            "interval_half_width_rel": round(level.half_width_rel, 4) if math.isfinite(level.half_width_rel) else None,
            "interval_within_precision": precise,
            "batches": level.batches,
            "batch_blocks": level.batch_size,
            "n_eff": round(level.n_eff, 1),
            "noise_rel": round(stats["noise_rel"], 4),
        }

    def _analyse(self) -> None:
        n = len(self._medians)
        start = max(self._origin, n - ANALYSIS_BLOCKS)
        need_after = self.config.min_blocks_after_warmup
        d = mser_truncation(self._prefix1, self._prefix2, start, n, need_after) if n - start >= need_after else None
        if d is not None and d - start > (n - start) * MSER_LATEST:
            d = None
        if d is None:
            d = self._quiet_cut(start, n)
        self._measured_lines = d is not None and self._steps_per_line(d) >= 2
        timed_out = self.last_ts - self._open_since >= self.config.max_undecided_s
        if d is None:
            self._good_blocks_in_a_row = self._out_of_reach_in_a_row = 0
            if timed_out and n - start >= 2 * need_after:
                self._final_answer(start + (n - start) // 2)
                return
            self._undecided(f"warming up: {n - self._origin} blocks, no warm-up end with {need_after} blocks after it yet", d)
            return
        moving = self._moving(d, n)
        if moving is not None and not timed_out:
            self._good_blocks_in_a_row = self._out_of_reach_in_a_row = 0
            self._undecided(f"warming up: {moving}", d)
            return
        stats = self._window_stats(d)
        checks = self._checks(stats)
        minimums_ok, minimums_why = self._minimums_met(stats["noise_rel"], stats["window_s"])
        self._good_blocks_in_a_row = self._good_blocks_in_a_row + 1 if checks["ok"] and minimums_ok else 0
        if self._good_blocks_in_a_row >= self.config.confirm_blocks:
            self._declare(d, stats, checks)
            return
        if timed_out:
            self._final_answer(d, stats, checks)
            return
        needed = self._seconds_needed(stats, checks) if minimums_ok and not checks["ok"] else None
        out_of_reach = needed is not None and needed > self.config.max_undecided_s
        self._out_of_reach_in_a_row = self._out_of_reach_in_a_row + 1 if out_of_reach else 0
        if self._out_of_reach_in_a_row >= self.config.confirm_blocks:
            self._final_answer(d, stats, checks, needed_s=needed)
            return
        confirming = (f"the checks hold on {counted(self._good_blocks_in_a_row, 'block')} in a row, "
                      f"{self.config.confirm_blocks} needed")
        why = (minimums_why or confirming) if checks["ok"] else self._why_not(checks)
        self._undecided(f"warming up: {why} (warm-up end at block {d - self._origin} of {n - self._origin})", d, checks)

    def _steps_per_line(self, first: int) -> float:
        """Steps per log line over the blocks from `first` on (by step number: a line stands for the steps since
        the previous one)."""
        lines = sum(len(block) for block in self._raw[first:])
        return (self.last_step - self._block_first_step[first] + 1) / max(1, lines)

    def _quiet_cut(self, start: int, n: int) -> int | None:
        """MSER's cut with QUIET_MIN_BLOCKS blocks after it (not min_blocks_after_warmup) on a run that logs 2+
        steps a line and is quiet after the cut (`_quiet`): each of its lines is already a rate measured over
        several steps, and a quiet one is known to the precision in a few of them (qwen3-8b-shape logs 5 steps a
        line every ~3 s: 8 blocks after the cut were 8 lines, ~24 s). None otherwise."""
        if n - start < QUIET_MIN_BLOCKS:
            return None
        d = mser_truncation(self._prefix1, self._prefix2, start, n, QUIET_MIN_BLOCKS)
        if d is None or d - start > (n - start) * MSER_LATEST or self._steps_per_line(d) < 2:
            return None
        raw = [v for block in self._raw[d:n] for v in block]
        return d if len(raw) >= QUIET_MIN_BLOCKS and self._quiet(noise_of(raw)) else None

    def _window_shift(self, d: int, n: int) -> int | None:
        """Before a declaration: has the level moved inside the window after the cut, blocks [d, n)? The change
        point c of the window (the split minimising both parts' squared deviations) with its newer part
        [c, n) at least 2 blocks, whose median lies further than the shift threshold (`shift_threshold`, by
        the window's noise, as once steady) and WINDOW_SHIFT_Z standard errors (the pooled residuals' spread, widened by their autocorrelation time) from the
        older part's median; None when the level did not move."""
        if n - d < 6:
            return None
        c = self._change_point(d, n)
        older, newer = self._medians[d:c], self._medians[c:n]
        if len(older) < 2 or len(newer) < 2:
            return None
        a, b = median(older), median(newer)
        residuals = [v - a for v in older] + [v - b for v in newer]
        se = (1.25 * stdev(residuals) * math.sqrt(autocorrelation_time(residuals))
              * math.sqrt(1 / len(older) + 1 / len(newer)))
        gap = abs(b - a)
        noise = noise_of([v for block in self._raw[d:n] for v in block])
        threshold = shift_threshold(self.config.precision, noisy=not self._quiet(noise))
        return c if gap > threshold * a and gap > WINDOW_SHIFT_Z * se else None

    def _moving(self, d: int, n: int) -> str | None:
        """Why no declaration may come while the level moves inside the window after the cut (`_window_shift`),
        or None when it does not: a figure over both levels is neither (a drop seconds before a declaration was
        declared at the level before it, +30..+39%). The answer waits until MSER's cut passes the move and the
        new level is judged on its own."""
        c = self._window_shift(d, n)
        if c is None:
            return None
        older, newer = median(self._medians[d:c]), median(self._medians[c:n])
        return (f"the level moved at step {self._block_first_step[c]} ({older:,.0f} -> ~{newer:,.0f} tok/s, "
                f"{newer / older - 1:+.0%}); waiting for the new level to be judged on its own")

    def _early_answer_allowed(self, stats: dict, checks: dict) -> bool:
        """Whether a final answer may come before max_undecided_s (the precision out of reach, or the run's end):
        the window after the cut spans REACH_MIN_SECONDS, Mann-Kendall sees no trend, the trend's estimate is
        within p, the trend is projected over half the window (not the trend_horizon_steps floor) and no decline
        is being confirmed flat."""
        if stats["window_s"] < REACH_MIN_SECONDS or checks["mann_kendall_p"] < TREND_P:
            return False  # a warm-up's widths are wide for want of points; a trend means drifting, not steady
        if abs(checks["trend_rel"]) > self.config.precision:
            return False  # a trend beyond p is the point estimate: wait (max_undecided_s decides it)
        if stats["horizon_floor"]:
            return False  # projected over trend_horizon_steps, the trend's width shrinks ~ time^-1.5, not ^-0.5
        # a decline was measured: the level must be seen flat again, not projected out of reach
        return not self._after_decline()

    def conclude(self) -> bool:
        """The run ended (exit 0, or a stop) while undecided: no more steps will narrow the checks, so the answer
        max_undecided_s or the precision out of reach would give is given now, under the same conditions (the
        minimums met, MSER's cut accepted, `_early_answer_allowed`): steady, noisy, with its wide interval,
        `decided_by: run_ended`. Without them (a warm-up, a trend, too short a window) the run stays without a
        verdict (`exited`/`stopped` before a steady state). True when it declared steady."""
        n = len(self._medians)
        start = max(self._origin, n - ANALYSIS_BLOCKS)
        need_after = self.config.min_blocks_after_warmup
        if self.estimate.steady or self.estimate.drifting or n - start < need_after or not self._minimums_met()[0]:
            return False
        d = mser_truncation(self._prefix1, self._prefix2, start, n, need_after)
        if d is None or d - start > (n - start) * MSER_LATEST:
            return False
        if self._moving(d, n) is not None:
            return False
        stats = self._window_stats(d)
        checks = self._checks(stats)
        if not self._early_answer_allowed(stats, checks):
            return False
        self._final_answer(d, stats, checks, decided_by="run_ended")
        return self.estimate.steady

    def _seconds_needed(self, stats: dict, checks: dict) -> float | None:
        """When the precision is out of reach: the seconds of steps (counted as max_undecided_s counts them)
        the checks would need to fit +/- p, projected from the current widths, or None while the evidence is
        too thin to project from or a trend is plausible. Both the level's half-width and the trend's
        projected interval (its wider end: with no trend its centre is noise too) shrink ~ 1/sqrt(time) at a
        fixed autocorrelation, so the window needs (w / p)^2 times the seconds it spans."""
        if not self._early_answer_allowed(stats, checks):
            return None
        start_ts, window_s = stats["start_ts"], stats["window_s"]
        lo, hi = stats["trend_rel_interval"]
        widest = max(stats["level"].half_width_rel, abs(lo), abs(hi))
        if not math.isfinite(widest):
            return None
        return start_ts - self._open_since + window_s * (widest / self.config.precision) ** 2

    @staticmethod
    def _why_not(checks: dict) -> str:
        parts = []
        if checks["window_steps"] < checks["trend_horizon_steps"]:
            parts.append(f"the window is {checks['window_steps']} steps; a trend is judged over "
                         f"{checks['trend_horizon_steps']}")
        elif checks.get("after_decline") and not checks["flat_across_window"]:
            lo, hi = checks["trend_rel_across_95"]
            have, need = seconds_against(checks["window_s"], checks["hold_s"])
            parts.append(f"after a decline, the level must hold within +/-{checks['precision']:.0%} across "
                         f"{need} s (as long as it fell over): {have} s, trend across it 95% "
                         f"{lo if lo is not None else -math.inf:+.1%}..{hi if hi is not None else math.inf:+.1%}")
        elif not checks["no_trend_beyond_precision"]:
            lo, hi = checks["trend_rel_95"]
            parts.append(f"a trend of {checks['trend_rel']:+.1%} over the window is still plausible "
                         f"(95% {lo if lo is not None else -math.inf:+.1%}..{hi if hi is not None else math.inf:+.1%})")
        if not checks["interval_within_precision"]:
            width = checks["interval_half_width_rel"]
            parts.append(f"the level is known to +/-{width:.1%}" if width is not None else "too few batches for an interval")
        return "; ".join(parts) + f" (precision {checks['precision']:.0%})"

    def _final_answer(self, d: int, stats: dict | None = None, checks: dict | None = None,
                      needed_s: float | None = None, decided_by: str = "max_undecided_s") -> None:
        """max_undecided_s ran out, the precision is out of reach within it (`needed_s`, projected), or the run
        ended (`decided_by="run_ended"`): steady (noisy, wide interval) unless a trend beyond the precision is there."""
        stats = stats or self._window_stats(d)
        checks = checks or self._checks(stats)
        checks = {**checks, "decided_by": decided_by, "max_undecided_s": self.config.max_undecided_s}
        if needed_s is not None:
            checks.update(decided_by="precision_out_of_reach", seconds_needed=math.ceil(needed_s))  # > max_undecided_s as read
        trending = stats["trend"].mk_p < TREND_P and abs(stats["trend_rel"]) > self.config.precision
        if not trending:
            self._declare(d, stats, checks, noisy=True)
            return
        per_min = stats["slope_tok_s_per_s"] * 60 / (stats["level"].mean or 1.0)
        self.estimate.drifting = True
        self.estimate.declared_step, self.estimate.declared_ts = self.last_step, self.last_ts
        self.estimate.reason = (
            f"drifting: still trending {per_min:+.1%} per minute ({per_min * stats['window_s'] / 60:+.1%} over the last "
            f"{stats['window_s']:.0f} s, "
            f"Mann-Kendall p={stats['trend'].mk_p:.3f}) after {self.config.max_undecided_s:.0f} s undecided"
        )
        self.estimate.evidence = {
            **self._base_evidence(d),
            "checks": checks,
            "slope_tok_s_per_s": round(stats["slope_tok_s_per_s"], 3),
            "slope_rel_per_min": round(per_min, 4),
            "level_tok_s": round(stats["level"].mean, 1),
        }

    def _declare(self, d: int, stats: dict, checks: dict, noisy: bool = False) -> None:
        self._truncation = self._declared_truncation = d
        self.estimate.steady = True
        self.estimate.declared_step, self.estimate.declared_ts = self.last_step, self.last_ts
        self.estimate.declared_warmup_end_step = self._block_first_step[d]
        self._forced_noisy = noisy
        self._set_level(stats, checks)
        self._declared_tok_s = self.estimate.tok_s
        if self.shifts and self.shifts[-1]["declared_tok_s"] is None:
            self.shifts[-1]["declared_tok_s"] = round(self.estimate.tok_s, 1)
            self.shifts[-1]["declared_step"] = self.last_step

    def _undecided(self, reason: str, d: int | None, checks: dict | None = None) -> None:
        if self._after_decline():  # said first: what the user must know is that the run is degrading
            reason = f"{decline_text(self.shifts[-1])}; {reason}"
        elif self.shifts:
            last = self.shifts[-1]
            reason += (f" after a decline from step {last['at_step']}" if last["shape"] == "decline"
                       else f" after a level shift at step {last['at_step']}")
        self.estimate.reason = reason
        self.estimate.evidence = {"blocks": len(self._medians) - self._origin, "truncation_block": d, "checks": checks}
        if self.shifts:
            self.estimate.evidence["level_shifts"] = self.shifts

    # ---- once steady ----------------------------------------------------------------------------
    def _refine(self, force: bool = False) -> None:
        """A new block while steady: the level and its interval follow it (no trend test: that is the
        shift rule's job now), up to the block where a suspected level shift began, if one is."""
        n = len(self._medians)
        first = max(self._truncation, n - REFINE_BLOCKS)
        self._since_refine += 1
        if self._since_refine < max(1, (n - first) // 100) and not force:
            return  # refined after ~1% more blocks each time: O(1) per block on long runs
        self._since_refine = 0
        end = self._suspect if self._suspect is not None and self._suspect - first >= 2 else n
        later = mser_truncation(self._prefix1, self._prefix2, first, end, self.config.min_blocks_after_warmup)
        if later is not None and self._truncation < later <= first + (end - first) // 2:
            self._truncation = first = later  # with more data MSER sees the warm-up's tail: cut it too
        level = batch_means_level(self._medians[first:end])
        # a decline is judged from the declaration's cut: the re-run MSER moves the cut later on a leak (its
        # start looks like a warm-up's tail), which would keep the window too short to see it
        since = max(self._declared_truncation, n - REFINE_BLOCKS)
        if since < end - 1 and self._declined(
                since, end, lambda: level if since == first else batch_means_level(self._medians[since:end])):
            return
        raw = [v for block in self._raw[first:end] for v in block]
        stats = {"first": first, "end": end, "level": level, "noise_rel": noise_of(raw)}
        checks = dict(self.estimate.evidence.get("checks") or {})
        checks.update({
            "interval_half_width_rel": round(level.half_width_rel, 4) if math.isfinite(level.half_width_rel) else None,
            "batches": level.batches, "batch_blocks": level.batch_size, "n_eff": round(level.n_eff, 1),
            "noise_rel": round(stats["noise_rel"], 4),
        })
        self._set_level(stats, checks)
        self._note_suspicion(end)

    def _note_suspicion(self, end: int) -> None:
        """While a shift is suspected: say so beside the level before it (the figure), with the new level as
        seen so far and what confirming it takes."""
        if end == len(self._medians):
            self.estimate.shift_suspected = None
            return
        since_step = self._block_first_step[end]
        recent = fmean(self._medians[end:])
        self.estimate.shift_suspected = {
            "since_step": since_step,
            "since_ts": self._block_ts[end - 1],
            "from_tok_s": round(self.estimate.tok_s, 1),
            "to_tok_s": round(recent, 1),
        }
        self.estimate.reason += (
            f"; level shift suspected since step {since_step}: ~{recent:,.0f} tok/s since, being confirmed (the "
            f"new level must hold {self.config.shift_hold_s:.0f} s and {self.config.min_steady_steps} steps); "
            f"the figure is the level before it"
        )
        self.estimate.evidence["shift_suspected"] = self.estimate.shift_suspected

    def _set_level(self, stats: dict, checks: dict) -> None:
        level: Level = stats["level"]
        d = self._truncation
        self.estimate.tok_s = level.mean
        self.estimate.interval = (level.lo, level.hi)
        self.estimate.noise_rel = round(stats["noise_rel"], 4)
        self.estimate.noisy = (
            self._forced_noisy or stats["noise_rel"] > self.config.noisy_rel or level.half_width_rel > self.config.precision
        )
        self.estimate.warmup_end_step = self._block_first_step[d]
        end = stats["end"]  # the figure's blocks end here: at a suspected shift, else with the newest block
        self.estimate.figure_steps = (
            self._block_first_step[stats["first"]],
            self._block_first_step[end] - 1 if end < len(self._medians) else self.last_step,
        )
        noisy = f", noisy: +/-{stats['noise_rel'] / 2:.0%} interval to interval" if self.estimate.noisy else ""
        needed, most = seconds_against(checks.get("seconds_needed", 0), self.config.max_undecided_s)
        timeout = {
            "max_undecided_s": " (decided after max_undecided_s: no trend beyond the precision)",
            "precision_out_of_reach": f" (precision {self.config.precision:.0%} out of reach: "
            f"~{needed} s of steps needed, max_undecided_s is {most}; no trend beyond the precision)",
            "run_ended": f" (the run ended before precision {self.config.precision:.0%} was reached; no trend beyond "
            f"the precision)",
        }.get(checks.get("decided_by"), "")
        where = figure_span(self.estimate.warmup_end_step, self.estimate.figure_steps, self.estimate.declared_step,
                            self.estimate.declared_warmup_end_step)
        self.estimate.reason = (
            f"steady at {level.mean:,.0f} tok/s (95% {level.lo:,.0f}..{level.hi:,.0f}{noisy}) {where}{timeout}"
        )
        self.estimate.evidence = {**self._base_evidence(d), "figure_steps": list(self.estimate.figure_steps),
                                  "checks": checks}
        if self.pauses["lines"]:  # the training rate; the wall clock's, pauses included, beside it
            elapsed = self.last_ts - self.first_ts
            wall = level.mean * max(0.0, 1 - self.pauses["seconds"] / elapsed) if elapsed > 0 else level.mean
            self.estimate.evidence["pauses"] = {**self.pauses, "wall_tok_s": round(wall, 1)}
            self.estimate.reason += (f"; the training rate: {counted(self.pauses['lines'], 'unmarked pause')}, "
                                     f"{self.pauses['seconds']:.0f} s, left out (wall clock ~{wall:,.0f} tok/s)")

    def _base_evidence(self, d: int) -> dict:
        n = len(self._medians)
        first = max(d, n - (REFINE_BLOCKS if self.estimate.steady else ANALYSIS_BLOCKS))
        evidence = {
            "blocks": n - self._origin,
            "truncation_block": d - self._origin,
            "steps_used": self.last_step - self._block_first_step[first] + 1,  # by step number
            "lines_used": sum(len(block) for block in self._raw[first:]),
            "steps_used_from": self._block_first_step[first],
        }
        if self.shifts:
            evidence["level_shifts"] = self.shifts
        return evidence
