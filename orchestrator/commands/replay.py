"""`dfo replay LOG`: the watcher's verdict on a recorded log, judged by the same decide/ code.

Renders only: reading the inventory and the log happens here, every decision in orchestrator/decide/.
The log is untrusted: its text (a crash line, a reason quoting it) is shown through sanitize.py, never as
markup or raw control characters, and its metric lines with out-of-range fields are counted and named.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.table import Table

from ..chains import catalogue_for
from ..decide import DecideConfig, Decision, figure_span, replay, replay_timeline
from ..errors import UsageError
from ..events import LevelShift
from ..inventory import load_inventory
from ..logfmt import MAX_TOK_S, MalformedLine, make_parser, parse_ts
from ..sanitize import markup, text
from ..words import counted
from .common import InventoryOpt, JsonOpt, console, err_console, print_json, verdicts_exit_status

EXAMPLE = ("Example: dfo replay logs/run-trees.log --baseline 150000 --variant trees -i inventory/lab.yaml --json; "
           "dfo replay logs/run-trees.log --timeline (when each verdict a watcher would have acted on came)")
COLOURS = {"steady": "green", "exited": "green", "stopped": "cyan", "undecided": "yellow", "drifting": "yellow",
           "crash": "red", "stall": "red", "too_slow": "magenta"}


def register(app: typer.Typer) -> None:
    app.command(
        "replay",
        help=(
            "Judge a recorded log with the watcher's rules and its own timestamps: prints the verdict held at "
            "the log's end. Exit status 1 for crash/stall/too_slow/undecided/drifting (as dfo watch), else 0. "
            "--timeline: every change of verdict on the way, each as it stood then (a table; with --json one JSON "
            "line each), then the final verdict, as without --timeline."
        ),
        epilog=EXAMPLE,
    )(replay_command)


def read_exit_code(log: Path) -> int | None:
    """The exit status a detached run wrote next to its log (`RUN.log.exit`, as runs.launch writes it, or
    `RUN.exit`), if there is one."""
    for exit_file in (log.with_name(log.name + ".exit"), log.with_suffix(".exit")):
        try:
            return int(exit_file.read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def replay_command(
    log: Path = typer.Argument(..., metavar="LOG", help="The run's log file (the contract's logfmt lines, or --regex)."),
    baseline: Optional[float] = typer.Option(None, "--baseline", help="Baseline tok/s for the too-slow rule.", metavar="TOK_S"),
    regex: Optional[str] = typer.Option(None, "--regex", metavar="REGEX", help="Metric regex with named groups step, tok_s (ts, loss ...)."),
    variant: Optional[str] = typer.Option(None, "--variant", metavar="VARIANT", help="The inventory variant that ran (its regex, baseline, chain)."),
    exit_code: Optional[int] = typer.Option(None, "--exit-code", metavar="N", help="The run's exit status (default: LOG's .exit file)."),
    line_interval: Optional[float] = typer.Option(
        None, "--line-interval", help="Seconds between lines, for logs with no timestamps at all.", metavar="S",
    ),
    timeline: bool = typer.Option(
        False, "--timeline", help="Every change of verdict, when it came (at_ts, at_step) and at what figure, then "
        "the final verdict. With --json: one decision JSON line per change, the final verdict's last.",
    ),
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = JsonOpt,
) -> None:
    if line_interval is not None and not 0 < line_interval < math.inf:
        raise UsageError(f"--line-interval {line_interval:g}: the seconds between lines must be more than 0 and finite",
                         hint="e.g. --line-interval 0.5")
    if baseline is not None and not 0 < baseline <= MAX_TOK_S:  # also refuses nan and inf
        raise UsageError(f"--baseline {baseline:g}: the baseline must be a number of tok/s above 0, at most "
                         f"{MAX_TOK_S:g}", hint="e.g. --baseline 150000")
    inv = load_inventory(inventory)
    spec = inv.variants.get(variant) if variant else None
    if variant and spec is None:
        raise UsageError(f"unknown variant {variant!r}; known: {', '.join(sorted(inv.variants)) or 'none'}")
    watch = inv.watch.decide_mapping()
    lines = read_log_lines(log)
    metrics = regex or (spec.metrics if spec else None)
    malformed = malformed_lines(lines, metrics)
    options = dict(
        run=log.stem,
        config=DecideConfig.from_mapping(watch),
        baseline=baseline or (spec.baseline_tok_s if spec else None) or watch.get("baseline_tok_s"),
        regex=metrics,
        variant=variant,
        chain=inv.fallback,
        catalogue=catalogue_for(inv),
        exit_code=exit_code if exit_code is not None else read_exit_code(log),
        line_interval_s=line_interval,
    )
    changes = replay_timeline(lines, **options) if timeline else [replay(lines, **options)]
    decision = changes[-1]
    if as_json:
        for change in changes[:-1]:
            print_json(change.to_json())
        print_json({**decision.to_json(), "malformed_lines": len(malformed)})
    elif timeline:
        render_timeline(changes, first_step_ts(lines, metrics))
        show_malformed(malformed)
    else:
        render(decision)
        show_malformed(malformed)
    raise typer.Exit(verdicts_exit_status([decision.decision]))


def read_log_lines(log: Path) -> list[str]:
    try:
        return log.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        raise UsageError(f"{log}: no such log file", hint="pass the path of a run's .log") from None
    except OSError as exc:
        raise UsageError(f"{log}: cannot read: {exc.strerror}") from None


def malformed_lines(lines: list[str], regex: str | None) -> list[tuple[int, MalformedLine]]:
    """(line number, record) of each metric line whose fields are out of range: the judge ignores them."""
    parse = make_parser(regex)
    found = []
    for number, line in enumerate(lines, start=1):
        record = parse(line, 0.0)
        if isinstance(record, MalformedLine):
            found.append((number, record))
    return found


def show_malformed(malformed: list[tuple[int, MalformedLine]]) -> None:
    if malformed:
        number, first = malformed[0]
        err_console.print(f"  {counted(len(malformed), 'malformed metric line')} ignored; first, line {number}: "
                          f"{markup(first.reason)}", highlight=False, soft_wrap=True)


def first_step_ts(lines: list[str], regex: str | None) -> float | None:
    """The clock of the log's first step line (the timeline's seconds count from it), None if it has none."""
    parse = make_parser(regex)
    for line in lines:
        record = parse(line, None)
        if getattr(record, "step", None) is not None and getattr(record, "ts", None) is not None:
            return record.ts
    return None


def render_timeline(changes: list[Decision], t0: float | None) -> None:
    """One row per change of verdict, oldest first, each as it stood then, and a last row `end`: the verdict
    `dfo replay` prints without --timeline (the same verdict as the row above it when nothing changed since,
    with the figure as it stands at the end); under the table, each row's time in full and its reason."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title=f"the verdict at the first line, {counted(max(0, len(changes) - 2), 'change')}, the end "
                        "(s: seconds after the first step line)")
    for column in ("#", "at (UTC)", "s", "step", "verdict", "tok/s", "95%", "action"):
        table.add_column(column, justify="left" if column in ("at (UTC)", "verdict", "action") else "right",
                         no_wrap=column != "95%", overflow="fold")  # a narrow terminal folds the interval
    names = [str(number) for number in range(1, len(changes))] + ["end"]
    for name, change in zip(names, changes):
        at = parse_ts(change.at_ts) if change.at_ts else None
        seconds = f"{at - t0:,.1f}" if at is not None and t0 is not None else ""
        figure = f"{change.steady_tok_s:,.0f}" if change.steady_tok_s is not None else ""
        interval = f"{change.interval[0]:,.0f}..{change.interval[1]:,.0f}" if change.interval else ""
        table.add_row(name, text((change.at_ts or "")[11:19]), seconds,
                      text(change.at_step if change.at_step is not None else ""),
                      text(change.decision, style=COLOURS.get(change.decision, "white")), figure, interval, change.action)
    console.print(table)
    for name, change in zip(names, changes):
        console.print(f"  {name}: {markup(change.at_ts or '')}: {markup(change.reason)}", highlight=False, soft_wrap=True)


def render(decision: Decision) -> None:
    colour = COLOURS.get(decision.decision, "white")
    where = f" at step {decision.at_step}" if decision.at_step is not None else ""
    console.print(f"[bold {colour}]{decision.decision}[/]{where}  action={decision.action}", highlight=False)
    console.print(f"  {markup(decision.reason)}", highlight=False, soft_wrap=True)
    if decision.signature:
        console.print(f"  signature: {markup(decision.signature)}: {markup(decision.evidence.get('line', ''))}",
                      highlight=False)
    if decision.steady_tok_s is not None:
        lo, hi = decision.interval
        noise = f", noise +/-{decision.noise_rel / 2:.0%}{' (noisy)' if decision.noisy else ''}" if decision.noise_rel is not None else ""
        evidence = decision.evidence
        where = figure_span(decision.warmup_end_step, evidence["steady"].get("figure_steps"),
                            evidence.get("steady_declared_step"), evidence.get("steady_declared_warmup_end_step"))
        console.print(f"  steady {decision.steady_tok_s:,.0f} tok/s (95% {lo:,.0f}..{hi:,.0f}{noise}) {where}",
                      highlight=False, soft_wrap=True)
    for shift in decision.level_shifts:  # the line the watch shows for it (one per shift, with both levels)
        console.print(f"  {LevelShift.describe(shift)}", highlight=False, soft_wrap=True)
    if decision.ended:
        console.print(f"  ended: {decision.ended}, exit status {decision.exit_code}", highlight=False)
    if decision.next_variant:
        console.print(f"  next variant: {markup(decision.next_variant)}", highlight=False)
