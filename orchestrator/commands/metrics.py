"""`dfo metrics NAME` (one run's history) and `dfo compare NAME NAME...` (runs side by side).

Renders only: the figures come from orchestrator/metrics.py, which reads the registry and nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.table import Table

from .. import metrics as metrics_lib
from ..decide import figure_span
from ..errors import UsageError
from ..report import LAST_WINDOW_S, STEADY
from ..sanitize import text
from ..store import Store
from ..words import counted
from .common import (JsonOpt, basis_label, bring_up_to_date, complete_runs, console, fit_table, number, print_basis_note,
                     print_json)

EXAMPLES = {
    "metrics": "Example: dfo metrics train_trees_20261129-1140 --plot trees.png",
    "compare": "Example: dfo compare train_trees_20261129-1140 train_nographs_20261129-1150 --plot both.png",
}
COMPARE_DROPPED_FIRST = ("settings", "warm-up s", "peak MiB", "±95%", "variant")


def register(app: typer.Typer) -> None:
    app.command(
        "metrics",
        help=("A run's stored history: tok/s, loss, memory and utilisation per GPU over time, with the warm-up "
              "end, the steady level and its interval, and the decisions marked."),
        epilog=EXAMPLES["metrics"],
    )(metrics_command)
    app.command(
        "compare",
        help="Runs side by side: variant, settings, tok/s ± interval, warm-up, peak memory, verdict; --plot overlays throughput.",
        epilog=EXAMPLES["compare"],
    )(compare_command)


def metrics_command(
    name: str = typer.Argument(..., help="Run name (see `dfo runs`).", metavar="NAME", autocompletion=complete_runs),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of the history.", metavar="FILE.png"),
    as_json: bool = JsonOpt,
) -> None:
    with Store() as store:
        bring_up_to_date(store, [name])
        metrics = metrics_lib.run_metrics(store, name)
    if plot is not None:
        metrics_lib.plot_run(metrics, plot)
    if as_json:
        print_json(metrics.to_json())
        return
    show_metrics(metrics)
    if plot is not None:
        console.print(f"plot: {plot}", highlight=False, markup=False)


def show_metrics(metrics: metrics_lib.RunMetrics) -> None:
    run = metrics.run
    exit_code = f" (exit code {run.exit_code})" if run.exit_code is not None else ""
    steps = [s["step"] for s in metrics.steps if s["step"] is not None]
    span = max((s["t"] for s in metrics.steps if s["t"] is not None), default=None)
    console.print(f"{run.name} on {run.target}, variant {run.variant or 'command'}: {run.state}{exit_code}; "
                  f"{counted(len(metrics.steps), 'metric line')}" + (f", up to step {max(steps)}" if steps else "")
                  + (f" in {span:,.0f} s" if span is not None else ""), highlight=False, markup=False)
    console.print(f"figure: {describe_figure(metrics)}", highlight=False, markup=False)
    if metrics.unreadable:
        console.print(f"decision: unreadable ({metrics.unreadable}); `dfo watch {run.name}` judges the run again",
                      highlight=False, markup=False, soft_wrap=True)
    losses = [s["loss"] for s in metrics.steps if s["loss"] is not None]
    if losses:
        console.print(f"loss: {losses[0]:.4g} -> {losses[-1]:.4g}", highlight=False)
    for gpu in metrics.gpu_summary():
        total = f" of {gpu['mem_total_mib']:,.0f}" if gpu["mem_total_mib"] else ""
        peak = f"{gpu['peak_mem_mib']:,.0f}" if gpu["peak_mem_mib"] is not None else "?"
        util = f"{gpu['mean_util_pct']:.0f}%" if gpu["mean_util_pct"] is not None else "?"
        console.print(f"GPU {gpu['index']}: peak {peak}{total} MiB, mean utilisation {util} ({counted(gpu['samples'], 'sample')})",
                      highlight=False)
    if not metrics.gpus:
        console.print("GPUs: no samples stored for this run", highlight=False)
    rows = metrics_lib.timeline(metrics)
    if not rows:
        console.print("no samples stored yet (is the run being watched? `dfo watch NAME`)", highlight=False)
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="over time (each row: a stretch of the run)")
    for column in ("until s", "step", "tok/s", "loss", "max MiB", "util %", "what happened"):
        table.add_column(column, justify="left" if column == "what happened" else "right",
                         no_wrap=column != "what happened", overflow="fold")
    for row in rows:
        table.add_row(*map(text, (f"{row['until_s']:,.0f}", _text(row["step"]), number(row["tok_s"]),
                                  "" if row["loss"] is None else f"{row['loss']:.4g}", number(row["mem_mib"]),
                                  _text(row["util_pct"]), "; ".join(row["events"]))))
    console.print(table)


def describe_figure(metrics: metrics_lib.RunMetrics) -> str:
    if metrics.tok_s is None:
        return "none (no steps with tok/s stored)"
    if metrics.basis == STEADY:
        interval = f" (95% {metrics.interval[0]:,.0f}-{metrics.interval[1]:,.0f})" if metrics.interval else ""
        end = metrics.warmup_end
        if metrics.cut_moved and metrics.figure_steps:  # the declaration as it was, as the watch's reason says it
            where = figure_span(end["step"], metrics.figure_steps, metrics.evidence("steady_declared_step"),
                                metrics.declared_warmup_end["step"])
            timed = f"; warm-up {metrics.warmup_s:,.1f} s to the cut now" if metrics.warmup_s is not None else ""
            return f"steady {metrics.tok_s:,.0f} tok/s{interval} {where}{timed}"
        after = f" after {metrics.warmup_s:,.1f} s" if metrics.warmup_s is not None else ""
        warm = f", warm-up ended at step {end['step']}{after}" if end else ""
        return f"steady {metrics.tok_s:,.0f} tok/s{interval}{warm}"
    verdict = metrics.verdict or "no verdict"
    return f"{metrics.tok_s:,.0f} tok/s, median of the last {LAST_WINDOW_S:.0f} s of steps ({verdict}: not a steady figure)"


def compare_command(
    names: list[str] = typer.Argument(..., help="Two or more run names (see `dfo runs`).", metavar="NAME",
                             autocompletion=complete_runs),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of their throughput over time, overlaid.", metavar="FILE.png"),
    as_json: bool = JsonOpt,
) -> None:
    if len(names) < 2:
        raise UsageError("dfo compare needs at least two run names", hint="e.g. dfo compare RUN_A RUN_B (see `dfo runs`)")
    with Store() as store:
        bring_up_to_date(store, list(dict.fromkeys(names)))
        runs = [metrics_lib.run_metrics(store, name) for name in dict.fromkeys(names)]
    if plot is not None:
        metrics_lib.plot_compare(runs, plot)
    if as_json:
        print_json({"runs": [compare_row(m) for m in runs]})
        return
    show_compare(runs, console.width)
    if plot is not None:
        console.print(f"plot: {plot}", highlight=False, markup=False)


def compare_row(m: metrics_lib.RunMetrics) -> dict:
    return {"run": m.run.name, "variant": m.run.variant, "settings": m.settings, "tok_s": m.tok_s, "basis": m.basis,
            "interval": list(m.interval) if m.interval else None, "warmup_s": m.warmup_s, "peak_mem_mib": m.peak_mem_mib,
            "verdict": m.verdict, "state": m.run.state}


def show_compare(runs: list[metrics_lib.RunMetrics], width: int) -> None:
    rows = [compare_row(m) for m in runs]
    cells = {
        "run": [r["run"] for r in rows],
        "variant": [r["variant"] or "command" for r in rows],
        "settings": [" ".join(f"{k}={v}" for k, v in r["settings"].items()) for r in rows],
        "tok/s": [number(r["tok_s"]) for r in rows],
        "basis": [basis_label(r["basis"]) for r in rows],
        "±95%": [number((r["interval"][1] - r["interval"][0]) / 2) if r["interval"] else "" for r in rows],
        "warm-up s": [number(r["warmup_s"]) for r in rows],
        "peak MiB": [number(r["peak_mem_mib"]) for r in rows],
        "verdict": [r["verdict"] or r["state"] for r in rows],
    }
    present = [c for c in cells if c in ("run", "tok/s", "verdict") or any(cells[c])]

    def build(shown: list[str], hidden: list[str]) -> Table:
        caption = f"not shown for lack of width: {', '.join(hidden)} (see --json)" if hidden else None
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, caption=caption, caption_justify="left")
        for column in shown:
            table.add_column(column, no_wrap=column not in ("run", "settings"), overflow="fold",
                             justify="right" if column in ("tok/s", "±95%", "warm-up s", "peak MiB") else "left")
        for k in range(len(rows)):
            table.add_row(*(text(cells[c][k]) for c in shown))  # settings are the user's words, never markup
        return table

    console.print(fit_table(present, build, width, COMPARE_DROPPED_FIRST))
    print_basis_note([r["basis"] for r in rows])


def _text(value: object) -> str:
    return "" if value is None else str(value)
