"""Options and rendering helpers shared by every command module.

Renders only: no SSH, SQL or checks here. Text that comes from users, files or remote machines is never
read as markup, and its control characters are shown, not sent to the terminal (orchestrator/sanitize.py:
both consoles are SafeConsoles; --json output is strict JSON).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from ..errors import DfoError, InventoryError
from ..sanitize import SafeConsole, json_line, markup

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


def print_error(err: DfoError) -> None:
    """One line per problem on stderr, prefixed `dfo: error:`."""
    lines = err.problems if isinstance(err, InventoryError) else [str(err)]
    for line in lines:
        err_console.print(f"[bold red]dfo: error:[/] {markup(line)}", highlight=False, soft_wrap=True)


def print_json(obj: Any) -> None:
    """One line of strict JSON on stdout (NaN/Infinity become null plus a `nonfinite` note)."""
    sys.stdout.write(json_line(obj) + "\n")
    sys.stdout.flush()



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
