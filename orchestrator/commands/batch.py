"""`dfo batch FILE` and `dfo report BATCH`: parse, call orchestrator/batch.py and report.py, render.

This module draws the live progress (cells done/running/left, ETA), the results table and the best
configuration per target; it must not hold scheduling, SQL or SSH (the scheduler, its resume rules and the
figures live in orchestrator/batch.py and report.py). Ctrl-C ends dfo, never a run: the same command again
resumes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .. import report as report_lib
from ..batch import Progress, open_watcher, plan_rows, run_batch
from ..chains import FallbacksLeft
from ..connections import Connections
from ..experiments import Plan, load_experiments
from ..inventory import load_inventory
from ..sanitize import text
from ..store import Store
from ..view import duration, exit_wait_text, step_text
from ..words import counted
from .common import (InventoryOpt, JsonOpt, basis_label, bring_up_to_date, console, fit_table, leave_half_done, number,
                     print_basis_note, print_json, say, say_finishing)

EXAMPLES = {
    "batch": "Example: dfo batch examples/compile-sweep.yaml -i inventory/lab.yaml --dry-run   (then without --dry-run)",
    "report": "Example: dfo report compile-sweep --plot sweep.png --csv sweep.csv",
}
FAILED_STATES = ("failed", "error")
NUMERIC = ("tok/s", "±95%", "warm-up s", "peak MiB")


def register(app: typer.Typer) -> None:
    app.command(
        "batch",
        help=(
            "Run an experiments file: expand its matrix into cells, run them over the targets (never two on one GPU), "
            "fall back on crashes, stop each at its stop_when, then print the results. Run it again to resume."
        ),
        epilog=EXAMPLES["batch"],
    )(batch_command)
    app.command(
        "report",
        help="Results of a batch from the registry: a row per cell, the best configuration per target; --plot/--csv/--json.",
        epilog=EXAMPLES["report"],
    )(report_command)


def batch_command(
    file: Path = typer.Argument(..., help="Experiments file (YAML): batch, targets, matrix, repeats, concurrency, stop_when.", metavar="FILE"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (each cell, its run name, start/skip/reattach); start nothing."),
    poll: float = typer.Option(1.0, "--poll", help="Seconds between looks at the running cells.", min=0.1, metavar="SECONDS"),
    wandb: str = typer.Option("off", "--wandb", help="Weights & Biases mode for built-in trainer runs: off|offline|online.", metavar="MODE"),
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = JsonOpt,
) -> None:
    inv = load_inventory(inventory)
    plan = load_experiments(file, inv)
    if dry_run:
        show_plan(plan, as_json)
        return

    again = f"`dfo batch {file}`"  # what finishes a fallback a second Ctrl-C leaves (never `dfo watch`: docs/batch.md)

    def finishing(fallbacks: list[str]) -> None:
        say_finishing(fallbacks, again)

    with Connections(inv) as connections, Store() as store:
        watcher = open_watcher(inv, connections, store)
        try:
            if as_json:
                run_batch(plan, inv, connections, store, watcher, wandb=wandb, poll_s=poll, on_interrupt=finishing)
            else:
                with Live(Text(f"batch {plan.batch}: preflight ..."), console=console, auto_refresh=False) as live:
                    run_batch(plan, inv, connections, store, watcher, wandb=wandb, poll_s=poll, on_interrupt=finishing,
                              on_progress=lambda progress: live.update(render_progress(progress, watcher), refresh=True))
        except FallbacksLeft as left:
            leave_half_done(left.fallbacks, again, left.overdue_s)
        except KeyboardInterrupt:
            say(f"interrupted: running cells go on; `dfo batch {file}` again resumes")
            raise typer.Exit(130)
        finally:
            watcher.close()
        rows = report_lib.cell_rows(store, plan.batch)
    show_report(plan.batch, rows, as_json)
    raise typer.Exit(1 if any(row.state in FAILED_STATES for row in rows) else 0)


def show_plan(plan: Plan, as_json: bool) -> None:
    with Store() as store:
        rows = plan_rows(plan, store)
    if as_json:
        print_json({"batch": plan.batch, "stop_when": plan.experiments.stop_when.describe(), "chain": list(plan.chain),
                    "concurrency": plan.experiments.concurrency.model_dump(), "cells": rows})
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("run", "target", "variant", "settings", "gpus", "action"):
        table.add_column(column, overflow="fold", no_wrap=column == "run")
    for row in rows:
        settings = " ".join(f"{k}={v}" for k, v in row["sets"].items())
        table.add_row(*map(text, (row["run"], row["target"], row["variant"], settings, str(row["gpus"] or "all"),
                                  row["action"])))
    console.print(table)
    concurrency = plan.experiments.concurrency
    console.print(
        f"{counted(len(rows), 'cell')}; stop when {plan.experiments.stop_when.describe()}; at most {concurrency.per_target} per target"
        f"{f', {concurrency.total} in all' if concurrency.total else ''}; fallback chain: {' -> '.join(plan.chain) or 'none'}",
        highlight=False,
    )


def render_progress(progress: Progress, watcher=None) -> Group:
    """Counts and ETA on one line, then the running cells (with each one's step and tok/s, from the watcher, or
    the wait of a stop of its run for it to exit) and the latest news."""
    counts = progress.counts
    eta = f"  ETA {duration(progress.eta_s)}" if progress.eta_s is not None else ""
    head = Text(
        f"batch {progress.batch}: {counts['done']} done, {counts['failed'] + counts['error']} failed, "
        f"{counts['running']} running, {counts['pending']} left{eta}",
        style="bold",
    )
    followed = {watched.name: watched for watched in watcher.runs()} if watcher is not None else {}
    running = Table(box=None, show_header=False, pad_edge=False)
    for cell, run in progress.running:
        watched = followed.get(run)
        now = text(f"{step_text(watched)}  {watched.latest.tok_s:,.0f} tok/s" if watched and watched.latest else "no step yet")
        running.add_row(text(f"  {cell}"), text(run), (exit_wait_text(watched) if watched else None) or now)
    return Group(head, running, *(text(f"  {line}", style="dim") for line in progress.news))


def report_command(
    batch: str = typer.Argument(..., help="Batch name (the experiments file's `batch:`).", metavar="BATCH"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG: throughput over time per run, steady tok/s per configuration.", metavar="OUT.png"),
    csv_path: Optional[str] = typer.Option(None, "--csv", help="Write the rows as CSV to this file ('-': stdout).", metavar="FILE"),
    as_json: bool = JsonOpt,
) -> None:
    with Store() as store:
        bring_up_to_date(store, [run.name for run in store.list_runs(batch=batch)])
        rows = report_lib.cell_rows(store, batch)
        if plot is not None:
            report_lib.plot(store, batch, rows, plot)
    if csv_path == "-":
        sys.stdout.write(report_lib.to_csv(rows))
        return
    if csv_path is not None:
        Path(csv_path).write_text(report_lib.to_csv(rows))
    show_report(batch, rows, as_json)
    if plot is not None and not as_json:
        console.print(f"plot: {plot}", highlight=False, markup=False)


REPORT_DROPPED_FIRST = ("fallbacks", "warm-up s", "peak MiB", "state", "±95%")
"""Columns given up, in this order, when the report is wider than the terminal; cell ids and figures stay whole."""


REPORT_COLUMNS = {
    "cell": lambda row: row.cell,
    "state": lambda row: row.state,
    "decision": lambda row: row.decision or (row.why[:30] if row.state == "error" else ""),
    "tok/s": lambda row: number(row.tok_s),
    "basis": lambda row: basis_label(row.basis),
    "±95%": lambda row: number((row.interval_high - row.interval_low) / 2) if row.interval_low is not None else "",
    "warm-up s": lambda row: number(row.warmup_s),
    "fallbacks": lambda row: " ".join(row.fallbacks),
    "peak MiB": lambda row: number(row.peak_gpu_mem_mib),
}
"""The report's columns and how each cell of them is written (`dfo report` and `dfo ui`'s batch page)."""


def report_cells(rows: list[report_lib.CellRow]) -> tuple[list[str], dict[str, list[str]]]:
    """The columns worth showing (cell, state and decision always; the others when any row fills them) and
    each column's cells, one per row, as `dfo report` writes them."""
    cells = {name: [render(row) for row in rows] for name, render in REPORT_COLUMNS.items()}
    present = [name for name in REPORT_COLUMNS if name in ("cell", "state", "decision") or any(cells[name])]
    return present, cells


def show_report(batch: str, rows: list[report_lib.CellRow], as_json: bool, width: Optional[int] = None) -> None:
    if as_json:
        print_json(report_lib.to_json(batch, rows))
        return
    present, cells = report_cells(rows)

    def build(shown: list[str], hidden: list[str]) -> Table:
        caption = f"not shown for lack of width: {', '.join(hidden)} (see --json)" if hidden else None
        table = Table(title=f"batch {batch}", box=box.SIMPLE_HEAD, pad_edge=False, caption=caption, caption_justify="left")
        for name in shown:  # cell ids fold when even the narrowest table is too wide; nothing is cut short
            table.add_column(name, no_wrap=name != "cell", overflow="fold", justify="right" if name in NUMERIC else "left")
        for index in range(len(rows)):
            table.add_row(*(text(cells[name][index]) for name in shown))  # remote words (an error's) are no markup
        return table

    console.print(fit_table(present, build, width or console.width, REPORT_DROPPED_FIRST))
    print_basis_note([row.basis for row in rows])
    for best in report_lib.best_per_target(rows):
        console.print(report_lib.describe_best(best), highlight=False)
