"""Score decide/ on the labelled real logs (tests/data/real/) and the synthetic trace suite
(tests/decide/tracegen.py), and print figures.

    .venv/bin/python bench/decide_traces.py                 # real logs + synthetic report set: seeds 500-529
    .venv/bin/python bench/decide_traces.py --seeds 0-29    # ... the synthetic tuning set

Real logs: per log the labelled verdict and level against what decide/ says, the level error, and the
seconds from the first step line to the first steady declaration (and to the declaration of the level held
at the end, when a shift re-opened it).
Per trace kind: verdicts right, premature steady declarations (before the true warm-up end), false
fallbacks, detection delay after the true warm-up end (steps, seconds), truncation-point error and the
steady figure's error; then the judge's cost per log line. Figures, not pass/fail.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "decide"))  # tracegen, reallogs

from reallogs import labelled, judge  # noqa: E402
from reallogs import score as score_real  # noqa: E402
from tracegen import KINDS, score, suite  # noqa: E402

from orchestrator.decide import replay  # noqa: E402


def seed_range(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fmt(values: list[float], digits: int = 0) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f} / {pct(values, 0.9):.{digits}f} / {max(values):.{digits}f}"


def real_table() -> None:
    rows = [score_real(log, judge(log)) for log in labelled()]
    print(f"decide/ on {len(rows)} labelled real logs (tests/data/real/labels.csv)")
    header = f"{'log':24} {'label':>7} {'got':>9} {'level':>8} {'label lvl':>9} {'err':>6} {'steady s':>8} {'final s':>7} {'noise':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        level = f"{r['level']:,.0f}" if r["level"] is not None else "-"
        err = f"{r['level_error'] * 100:+.1f}%" if r["level_error"] is not None else "-"
        first = f"{r['first_declared_s']:.0f}" if r["first_declared_s"] is not None else "-"
        final = f"{r['declared_s']:.0f}" if r["declared_s"] is not None else "-"
        noise = f"{r['noise_rel']:.2f}{'*' if r['noisy'] else ''}" if r["noise_rel"] is not None else "-"
        print(f"{r['name']:24} {r['want']:>7} {r['got']:>9} {level:>8} {r['label_level']:>9,.0f} {err:>6} {first:>8} {final:>7} {noise:>6}")
    steady = [r for r in rows if r["want"] == "steady"]
    right = [r for r in steady if r["verdict_ok"] and r["level_ok"]]
    delays = [r["first_declared_s"] for r in right]
    print("-" * len(header))
    print(
        f"steady-labelled: {len(right)}/{len(steady)} steady within 5% of the label "
        f"({len(right) / len(steady):.0%}); others: {sum(r['verdict_ok'] for r in rows if r['want'] != 'steady')}/"
        f"{len(rows) - len(steady)} right; steady declared after the first step line (s) med/p90/max {fmt(delays)}"
    )
    print("  (noise = IQR / median of the interval throughputs; * = flagged noisy)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="500-529", help="seed range, e.g. 500-529 (report) or 0-29 (tuning)")
    seeds = seed_range(parser.parse_args().seeds)
    real_table()
    traces = suite(seeds)
    rows_by_kind: dict[str, list[dict]] = defaultdict(list)
    lines = 0
    started = time.process_time()
    for trace in traces:
        rows_by_kind[trace.kind].append(score(trace, replay(trace.lines, **trace.replay_kwargs())))
        lines += len(trace.lines)
    cpu = time.process_time() - started
    print(f"decide/ on {len(traces)} labelled traces ({len(KINDS)} kinds x seeds {seeds.start}-{seeds.stop - 1})")
    header = f"{'kind':32} {'ok':>5} {'prem':>4} {'ffb':>4}  {'delay steps med/p90/max':>24}  {'delay s med/p90/max':>20}  {'trunc err med|abs|':>18}  {'level err max':>13}"
    print(header)
    print("-" * len(header))
    totals = defaultdict(int)
    for kind, rows in rows_by_kind.items():
        delays = [r["delay_steps"] for r in rows if r["delay_steps"] is not None]
        delay_s = [r["delay_s"] for r in rows if r["delay_s"] is not None]
        trunc = [abs(r["truncation_error"]) for r in rows if r["truncation_error"] is not None]
        level = [abs(r["level_error"]) * 100 for r in rows if r["level_error"] is not None]
        ok = sum(r["verdict_ok"] for r in rows)
        premature = sum(r["premature"] for r in rows)
        false_fb = sum(r["false_fallback"] for r in rows)
        totals["ok"] += ok
        totals["premature"] += premature
        totals["false_fallback"] += false_fb
        totals["n"] += len(rows)
        print(
            f"{kind:32} {ok:>2}/{len(rows):<2} {premature:>4} {false_fb:>4}  {fmt(delays):>24}  {fmt(delay_s):>20}  "
            f"{(f'{statistics.median(trunc):.0f}' if trunc else '-'):>18}  {(f'{max(level):.1f}%' if level else '-'):>13}"
        )
    all_rows = [r for rows in rows_by_kind.values() for r in rows]
    delays = [r["delay_steps"] for r in all_rows if r["delay_steps"] is not None]
    print("-" * len(header))
    print(
        f"total: {totals['ok']}/{totals['n']} verdicts right, {totals['premature']} premature steady, "
        f"{totals['false_fallback']} false fallbacks; delay after true warm-up end (steps) med/p90/max {fmt(delays)}"
    )
    early = sum(r["before_2pct"] for r in all_rows)
    print(f"  ({early} declared after the level was within the precision but before the 2% point: negative delays above)")
    per_line_us = cpu / lines * 1e6
    print(
        f"cost: {lines} log lines in {cpu:.1f} s CPU = {per_line_us:.0f} us/line (parse + judge); "
        f"8 runs x 10 lines/s = {80 * per_line_us / 1e4:.2f}% of one core"
    )


if __name__ == "__main__":
    main()
