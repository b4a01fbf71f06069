"""`dfo inventory check`: validate an inventory and show its targets. Renders only; the library validates."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..inventory import Inventory, load_inventory
from .common import InventoryOpt, JsonOpt, console, print_json

CHECK_EXAMPLE = "Example: dfo inventory check -i inventory/lab.example.yaml"


def register(app: typer.Typer) -> None:
    inventory_app = typer.Typer(help="Inspect the inventory (hosts, containers, variants).", no_args_is_help=True, epilog=CHECK_EXAMPLE)
    inventory_app.command("check", help="Validate an inventory and list its targets.", epilog=CHECK_EXAMPLE)(check)
    app.add_typer(inventory_app, name="inventory")


def check(inventory: Optional[Path] = InventoryOpt, as_json: bool = JsonOpt) -> None:
    inv = load_inventory(inventory)
    rows = target_rows(inv)
    if as_json:
        print_json({"inventory": inv.source, "targets": rows, "variants": list(inv.variants), "fallback": inv.fallback})
        return
    table = Table(title=f"{inv.source}: {len(rows)} targets")
    for column in ("target", "host", "address", "ctid", "GPUs"):
        table.add_column(column)
    for row in rows:
        gpus = ",".join(map(str, row["gpus"])) or "all visible"
        table.add_row(row["target"], row["host"], row["address"], str(row["ctid"] or "-"), gpus)
    console.print(table)


def target_rows(inv: Inventory) -> list[dict]:
    rows = []
    for name in inv.target_names():
        spec = inv.target(name)
        address = "local" if spec.transport == "local" else f"{spec.address}{':' + str(spec.port) if spec.port else ''}"
        rows.append({"target": name, "host": spec.host, "address": address, "ctid": spec.ctid, "gpus": list(spec.gpus)})
    return rows
