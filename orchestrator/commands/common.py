"""Options and rendering helpers shared by every command module.

Renders only: no SSH, SQL or checks here. Text that comes from users, files or remote machines is printed
verbatim (escaped for rich), never read as markup.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import DfoError, InventoryError

console = Console()
err_console = Console(stderr=True)

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
        err_console.print(f"[bold red]dfo: error:[/] {escape(line)}", highlight=False, soft_wrap=True)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()

