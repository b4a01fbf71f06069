"""Score decide/ on the labelled real logs (tests/data/real/) and the synthetic trace suite
(tests/decide/tracegen.py), and print figures.

    .venv/bin/python bench/decide_traces.py                 # real logs + synthetic report set: seeds 500-529
    .venv/bin/python bench/decide_traces.py --seeds 0-29    # ... the synthetic tuning set
    .venv/bin/python bench/decide_traces.py --timeline LOG [--precision 0.10] [--min-steady-seconds 40]

Real logs: per log the labelled verdict and level against what decide/ says, the level error, and the
seconds from the first step line to the first steady declaration (and to the declaration of the level held
at the end, when a shift re-opened it).
Per trace kind: verdicts right, premature steady declarations (before the true warm-up end), false
fallbacks, detection delay after the true warm-up end (steps, seconds), truncation-point error and the
steady figure's error; then the judge's cost per log line. Figures, not pass/fail.
--timeline: one log replayed up to each of its step lines (O(lines^2): ~30 s of CPU for 650 lines), printing
what holds the verdict back each time that changes (the trend check, the level's interval, the minimums or
confirming blocks, no warm-up end yet), then per check the seconds after the first step line it failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "decide"))  # tracegen, reallogs

from reallogs import first_step_ts, labelled, judge  # noqa: E402
from reallogs import score as score_real  # noqa: E402
from tracegen import KINDS, score, suite  # noqa: E402

from orchestrator.decide import DecideConfig, replay  # noqa: E402
from orchestrator.logfmt import StepRecord, parse_logfmt  # noqa: E402


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


def held_back_by(checks: dict) -> str:
    """What keeps an undecided verdict undecided, from its evidence's checks."""
    if not checks:
        return "no warm-up end yet"
    failing = [name for name, key in (("trend", "no_trend_beyond_precision"), ("interval", "interval_within_precision"))
               if not checks.get(key)]
    return " + ".join(failing) or "minimums / confirming blocks"


def timeline(path: Path, config: DecideConfig) -> None:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    t0 = first_step_ts(lines)
    print(f"{path.name} at precision {config.precision:.0%}, minimums {config.min_steady_steps} steps / "
          f"{config.min_steady_seconds:.0f} s; seconds after the first step line")
    previous, failed, analysed = None, defaultdict(list), 0
    decision = None
    for index, text in enumerate(lines):
        record = parse_logfmt(text)
        if not isinstance(record, StepRecord) or record.ts is None:
            continue
        decision = replay(lines[: index + 1], run=path.stem, config=config)
        seconds = record.ts - t0
        checks = (decision.evidence.get("steady") or {}).get("checks") or {}
        state = decision.decision if decision.decision != "undecided" else held_back_by(checks)
        if checks and decision.decision == "undecided":
            analysed += 1
            for name, key in (("trend", "no_trend_beyond_precision"), ("interval", "interval_within_precision")):
                if not checks.get(key):
                    failed[name].append(seconds)
        if state != previous:
            figure = f" at {decision.steady_tok_s:,.0f}" if decision.steady_tok_s is not None else ""
            trend_95 = checks.get("trend_rel_95")
            detail = (f"  trend 95% {trend_95[0] or 0:+.1%}..{trend_95[1] or 0:+.1%}, level +/-"
                      f"{checks.get('interval_half_width_rel') or 0:.1%}") if trend_95 else ""
            print(f"  {seconds:6.1f} s  step {record.step:>7}  {state}{figure}{detail}")
            previous = state
    for name in ("trend", "interval"):
        times = failed[name]
        span = f", first at {times[0]:.1f} s, last at {times[-1]:.1f} s" if times else ""
        print(f"  {name} check failed on {len(times)} of {analysed} analysed undecided step lines{span}")
    if decision is not None:
        print(f"  end: {decision.decision}: {decision.reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="500-529", help="seed range, e.g. 500-529 (report) or 0-29 (tuning)")
    parser.add_argument("--timeline", type=Path, help="one log: what holds its verdict back, and from when")
    parser.add_argument("--precision", type=float, default=DecideConfig.precision, help="with --timeline")
    parser.add_argument("--min-steady-seconds", type=float, default=DecideConfig.min_steady_seconds, help="with --timeline")
    args = parser.parse_args()
    if args.timeline:
        timeline(args.timeline, DecideConfig(precision=args.precision, min_steady_seconds=args.min_steady_seconds))
        return
    seeds = seed_range(args.seeds)
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
