"""`dfo watch [NAME ...]`: follow runs live, decide, fall back; also the body of `dfo launch --watch`.

Parses options, builds a Watcher and drives it, rendering with view.py (or one JSON object per event with
--json). Every fallback, a single run's or a multi-node run's, is the Watcher's lifecycle's, carried out while the
watch goes on (orchestrator/lifecycle.py), and so is one a dfo that died left half done: finished by the lifecycle
that holds its chain once the watch attaches it. Ctrl-C ends the watch and leaves every run running. All mechanics
live in orchestrator/watch.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import typer
from rich.live import Live

from ..chains import FALLBACK, MULTINODE_FALLBACK, FallbacksLeft, inventory_for
from ..connections import Connections
from ..decide import Decision, read_stored
from ..events import (DecisionMade, Event, Final, GpuError, LeaseHeld, LeftToBatch, LevelShift, MultinodeFellBack,
                      MultinodeSummary)
from ..history import sync_before_attach
from ..inventory import Inventory
from ..runs import StopWait
from ..states import Verdict
from ..store import Store, utc_now
from ..view import render
from ..watch import Watcher, current_decision
from .common import (InventoryOpt, complete_runs, console, ctrl_c_held, err_console, leave_half_done, print_json,
                     say_finishing, say_waiting, verdicts_exit_status)

EXAMPLE = "Example: dfo watch train_trees_20261129-1140 --until-decided   |   dfo watch --json   (all active runs)"
AGAIN = "`dfo watch`"  # what finishes a fallback that a second Ctrl-C leaves half done
ON_CTRL_C = "Ctrl-C finishes this fallback first"  # what a stop's wait said on stderr adds (say_each_wait)
SHOWN_EVENTS = ("decision", "level_shift", "left_to_batch", "stopped", "fell_back", "multinode_fell_back", "not_signalled",
                "action_error", "ended", "truncated", "gap", "disconnected", "gpu_error", "unreachable", "gpu_idle", "malformed",
                "took_over", "lease_held")


def register(app: typer.Typer) -> None:
    app.command(
        "watch",
        help=(
            "Follow runs live (no names: every active run), judge them warming up / steady / crashed / stalled / "
            "too slow, and on a crash or too-slow verdict stop the run and launch the next variant of its chain."
        ),
        epilog=EXAMPLE,
    )(watch_command)


def watch_command(
    names: Optional[list[str]] = typer.Argument(None, metavar="NAME", autocompletion=complete_runs,
                                                help="Run names (see `dfo runs`); a run that fell back means its chain's newest run."),
    interval: float = typer.Option(0.5, "--interval", help="Seconds between refreshes of the live view.", min=0.05, metavar="SECONDS"),
    poll: Optional[float] = typer.Option(None, "--poll", help="Poll each container every S seconds instead of streaming.", min=0.2, metavar="SECONDS"),
    until_decided: bool = typer.Option(False, "--until-decided", help="Exit once every chain has a final decision (steady counts)."),
    no_fallback: bool = typer.Option(False, "--no-fallback", help="Only report verdicts: never stop a run or launch another."),
    unreachable_after: Optional[float] = typer.Option(
        None, "--unreachable-after", min=1, metavar="SECONDS",
        help="Give up on a container out of reach this long: its runs end the watch undecided, exit 1 "
             "(default: the inventory's watch.unreachable_s, 300). Shorter outages resume where they stopped."),
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per event, then each chain's final decision."),
) -> None:
    began = utc_now()  # before the runs are listed: a group fallback finished from here on is said (Lifecycle)
    with Store() as store:
        runs = resolve_names(store, names or [])
        if not runs:
            err_console.print("no active runs to watch (see `dfo runs`)", highlight=False)
            raise typer.Exit(0)
        inv, note = inventory_for(store.get_run(runs[0]), inventory)  # the file the runs were launched from
    if note:
        err_console.print(note, highlight=False, markup=False)
    raise typer.Exit(watch_runs(inv, runs, interval=interval, poll=poll, until_decided=until_decided,
                                fallback=not no_fallback, as_json=as_json, unreachable_s=unreachable_after, began=began))


def resolve_nodes(store: Store, names: Sequence[str]) -> list[str]:
    """Each multi-node run among `names` replaced by its nodes (they never fall back on their own)."""
    return [node for name in names for node in (store.nodes_of(name) or [name])]


def report_multinode(store: Store, runs: Sequence[str], as_json: bool) -> None:
    """After a watch, one line per multi-node run whose nodes are among `runs` (the watch's, its fallbacks'
    successors too): its verdict, the node that failed first."""
    from ..multinode import outcomes, summary
    from ..decide.nodes import first_failure

    for group in groups_of(store, runs):
        if as_json:
            culprit = first_failure(outcomes(store, group))
            nodes = store.nodes_of(group)
            print_json(MultinodeSummary(at=utc_now(), run=group, chain=group, nodes=nodes,
                                        first_failed=nodes[culprit.rank] if culprit else None,
                                        summary=summary(store, group)).to_json())
        else:
            console.print(summary(store, group), highlight=False, markup=False, soft_wrap=True)


def resolve_names(store: Store, names: Sequence[str]) -> list[str]:
    """Named runs (each replaced by the newest run of its chain), or every active run when none is named."""
    if not names:  # and the runs (multi-node: their nodes) whose fallback a dfo that died left half done
        return list(dict.fromkeys([run.name for run in store.list_runs(active=True)] + [
            name for intent in store.open_intents() if intent.kind in (FALLBACK, MULTINODE_FALLBACK)
            for name in store.nodes_of(intent.data["run"]) or [intent.data["run"]]]))
    resolved = []
    for name in resolve_nodes(store, names):
        store.get_run(name)  # UnknownRun names the fix
        name = store.chain_runs(name)[-1]
        if name not in resolved:
            resolved.append(name)
    return resolved


def watch_runs(
    inventory: Inventory,
    names: Sequence[str],
    *,
    interval: float = 0.5,
    poll: float | None = None,
    until_decided: bool = False,
    fallback: bool = True,
    as_json: bool = False,
    chain: Sequence[str] | None = None,
    unreachable_s: float | None = None,
    began: str | None = None,
) -> int:
    """Watch `names` until Ctrl-C, until every chain is decided (--until-decided), or until every run ended
    or was given up on (its container out of reach for `unreachable_s`).

    Returns the exit status: 1 when a chain's final verdict is a failure (crash, stall, too slow, undecided
    when the watch ended, drifting) or a run was given up on, else 0 (steady, exited cleanly, stopped);
    130 on Ctrl-C. A fallback a dfo that died left half done in a chain the watch holds is finished by its
    lifecycle once the chain is attached (Lifecycle.finish_open_intents), and its successor followed."""
    with Connections(inventory) as connections, Store() as store:
        names = resolve_nodes(store, names)
        catch_up_first(store, names, connections)
        unshown: list[Event] = []  # the live view's: each event as it is emitted, until its line is printed
        watcher = Watcher(inventory, connections, store, fallback=fallback, poll=poll, chain_override=chain,
                          on_event=(lambda event: print_json(event.to_json())) if as_json else unshown.append,
                          unreachable_s=unreachable_s, on_wait=say_each_wait() if as_json else None,  # the view shows them
                          began=began)
        try:
            for name in names:
                watcher.attach(name)
            if as_json:
                drive(watcher, until_decided, interval, lambda: None)
            else:
                with Live(render(watcher), console=console, auto_refresh=False, transient=False) as live:
                    drive(watcher, until_decided, interval, lambda: show(live, watcher, unshown))
                if not console.is_terminal:
                    console.print()  # Live leaves its last frame without a newline when not on a terminal
        except KeyboardInterrupt:  # a fallback under way is finished first (a second Ctrl-C leaves it half done)
            return stopped_watching(watcher.lifecycle.finish_actions(lambda fallbacks: say_finishing(fallbacks, AGAIN)))
        finally:
            watcher.close()
        decisions = finals(watcher, store)
        lost = any(w.lost for w in watcher.runs())
        followed = [w.name for w in watcher.runs()]
    if as_json:
        for final in decisions:
            print_json(final.to_json())  # every JSON line has a kind
    else:
        summarise(decisions)
    with Store() as store:
        report_multinode(store, followed, as_json)
    return 1 if lost else verdicts_exit_status(final.decision.decision for final in decisions)


def catch_up_first(store: Store, names: Sequence[str], connections: Connections) -> None:
    """The runs' rows and stored histories brought up to date before they are attached (history.sync_before_attach,
    over the watch's own connections): one that ended is reported ended at once. A target that cannot be read is
    named on stderr; the watch then reads it itself."""
    runs = [run for name in names if (run := store.find_run(name)) is not None]
    for target, why in sync_before_attach(store, runs, lambda run: connections).items():
        err_console.print(f"note: could not read the logs on {target} before the watch ({why})",
                          highlight=False, markup=False, soft_wrap=True)


def say_each_wait() -> Callable[[StopWait], None]:
    """The Watcher's `on_wait` under --json (no live view to show it): each stop's wait for its run to exit said on
    stderr as `dfo stop` says it, each run's on its own (say_waiting: after 1 s, then every 10 s)."""
    sayers: dict[str, Callable[[StopWait], None]] = {}
    return lambda wait: sayers.setdefault(wait.name, say_waiting(ON_CTRL_C))(wait)


def stopped_watching(interrupted: KeyboardInterrupt | None) -> int:
    """Ctrl-C ends the watch (exit 130) once the fallbacks under way are finished; a second one (FallbacksLeft)
    left them half done: said, and the process leaves at once."""
    if isinstance(interrupted, FallbacksLeft):
        leave_half_done(interrupted.fallbacks, AGAIN, interrupted.overdue_s)
    err_console.print("stopped watching; the runs go on (dfo watch again to reattach)", highlight=False)
    return 130


def groups_of(store: Store, names: Sequence[str]) -> list[str]:
    """The multi-node runs the node runs among `names` belong to, once each."""
    return list(dict.fromkeys(group[0] for group in (store.node_group(run) for run in names) if group))


def drive(watcher: Watcher, until_decided: bool, interval: float, refresh: Callable[[], None]) -> None:
    """Step the watcher until it is done, calling `refresh()` at most every `interval` seconds, and once more at
    the end, Ctrl-C included: what was seen before a Ctrl-C is still shown."""
    shown_at = 0.0
    try:
        watcher.step(0)  # once at least: what attaching said is shown even when all is settled
        while not done(watcher, until_decided):
            watcher.step(min(0.25, interval))
            if time.monotonic() - shown_at >= interval:
                refresh()
                shown_at = time.monotonic()
    except KeyboardInterrupt:
        refresh()
        raise
    refresh()


def done(watcher: Watcher, until_decided: bool) -> bool:
    if not watcher.settled():
        return False
    if until_decided:
        return True
    return all(w.alive is False or w.given_up for w in watcher.runs() if w.name in {c["current"] for c in watcher.chains()})


def show(live: Live, watcher: Watcher, unshown: list[Event]) -> None:
    """The lines of the events not shown yet above the view, then the view: all of it, a Ctrl-C pressed meanwhile
    taking effect after it (a batch's level shift and the verdict it re-opened are never cut apart)."""
    with ctrl_c_held():
        events = unshown[:]
        for event in events:
            if event.kind in SHOWN_EVENTS:
                live.console.print(event_line(event), highlight=False, markup=False, soft_wrap=True)
        del unshown[:len(events)]
        live.update(render(watcher), refresh=True)


def event_line(event: Event) -> str:
    """One line for the scroll-back above the live view."""
    if isinstance(event, DecisionMade) and (d := read_stored(event.decision)[0]) is not None:
        nxt = f" -> {d.next_run}" if d.next_run else ""
        if d.decision == Verdict.CRASH:  # the crash itself is printed once, in its run's panel (view.crash_rows)
            return f"{event.at[11:19]} {event.subject}: {crash_words(d)} (action {d.action}{nxt}): {crash_shown(d)}"
        return f"{event.at[11:19]} {event.subject}: {d.decision} (action {d.action}{nxt}): {d.reason}"
    if isinstance(event, (LevelShift, LeftToBatch, LeaseHeld)):
        return f"{event.at[11:19]} {event.subject}: {event.text}"
    if isinstance(event, MultinodeFellBack):  # `mn: fell back on all 2 nodes to mn.2-ps2ok`, as it always was
        return f"{event.subject}: {event.text}"
    if isinstance(event, GpuError) and event.no_nvidia_smi:
        return f"{event.at[11:19]} {event.subject}: no nvidia-smi there (a CPU-only target): no GPU samples"
    detail = ", ".join(f"{k}={v}" for k, v in event.to_json().items() if k not in ("kind", "at", "run", "chain", "target"))
    return f"{event.at[11:19]} {event.subject}: {event.kind} {detail}".rstrip()


def finals(watcher: Watcher, store: Store) -> list[Final]:
    """The watch's last word on each chain (events.Final): its current run's decision, read as the typed Decision
    (decide.read_stored), and how that run ended. A run the watch holds no readable decision of (a successor the
    lifecycle launched but could not follow, a damaged stored one) is `undecided`, saying why."""
    out = []
    for summary in watcher.chains():
        decision = current_decision(summary)
        run = store.find_run(decision.run)
        ended = {"state": run.state, "exit_code": run.exit_code} if run is not None and not run.active else None
        out.append(Final(chain=summary["root"], decision=decision, ended=ended))
    return out


def summarise(last: list[Final]) -> None:
    for final in last:
        console.print(final_line(final), highlight=False, markup=False, soft_wrap=True)


def final_line(final: Final) -> str:
    """`c1: c1.2-nographs steady at 5,344 tok/s; exited 0 (action keep: ...)`: the verdict and how the run ended."""
    d, verdict = final.decision, final.decision.decision
    if verdict in (Verdict.STEADY, Verdict.EXITED) and d.steady_tok_s is not None:  # steady, then exited
        what = f"steady at {d.steady_tok_s:,.0f} tok/s"
    elif verdict == Verdict.CRASH:
        what = crash_words(d)
    else:
        what = verdict + (f" at step {d.at_step}" if d.at_step is not None else "")
    ended = final.ended
    if ended is None:
        how = "still running"
    elif ended.get("exit_code") is not None:
        how = f"{'exited' if ended['state'] in ('exited', 'crashed') else ended['state']} {ended['exit_code']}"
    else:
        how = f"{ended['state']}, no exit status"
    reason = f"{crash_shown(d)} above" if verdict == Verdict.CRASH else d.reason
    return f"{final.chain}: {d.run} {what}; {how} (action {d.action}: {reason})"


def crash_shown(d: Decision) -> str:
    """Where the crash's meaning and lines are printed (once): the crashed run's panel of the view."""
    return f"the crash: in {d.run}'s panel"


def crash_words(d: Decision) -> str:
    """`crash [cudagraph_tls] at step 3`: a crash named by its signature, its meaning and lines left to its panel."""
    signature = f" [{d.signature}]" if d.signature else ""
    return f"crash{signature}" + (f" at step {d.at_step}" if d.at_step is not None else "")
