"""What each page of `dfo ui` shows, as plain values for its template: from the CLI's own code, never a copy.

The runs list takes each run's figure from report.run_figure (as `dfo report` and `dfo metrics` do) and writes
numbers with commands/common.number; a run's page is metrics.run_metrics with commands/metrics.describe_figure
(the line `dfo metrics` prints); a batch's page is report.cell_rows with the cells `dfo report` prints
(commands/batch.report_cells) and report.describe_best. So a figure on a page is the figure in the terminal.

This module reads the registry only (a run's log tail is app.py's, through runs.log_tail); it renders nothing
itself and trusts no text it reads: the templates escape it all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .. import metrics as metrics_lib
from ..commands.batch import report_cells
from ..commands.common import basis_label, basis_note, number
from ..commands.metrics import describe_figure
from ..commands.runs import state_text
from ..events import LevelShift
from ..logfmt import parse_ts
from ..decide import read_stored
from ..report import STEADY, UNREADABLE, best_per_target, cell_rows, describe_best, run_figure
from ..sanitize import visible
from ..store import Run, Store
from ..view import duration
from . import charts

GREY, RED, GREEN, BLUE, PURPLE = "#777777", "#d62728", "#2ca02c", "#1f77b4", "#9467bd"


@dataclass
class RunRow:
    """One line of the runs list."""

    name: str
    state: str
    verdict: str
    tok_s: str  # `7,129`, or "" without a figure
    basis: str  # steady | last-win | "" (commands/common.basis_label)
    figure_basis: Optional[str]  # report.STEADY | report.LAST_WINDOW | None
    interval: str  # `95% 7,050..7,210` for a steady figure
    target: str
    variant: str
    age: str
    duration: str
    batch: str
    active: bool


def run_rows(store: Store, now: float) -> list[RunRow]:
    """Every run of the registry, newest first."""
    return [run_row(store, run, now) for run in reversed(store.list_runs())]


def runs_note(rows: list[RunRow]) -> Optional[str]:
    """The footnote `dfo compare` and `dfo report` print under last-window figures, when the list has any."""
    return basis_note([row.figure_basis for row in rows])


def verdict_word(stored: object) -> str:
    """A stored decision's verdict as one word (`unreadable` for one this dfo cannot read; "" for none)."""
    decision, unreadable = read_stored(stored)
    return str(decision.decision) if decision else (UNREADABLE if unreadable else "")


def run_row(store: Store, run: Run, now: float) -> RunRow:
    decision, unreadable = read_stored(run.decision)
    tok_s, basis = run_figure(store, run, decision)
    interval = decision.interval if decision and basis == STEADY else None
    started = parse_ts(run.started_at) if run.started_at else None
    ended = parse_ts(run.ended_at) if run.ended_at else None
    verdict = str(decision.decision) if decision else (UNREADABLE if unreadable else "")
    if decision and decision.noisy:
        verdict += " (noisy)"
    return RunRow(
        name=run.name,
        state=state_text(run),
        verdict=verdict,
        tok_s=number(tok_s),
        basis=basis_label(basis),
        figure_basis=basis,
        interval=f"95% {number(interval[0])}..{number(interval[1])}" if interval else "",
        target=run.target,
        variant=run.variant or "command",
        age=f"{duration(now - started)} ago" if started is not None else "",
        duration=duration((ended if ended is not None else now) - started) if started is not None else "",
        batch=run.batch or "",
        active=run.active,
    )


# ---------------------------------------------------------------------------------------------- a run

@dataclass
class ChainLink:
    name: str
    variant: str
    state: str
    verdict: str
    current: bool


@dataclass
class RunPage:
    run: Run
    row: RunRow
    figure: str  # `dfo metrics`' "figure:" line
    reason: str
    shifts: list[str]
    charts: list[Any]  # Markup of each SVG
    gpus: list[dict[str, Any]]
    chain: list[ChainLink]
    ahead: list[str]  # the variants of its chain not tried yet
    group: Optional[str]  # the multi-node run it is a node of
    steps: int
    last_step: Optional[int]
    settings: str
    notes: list[str] = field(default_factory=list)


def run_page(store: Store, name: str, now: float) -> RunPage:
    """Run `name`'s page; UnknownRun names the fix."""
    metrics = metrics_lib.run_metrics(store, name)
    run = metrics.run
    decision = metrics.decision
    steps = [s["step"] for s in metrics.steps if s["step"] is not None]
    group = store.node_group(name)
    return RunPage(
        run=run,
        row=run_row(store, run, now),
        figure=describe_figure(metrics),
        reason=visible((decision.reason if decision else metrics.unreadable) or ""),
        shifts=[LevelShift.describe(shift) for shift in (decision.level_shifts if decision else ())],
        charts=[charts.render(chart) for chart in run_charts(metrics)],
        gpus=metrics.gpu_summary(),
        chain=chain_links(store, run),
        ahead=list(run.chain or ()),
        group=group[0] if group else None,
        steps=len(metrics.steps),
        last_step=max(steps) if steps else None,
        settings=" ".join(f"{k}={v}" for k, v in metrics.settings.items()),
    )


def run_charts(metrics: metrics_lib.RunMetrics) -> list[charts.Chart]:
    """Throughput (warm-up end, steady level and band, decisions marked), loss, memory and utilisation per GPU:
    the panels of `dfo metrics --plot`, from the same RunMetrics."""
    marks = [charts.Mark(t, what, GREY if what.startswith("warm-up") else RED, dash=what.startswith("warm-up"))
             for t, what in sorted(metrics_lib.timeline_events(metrics), key=lambda event: event[0])]
    throughput = charts.Chart("throughput", "tok/s", [charts.Series(
        "tok/s", [(s["t"], s["tok_s"]) for s in metrics.steps if s["t"] is not None and s["tok_s"] is not None], BLUE)],
        marks=list(marks), empty_text="no steps with tok/s stored yet")
    if metrics.tok_s is not None:
        label = "steady level" if metrics.basis == STEADY else "last-window median (not steady)"
        throughput.marks.append(charts.Mark(metrics.tok_s, label, GREEN, dash=True, vertical=False))
    if metrics.interval:
        throughput.bands.append(charts.Band(*metrics.interval, "95% interval", GREEN))
    loss = charts.Chart("loss", "loss", [charts.Series(
        "loss", [(s["t"], s["loss"]) for s in metrics.steps if s["t"] is not None and s["loss"] is not None], PURPLE)],
        marks=list(marks))

    def per_gpu(key: str) -> list[charts.Series]:
        return [charts.Series(f"GPU {index}", [(g["t"], g[key]) for g in samples if g["t"] is not None and g[key] is not None],
                              charts.PALETTE[k % len(charts.PALETTE)])
                for k, (index, samples) in enumerate(sorted(metrics.gpus.items()))]

    missing = "not reported" if metrics.gpus else "no GPU samples stored"
    memory = charts.Chart("GPU memory per GPU", "MiB", per_gpu("mem_used_mib"), empty_text=missing)
    util = charts.Chart("GPU utilisation per GPU", "%", per_gpu("util_pct"), y_range=(0.0, 100.0), empty_text=missing)
    return [throughput, loss, memory, util]


def chain_links(store: Store, run: Run) -> list[ChainLink]:
    """The fallback chain `run` belongs to: from its root, through `run`, to the newest run that followed it."""
    lineage = store.lineage(run.name)
    names = list(dict.fromkeys(lineage + store.chain_runs(run.name)[1:]))
    links = []
    for other in filter(None, map(store.find_run, names)):
        links.append(ChainLink(other.name, other.variant or "command", state_text(other),
                               verdict_word(other.decision), other.name == run.name))
    return links


@dataclass
class GroupPage:
    """A multi-node run: no row of its own, one per node (RUN.nodeK)."""

    name: str
    summary: str  # the line `dfo runs NAME` ends with (multinode.summary)
    rendezvous: str
    nodes: list[RunRow]


def group_page(store: Store, name: str, now: float) -> Optional[GroupPage]:
    """Multi-node run `name`'s page; None when `name` is no multi-node run."""
    from ..multinode import summary

    nodes = [store.get_run(node) for node in store.nodes_of(name)]
    if not nodes:
        return None
    group = store.node_group(nodes[0].name)
    return GroupPage(name, summary(store, name), group[2] if group else "", [run_row(store, node, now) for node in nodes])


# ---------------------------------------------------------------------------------------------- a batch

@dataclass
class BatchPage:
    name: str
    columns: list[str]
    rows: list[dict[str, str]]  # column -> cell, plus `_run`: the cell's final run (a link)
    best: list[str]
    note: Optional[str]
    chart: Any  # Markup: each cell's final run's tok/s over time


def batch_page(store: Store, name: str) -> BatchPage:
    """Batch `name`'s report: the cells `dfo report` prints, its best line per target, and each cell's
    throughput over time (its final run's, as `dfo report --plot` draws it)."""
    cell_list = cell_rows(store, name)
    columns, cells = report_cells(cell_list)
    rows = [{**{column: cells[column][k] for column in columns}, "_run": row.final_run or ""}
            for k, row in enumerate(cell_list)]
    series = []
    for k, row in enumerate(r for r in cell_list if r.final_run):
        steps = metrics_lib.run_metrics(store, row.final_run).steps
        series.append(charts.Series(row.cell, [(s["t"], s["tok_s"]) for s in steps if s["t"] is not None
                                               and s["tok_s"] is not None], charts.PALETTE[k % len(charts.PALETTE)]))
    chart = charts.render(charts.Chart("throughput of each cell's final run", "tok/s", series,
                                       empty_text="no cell has stored steps yet"))
    return BatchPage(name, columns, rows, [describe_best(best) for best in best_per_target(cell_list)],
                     basis_note([row.basis for row in cell_list]), chart)


NUMERIC_COLUMNS = ("tok/s", "±95%", "warm-up s", "peak MiB")
