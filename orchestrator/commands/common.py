"""Options and rendering helpers shared by every command module.

Renders only: no SSH, SQL or checks here. Text that comes from users, files or remote machines is never
read as markup, and its control characters are shown, not sent to the terminal (orchestrator/sanitize.py:
both consoles are SafeConsoles; --json output is strict JSON).
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from ..errors import DfoError, InventoryError
from ..sanitize import SafeConsole, json_line, markup

console = SafeConsole()
err_console = SafeConsole(stderr=True)

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

