"""`dfo inventory check|discover|import`: validate an inventory; write one from a Proxmox host or an Ansible
inventory. Renders and writes files only; validation, discovery and conversion live in the library
(inventory.py, discover.py, ansible.py)."""

from __future__ import annotations

import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError
from rich.table import Table

from ..errors import UsageError
from ..inventory import Inventory, describe_validation_error, load_inventory, parse_inventory
from ..words import counted
from .common import InventoryOpt, JsonOpt, console, err_console, print_json

CHECK_EXAMPLE = "Example: dfo inventory check -i inventory/lab.example.yaml"
DISCOVER_EXAMPLE = "Example: dfo inventory discover root@10.1.2.6 -o lab.yaml   |   dfo inventory discover pve1 --merge lab.yaml"
IMPORT_EXAMPLE = "Example: dfo inventory import ansible/hosts.yml -o lab.yaml   (then: dfo inventory discover HOST --merge lab.yaml)"


def register(app: typer.Typer) -> None:
    inventory_app = typer.Typer(help="Inspect the inventory (hosts, containers, variants).", no_args_is_help=True, epilog=CHECK_EXAMPLE)
    inventory_app.command("check", help="Validate an inventory and list its targets.", epilog=CHECK_EXAMPLE)(check)
    inventory_app.command(
        "discover",
        help=("Ask a Proxmox host (over SSH) for its containers, their configs and GPUs (pct list, pct config, one "
              "nvidia-smi per running container) and write an inventory, commented where dfo guessed."),
        epilog=DISCOVER_EXAMPLE,
    )(discover_command)
    inventory_app.command(
        "import", help="Turn an Ansible inventory (YAML, INI, or the JSON of `ansible-inventory --list`) into a dfo "
                  "inventory: its hosts with address, user, port, and their Ansible groups as comments.",
        epilog=IMPORT_EXAMPLE,
    )(import_command)
    app.add_typer(inventory_app, name="inventory")


def check(inventory: Optional[Path] = InventoryOpt, as_json: bool = JsonOpt) -> None:
    inv = load_inventory(inventory)
    rows = target_rows(inv)
    if as_json:
        print_json({"inventory": inv.source, "targets": rows, "variants": list(inv.variants), "fallback": inv.fallback})
        return
    table = Table(title=f"{inv.source}: {counted(len(rows), 'target')}")
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


def discover_command(
    host: str = typer.Argument(..., help="The Proxmox host: an address, user@address, an ~/.ssh/config alias, or a host of the --merge file.", metavar="HOST"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the inventory here (default: stdout; with --merge: the merged file).", metavar="FILE"),
    merge: Optional[Path] = typer.Option(None, "--merge", help="Add what was found to this inventory, keeping its variants and hand edits.", metavar="FILE"),
    name: Optional[str] = typer.Option(None, "--name", help="The host's name in the inventory (default: from HOST).", metavar="NAME"),
    port: Optional[int] = typer.Option(None, "--port", help="SSH port (default: ~/.ssh/config, else 22).", min=1, max=65535, metavar="PORT"),
    accept_new_host_key: bool = typer.Option(False, "--accept-new-host-key", help="Record the key of a host not yet in known_hosts."),
) -> None:
    from ..connections import Connections
    from ..discover import discover, host_name_for, merge_inventory, render

    user, _, address = host.rpartition("@")
    existing = load_inventory(merge) if merge is not None else None
    if existing is not None and address in existing.hosts and not user:
        host_name = name or address
        entry = existing.hosts[address]
        inv, address, port, user = existing, entry.address or address, entry.port, entry.user
    else:
        host_name = name or host_name_for(address)
        try:
            inv = Inventory.model_validate({"hosts": {host_name: {"address": address, "port": port, "user": user or None}}})
        except ValidationError as exc:  # an address with a newline or a leading '-': named as HOST, not ssh's words
            raise UsageError(f"HOST {host!r}: {describe_validation_error(exc)[0].split(': ', 1)[-1]}",
                             hint="pass an address, user@address or an ~/.ssh/config alias") from None
    with Connections(inv, accept_new_host_keys=accept_new_host_key) as connections:
        found = discover(connections.host(host_name), host_name, address, port=port, user=user or None)
    text = render(found, when=_now())
    target = output
    if merge is not None:
        merged = merge_inventory(merge.read_text(encoding="utf-8"), text, source=str(merge))
        text, target = merged.text, output or merge
        summary = (f"{merged.host}: added {', '.join(merged.added) or 'nothing'}"
                   + (f"; kept as written: {', '.join(merged.kept)}" if merged.kept else ""))
    else:
        summary = f"{host_name}: {counted(len(found.containers), 'container')}"
    guessed = [item.name for item in found.containers if item.guesses()]
    if guessed:
        summary += f"; guessed (see the comments): {', '.join(guessed)}"
    parse_inventory(text, source=str(target or "<discovered>"))  # never write an inventory dfo would refuse
    _write(text, target)
    err_console.print(summary + (f"; wrote {target}" if target else ""), highlight=False, markup=False, soft_wrap=True)


def import_command(
    file: Path = typer.Argument(..., help="Ansible inventory, YAML (all: hosts/children/vars), INI ([group] lines) or "
                                          "`ansible-inventory --list` JSON.", metavar="FILE"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the inventory here (default: stdout).", metavar="FILE"),
) -> None:
    from ..ansible import import_inventory

    try:
        source = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{file}: cannot read: {exc.strerror}", hint="pass an existing Ansible inventory file") from None
    text = import_inventory(source, source=str(file), when=_now())
    parse_inventory(text, source=str(output or "<imported>"))
    _write(text, output)
    if output:
        err_console.print(f"wrote {output}; next: dfo inventory discover HOST --merge {output}", highlight=False, markup=False)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def _write(text: str, path: Optional[Path]) -> None:
    """Print `text`, or replace `path` with it in one rename (a reader never sees half a file)."""
    if path is None:
        sys.stdout.write(text)
        return
    partial = path.with_name(f".{path.name}.dfo-{os.getpid()}")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
