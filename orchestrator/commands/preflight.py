"""`dfo preflight` (is each target ready for a run?) and `dfo hostkey trust` (record a host's SSH key).

Renders only: the checks live in orchestrator/preflight.py, host keys in orchestrator/remote/ssh.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..connections import Connections
from ..errors import UsageError
from ..inventory import load_inventory
from ..preflight import GPU_CHECK_NAMES, TargetReport, preflight
from ..words import counted
from .common import InventoryOpt, JsonOpt, complete_targets, console, print_json

PREFLIGHT_EXAMPLE = "Example: dfo preflight --host ct200 --host ct201 -i inventory/lab.yaml   |   dfo preflight --host all"
TRUST_EXAMPLE = "Example: dfo hostkey trust pve1 -i inventory/lab.yaml"


def register(app: typer.Typer) -> None:
    app.command(
        "preflight",
        help="Check targets in parallel: SSH, container running, nvidia-smi, GPUs idle, workspace, python/torch.",
        epilog=PREFLIGHT_EXAMPLE,
    )(preflight_command)
    hostkey_app = typer.Typer(help="Manage SSH host keys in ~/.ssh/known_hosts.", no_args_is_help=True, epilog=TRUST_EXAMPLE)
    hostkey_app.command("trust", help="Record an unknown host's key (prints its fingerprint).", epilog=TRUST_EXAMPLE)(
        trust_command
    )
    app.add_typer(hostkey_app, name="hostkey")


def preflight_command(
    hosts: list[str] = typer.Option(..., "--host", metavar="TARGET", autocompletion=complete_targets,
                                    help="Target (container name) to check; repeat for more; `host:NAME` for every "
                                         "container of a Proxmox host, a group of the inventory's groups:, `all` for "
                                         "every target."),
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = JsonOpt,
    accept_new_host_key: bool = typer.Option(
        False, "--accept-new-host-key", help="Record the key of a host not yet in known_hosts (like ssh's accept-new)."
    ),
) -> None:
    inv = load_inventory(inventory)
    hosts = inv.targets_of(hosts)
    with Connections(inv, accept_new_host_keys=accept_new_host_key, offer_accept_new=True) as connections:
        reports = preflight(connections, hosts)
    if as_json:  # `ok`: ready, as the text says (a CPU-only target is ready for CPU runs); `checks_ok`: every check passed
        print_json([{**report.to_json(), "ok": report.ok or report.cpu_only, "checks_ok": report.ok,
                     "cpu_only": report.cpu_only} for report in reports])
    else:
        console.print(report_table(reports))
        for report in reports:
            if report.cpu_only:
                console.print(cpu_only_note(report), highlight=False, markup=False, soft_wrap=True)
        ready = [report.target + (" (CPU only)" if report.cpu_only else "") for report in reports if report.ok or report.cpu_only]
        console.print(f"{len(ready)} of {counted(len(reports), 'target')} ready"
                      + (f": {', '.join(ready)}" if ready else ""))
    raise typer.Exit(0 if all(report.ok or report.cpu_only for report in reports) else 1)


NO_GPU_WHY = {"missing": "no nvidia-smi here", "no_devices": "nvidia-smi finds none"}


def cpu_only_note(report: TargetReport) -> str:
    """What a target without a GPU is still good for, instead of a list of failures."""
    code = next(c.code for c in report.checks if c.name == "nvidia_smi")
    return (f"{report.target} has no GPU ({NO_GPU_WHY.get(code, code)}): it is ready for CPU runs (the built-in variants "
            f"use preset tiny-cpu, e.g. `dfo launch --host {report.target} --variant eager --watch`); dfo replay, report, "
            "metrics and compare need no GPU either")


def report_table(reports: list[TargetReport]) -> Table:
    table = Table(title="preflight")
    for column in ("target", "check", "", "detail"):
        table.add_column(column, overflow="fold")
    for report in reports:
        for index, check in enumerate(report.checks):
            mark = "[dim]skip[/]" if check.skipped else ("[green]ok[/]" if check.ok else "[bold red]FAIL[/]")
            detail = check.detail
            if report.cpu_only and check.name in GPU_CHECK_NAMES:
                mark = "[dim]no GPU[/]" if check.name == "nvidia_smi" else "[dim]n/a[/]"
                detail = check.detail if check.name == "nvidia_smi" else "no GPU to check"
            table.add_row(report.target if index == 0 else "", check.name, mark, escape(detail), end_section=index == len(report.checks) - 1)
    return table


def trust_command(host: str = typer.Argument(..., help="Inventory host (or target) name.", metavar="HOST"), inventory: Optional[Path] = InventoryOpt) -> None:
    inv = load_inventory(inventory)
    host_name = host if host in inv.hosts else inv.target(host).host
    entry = inv.hosts[host_name]
    if entry.transport != "ssh":
        raise UsageError(f"host {host_name!r} uses transport {entry.transport}: it has no SSH host key")
    from ..remote.ssh import trust_host_key  # paramiko is loaded only when needed

    fingerprint = trust_host_key(entry.address, port=entry.port, timeout=inv.defaults.connect_timeout, name=host_name)
    console.print(escape(f"recorded host key of {host_name} ({entry.address}): {fingerprint}"), soft_wrap=True, highlight=False)
