"""The knobs of the decision rules (the inventory's `watch:` keys), with their defaults and checks.

Plain data: no I/O. docs/decisions.md explains each rule and why the defaults are what they are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import UsageError

NOT_DECIDE_KEYS = frozenset({"baseline_tok_s", "unreachable_s"})  # inventory `watch:` keys used elsewhere


@dataclass(frozen=True)
class DecideConfig:
    first_step_grace_s: float = 900.0
    """Seconds from the run's start to its first step before it counts as stalled (compilation is slow)."""
    min_steady_steps: int = 60
    """Steady needs at least this many steps since the first step (an autotuning plateau is shorter)."""
    min_steady_seconds: float = 60.0
    """... and at least this many seconds since the first step."""
    stall_factor: float = 10.0
    """After the first step: stalled when silent for stall_factor x the median gap between step lines ..."""
    stall_floor_s: float = 120.0
    """... but never sooner than this many seconds (a checkpoint save can take a minute)."""
    too_slow_tolerance: float = 0.10
    """Too slow when the steady interval's upper bound is below (1 - tolerance) x the baseline."""
    block_size: int = 5
    """Steps per block; the detector works on block medians."""
    min_blocks_after_warmup: int = 12
    """MSER's truncation point is accepted only with at least this many blocks after it."""
    stable_rel: float = 0.03
    """Halves' medians, the Theil-Sen level change and each new block must agree within this fraction."""
    max_iqr_rel: float = 0.10
    """IQR / median of the block medians after the warm-up must not exceed this."""
    confirm_blocks: int = 2
    """Consecutive new blocks that must pass every check before steady is declared."""
    max_interval_rel: float = 0.015
    """Steady needs the 95% interval's half-width within this fraction of the level (a noisy run waits)."""
    drift_horizon_blocks: int = 20
    """The Theil-Sen slope is projected over at least this many blocks: a slow leak in a short window fails."""
    shift_rel: float = 0.06
    """After steady: `shift_blocks` block medians in a row beyond this fraction on one side re-open the verdict ..."""
    shift_blocks: int = 4
    """... (a recompile, a throttled GPU, or an autotuning stretch longer than the minimums)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise UsageError(f"watch.{f.name} must be >= 0, got {getattr(self, f.name)}")
        if min(self.block_size, self.confirm_blocks, self.shift_blocks) < 1 or self.min_blocks_after_warmup < 2:
            raise UsageError("watch.block_size, confirm_blocks and shift_blocks must be >= 1, min_blocks_after_warmup >= 2")
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
            raise UsageError(f"unknown watch key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)
