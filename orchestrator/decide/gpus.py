"""Which of a run's GPUs went idle first: the idle-GPU detector over GpuObs samples.

A multi-GPU run whose one drafter died (or hangs) shows it on the GPUs before anywhere else: that GPU's
utilisation drops to ~0 while the others stay busy (waiting in a collective reads ~100%). The detector
flags a GPU that (1) was busy at some earlier sample, (2) has been at or below `idle_pct` for `samples`
samples in a row, (3) while at least one other GPU was at or above `busy_pct` in each of those samples. The
time it went idle is its first idle sample. A flagged GPU that gets busy again is no longer idle (a warm-up
pause is not a death); a GPU never seen busy is never flagged (it may simply be unused).

Pure: samples in, flags out; no I/O, no clock. The caller passes only the target's own GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ..logfmt import format_ts
from .observations import GpuObs

IDLE_PCT = 5.0
BUSY_PCT = 20.0
IDLE_SAMPLES = 3  # nvidia-smi -lms 1000: about 3 s of idleness


@dataclass(frozen=True)
class IdleGpu:
    """GPU `index` has been idle since `since` (its first idle sample) while `busy` stayed busy."""

    index: int
    since: float
    flagged_at: float
    busy: tuple[int, ...]

    def describe(self) -> str:
        others = ", ".join(str(i) for i in self.busy)
        return f"GPU {self.index} went idle first at {format_ts(self.since)} (GPU {others} still busy)"

    def to_json(self) -> dict:
        return {"gpu": self.index, "idle_since": format_ts(self.since), "flagged_at": format_ts(self.flagged_at),
                "busy_gpus": list(self.busy)}


@dataclass
class _GpuTrack:
    seen_busy: bool = False
    idle_since: float | None = None
    idle_run: int = 0  # consecutive idle samples with another GPU busy


@dataclass
class IdleGpuDetector:
    """Feed GpuObs in time order; `feed` returns the GPUs newly flagged by that sample."""

    idle_pct: float = IDLE_PCT
    busy_pct: float = BUSY_PCT
    samples: int = IDLE_SAMPLES
    tracks: dict[int, _GpuTrack] = field(default_factory=dict)
    flagged: dict[int, IdleGpu] = field(default_factory=dict)  # GPUs idle now, by index

    def feed(self, obs: GpuObs) -> list[IdleGpu]:
        utils = {int(g["index"]): float(g["util_pct"]) for g in obs.gpus
                 if g.get("index") is not None and g.get("util_pct") is not None}
        busy = {index for index, util in utils.items() if util >= self.busy_pct}
        new = []
        for index, util in utils.items():
            track = self.tracks.setdefault(index, _GpuTrack())
            if util > self.idle_pct:
                track.seen_busy = track.seen_busy or util >= self.busy_pct
                track.idle_since, track.idle_run = None, 0
                self.flagged.pop(index, None)
                continue
            others_busy = tuple(sorted(busy - {index}))
            if not track.seen_busy or not others_busy:
                track.idle_since, track.idle_run = None, 0  # all idle together: nobody went first
                continue
            track.idle_since = obs.ts if track.idle_since is None else track.idle_since
            track.idle_run += 1
            if track.idle_run >= self.samples and index not in self.flagged:
                self.flagged[index] = IdleGpu(index, track.idle_since, obs.ts, others_busy)
                new.append(self.flagged[index])
        return new

    def first(self) -> IdleGpu | None:
        """The GPU idle now that went idle earliest (None: none is)."""
        return min(self.flagged.values(), key=lambda gpu: (gpu.since, gpu.index), default=None)


def first_idle_gpu(samples: Iterable[GpuObs], **rule) -> IdleGpu | None:
    """The detector over a whole sequence: the GPU flagged first and still idle at the end, or None."""
    detector = IdleGpuDetector(**rule)
    for obs in samples:
        detector.feed(obs)
    return detector.first()
