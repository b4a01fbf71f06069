"""`dfo report`: what a batch found, from the store alone: one row per cell, the best configuration per target,
CSV/JSON export and a PNG of throughput over time and steady throughput per configuration.

A cell's figures come from the last run of its fallback chain (the one that measured something): steady tok/s
with its 95% interval and warm-up time from that run's decision, peak GPU memory from its GPU samples.

This module must not reach a machine or judge a run (it reads decisions the watcher stored); matplotlib is
imported only when a plot is asked for, with the Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any, Optional

from .batch import CellRecord, CellTable
from .errors import UsageError
from .logfmt import parse_ts
from .store import Run, Store

PLOT_SIZE_IN = (13.0, 5.0)
PLOT_DPI = 100
MAX_LEGEND = 12


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
    decision = (record.outcome.get("decision") or (final.decision if final else None)) or {}
    interval = decision.get("interval") or [None, None]
    return CellRow(
        cell=cell.id,
        target=cell.target,
        variant=cell.variant,
        settings=" ".join(f"{k}={v}" for k, v in cell.sets),
        gpus=cell.gpus,
        repeat=cell.repeat,
        state=record.state,
        decision=decision.get("decision"),
        steady_tok_s=decision.get("steady_tok_s"),
        interval_low=interval[0],
        interval_high=interval[1],
        warmup_s=warmup_seconds(store, final, decision) if final else None,
        fallbacks=[run.variant or "" for run in runs[1:]],
        final_run=final.name if final else None,
        peak_gpu_mem_mib=peak_gpu_memory(store, final, record.gpu_ids) if final else None,
        why=record.outcome.get("why") or record.outcome.get("error") or "",
        runs=[run.name for run in runs],
    )


def warmup_seconds(store: Store, run: Run, decision: dict) -> Optional[float]:
    """Seconds from the run's start to the step where its steady state began (compile and warm-up included)."""
    end_step = decision.get("warmup_end_step")
    if end_step is None:
        return None
    samples = [s for s in store.samples(run.name) if s.get("step") is not None and s.get("ts") is not None]
    reached = next((s["ts"] for s in samples if s["step"] >= end_step), None)
    start = parse_ts(run.started_at) if run.started_at else (samples[0]["ts"] if samples else None)
    return round(max(reached - start, 0.0), 1) if reached is not None and start is not None else None  # clocks may differ a little


def peak_gpu_memory(store: Store, run: Run, gpu_ids: tuple[int, ...]) -> Optional[float]:
    """The most memory any of the run's GPUs held: its own samples, else the target's samples of its GPUs
    while it ran (samples taken while several runs shared the container are not attributed to one run)."""
    samples = store.gpu_samples(run=run.name)
    if not samples:
        start = parse_ts(run.started_at) if run.started_at else None
        end = parse_ts(run.ended_at) if run.ended_at else None
        samples = [
            s for s in store.gpu_samples(target=run.target)
            if (start is None or (s["ts"] or 0) >= start) and (end is None or (s["ts"] or 0) <= end)
            and (not gpu_ids or s["index"] in gpu_ids)
        ]
    used = [s["mem_used_mib"] for s in samples if s.get("mem_used_mib") is not None]
    return max(used) if used else None


def best_per_target(rows: list[CellRow]) -> list[dict[str, Any]]:
    """For each target, the configuration with the highest mean steady tok/s over its repeats."""
    by_config: dict[tuple[str, str], list[CellRow]] = {}
    for row in rows:
        if row.steady_tok_s is not None:
            by_config.setdefault((row.target, row.config), []).append(row)
    best: dict[str, dict[str, Any]] = {}
    for (target, config), group in by_config.items():
        figure = mean(row.steady_tok_s for row in group)
        if target not in best or figure > best[target]["steady_tok_s"]:
            best[target] = {"target": target, "config": config, "steady_tok_s": round(figure, 1), "repeats": len(group),
                            "cells": [row.cell for row in group]}
    order = list(dict.fromkeys(row.target for row in rows))
    return [best[target] for target in order if target in best]


# ---------------------------------------------------------------------------------------------- export

CSV_COLUMNS = ("cell", "target", "variant", "settings", "gpus", "repeat", "state", "decision", "steady_tok_s",
               "interval_low", "interval_high", "warmup_s", "fallbacks", "final_run", "peak_gpu_mem_mib", "why")


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
    """A PNG: left, tok/s over time since start for every run of the batch; right, each cell's steady tok/s
    per configuration with its 95% interval as error bars (one colour per target)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (over_time, steady) = pyplot.subplots(1, 2, figsize=PLOT_SIZE_IN, dpi=PLOT_DPI,
                                                   gridspec_kw={"width_ratios": [3, 2]})
    try:
        _plot_over_time(over_time, store, rows)
        _plot_steady(steady, rows)
        figure.suptitle(f"batch {batch}")
        figure.tight_layout()
        figure.savefig(path, dpi=PLOT_DPI)
    finally:
        pyplot.close(figure)
    return Path(path)


def _plot_over_time(axes: Any, store: Store, rows: list[CellRow]) -> None:
    drawn = 0
    for row in rows:
        for name in row.runs:
            points = [(s["ts"], s["tok_s"]) for s in store.samples(name) if s.get("ts") is not None and s.get("tok_s") is not None]
            if not points:
                continue
            start = points[0][0]
            axes.plot([t - start for t, _ in points], [v for _, v in points], linewidth=1.2,
                      label=name if drawn < MAX_LEGEND else None)
            drawn += 1
    axes.set_title("throughput over time, per run")
    axes.set_xlabel("seconds since the run's first step")
    axes.set_ylabel("tok/s")
    if drawn:
        axes.legend(fontsize=6, loc="lower right")
    else:
        axes.text(0.5, 0.5, "no samples stored", ha="center", va="center", transform=axes.transAxes)


def _plot_steady(axes: Any, rows: list[CellRow]) -> None:
    measured = [row for row in rows if row.steady_tok_s is not None]
    configs = list(dict.fromkeys(row.config for row in measured))
    targets = list(dict.fromkeys(row.target for row in measured))
    for k, target in enumerate(targets):
        mine = [row for row in measured if row.target == target]
        offset = (k - (len(targets) - 1) / 2) * 0.12
        xs = [configs.index(row.config) + offset for row in mine]
        ys = [row.steady_tok_s for row in mine]
        low = [row.steady_tok_s - (row.interval_low if row.interval_low is not None else row.steady_tok_s) for row in mine]
        high = [(row.interval_high if row.interval_high is not None else row.steady_tok_s) - row.steady_tok_s for row in mine]
        axes.errorbar(xs, ys, yerr=[low, high], fmt="o", capsize=4, label=target)
    axes.set_title("steady throughput per configuration (95% interval)")
    axes.set_xticks(range(len(configs)))
    axes.set_xlim(-0.6, max(len(configs), 1) - 0.4)
    axes.set_xticklabels(configs, rotation=20, ha="right", fontsize=8)
    axes.set_ylabel("steady tok/s")
    if measured:
        axes.legend(fontsize=8)
    else:
        axes.text(0.5, 0.5, "no cell reached a steady state", ha="center", va="center", transform=axes.transAxes)
