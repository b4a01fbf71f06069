"""Replay a recorded log through the same RunJudge the watcher uses, with the log's own clock.

Each line's timestamp (or, for lines without one, the last timestamp seen) is the clock; between two
lines the watcher's ticks are re-created every `tick_s` seconds, so a stall is declared when the watcher
would have declared it. The result is the verdict held at the log's end; a crash or too-slow anywhere
overrides an earlier steady, and `at_step` is the step at which the held verdict was first reached.
`replay_timeline` gives every change of verdict on the way there (what a watcher would have acted on, and
when), the final verdict last.
Pure: takes lines, returns Decisions; reading the file is the CLI's job.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

from ..logfmt import make_parser
from .config import DecideConfig
from .judge import Decision, RunJudge
from .observations import ExitObs, Observation, TickObs, observation_from_record
from .signatures import Catalogue

MAX_TICKS_PER_GAP = 100_000  # a gap of days in a log is still replayed in bounded time


def _ticks_between(start: float, end: float, tick_s: float) -> Iterable[TickObs]:
    step = max(tick_s, (end - start) / MAX_TICKS_PER_GAP)
    t = start + step
    while t < end:
        yield TickObs(t)
        t += step


def replay(
    lines: Iterable[str],
    *,
    run: str = "",
    config: DecideConfig | None = None,
    baseline: float | None = None,
    regex: str | None = None,
    variant: str | None = None,
    chain: Sequence[str] = (),
    fallback: bool = True,
    catalogue: Catalogue | None = None,
    exit_code: int | None = None,
    end_ts: float | None = None,
    line_interval_s: float | None = None,
    tick_s: float = 1.0,
    after_each: Callable[[RunJudge], None] | None = None,
) -> Decision:
    """Judge a whole log; `exit_code`/`end_ts` add the run's exit status and the clock after its last line.

    `line_interval_s` gives a log without any timestamps a clock (each line that many seconds after the
    previous one); without it such a log cannot pass the minimum-seconds rule and stays undecided.
    `after_each(judge)` is called after each line and each tick past the last line (replay_timeline's hook)."""
    judge = RunJudge(config, baseline, run=run, variant=variant, chain=chain, fallback=fallback, catalogue=catalogue)
    look = after_each or (lambda _: None)
    clock = None
    for clock, _ in judged_lines(judge, lines, regex=regex, line_interval_s=line_interval_s, tick_s=tick_s):
        look(judge)
        if judge.settled:
            break  # the watcher acts on it; what follows in the log cannot change the verdict
    if end_ts is not None and clock is not None and end_ts > clock:
        for tick in _ticks_between(clock, end_ts, tick_s):
            judge.observe(tick)
            look(judge)
        judge.observe(TickObs(end_ts))
        clock = end_ts
    if exit_code is not None:
        judge.observe(ExitObs(clock if clock is not None else 0.0, exit_code))
    return judge.end_of_log()


def replay_timeline(lines: Iterable[str], **options) -> list[Decision]:
    """Every change of verdict on the way to `replay(lines, **options)`'s verdict, oldest first, then that
    verdict: each change the Decision as it stood when the verdict changed (its `at_step`, `at_ts`,
    `steady_tok_s` and `interval` are those of that moment: what a watcher acting on it would have acted on).
    A change is a new verdict, signature, action or ending, or a new steady level declared (a shift re-opened
    the verdict and the new level was declared); the figure refining under a held declaration is not one.
    The first entry is the verdict at the log's first line; the last is exactly what `replay` returns, the
    same verdict as the change before it when nothing changed since (then with the figure as it stands at
    the end, which may have moved since it was declared)."""
    changes: list[Decision] = []
    seen: list[tuple] = [()]  # the judge's state when last looked at: a Decision is built only when it moved

    def look(judge: RunJudge) -> None:
        state = held_state(judge)
        if state == seen[0]:
            return
        seen[0] = state
        decision = judge.decision()
        if not changes or verdict_key(changes[-1]) != verdict_key(decision):
            changes.append(decision)

    final = replay(lines, **options, after_each=look)
    return [*changes, final]


def held_state(judge: RunJudge) -> tuple:
    """What of the judge's state can change its verdict_key, read without building a Decision (cheap enough to
    look at after every observation): settled, steady or drifting and the step that level was declared at, and
    whether a step was seen. A caller builds `judge.decision()` only when this moved: the Decision as it stood
    when its verdict was reached (replay_timeline; the watch's Watcher._feed)."""
    estimate = judge.steady.estimate
    held = estimate.steady or estimate.drifting
    return (judge.settled, estimate.steady, estimate.drifting, estimate.declared_step if held else None,
            judge.last_step is None)


def verdict_key(decision: Decision) -> tuple:
    """What makes two decisions the same verdict in a timeline: the verdict, signature, action and ending, and
    the step the steady (or drifting) level held was declared at."""
    declared = decision.evidence.get("steady_declared_step") if decision.decision in ("steady", "drifting") else None
    return decision.decision, decision.signature, decision.action, decision.ended, declared


def decision_key(decision: Decision) -> tuple:
    """What makes a decision news: the verdict, the action, the next run, a level shift suspected (where it
    began) or no longer suspected, and memory climbing since steady (`degrading`: which memory) or no longer, or
    still climbing when the run ended (`degrading_at_end`: the run may end in the step() where the climb is seen)."""
    suspected = (decision.shift_suspected or {}).get("since_step")
    climbs = [(d or {}).get(key) for d in (decision.degrading, decision.degrading_at_end) for key in ("what", "gpu")]
    return decision.decision, decision.action, decision.next_run, decision.signature, suspected, *climbs


def judged_lines(
    judge: RunJudge, lines: Iterable[str], *, regex: str | None = None, line_interval_s: float | None = None,
    tick_s: float = 1.0,
) -> Iterator[tuple[float, Observation]]:
    """Feed `judge` the log line by line on the log's own clock (ticks between lines, as the watcher's);
    yields (clock, observation) after each line, for a caller that looks at `judge.decision()` as it goes
    (`replay` keeps the last; a test can check what the watch showed at every step)."""
    parse = make_parser(regex)
    clock: float | None = None
    for index, text in enumerate(lines):
        received = index * line_interval_s if line_interval_s is not None else clock
        record = parse(text, received)
        ts = getattr(record, "ts", None)
        if ts is None and clock is None:
            ts = 0.0
        obs = observation_from_record(record, ts if ts is not None else clock)
        if clock is None or obs.ts > clock:
            if clock is not None:
                for tick in _ticks_between(clock, obs.ts, tick_s):
                    judge.observe(tick)
            clock = obs.ts
            judge.observe(TickObs(clock))
        judge.observe(obs)
        yield clock, obs
