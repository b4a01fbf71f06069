"""Memory that keeps climbing after a run was declared steady: a leak on its way to an out-of-memory crash.

Fed by the judge with the memory a run holds once it is steady: each GPU's `mem_used_mib` from the watch's
nvidia-smi samples (about one a second, with `mem_total_mib`), and the trainer's `mem_gb` of its step lines
(the peak allocated, so `dfo replay` sees it too). Memory grows during a warm-up (the allocator's pools,
compilation) and may step up once later (an eval, a larger batch); a leak climbs on and on. So, per source,
over the samples since the first steady declaration (at most the newest hour), in buckets of BUCKET_S seconds:
the medians of the window's three thirds each higher than the one before by at least a fiftieth of the rise
threshold, the rise from the first bucket to the newest at least max(RISE_MIN_GIB, RISE_OF_TOTAL x the GPU's
total) (without a total: RISE_OF_BASE x the memory at the declaration), over at least MIN_WINDOW_S; and that
on every bucket for `hold_s` seconds (the judge passes min_steady_seconds). A one-off step up fails the
thirds (two of them equal); a leak passes on every look. Then `state()` says which source climbs, how fast,
and, with a total, when it would be full at this rate.

Pure: samples in, a dict out; no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

BUCKET_S = 5.0  # samples are kept as the median of each 5-s bucket: one evaluation per bucket
MAX_BUCKETS = 720  # the newest hour since the declaration
MIN_WINDOW_S = 60.0  # a climb is judged over at least a minute of samples
RISE_MIN_GIB = 0.5  # ... of at least 0.5 GiB
RISE_OF_TOTAL = 0.01  # ... and 1% of the GPU's memory (1.4 GiB of an H200's 140 GiB)
RISE_OF_BASE = 0.05  # without a total (the trainer's mem_gb): 5% of what the run held at the declaration


@dataclass
class _Series:
    base_gib: float | None = None
    total_gib: float | None = None
    buckets: deque = field(default_factory=lambda: deque(maxlen=MAX_BUCKETS))  # (end ts, median GiB)
    pending: list = field(default_factory=list)
    pending_since: float | None = None
    climbing_since: float | None = None
    climb: dict | None = None  # the measure of the climb, set on every bucket it holds


class MemoryWatch:
    """Feed (ts, source, GiB, total GiB or None) in time order once the run is steady; read `state()`."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.series: dict[str, _Series] = {}

    def feed(self, ts: float, source: str, gib: float, total_gib: float | None = None) -> None:
        series = self.series.setdefault(source, _Series())
        if series.base_gib is None:
            series.base_gib = gib
        series.total_gib = total_gib or series.total_gib
        if series.pending_since is None:
            series.pending_since = ts
        series.pending.append(gib)
        if ts - series.pending_since < BUCKET_S:
            return
        series.buckets.append((ts, median(series.pending)))
        series.pending, series.pending_since = [], None
        self._judge(series)

    def _judge(self, series: _Series) -> None:
        buckets = list(series.buckets)
        now_ts, now_gib = buckets[-1]
        start_ts, start_gib = buckets[0]
        seconds = now_ts - start_ts
        if series.total_gib:
            need = max(RISE_MIN_GIB, RISE_OF_TOTAL * series.total_gib)
        else:
            need = max(RISE_MIN_GIB, RISE_OF_BASE * series.base_gib)
        third = len(buckets) // 3
        climbing = False
        if seconds >= MIN_WINDOW_S and third >= 2:
            thirds = [median(v for _, v in buckets[i * third : (i + 1) * third]) for i in range(2)]
            thirds.append(median(v for _, v in buckets[2 * third :]))
            step = need / 50
            climbing = thirds[1] - thirds[0] >= step and thirds[2] - thirds[1] >= step and now_gib - start_gib >= need
        if not climbing:
            series.climbing_since, series.climb = None, None
            return
        series.climbing_since = series.climbing_since or now_ts
        # the rate from the first third's median to the last one's, between their centres
        centre = [median(t for t, _ in buckets[:third]), median(t for t, _ in buckets[2 * third :])]
        rate = (thirds[2] - thirds[0]) / (centre[1] - centre[0]) if centre[1] > centre[0] else 0.0
        full_in = (series.total_gib - now_gib) / rate if series.total_gib and rate > 0 else None
        series.climb = {
            "since_ts": start_ts - BUCKET_S, "from_gib": round(start_gib, 2), "now_gib": round(now_gib, 2),
            "total_gib": round(series.total_gib, 2) if series.total_gib else None,
            "gib_per_min": round(rate * 60, 3), "full_in_s": round(full_in) if full_in is not None else None,
            "climbing_for_s": round(now_ts - series.climbing_since, 1),
        }

    def state(self) -> tuple[str, dict] | None:
        """The source climbing for `hold_s` or more that would be full soonest (or climbs fastest, without a
        total), with its measure; None when none does."""
        held = [(source, s.climb) for source, s in self.series.items()
                if s.climb is not None and s.climb["climbing_for_s"] >= self.hold_s]
        if not held:
            return None
        return min(held, key=lambda item: (item[1]["full_in_s"] is None, item[1]["full_in_s"] or 0, -item[1]["gib_per_min"]))
