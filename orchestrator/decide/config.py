"""The knobs of the decision rules (the inventory's `watch:` keys), with their defaults and checks.

Plain data: no I/O. docs/decisions.md explains each rule and why the defaults are what they are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import UsageError
from ..words import plural

NOT_DECIDE_KEYS = frozenset({"baseline_tok_s", "unreachable_s"})  # inventory `watch:` keys used elsewhere


@dataclass(frozen=True)
class DecideConfig:
    first_step_grace_s: float = 900.0
    """Seconds from the run's start to its first step before it counts as stalled (compilation is slow)."""
    min_steady_steps: int = 60
    """Steady needs at least this many steps since the first step (an autotuning plateau is shorter); at the
    default, not on a quiet run logging 2+ steps a line (its lines are the evidence: steady._quiet_cut)."""
    min_steady_seconds: float = 15.0
    """... and at least this many seconds since the first step; a quiet run (its intervals vary within the
    precision) 0.8 x this (steady.QUIET_SECONDS_SHARE: 12 s), any other run shift_hold_s (its slow swings last
    10-30 s)."""
    stall_factor: float = 10.0
    """After the first step: stalled when silent for stall_factor x the median gap between step lines ..."""
    stall_floor_s: float = 120.0
    """... but never sooner than this many seconds (a checkpoint save can take a minute)."""
    too_slow_tolerance: float = 0.10
    """Too slow when the steady interval's upper bound is below (1 - tolerance) x the baseline."""
    precision: float = 0.05
    """Steady once no trend larger than this fraction over the window is plausible and the level's 95%
    interval is within +/- this fraction of it."""
    max_undecided_s: float = 600.0
    """Seconds of steps (since the first step, or since a level shift) after which an undecided run gets a
    final answer: steady flagged noisy (no trend beyond the precision) or drifting. The steady (noisy) answer
    comes sooner when the checks' widths project the precision out of reach within this time."""
    noisy_rel: float = 0.10
    """`noisy` is flagged when the interval throughputs' IQR / median exceeds this (reported, never a gate)."""
    block_size: int = 5
    """Steps per block; the detector works on block medians (MSER-5)."""
    min_blocks_after_warmup: int = 8
    """MSER's truncation point is accepted only with at least this many blocks after it."""
    trend_horizon_steps: int = 150
    """The trend is projected over half the window after the warm-up (from its centre, where the level is
    measured, to its newest block) and over at least this many steps (a slow leak seen in a short window is
    not a level), or 15 lines where a line stands for 2+ steps, whichever is fewer steps."""
    confirm_blocks: int = 2
    """Consecutive new blocks that must pass every check before steady is declared."""
    shift_blocks: int = 4
    """After steady: the median of the newest m blocks (m >= shift_blocks, spanning the minimum steps and seconds;
    also 2m and 4m) further than min(3 x precision, 15%) and 4 standard errors from the level before them is a
    level shift: it re-opens the verdict."""

    @property
    def shift_hold_s(self) -> float:
        """Seconds a move must hold before it replaces a declared level (a level shift, a decline, memory
        climbing): twice min_steady_seconds, as a new level displaces one already known."""
        return 2 * self.min_steady_seconds

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise UsageError(f"watch.{f.name} must be >= 0, got {getattr(self, f.name)}")
        if min(self.block_size, self.confirm_blocks, self.shift_blocks) < 1 or self.min_blocks_after_warmup < 2:
            raise UsageError("watch.block_size, confirm_blocks and shift_blocks must be >= 1, min_blocks_after_warmup >= 2")
        if not 0 < self.precision < 1:
            raise UsageError(f"watch.precision must be between 0 and 1 (0.05 = 5%), got {self.precision}")
        if not 0 < self.too_slow_tolerance < 1:
            raise UsageError(f"watch.too_slow_tolerance must be between 0 and 1, got {self.too_slow_tolerance}")

    @classmethod
    def from_mapping(cls, values: dict | None) -> "DecideConfig":
        """Build from an inventory's `watch:` mapping; unknown keys are a usage error naming the known ones.
        `baseline_tok_s` (RunJudge's) and `unreachable_s` (the Watcher's) belong to the same mapping but are
        not rules of decide/, so they are skipped here."""
        values = {k: v for k, v in (values or {}).items() if k not in NOT_DECIDE_KEYS}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(f"unknown watch {plural(len(unknown), 'key')} {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**values)
