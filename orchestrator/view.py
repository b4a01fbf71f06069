"""The live view of `dfo watch`: one panel per followed run, built from the Watcher's state.

Per run: variant and target, time since it started, step (of the trainer's total, with an ETA from the recent
step rate, when the trainer's event=start gives steps=), tok/s with a sparkline of recent steps, warm-up/steady
state, a warning line while memory climbs after steady, a line while dfo's stop waits for the run to exit after
its SIGTERM, per-GPU memory and utilisation bars (a GPU that went idle while the others stay busy says since when),
queue fill and active drafters when the trainer reports them, the last log lines, and the decision with its
reason. A header line shows each container's channel: connected, reconnecting (and why), and the gaps it came
back from.

What it must not do: read the store, reach a machine or change the Watcher, or show remote text (log lines,
reasons, channel errors, nvidia-smi's words) other than through sanitize.py. Rendering is plain text
building (no measuring, no layout tricks), cheap enough for a few refreshes a second.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .logfmt import format_ts, parse_ts
from .sanitize import markup, text, visible
from .watch import Link, WatchedRun, Watcher
from .words import counted

SPARK = "▁▂▃▄▅▆▇█"
WARNING = "bold yellow"  # what the user should act on before it becomes a verdict (memory climbing)
BAR_WIDTH = 10
COLOURS = {"steady": "green", "exited": "green", "undecided": "yellow", "crash": "red", "stall": "red",
           "too_slow": "magenta"}


def sparkline(values: Sequence[float], width: int = 30) -> str:
    """The last `width` values as block characters scaled between their min and max."""
    values = list(values)[-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low
    if span <= 0:
        return SPARK[len(SPARK) // 2] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in values)


def bar(fraction: float | None, width: int = BAR_WIDTH) -> str:
    """`███░░░░░░░` for a fraction in [0, 1]; `?` when unknown."""
    if fraction is None:
        return "?" * width
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def state_text(watched: WatchedRun) -> Text:
    """What the run is doing now, coloured by its decision."""
    decision = watched.decision
    colour = COLOURS.get(decision.decision, "white")
    if watched.stopped_reason:
        return text(f"stopped by dfo: {watched.stopped_reason}", style="cyan")
    if watched.lost:
        return Text("given up: its container is out of reach (undecided)", style="bold red")
    if watched.nothing_ran:
        return Text("nothing ran: its launch never started (undecided)", style="bold red")
    shift = decision.level_shifts[-1] if decision.level_shifts else None
    reopened = reopened_text(shift) if shift is not None and shift["declared_tok_s"] is None else None
    if decision.decision == "undecided":
        label = reopened or (("compiling" if watched.compiles else "waiting for the first step")
                             if watched.latest is None else "warming up")
    elif decision.decision in ("exited", "stopped") and reopened:  # it ended before a new level held
        label = f"{decision.decision}; {reopened}"
    elif decision.decision == "steady" and decision.steady_tok_s is not None:
        label = f"steady {decision.steady_tok_s:,.0f} tok/s"
        if decision.interval:
            label += f" (95% {decision.interval[0]:,.0f}..{decision.interval[1]:,.0f})"
        if shift is not None:
            what = ("a decline from step" if shift.get("shape") == "decline" else "a level shift at step")
            label += f" since {what} {shift['at_step']} (from {shift['from_tok_s']:,.0f})"
        if decision.shift_suspected:
            label += (f"; level shift suspected since step {decision.shift_suspected['since_step']}, new level "
                      f"~{decision.shift_suspected['to_tok_s']:,.0f} being confirmed")
    else:
        label = decision.decision
        if decision.signature:
            label += f" [{visible(decision.signature)}]"
    action = f"  -> {decision.action}" if decision.action not in ("none", "keep") or decision.decision == "steady" else ""
    if decision.next_run:
        action += f" {decision.next_run}"
    elif watched.acting:
        action += " (in progress)"
    return text(label + action, style=f"bold {colour}")


def memory_text(watched: WatchedRun) -> Text | None:
    """`memory climbing +2.34 GiB/min on GPU 0 (40.0 -> 43.1 GiB since 14:03:05), full (140 GiB) in ~41 min`: the
    decision's `degrading` (decide/memory.py, after the steady declaration) as a warning of its own, or, once the
    run ended or got its verdict, the climb it ended with (`degrading_at_end`). None when nothing climbs."""
    climb, label = watched.decision.degrading, "memory climbing"
    if climb is None:
        climb, label = watched.decision.degrading_at_end, "memory was climbing at the end"
    if climb is None:
        return None
    where = f"on GPU {climb['gpu']}" if climb["what"] == "gpu_memory" else "in the trainer's mem_gb"
    line = (f"{label} {climb['gib_per_min']:+,.2f} GiB/min {where} ({climb['from_gib']:,.1f} -> "
            f"{climb['now_gib']:,.1f} GiB since {climb['since_at'][11:19]})")
    if climb.get("full_in_s") is not None and climb is watched.decision.degrading:
        line += f", full ({climb['total_gib']:,.0f} GiB) in ~{duration(climb['full_in_s'])} at this rate"
    return text(line, style=WARNING)


def exit_wait_text(watched: WatchedRun, now: float | None = None) -> Text | None:
    """`stopping: waiting for it to checkpoint and exit since 14:03:05 (SIGTERM sent 12s ago; SIGKILL in 1m18s of
    its 90 s grace)`: dfo's stop of the run (a fallback's, a batch's stop_when) between its SIGTERM and the run's
    exit, as `dfo stop` says it every 10 s. None when no stop waits on it."""
    wait = watched.exit_wait
    if wait is None or watched.alive is False:
        return None
    now = now if now is not None else time.time()
    return text(f"stopping: waiting for it to checkpoint and exit since {format_ts(wait.term_at)[11:19]} (SIGTERM sent "
                f"{duration(now - wait.term_at)} ago; SIGKILL in {duration(wait.left_s(now))} of its {wait.grace_s:g} s "
                "grace)", style="bold cyan")


def reopened_text(shift: dict) -> str:
    """`re-opened: decline from step 71, 4,988 -> ~4,442 tok/s`: a steady verdict re-opened by a level shift (or a
    decline) whose new level has not held yet."""
    what = "decline from step" if shift.get("shape") == "decline" else "level shift at step"
    return f"re-opened: {what} {shift['at_step']}, {shift['from_tok_s']:,.0f} -> ~{shift['to_tok_s']:,.0f} tok/s"


def gpu_rows(watched: WatchedRun) -> Iterable[str]:
    idle = watched.judge.idle_gpus.flagged
    for gpu in watched.gpu_now:
        used, total, util = gpu.get("mem_used_mib"), gpu.get("mem_total_mib"), gpu.get("util_pct")
        mem_fraction = used / total if used is not None and total else None
        mem = f"{used / 1024:5.1f}/{total / 1024:.0f} GiB" if used is not None and total else "   ?"
        util_text = f"{util:3.0f}%" if util is not None else "  ?"
        flag = f"   went idle {format_ts(idle[gpu['index']].since)[11:19]}" if gpu.get("index") in idle else ""
        yield (f"GPU{gpu.get('index')}  mem {bar(mem_fraction)} {mem}   "
               f"util {bar(util / 100 if util is not None else None)} {util_text}{flag}")


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    seconds = max(0, int(seconds))
    minutes, secs = divmod(seconds, 60)
    if minutes >= 60:
        return f"{minutes // 60}h{minutes % 60:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def eta_seconds(step_times: Sequence[tuple[float, int]], total: int | None) -> float | None:
    """Seconds to step `total` at the rate of the recent steps (None: no total, or no rate yet)."""
    if total is None or len(step_times) < 2:
        return None
    (t0, s0), (t1, s1) = step_times[0], step_times[-1]
    if t1 <= t0 or s1 <= s0:
        return None
    return max(0.0, (total - s1) * (t1 - t0) / (s1 - s0))


def step_text(watched: WatchedRun) -> str:
    """`step 1,200 of 3,000 (ETA 2m10s)`, or `step 1,200` when the trainer did not say its total."""
    latest = watched.latest
    if latest is None:
        return "no step yet"
    if watched.steps_total is None:
        return f"step {latest.step:,}"
    eta = eta_seconds(watched.step_times, watched.steps_total)
    return f"step {latest.step:,} of {watched.steps_total:,}" + (f" (ETA {duration(eta)})" if eta is not None else "")


def elapsed_text(watched: WatchedRun, now: float | None = None) -> str:
    """How long the run has been going (up to its last step once it has ended)."""
    start = parse_ts(watched.run.started_at) if watched.run.started_at else None
    if start is None:
        return ""
    end = (now or time.time()) if watched.alive is not False else (watched.latest.ts if watched.latest else start)
    return f"running {duration(end - start)}" if watched.alive is not False else f"ran {duration(end - start)}"


def first_step_text(watched: WatchedRun, now: float | None = None) -> str:
    """Before the first step: `compiling, 42s` while the trainer's event=start names a compiled variant, else
    `no step yet, 42s` (the time since the run started); once it ended, `ran 3s, no step`."""
    start = parse_ts(watched.run.started_at) if watched.run.started_at else None
    if watched.alive is False:
        return " ".join(filter(None, [elapsed_text(watched, now), "no step"]))
    phase = "compiling" if watched.compiles else "no step yet"
    return f"{phase}, {duration((now or time.time()) - start)}" if start is not None else phase


def progress_line(watched: WatchedRun) -> Text:
    latest = watched.latest
    if latest is None:
        return Text(first_step_text(watched), style="dim")
    parts = [part for part in (elapsed_text(watched), step_text(watched)) if part]
    parts.append(f"{latest.tok_s:,.0f} tok/s {sparkline(watched.throughput)}")
    if latest.loss is not None:
        parts.append(f"loss {latest.loss:.4g}")
    if latest.q_fill is not None:
        parts.append(f"queue {latest.q_fill:.0%}")
    if latest.active is not None:
        parts.append(f"active drafters {latest.active}")
    if latest.phase != "train":
        parts.append(latest.phase)
    if watched.malformed:
        parts.append(f"{counted(watched.malformed, 'malformed metric line')} ignored")
    return text("   ".join(parts))


def crash_lines(watched: WatchedRun) -> list[str]:
    """A crash's own lines (its traceback's tail, or the line that gave its signature), shown above the last log
    lines not among them: the one place the watch prints them (the scroll-back and the final line name the crash
    and refer here). Empty for any other verdict."""
    if watched.decision.decision != "crash":
        return []
    evidence = watched.decision.evidence
    return list(evidence.get("traceback_tail") or ([evidence["line"]] if evidence.get("line") else []))


def run_panel(watched: WatchedRun) -> Panel:
    body = Table.grid(padding=(0, 1))
    body.add_column()
    body.add_row(progress_line(watched))
    body.add_row(state_text(watched))
    for line in (memory_text(watched), exit_wait_text(watched)):
        if line is not None:
            body.add_row(line)
    if watched.decision.decision != "undecided" or watched.decision.at_step is not None:  # a reason about steps
        body.add_row(text(watched.decision.reason, style="dim"))  # (not one from before them beside step 650)
    for row in gpu_rows(watched):
        body.add_row(text(row))
    crash = crash_lines(watched)
    for line in crash + [line for line in list(watched.lines)[-3:] if line not in crash]:
        body.add_row(text("│ " + line, style="dim", no_wrap=True, overflow="ellipsis"))
    title = f"[bold]{markup(watched.name)}[/]  {markup(watched.run.variant or '?')} on {markup(watched.run.target)}"
    if watched.run.parent:
        title += f"  (after {markup(watched.run.parent)})"
    return Panel(body, title=title, title_align="left", border_style=COLOURS.get(watched.decision.decision, "white"))


def link_text(name: str, link: Link, unreachable_s: float) -> Text:
    if link.connected:
        line = text(f"{name}: connected", style="green")
    else:
        line = text(f"{name}: reconnecting" + (f" ({link.reason})" if link.reason else ""), style="yellow")
        if link.down_since is not None:
            line.append(f", down {time.time() - link.down_since:.0f} s (gives up after {unreachable_s:g} s)", style="yellow")
    if link.reconnects:
        line.append(f", {counted(link.reconnects, 'gap')}, last {link.last_gap_s or 0:.1f} s", style="yellow")
    if link.no_nvidia_smi:
        line.append(", no GPU (nvidia-smi not found)", style="dim")
    elif link.gpu_error:
        line.append(visible(f", nvidia-smi: {link.gpu_error}"), style="red")
    return line


def render(watcher: Watcher) -> RenderableType:
    """The whole view: the channels' line, then one panel per run (the current run of each chain last)."""
    links = Text("  ").join(link_text(name, link, watcher.unreachable_s) for name, link in watcher.links.items())
    panels = [run_panel(watched) for watched in watcher.runs()]
    return Group(links, *panels) if panels else Group(links, Text("no runs followed", style="dim"))
