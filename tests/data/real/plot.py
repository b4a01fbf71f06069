"""Plot tok_s over time for the labelled real logs (the picture the labels were read from).

    .venv/bin/python tests/data/real/plot.py tests/data/real/*.log --out /tmp/plots   # needs matplotlib

One PNG per log: tok_s of each step line against seconds since the first step line (top axis: step).
Not used by the tests or the detector.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from orchestrator.logfmt import StepRecord, parse_logfmt  # noqa: E402


def steps_of(path: Path) -> list[StepRecord]:
    records = (parse_logfmt(line) for line in path.read_text(errors="replace").splitlines())
    return [r for r in records if isinstance(r, StepRecord) and r.ts is not None]


def plot(path: Path, out: Path) -> Path:
    steps = steps_of(path)
    t0 = steps[0].ts
    fig, ax = plt.subplots(figsize=(14, 5))
    ax.plot([s.ts - t0 for s in steps], [s.tok_s for s in steps], ".-", lw=0.6, ms=2.5)
    ax.set_xlabel("seconds since the first step line")
    ax.set_ylabel("tok_s")
    ax.grid(True, alpha=0.4)
    ax.set_ylim(bottom=0)
    top = ax.secondary_xaxis("top")
    seconds, numbers = [s.ts - t0 for s in steps], [s.step for s in steps]
    top.set_xticks(seconds[:: max(1, len(seconds) // 12)], [str(n) for n in numbers[:: max(1, len(numbers) // 12)]])
    top.set_xlabel("step")
    ax.set_title(path.name)
    target = out / f"{path.stem}.png"
    fig.savefig(target, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/real-plots"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for log in args.logs:
        print(plot(log, args.out))


if __name__ == "__main__":
    main()
