"""Options and rendering helpers shared by every command module.

Renders only: no SSH, SQL or checks here. Text that comes from users, files or remote machines is never
read as markup, and its control characters are shown, not sent to the terminal (orchestrator/sanitize.py:
both consoles are SafeConsoles; --json output is strict JSON).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, NoReturn, Sequence

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from ..errors import DfoError, InventoryError
from ..sanitize import SafeConsole, json_line, markup
from ..states import Verdict

console = SafeConsole()
err_console = SafeConsole(stderr=True)
WIDE = Console(width=10_000)
"""Measures a table's natural width (never prints)."""

InventoryOpt = typer.Option(
    None,
    "-i",
    "--inventory",
    help="Inventory YAML file. Default: $DFO_INVENTORY, else the built-in inventory with the local target 'here'.",
    metavar="FILE",
)
JsonOpt = typer.Option(False, "--json", help="Print machine-readable JSON instead of tables.")


def verdicts_exit_status(verdicts: Iterable[str | None]) -> int:
    """The exit status of a command that ends on verdicts (`dfo watch`, `launch --watch`, `dfo replay`): 1 when
    any is a failure by Verdict.is_failure (crash, stall, too_slow, undecided, drifting), else 0."""
    return 1 if any(Verdict.of(verdict).is_failure() for verdict in verdicts) else 0


def bring_up_to_date(store, names: Sequence[str]) -> None:
    """The runs' stored history up to their logs' end first (history.sync_runs; a run whose history is complete is
    not looked at); a target that cannot be read is named on stderr and its runs are shown as stored."""
    from ..history import needs_sync, sync_runs

    runs = [store.get_run(name) for name in names]
    behind = [run for run in runs if needs_sync(run)]
    for target, why in (sync_runs(store, behind) if behind else {}).items():
        err_console.print(f"note: could not read the logs on {target} ({why}); showing the history as stored",
                          highlight=False, markup=False, soft_wrap=True)


def say(line: str) -> None:
    """One line on stderr, as it is (no markup, no highlighting)."""
    err_console.print(line, highlight=False, markup=False, soft_wrap=True)


SAY_WAITING_EVERY_S = 10.0


def say_waiting(on_ctrl_c: str = "Ctrl-C leaves it running") -> Callable[[Any], None]:
    """A stop's `on_wait` (runs.StopWait): its line on stderr once the run has had its SIGTERM for a second, then
    every 10 s; `on_ctrl_c` says what Ctrl-C does there."""
    said: list[float] = []

    def on_wait(wait) -> None:
        if wait.waited_s >= 1 and (not said or wait.waited_s - said[-1] >= SAY_WAITING_EVERY_S):
            said.append(wait.waited_s)
            say(wait.text(on_ctrl_c))
    return on_wait


def say_finishing(fallbacks: Sequence[str], again: str) -> None:
    """Ctrl-C with fallbacks under way (`dfo watch`, `dfo batch`: chains.finish_under_way): which ones are
    finished first, and that a second Ctrl-C leaves them to `again` (the commands that finish them)."""
    say(f"interrupted: finishing the fallback of {'; '.join(fallbacks)} first; Ctrl-C again leaves it to the next {again}")


def leave_half_done(fallbacks: Sequence[str], again: str, overdue_s: float | None = None) -> NoReturn:
    """A second Ctrl-C, or fallbacks still under way `overdue_s` after they started, longer than their remote
    calls can take (chains.FallbacksLeft): say so and leave at once, exit 130. The fallbacks' threads may be
    inside a remote call and cannot be interrupted: the process ends as a kill would (what they did is in the
    registry, their intents open; nothing remote is signalled)."""
    why = "interrupted again" if overdue_s is None else f"still under way after {overdue_s:g} s, longer than its remote calls can take"
    say(f"{why}: the fallback of {'; '.join(fallbacks)} is left half done; the next {again} finishes it; the runs go on")
    sys.stderr.flush()
    os._exit(130)


def print_error(err: DfoError) -> None:
    """One line per problem on stderr, prefixed `dfo: error:`."""
    lines = err.problems if isinstance(err, InventoryError) else [str(err)]
    for line in lines:
        first, *more = line.split("\n")  # a remote error's further lines, indented under it
        err_console.print(f"[bold red]dfo: error:[/] {markup(first)}", highlight=False, soft_wrap=True)
        for extra in more:
            err_console.print(f"  {markup(extra)}", highlight=False, soft_wrap=True)


def print_json(obj: Any) -> None:
    """One line of strict JSON on stdout (NaN/Infinity become null plus a `nonfinite` note)."""
    sys.stdout.write(json_line(obj) + "\n")
    sys.stdout.flush()


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """A Ctrl-C pressed inside the block takes effect when it ends: what the block prints is printed whole (the
    live view's lines and frame). A second one takes effect at once (a write to a pipe nobody reads never holds
    dfo). Off the main thread, where no signal handler runs, a plain block. Not used for each --json line: it
    costs more than encoding the line, and a handler runs between Python's calls, not inside a write that does
    not block, so only a write stuck on a full pipe is cut by it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[tuple[int, Any]] = []

    def held(signum: int, frame: Any) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append((signum, frame))

    previous = signal.signal(signal.SIGINT, held)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed and callable(previous):  # Python's own handler raises KeyboardInterrupt
        previous(*pressed[0])
    elif pressed and previous == signal.SIG_DFL:
        raise KeyboardInterrupt



def natural_width(table: Table) -> int:
    """The width `table` takes when nothing is wrapped or cut."""
    return Measurement.get(WIDE, WIDE.options, table).maximum


def fit_table(columns: Sequence[str], build: Callable[[list[str], list[str]], Table], width: int,
              dropped_first: Sequence[str]) -> Table:
    """`build(shown, hidden)` with the columns of `dropped_first` left out, in that order, until the table fits
    `width`: a column is given up whole rather than cut to `7,1…`. `hidden` lets the table say what it left out."""
    shown = list(columns)
    table = build(shown, [])
    for column in dropped_first:
        if natural_width(table) <= width:
            break
        if column in shown:
            shown.remove(column)
            table = build(shown, [c for c in columns if c not in shown])
    return table


def number(value: float | None) -> str:
    """A figure for a table: `7,129`, or nothing when there is none."""
    return "" if value is None else f"{value:,.0f}"


def basis_label(basis: str | None) -> str:
    """The short label of a figure's basis in tables (report.STEADY / report.LAST_WINDOW)."""
    from ..report import LAST_WINDOW, STEADY

    return {STEADY: "steady", LAST_WINDOW: "last-win"}.get(basis or "", "")


def basis_note(bases: Sequence[str | None]) -> str | None:
    """The footnote a table with last-window figures needs, so that none is read as a steady figure (None: no
    such figure in it)."""
    from ..report import LAST_WINDOW, LAST_WINDOW_S

    if LAST_WINDOW not in bases:
        return None
    return (f"last-win: median tok/s over the run's last {LAST_WINDOW_S:.0f} s of steps; it never reached a "
            "steady state, so it is not a steady figure")


def print_basis_note(bases: Sequence[str | None]) -> None:
    note = basis_note(bases)
    if note:
        console.print(note, highlight=False)


# ---------------------------------------------------------------------------------------------- completion
# Shell completion (`dfo --install-completion`) of run, target and variant names. Each reads the registry or
# the inventory and never fails: a broken file completes nothing rather than printing a traceback into the shell.

def complete_runs(incomplete: str) -> list[str]:
    from ..store import Store

    try:
        with Store() as store:
            names = [run.name for run in store.list_runs()]
    except Exception:
        return []
    return [name for name in reversed(names) if name.startswith(incomplete)]  # newest first


def complete_targets(ctx: typer.Context, incomplete: str) -> list[str]:
    inventory = _inventory_of(ctx)
    return [name for name in inventory.target_names() if name.startswith(incomplete)] if inventory else []


def complete_variants(ctx: typer.Context, incomplete: str) -> list[str]:
    inventory = _inventory_of(ctx)
    return [name for name in inventory.variants if name.startswith(incomplete)] if inventory else []


def _inventory_of(ctx: typer.Context):
    from ..inventory import load_inventory

    try:
        return load_inventory(ctx.params.get("inventory"))
    except Exception:
        return None
