"""Write the probe logs of tests/data/probe/ and their labels.csv: one set per shape issue 27 names.

    .venv/bin/python tests/data/probe/make_probes.py            # (re)write the logs and labels.csv here
    .venv/bin/python tests/data/probe/make_probes.py --check    # exit 1 if a file differs from what it writes

Each log is in the trainer's metric-line format (`ts=... event=step step=N tok_s=X loss=... phase=train`, after
an `event=start` and an `event=compile` line), generated from a seeded `random.Random` (the Mersenne Twister:
the same bytes on every Python), so the files are exactly what this script makes (tests/decide/
test_decide_probe.py checks it). The shapes (4-6 logs each, seeds 0..n-1):
- quiet: a compute-bound run (qwen3-8b-shape-like): a line every 5 steps, ~1 line/s; a compile-slowed first
  line (phase=warmup), a second at 90-97% of the level, then the level with 0.3-0.8% noise; 2 minutes.
- short_noisy: a short steady run, 160-260 steps, one line a step (0.25-1.0 s), a short exponential warm-up,
  then 4-7% AR(1) noise; it ends while still running.
- fast_leak: 20 steps/s, a line every 20 steps, 5-8% AR(1) noise, a warm-up of a few seconds, then a leak of
  0.5% per 100 steps (0.1%/s) for 5 minutes: never steady.
- early_drop: launch-bound (10-20 steps/s, a line every 20 steps), 6-8% noise on a level rising 10-20% for
  30-45 s, then a 20-40% drop to a level that holds for 100-120 s: the level a person reads is the new one.
- late_drop: a quiet run (2-3% noise, a line every 5 steps at 5 steps/s) steady for 120 s, then a 10-15% drop
  that holds for 180 s: the first verdict is the first level, the final one the new level.
- eval_pauses: 3% noise, a line every 10 steps at 10 steps/s, and every 30-45 s an eval pause of 8-15 s that
  the trainer does not mark: no line during it, and the line after it carries the pause in its tok_s (its
  tokens over its wall time, as trainer/replica.py computes it); 5 minutes.
labels.csv, per log: the verdict at the end (`steady`, or `not_steady`), the level then and the step it
holds from, the first steady verdict's level and the earliest step it may come at (before it: premature),
the drop's step and seconds after the first step line, the wall-clock rate (eval_pauses), how near a figure
must be to the level (5%; eval_pauses 2%: with 3% noise over ~250 lines either rate is known to well under
1%, and a figure 2-5% below the training rate is a blend of the two), and the goals' bounds: first steady within `first_within_s` of the first step line, re-opened within `reopen_within_s` of
the drop, steady held at most `held_steady_max_s` (fast_leak).
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import random
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
T0 = 1_796_169_600.0  # 2026-12-02T00:00:00Z
SETTLED = 0.02  # a warm-up ends where the noise-free curve stays within 2% of its level
PRECISION = 0.05  # a first steady declaration before the curve is within 5% of its level is premature
COLUMNS = ["file", "shape", "verdict", "level_tok_s", "holds_from_step", "first_level_tok_s", "first_from_step",
           "drop_step", "drop_s", "wall_tok_s", "level_tolerance", "first_within_s", "reopen_within_s",
           "held_steady_max_s", "note"]


def stamp(epoch: float) -> str:
    moment = datetime.fromtimestamp(round(epoch, 3), tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class Ar1:
    """AR(1) relative noise with standard deviation `sigma` and lag-1 correlation `phi`."""

    def __init__(self, rng: random.Random, sigma: float, phi: float) -> None:
        self.rng, self.sigma, self.phi = rng, sigma, phi
        self.value = rng.gauss(0, sigma)

    def __next__(self) -> float:
        self.value = self.phi * self.value + self.rng.gauss(0, self.sigma * math.sqrt(1 - self.phi ** 2))
        return self.value


@dataclass
class Log:
    """A trainer log being written: the clock, the step, the lines."""

    rng: random.Random
    name: str
    ts: float = T0
    step: int = 0
    loss: float = 6.0
    lines: list[str] = field(default_factory=list)
    first_step_ts: float | None = None
    step_ts: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lines.append(f"ts={stamp(self.ts)} event=start run={self.name} variant=probe topology=threads")
        self.ts += self.rng.uniform(20, 60)
        self.lines.append(f"ts={stamp(self.ts)} event=compile drafter=0 seconds={self.ts - T0 - 1:.2f}")

    def line(self, seconds: float, steps: int, tok_s: float, phase: str = "train") -> None:
        """One step line `seconds` after the previous one, `steps` steps later, at `tok_s`."""
        self.ts += seconds
        self.step += steps
        self.loss = max(0.5, self.loss * 0.998)
        self.first_step_ts = self.first_step_ts or self.ts
        self.step_ts[self.step] = self.ts
        self.lines.append(f"ts={stamp(self.ts)} event=step step={self.step} tok_s={tok_s:.1f} loss={self.loss:.4f} "
                          f"phase={phase}")

    def seconds(self) -> float:
        return self.ts - self.first_step_ts if self.first_step_ts is not None else 0.0


def label(log: Log, shape: str, verdict: str, note: str, **fields) -> dict:
    return {"file": f"{log.name}.log", "shape": shape, "verdict": verdict, "note": note,
            **{key: fields.get(key, "") for key in COLUMNS[3:-1]}, "level_tolerance": fields.get("level_tolerance", 0.05)}


def rounded(value: float) -> float:
    return round(value, 1)


def quiet(seed: int) -> tuple[Log, dict]:
    rng = random.Random(f"quiet-{seed}")
    log = Log(rng, f"quiet-{seed}")
    level, noise = rng.uniform(7_000, 12_000), Ar1(rng, rng.uniform(0.003, 0.008), 0.3)
    per_line = rng.uniform(0.9, 1.1)
    log.line(per_line * rng.uniform(2, 5), 5, level * rng.uniform(0.05, 0.4), "warmup")  # the compile in it
    log.line(per_line, 5, level * rng.uniform(0.90, 0.97) * (1 + next(noise)))
    while log.seconds() < 120:
        log.line(per_line * rng.uniform(0.98, 1.02), 5, level * (1 + next(noise)))
    return log, label(log, "quiet", "steady", "flat from the third line, under 1% noise", level_tok_s=rounded(level),
                      holds_from_step=15, first_level_tok_s=rounded(level), first_from_step=15, first_within_s=15)


def short_noisy(seed: int) -> tuple[Log, dict]:
    rng = random.Random(f"short_noisy-{seed}")
    log = Log(rng, f"short_noisy-{seed}")
    level, steps = rng.uniform(40_000, 120_000), rng.randint(160, 260)
    amplitude, tau = rng.uniform(0.3, 0.6), rng.uniform(5, 15)
    noise = Ar1(rng, rng.uniform(0.04, 0.07), rng.uniform(0.3, 0.5))
    per_step = rng.uniform(0.25, 1.0)
    for step in range(1, steps + 1):
        log.line(per_step * rng.uniform(0.9, 1.1), 1, level * (1 - amplitude * math.exp(-step / tau)) * (1 + next(noise)))
    settled = math.ceil(tau * math.log(amplitude / SETTLED))
    within = math.ceil(tau * math.log(amplitude / PRECISION))
    return log, label(log, "short_noisy", "steady", f"{steps} steps, {noise.sigma:.1%} AR(1) noise after a short warm-up",
                      level_tok_s=rounded(level), holds_from_step=settled, first_level_tok_s=rounded(level),
                      first_from_step=within)


def fast_leak(seed: int) -> tuple[Log, dict]:
    rng = random.Random(f"fast_leak-{seed}")
    log = Log(rng, f"fast_leak-{seed}")
    level, noise = rng.uniform(30_000, 80_000), Ar1(rng, rng.uniform(0.05, 0.08), 0.5)
    per_step, amplitude, tau_s = 0.05, rng.uniform(0.3, 0.6), rng.uniform(0.5, 2.0)
    t = 0.0
    while t < 300:
        seconds = 20 * per_step * rng.uniform(0.97, 1.03)
        t += seconds
        curve = (1 - amplitude * math.exp(-t / tau_s)) * (1 - 0.005 / 100) ** (t / per_step)  # -0.005% a step
        log.line(seconds, 20, level * curve * (1 + next(noise)))
    return log, label(log, "fast_leak", "not_steady", "-0.5% per 100 steps at 20 steps/s (0.1%/s) for 5 minutes",
                      held_steady_max_s=60)


def early_drop(seed: int) -> tuple[Log, dict]:
    rng = random.Random(f"early_drop-{seed}")
    log = Log(rng, f"early_drop-{seed}")
    level, rise, drop = rng.uniform(45_000, 60_000), rng.uniform(0.10, 0.20), rng.uniform(0.20, 0.40)
    drop_s, after_s = rng.uniform(30, 45), rng.uniform(100, 120)
    per_line = 20 / rng.uniform(10, 20)
    noise = Ar1(rng, rng.uniform(0.06, 0.08), 0.4)
    top = level * (1 + rise)
    while log.seconds() < drop_s:
        log.line(per_line * rng.uniform(0.95, 1.05), 20, level * (1 + rise * log.seconds() / drop_s) * (1 + next(noise)))
    drop_step, at_s, new = log.step + 20, log.seconds(), top * (1 - drop)
    while log.seconds() < drop_s + after_s:
        log.line(per_line * rng.uniform(0.95, 1.05), 20, new * (1 + next(noise)))
    return log, label(log, "early_drop", "steady", f"rising {rise:.0%} to {top:,.0f} for {at_s:.0f} s, then "
                      f"-{drop:.0%} to {new:,.0f}", level_tok_s=rounded(new), holds_from_step=drop_step,
                      first_level_tok_s=rounded(new), first_from_step=drop_step, drop_step=drop_step,
                      drop_s=round(at_s, 1), first_within_s=60)


def late_drop(seed: int) -> tuple[Log, dict]:
    rng = random.Random(f"late_drop-{seed}")
    log = Log(rng, f"late_drop-{seed}")
    level, drop = rng.uniform(20_000, 100_000), rng.uniform(0.10, 0.15)
    noise = Ar1(rng, rng.uniform(0.02, 0.03), 0.4)
    amplitude, tau = rng.uniform(0.3, 0.6), rng.uniform(3, 8)  # in lines
    lines = 0
    while log.seconds() < 120:
        lines += 1
        log.line(rng.uniform(0.97, 1.03), 5, level * (1 - amplitude * math.exp(-lines / tau)) * (1 + next(noise)))
    drop_step, at_s, new = log.step + 5, log.seconds(), level * (1 - drop)
    while log.seconds() < 300:
        log.line(rng.uniform(0.97, 1.03), 5, new * (1 + next(noise)))
    within = 5 * math.ceil(tau * math.log(amplitude / PRECISION))
    return log, label(log, "late_drop", "steady", f"steady at {level:,.0f} for 120 s, then -{drop:.0%} to {new:,.0f} "
                      "for 180 s", level_tok_s=rounded(new), holds_from_step=drop_step,
                      first_level_tok_s=rounded(level), first_from_step=within, drop_step=drop_step,
                      drop_s=round(at_s, 1), reopen_within_s=60)


def eval_pauses(seed: int) -> tuple[Log, dict]:
    rng = random.Random(f"eval_pauses-{seed}")
    log = Log(rng, f"eval_pauses-{seed}")
    level, noise = rng.uniform(20_000, 100_000), Ar1(rng, 0.03, 0.4)
    every_s, pause_s = rng.uniform(30, 45), rng.uniform(8, 15)
    next_pause, paused, trained = every_s, 0.0, 0.0
    while log.seconds() < 300:
        seconds = rng.uniform(0.97, 1.03)
        pause = pause_s * rng.uniform(0.9, 1.1) if log.first_step_ts is not None and log.seconds() >= next_pause else 0.0
        if pause:
            next_pause += every_s
        paused, trained = paused + pause, trained + seconds
        log.line(seconds + pause, 10, level * (1 + next(noise)) * seconds / (seconds + pause))
    wall = level * trained / (trained + paused)
    return log, label(log, "eval_pauses", "steady", f"an unmarked {pause_s:.0f}-s pause every {every_s:.0f} s: "
                      f"training {level:,.0f}, wall clock {wall:,.0f}", level_tok_s=rounded(level), holds_from_step=10,
                      first_level_tok_s=rounded(level), first_from_step=10, wall_tok_s=rounded(wall),
                      level_tolerance=0.02)


SHAPES = {"quiet": (quiet, 4), "short_noisy": (short_noisy, 6), "fast_leak": (fast_leak, 4),
          "early_drop": (early_drop, 4), "late_drop": (late_drop, 4), "eval_pauses": (eval_pauses, 4)}


def generate() -> dict[str, str]:
    """file name -> text, labels.csv included."""
    files, rows = {}, []
    for make, count in SHAPES.values():
        for seed in range(count):
            log, row = make(seed)
            files[row["file"]] = "\n".join(log.lines) + "\n"
            rows.append(row)
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    files["labels.csv"] = out.getvalue()
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the files here instead of writing")
    args = parser.parse_args()
    files = generate()
    if args.check:
        differ = [name for name, body in files.items()
                  if not (HERE / name).exists() or (HERE / name).read_text() != body]
        print("\n".join(differ) or "all probe files are what make_probes.py writes")
        return 1 if differ else 0
    for name, body in files.items():
        (HERE / name).write_text(body)
    print(f"wrote {len(files)} files in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
