"""`dfo metrics` and `dfo compare`: one run's history (or several runs side by side) from the store alone.

A run's history is what the watcher stored: its metric lines (tok/s, loss), the GPU samples of its GPUs
(memory, utilisation), its decisions (events of kind `decision`, with the time each was made) and its final
verdict. From those: the warm-up end, the steady level and its 95% interval, a figure for every run (the
steady one, else the last-window median, as in `dfo report`), a coarse timeline for a terminal, and PNGs.

This module must not reach a machine or judge a run; matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, median
from typing import Any, Optional

from . import events as ev
from .logfmt import parse_ts
from .decide import Decision, read_stored
from .report import LEGEND_FONT, PLOT_DPI, STEADY, UNREADABLE, config_colours, run_figure, run_gpu_samples
from .store import Run, Store

TIMELINE_ROWS = 12
METRICS_PLOT_IN = (12.0, 9.0)
COMPARE_PLOT_IN = (12.0, 5.5)


@dataclass
class RunMetrics:
    """A run's stored history, times in seconds since the run started (its first sample when no start is known)."""

    run: Run
    start_ts: Optional[float]
    steps: list[dict[str, Any]]  # {t, step, tok_s, loss}
    gpus: dict[int, list[dict[str, Any]]]  # index -> [{t, mem_used_mib, mem_total_mib, util_pct}]
    decisions: list[dict[str, Any]]  # {t, decision, action, at_step}, in the order they were made
    settings: dict[str, Any] = field(default_factory=dict)
    tok_s: Optional[float] = None  # the run's figure ...
    basis: Optional[str] = None  # ... and its basis (report.STEADY / report.LAST_WINDOW)

    decision: Optional[Decision] = None  # the run's stored decision (decide.read_stored), None: none or unreadable
    unreadable: Optional[str] = None  # why its stored decision cannot be read (an old or damaged one)

    @property
    def verdict(self) -> Optional[str]:
        """The verdict's word; `unreadable` for a stored decision that cannot be read; None: no decision."""
        return str(self.decision.decision) if self.decision else (UNREADABLE if self.unreadable else None)

    @property
    def interval(self) -> Optional[tuple[float, float]]:
        interval = self.decision.interval if self.decision and self.basis == STEADY else None
        return (interval[0], interval[1]) if interval else None

    def evidence(self, *path: str) -> Any:
        """The verdict's evidence at `path` (evidence is free-form: a level that is not an object is no value)."""
        value: Any = self.decision.evidence if self.decision else None
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    @property
    def warmup_end(self) -> Optional[dict[str, Any]]:
        """{step, t} of the warm-up cut now (where the figure's steps begin), when the verdict names one."""
        return self._reached(self.decision.warmup_end_step if self.decision else None)

    @property
    def declared_warmup_end(self) -> Optional[dict[str, Any]]:
        """{step, t} of the warm-up cut when steady was declared (the cut only moves later as data come,
        docs/decisions.md point 2); the cut now for a verdict that does not record it."""
        declared = self.evidence("steady_declared_warmup_end_step")
        return self._reached(declared) if isinstance(declared, (int, float)) else self.warmup_end

    @property
    def figure_steps(self) -> Optional[tuple[int, int]]:
        """The steps the steady figure is the level of, (first, last), when the verdict records them."""
        steps = self.evidence("steady", "figure_steps")
        return (steps[0], steps[1]) if isinstance(steps, list) and len(steps) == 2 else None

    @property
    def cut_moved(self) -> bool:
        """Whether the warm-up cut moved later than where it was when steady was declared."""
        end, declared = self.warmup_end, self.declared_warmup_end
        return bool(end and declared and end["step"] != declared["step"])

    def _reached(self, step: Optional[int]) -> Optional[dict[str, Any]]:
        """{step, t}: `step` and the time of the first stored step at or after it (None: not reached)."""
        if step is None:
            return None
        reached = next((s for s in self.steps if s["step"] is not None and s["step"] >= step), None)
        return {"step": step, "t": reached["t"] if reached else None}

    @property
    def warmup_s(self) -> Optional[float]:
        return warmup_seconds_of(self)

    @property
    def peak_mem_mib(self) -> Optional[float]:
        used = [g["mem_used_mib"] for samples in self.gpus.values() for g in samples if g["mem_used_mib"] is not None]
        return max(used) if used else None

    def gpu_summary(self) -> list[dict[str, Any]]:
        """Per GPU: peak and total memory, mean utilisation."""
        summary = []
        for index, samples in sorted(self.gpus.items()):
            used = [g["mem_used_mib"] for g in samples if g["mem_used_mib"] is not None]
            totals = [g["mem_total_mib"] for g in samples if g["mem_total_mib"] is not None]
            util = [g["util_pct"] for g in samples if g["util_pct"] is not None]
            summary.append({"index": index, "peak_mem_mib": max(used) if used else None,
                            "mem_total_mib": max(totals) if totals else None,
                            "mean_util_pct": round(fmean(util), 1) if util else None, "samples": len(samples)})
        return summary

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run.name, "target": self.run.target, "variant": self.run.variant, "state": self.run.state,
            "exit_code": self.run.exit_code, "settings": self.settings, "started_at": self.run.started_at,
            "tok_s": self.tok_s, "basis": self.basis, "interval": list(self.interval) if self.interval else None,
            "decision": self.verdict, "decision_unreadable": self.unreadable, "warmup_end": self.warmup_end, "warmup_s": self.warmup_s,
            "declared_warmup_end": self.declared_warmup_end,
            "figure_steps": list(self.figure_steps) if self.figure_steps else None,
            "peak_mem_mib": self.peak_mem_mib, "gpus": self.gpu_summary(), "decisions": self.decisions,
            "samples": self.steps,
            "gpu_samples": {str(index): samples for index, samples in sorted(self.gpus.items())},
        }


def warmup_seconds_of(metrics: RunMetrics) -> Optional[float]:
    end = metrics.warmup_end
    return round(max(end["t"], 0.0), 1) if end and end["t"] is not None else None


def run_metrics(store: Store, name: str) -> RunMetrics:
    """The stored history of run `name`; UnknownRun names the fix."""
    run = store.get_run(name)
    samples = [s for s in store.samples(name) if s.get("ts") is not None]
    start = parse_ts(run.started_at) if run.started_at else None
    if start is None and samples:
        start = samples[0]["ts"]

    def since(ts: Optional[float]) -> Optional[float]:
        return None if ts is None or start is None else round(ts - start, 3)

    steps = [{"t": since(s["ts"]), "step": s.get("step"), "tok_s": s.get("tok_s"), "loss": s.get("loss")} for s in samples]
    gpus: dict[int, list[dict[str, Any]]] = {}
    for g in run_gpu_samples(store, run, ()):
        gpus.setdefault(g["index"], []).append({"t": since(g["ts"]), "mem_used_mib": g["mem_used_mib"],
                                                "mem_total_mib": g["mem_total_mib"], "util_pct": g["util_pct"]})
    decisions = []
    for event in store.events(name, kind="decision"):
        made, _ = read_stored((event["data"] or {}).get("decision") if isinstance(event["data"], dict) else None)
        if made is not None:  # one that cannot be read is left out of the timeline
            decisions.append({"t": since(parse_ts(event["at"])), "decision": str(made.decision),
                              "action": str(made.action), "at_step": made.at_step})
    launched = store.events(name, kind=ev.Launched.kind)
    settings = dict((launched[0]["data"] or {}).get("sets") or {}) if launched else {}
    decision, unreadable = read_stored(run.decision)
    unreadable = unreadable or (run.unreadable if run.unreadable and "runs.decision" in run.unreadable else None)
    tok_s, basis = run_figure(store, run, decision)
    return RunMetrics(run, start, steps, gpus, decisions, settings, tok_s, basis, decision, unreadable)


def timeline(metrics: RunMetrics, rows: int = TIMELINE_ROWS) -> list[dict[str, Any]]:
    """The run cut into `rows` equal stretches of time: per stretch its last step, median tok/s, last loss,
    the most memory any GPU held and the GPUs' mean utilisation, and what happened in it (warm-up end, decisions)."""
    times = [s["t"] for s in metrics.steps if s["t"] is not None]
    times += [g["t"] for samples in metrics.gpus.values() for g in samples if g["t"] is not None]
    if not times:
        return []
    first, last = min(min(times), 0.0), max(times)
    width = max((last - first) / rows, 1e-9)

    def bucket(t: Optional[float]) -> Optional[int]:
        return None if t is None else min(int((t - first) / width), rows - 1)

    table = [{"until_s": round(first + width * (k + 1), 1), "step": None, "tok_s": None, "loss": None,
              "mem_mib": None, "util_pct": None, "events": []} for k in range(rows)]
    for k, group in _grouped(metrics.steps, bucket).items():
        tok = [s["tok_s"] for s in group if s["tok_s"] is not None]
        losses = [s["loss"] for s in group if s["loss"] is not None]
        table[k].update(step=group[-1]["step"], tok_s=round(median(tok), 1) if tok else None,
                        loss=losses[-1] if losses else None)
    gpu_samples = [g for samples in metrics.gpus.values() for g in samples]
    for k, group in _grouped(gpu_samples, bucket).items():
        used = [g["mem_used_mib"] for g in group if g["mem_used_mib"] is not None]
        util = [g["util_pct"] for g in group if g["util_pct"] is not None]
        table[k].update(mem_mib=max(used) if used else None, util_pct=round(fmean(util)) if util else None)
    for t, what in sorted(timeline_events(metrics), key=lambda event: event[0]):
        table[bucket(t)]["events"].append(what)
    return [row for row in table if row["step"] is not None or row["mem_mib"] is not None or row["events"]]


def timeline_events(metrics: RunMetrics) -> list[tuple[float, str]]:
    """(t, what) of what happened: the warm-up's end where the verdict put it when declared (the cut only moves
    later: a cut that did is an event of its own, where the figure's steps now begin), and each decision."""
    events = []
    declared, end = metrics.declared_warmup_end, metrics.warmup_end
    if declared and declared["t"] is not None:
        events.append((declared["t"], f"warm-up ends (step {declared['step']})"))
    if metrics.cut_moved and end["t"] is not None:
        steps = metrics.figure_steps
        over = f": the figure is over steps {steps[0]}..{steps[1]}" if steps else ""
        events.append((end["t"], f"warm-up cut moved later to step {end['step']}{over}"))
    events += [(d["t"], f"{d['decision']} -> {d['action']}") for d in metrics.decisions
               if d["t"] is not None and d["decision"] != "undecided"]
    return events


def _grouped(items: list[dict[str, Any]], bucket) -> dict[int, list[dict[str, Any]]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for item in items:
        k = bucket(item["t"])
        if k is not None:
            groups.setdefault(k, []).append(item)
    return groups


# ---------------------------------------------------------------------------------------------- plots

def plot_run(metrics: RunMetrics, path: Path) -> Path:
    """A PNG of four panels over the same time axis: tok/s (warm-up end, steady level and interval, decisions
    marked), loss, memory per GPU, utilisation per GPU."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, panels = pyplot.subplots(4, 1, figsize=METRICS_PLOT_IN, dpi=PLOT_DPI, sharex=True,
                                     gridspec_kw={"height_ratios": [3, 2, 2, 2]})
    throughput, loss, memory, util = panels
    try:
        points = [(s["t"], s["tok_s"]) for s in metrics.steps if s["t"] is not None and s["tok_s"] is not None]
        throughput.plot([t for t, _ in points], [v for _, v in points], color="tab:blue", linewidth=1.2, label="tok/s")
        if metrics.tok_s is not None:
            label = "steady level" if metrics.basis == STEADY else "last-window median (not steady)"
            throughput.axhline(metrics.tok_s, color="tab:green", linestyle="--", linewidth=1.2, label=label)
        if metrics.interval:
            throughput.axhspan(*metrics.interval, color="tab:green", alpha=0.15, label="95% interval")
        end = metrics.warmup_end
        for axes in panels:
            if end and end["t"] is not None:
                axes.axvline(end["t"], color="grey", linestyle=":", linewidth=1.2)
            for decision in metrics.decisions:
                if decision["t"] is not None and decision["decision"] != "undecided":
                    axes.axvline(decision["t"], color="tab:red", linewidth=1.0, alpha=0.7)
        if end and end["t"] is not None:
            throughput.plot([], [], color="grey", linestyle=":", label=f"warm-up end (step {end['step']})")
        for decision in metrics.decisions:
            if decision["t"] is not None and decision["decision"] != "undecided":
                throughput.annotate(decision["decision"], (decision["t"], 1.0), xycoords=("data", "axes fraction"),
                                    xytext=(3, -12), textcoords="offset points", color="tab:red", fontsize=LEGEND_FONT)
        throughput.set_ylabel("tok/s")
        throughput.legend(fontsize=LEGEND_FONT, loc="lower right")
        losses = [(s["t"], s["loss"]) for s in metrics.steps if s["t"] is not None and s["loss"] is not None]
        loss.plot([t for t, _ in losses], [v for _, v in losses], color="tab:purple", linewidth=1.2)
        loss.set_ylabel("loss")
        colours = config_colours([f"GPU {index}" for index in sorted(metrics.gpus)])
        for index, samples in sorted(metrics.gpus.items()):
            times = [g["t"] for g in samples]
            memory.plot(times, [g["mem_used_mib"] for g in samples], color=colours[f"GPU {index}"], label=f"GPU {index}")
            util.plot(times, [g["util_pct"] for g in samples], color=colours[f"GPU {index}"], label=f"GPU {index}")
        memory.set_ylabel("memory MiB")
        util.set_ylabel("utilisation %")
        util.set_ylim(-2, 102)
        for axes, what in ((loss, losses), (memory, metrics.gpus)):
            if not what:
                axes.text(0.5, 0.5, "not reported", ha="center", va="center", transform=axes.transAxes)
        if metrics.gpus:
            memory.legend(fontsize=LEGEND_FONT, loc="lower right", ncol=min(len(metrics.gpus), 8))
        util.set_xlabel("seconds since the run started")
        verdict = metrics.verdict or "no verdict"
        figure.suptitle(f"{metrics.run.name} on {metrics.run.target} ({metrics.run.variant or 'command'}): {verdict}")
        figure.tight_layout()
        figure.savefig(path, dpi=PLOT_DPI)
    finally:
        pyplot.close(figure)
    return Path(path)


def plot_compare(runs: list[RunMetrics], path: Path) -> Path:
    """A PNG: every run's tok/s over time on one axis, each run's figure as a dashed level in its colour."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, 1, figsize=COMPARE_PLOT_IN, dpi=PLOT_DPI)
    try:
        colours = config_colours([m.run.name for m in runs])
        for m in runs:
            points = [(s["t"], s["tok_s"]) for s in m.steps if s["t"] is not None and s["tok_s"] is not None]
            colour = colours[m.run.name]
            axes.plot([t for t, _ in points], [v for _, v in points], color=colour, linewidth=1.2,
                      label=f"{m.run.name} ({m.run.variant or 'command'})")
            if m.tok_s is not None:
                axes.axhline(m.tok_s, color=colour, linestyle="--" if m.basis == STEADY else ":", linewidth=1.0)
        axes.set_xlabel("seconds since the run started")
        axes.set_ylabel("tok/s")
        axes.set_title("throughput (dashed: steady level; dotted: last-window median, not steady)")
        axes.legend(fontsize=LEGEND_FONT + 1, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=min(len(runs), 3),
                    frameon=False)
        figure.tight_layout()
        figure.savefig(path, dpi=PLOT_DPI)
    finally:
        pyplot.close(figure)
    return Path(path)
