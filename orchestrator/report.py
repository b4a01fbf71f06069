"""`dfo report`: what a batch found, from the store alone: one row per cell, the best configuration per target,
CSV/JSON export and a PNG of throughput over time and steady throughput per configuration.

A cell's figures come from the last run of its fallback chain (the one that measured something): steady tok/s
with its 95% interval and warm-up time from that run's decision, peak GPU memory from its GPU samples. A cell
without a steady verdict (undecided, drifting, stopped at `stop_when: {steps: N}` before it settled) still gets a
figure: the median tok/s of its last window of steps, labelled as such (`basis`), and never ranked against
steady figures as if it were one.

This module must not reach a machine or judge a run (it reads decisions the watcher stored); matplotlib is
imported only when a plot is asked for, with the Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean, median
from typing import Any, Optional

from .batch import CellRecord, CellTable
from .decide import Decision, read_stored
from .decide.steady import DROPPED_PHASES
from .errors import UsageError
from .logfmt import parse_ts
from .store import Run, Store

PLOT_SIZE_IN = (13.0, 5.0)
PLOT_DPI = 100
LEGEND_FONT = 9
LAST_WINDOW_S = 60.0  # an unsettled run's figure: the median over its last minute of steps ...
LAST_WINDOW_MIN_STEPS = 5  # ... or over its last 5 metric lines when that minute holds fewer
STEADY = "steady"
LAST_WINDOW = "last-window median"
UNREADABLE = "unreadable"  # a stored decision not of the shape this dfo writes (decide.read_stored): said, not guessed at


@dataclass
class CellRow:
    """One line of the report. `config` is what the cell measured: its final variant, settings and GPU count."""

    cell: str
    target: str
    variant: str
    settings: str
    gpus: Optional[int]
    repeat: int
    state: str
    decision: Optional[str]
    steady_tok_s: Optional[float]
    interval_low: Optional[float]
    interval_high: Optional[float]
    warmup_s: Optional[float]
    fallbacks: list[str]
    final_run: Optional[str]
    peak_gpu_mem_mib: Optional[float]
    why: str
    runs: list[str] = field(default_factory=list)
    tok_s: Optional[float] = None  # the cell's figure: steady_tok_s, else the last-window median
    basis: Optional[str] = None  # STEADY or LAST_WINDOW (None: no figure at all)

    @property
    def config(self) -> str:
        final = self.fallbacks[-1] if self.fallbacks else self.variant
        return " ".join(part for part in (final, self.settings, f"gpus={self.gpus}" if self.gpus else "") if part)


def cell_rows(store: Store, batch: str) -> list[CellRow]:
    """Every cell of `batch`, in plan order; UsageError names the known batches when there is no such batch."""
    table = CellTable(store)
    records = table.records(batch)
    if not records:
        known = ", ".join(b["name"] for b in table.batches()) or "none yet"
        raise UsageError(f"no batch named {batch!r} in the registry; known batches: {known}", hint="run `dfo batch FILE` first")
    return [_row(store, table, record) for record in records]


def _row(store: Store, table: CellTable, record: CellRecord) -> CellRow:
    cell = record.cell
    chain = table.chain(record.root_run) if record.root_run else []
    runs = [run for run in (store.find_run(name) for name in chain) if run is not None]
    final = runs[-1] if runs else None
    decision, unreadable = read_stored(record.outcome.get("decision") or (final.decision if final else None))
    interval = (decision.interval if decision else None) or [None, None]
    tok_s, basis = run_figure(store, final, decision) if final else (None, None)
    return CellRow(
        cell=cell.id,
        target=cell.target,
        variant=cell.variant,
        settings=" ".join(f"{k}={v}" for k, v in cell.sets),
        gpus=cell.gpus,
        repeat=cell.repeat,
        state=record.state,
        decision=str(decision.decision) if decision else (UNREADABLE if unreadable else None),
        steady_tok_s=decision.steady_tok_s if decision else None,
        interval_low=interval[0],
        interval_high=interval[1],
        warmup_s=warmup_seconds(store, final, decision) if final else None,
        fallbacks=[run.variant or "" for run in runs[1:]],
        final_run=final.name if final else None,
        peak_gpu_mem_mib=peak_gpu_memory(store, final, record.gpu_ids) if final else None,
        why=record.outcome.get("why") or record.outcome.get("error") or "",
        runs=[run.name for run in runs],
        tok_s=tok_s,
        basis=basis,
    )


def run_figure(store: Store, run: Run, decision: Optional[Decision]) -> tuple[Optional[float], Optional[str]]:
    """The run's throughput figure and its basis: the steady verdict's, else the last-window median."""
    if decision is not None and decision.steady_tok_s is not None:
        return decision.steady_tok_s, STEADY
    median_tok_s = last_window_median(store.samples(run.name))
    return (median_tok_s, LAST_WINDOW) if median_tok_s is not None else (None, None)


def last_window_median(samples: list[dict]) -> Optional[float]:
    """Median tok/s over the last LAST_WINDOW_S seconds of training steps (at least LAST_WINDOW_MIN_STEPS lines)."""
    points = [s for s in samples if s.get("tok_s") is not None and s.get("phase") not in DROPPED_PHASES]
    if not points:
        return None
    end = points[-1].get("ts")
    recent = [s for s in points if end is not None and s.get("ts") is not None and s["ts"] >= end - LAST_WINDOW_S]
    if len(recent) < LAST_WINDOW_MIN_STEPS:
        recent = points[-LAST_WINDOW_MIN_STEPS:]
    return round(median(s["tok_s"] for s in recent), 1)


def warmup_seconds(store: Store, run: Run, decision: Optional[Decision]) -> Optional[float]:
    """Seconds from the run's start to the step where its steady state began (compile and warm-up included)."""
    end_step = decision.warmup_end_step if decision is not None else None
    if end_step is None:
        return None
    samples = [s for s in store.samples(run.name) if s.get("step") is not None and s.get("ts") is not None]
    reached = next((s["ts"] for s in samples if s["step"] >= end_step), None)
    start = parse_ts(run.started_at) if run.started_at else (samples[0]["ts"] if samples else None)
    return round(max(reached - start, 0.0), 1) if reached is not None and start is not None else None  # clocks may differ a little


def peak_gpu_memory(store: Store, run: Run, gpu_ids: tuple[int, ...]) -> Optional[float]:
    """The most memory any of the run's GPUs held."""
    used = [s["mem_used_mib"] for s in run_gpu_samples(store, run, gpu_ids) if s.get("mem_used_mib") is not None]
    return max(used) if used else None


def run_gpu_samples(store: Store, run: Run, gpu_ids: tuple[int, ...]) -> list[dict[str, Any]]:
    """The run's own GPU samples, else the target's samples of its GPUs (`gpu_ids`; empty: all) while it ran
    (samples taken while several runs shared the container are not attributed to one run)."""
    samples = store.gpu_samples(run=run.name)
    if samples:
        return samples
    start = parse_ts(run.started_at) if run.started_at else None
    end = parse_ts(run.ended_at) if run.ended_at else None
    return [
        s for s in store.gpu_samples(target=run.target)
        if (start is None or (s["ts"] or 0) >= start) and (end is None or (s["ts"] or 0) <= end)
        and (not gpu_ids or s["index"] in gpu_ids)
    ]


def best_per_target(rows: list[CellRow]) -> list[dict[str, Any]]:
    """For each target, the configuration with the highest mean figure over its repeats, chosen among comparable
    figures: steady ones when the target has any (`basis: steady`), else last-window medians. A faster
    configuration left out because its figure is not steady is named in `faster_unsteady`."""
    best: list[dict[str, Any]] = []
    for target in dict.fromkeys(row.target for row in rows):
        means = {basis: _config_means([r for r in rows if r.target == target and r.basis == basis])
                 for basis in (STEADY, LAST_WINDOW)}
        basis = STEADY if means[STEADY] else LAST_WINDOW
        if not means[basis]:
            continue
        config, (figure, group) = max(means[basis].items(), key=lambda item: item[1][0])
        entry = {"target": target, "config": config, "steady_tok_s": round(figure, 1) if basis == STEADY else None,
                 "tok_s": round(figure, 1), "basis": basis, "repeats": len(group), "cells": [row.cell for row in group],
                 "faster_unsteady": None}
        if basis == STEADY:
            faster = {c: m for c, m in means[LAST_WINDOW].items() if m[0] > figure}
            if faster:
                name, (other, _) = max(faster.items(), key=lambda item: item[1][0])
                entry["faster_unsteady"] = {"config": name, "tok_s": round(other, 1), "basis": LAST_WINDOW}
        best.append(entry)
    return best


def _config_means(rows: list[CellRow]) -> dict[str, tuple[float, list[CellRow]]]:
    groups: dict[str, list[CellRow]] = {}
    for row in rows:
        if row.tok_s is not None:
            groups.setdefault(row.config, []).append(row)
    return {config: (mean(row.tok_s for row in group), group) for config, group in groups.items()}


def describe_best(best: dict[str, Any]) -> str:
    """One line for a terminal: what won, on which basis, and what was left out of the comparison."""
    what = "steady" if best["basis"] == STEADY else "last-window median; no cell reached a steady state"
    line = f"best on {best['target']}: {best['config']} at {best['tok_s']:,.0f} tok/s ({what}, mean of {best['repeats']})"
    faster = best.get("faster_unsteady")
    if faster:
        line += (f"; {faster['config']} ran faster ({faster['tok_s']:,.0f} tok/s, last-window median) but never settled, "
                 "so it is not compared")
    return line


# ---------------------------------------------------------------------------------------------- export

CSV_COLUMNS = ("cell", "target", "variant", "settings", "gpus", "repeat", "state", "decision", "tok_s", "basis",
               "steady_tok_s", "interval_low", "interval_high", "warmup_s", "fallbacks", "final_run", "peak_gpu_mem_mib",
               "why")


def to_json(batch: str, rows: list[CellRow]) -> dict[str, Any]:
    return {"batch": batch, "cells": [{**asdict(row), "config": row.config} for row in rows], "best": best_per_target(rows)}


def to_csv(rows: list[CellRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        values = asdict(row)
        values["fallbacks"] = " ".join(row.fallbacks)
        writer.writerow(["" if values[c] is None else values[c] for c in CSV_COLUMNS])
    return out.getvalue()


def write_json(path: Path, batch: str, rows: list[CellRow]) -> None:
    Path(path).write_text(json.dumps(to_json(batch, rows), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------- plot

def plot(store: Store, batch: str, rows: list[CellRow], path: Path) -> Path:
    """A PNG: left, tok/s over time since start for every run of the batch; right, each cell's figure per
    configuration (steady with its 95% interval: filled; last-window median: hollow). One colour per
    configuration in both panels, one marker per target; the legend under the panels names them."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (over_time, figures) = pyplot.subplots(1, 2, figsize=PLOT_SIZE_IN, dpi=PLOT_DPI,
                                                    gridspec_kw={"width_ratios": [3, 2]})
    try:
        colours = config_colours([config for row in rows for _, config in row_runs(row)] + [row.config for row in rows])
        drawn = _plot_over_time(over_time, store, rows, colours)
        _plot_figures(figures, rows, colours)
        figure.suptitle(f"batch {batch}")
        _config_legend(figure, [c for c in colours if c in drawn or any(r.config == c and r.tok_s is not None for r in rows)],
                       colours)
        figure.savefig(path, dpi=PLOT_DPI)
    finally:
        pyplot.close(figure)
    return Path(path)


def row_runs(row: CellRow) -> list[tuple[str, str]]:
    """(run, configuration) for every run of the cell's chain: a fallback run measured its own variant."""
    variants = [row.variant, *row.fallbacks]
    return [(name, _config(variants[min(k, len(variants) - 1)], row.settings, row.gpus)) for k, name in enumerate(row.runs)]


def _config(variant: str, settings: str, gpus: Optional[int]) -> str:
    return " ".join(part for part in (variant, settings, f"gpus={gpus}" if gpus else "") if part)


def config_colours(configs: list[str]) -> dict[str, Any]:
    """A distinct colour per configuration, in order of first appearance (tab10, then tab20 for more)."""
    from matplotlib import colormaps

    names = list(dict.fromkeys(configs))
    palette = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: palette(k % palette.N) for k, name in enumerate(names)}


def _config_legend(figure: Any, configs: list[str], colours: dict[str, Any]) -> None:
    """The configurations, under both panels, at a readable size; the panels shrink to leave it room."""
    from matplotlib.lines import Line2D

    columns = min(max(len(configs), 1), 4)
    rows = -(-len(configs) // columns) if configs else 0
    bottom = min(0.06 + 0.055 * rows, 0.4)
    figure.tight_layout(rect=(0, bottom, 1, 1))
    if configs:
        handles = [Line2D([], [], color=colours[c], linewidth=3) for c in configs]
        figure.legend(handles, configs, loc="lower center", ncol=columns, fontsize=LEGEND_FONT + 1,
                      title="configuration", title_fontsize=LEGEND_FONT + 1, frameon=False)


def _plot_over_time(axes: Any, store: Store, rows: list[CellRow], colours: dict[str, Any]) -> set[str]:
    drawn: set[str] = set()
    for row in rows:
        for name, config in row_runs(row):
            points = [(s["ts"], s["tok_s"]) for s in store.samples(name) if s.get("ts") is not None and s.get("tok_s") is not None]
            if not points:
                continue
            start = points[0][0]
            axes.plot([t - start for t, _ in points], [v for _, v in points], linewidth=1.2, color=colours[config], alpha=0.85)
            drawn.add(config)
    axes.set_title("throughput over time (one line per run)")
    axes.set_xlabel("seconds since the run's first step")
    axes.set_ylabel("tok/s")
    if not drawn:
        axes.text(0.5, 0.5, "no samples stored", ha="center", va="center", transform=axes.transAxes)
    return drawn


MARKERS = "osD^vP*X"


def _plot_figures(axes: Any, rows: list[CellRow], colours: dict[str, Any]) -> None:
    from matplotlib.lines import Line2D

    measured = [row for row in rows if row.tok_s is not None]
    configs = list(dict.fromkeys(row.config for row in measured))
    targets = list(dict.fromkeys(row.target for row in measured))
    for k, target in enumerate(targets):
        offset = (k - (len(targets) - 1) / 2) * 0.12
        for row in (r for r in measured if r.target == target):
            x, colour, marker = configs.index(row.config) + offset, colours[row.config], MARKERS[k % len(MARKERS)]
            if row.basis == STEADY:
                low, high = interval_bounds(row)
                axes.vlines([x], [low], [high], color=colour, linewidth=1.5)  # the interval as measured, even when
                axes.plot([x, x], [low, high], "_", color=colour, markersize=10)  # the figure lies outside it
                axes.plot([x], [row.tok_s], marker, color=colour, markersize=7)
            else:
                axes.plot([x], [row.tok_s], marker, markerfacecolor="white", markeredgecolor=colour, markeredgewidth=2,
                          markersize=8)
    axes.set_title("figure per configuration (steady: 95% interval)")
    axes.set_xticks(range(len(configs)))
    axes.set_xlim(-0.6, max(len(configs), 1) - 0.4)
    axes.set_xticklabels(configs, rotation=20, ha="right", fontsize=LEGEND_FONT)
    axes.set_ylabel("tok/s")
    if not measured:
        axes.text(0.5, 0.5, "no cell has a figure", ha="center", va="center", transform=axes.transAxes)
        return
    handles = [Line2D([], [], linestyle="none", marker=MARKERS[k % len(MARKERS)], color="black", label=f"on {target}")
               for k, target in enumerate(targets)]
    handles.append(Line2D([], [], linestyle="none", marker="o", color="grey", label="steady"))
    if any(row.basis == LAST_WINDOW for row in measured):
        handles.append(Line2D([], [], linestyle="none", marker="o", markerfacecolor="white", markeredgecolor="grey",
                              markeredgewidth=2, label="last-window median (not steady)"))
    axes.legend(handles=handles, fontsize=LEGEND_FONT, loc="best")


def interval_bounds(row: CellRow) -> tuple[float, float]:
    """The 95% interval to draw: as stored (a median figure may lie outside its batch-means interval, which once
    crashed matplotlib's yerr), or the figure itself when there is none."""
    low = row.tok_s if row.interval_low is None else row.interval_low
    high = row.tok_s if row.interval_high is None else row.interval_high
    return min(low, high), max(low, high)
