"""`dfo push`, `dfo launch`, `dfo runs`, `dfo logs` and `dfo stop`: parse, call package/runs/store, render.

The mechanics live in orchestrator/package.py, runs.py and store.py; this module holds no SSH or SQL, and
never prints a secret (launch only reports which secret names were missing).
"""

from __future__ import annotations

import codecs
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

import typer
from rich import box
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from .. import runs as runs_lib
from ..connections import Connections
from ..errors import DfoError, RefusedError, RemoteError, UsageError
from ..decide import read_stored
from ..events import LaunchAnswer, LevelShift, ResumeAnswer
from ..inventory import TargetSpec, load_inventory
from ..launchplan import Gate
from ..logfmt import format_ts
from ..names import check_name
from ..package import push
from ..preflight import TOLERABLE_WHEN_BUSY, TargetReport
from ..states import RunState
from ..store import Run, Store, utc_now
from ..sanitize import markup, visible
from ..words import counted
from .common import (InventoryOpt, JsonOpt, complete_runs, complete_targets, complete_variants, console, err_console,
                     fit_table, number, print_json, say_waiting)

EXAMPLES = {
    "push": "Example: dfo push --host ct200 -i inventory/lab.yaml",
    "launch": "Example: dfo launch --host ct200 --variant nographs --set steps=2000   (then: dfo watch NAME)   |   "
              "dfo launch --host ct200 --host ct201 --variant ps-trees-2n   (one run on two nodes)",
    "runs": "Example: dfo runs --active   |   dfo runs --state crashed --since 3d --limit 20   |   dfo runs --batch sweep1 --json   |   "
            "dfo runs train_trees_20261129-1140   |   dfo runs rm NAME   |   dfo runs prune --older-than 7d",
    "rm": "Example: dfo runs rm train_nographs_20261129-1140 train_trees_20261129-1150   |   dfo runs rm RUN --force",
    "prune": "Example: dfo runs prune   (runs older than 7 days)   |   dfo runs prune --older-than 1d --json",
    "logs": "Example: dfo logs train_nographs_20261129-1140 -n 200 -f",
    "resume": "Example: dfo resume train_nographs_20261129-1140 --watch",
    "stop": "Example: dfo stop train_nographs_20261129-1140 --grace 60   |   dfo stop RUN1 RUN2   |   dfo stop --all",
}

HostOpt = typer.Option(..., "--host", help="Target (container name from the inventory), e.g. ct200.", metavar="TARGET",
                       autocompletion=complete_targets)


def register(app: typer.Typer) -> None:
    app.command("push", help="Copy the trainer package into a target if it lacks this exact version.", epilog=EXAMPLES["push"])(push_command)
    app.command(
        "launch",
        help="Preflight a target, push the trainer if needed, start a run detached with a named log, record it.",
        epilog=EXAMPLES["launch"],
    )(launch_command)
    runs_help = ("List the runs in the registry (name, target, PID, state, start, duration, steady tok/s, decision, "
                 "variant), filtered by --state, --since, --limit; NAME: one run in full. `dfo runs rm NAME...` and "
                 "`dfo runs prune` remove runs from the registry.")
    runs_app = typer.Typer(cls=RunsGroup, help=runs_help)
    runs_app.command("list", help=runs_help, epilog=EXAMPLES["runs"])(runs_command)
    runs_app.command("rm", help="Remove runs from the registry with everything recorded of them (never their logs). A "
                                "run that may still be going is refused unless --force, which stops it first "
                                "(identity-checked, as dfo stop).", epilog=EXAMPLES["rm"])(rm_command)
    runs_app.command("prune", help="Remove the runs that ended (or started) more than --older-than ago from the "
                                   "registry. Runs that may still be going are kept unless --force, which stops them "
                                   "first.", epilog=EXAMPLES["prune"])(prune_command)
    app.add_typer(runs_app, name="runs")
    app.command("logs", help="Show the tail of a run's log; -f follows it until Ctrl-C (the run goes on).", epilog=EXAMPLES["logs"])(
        logs_command
    )
    app.command(
        "resume",
        help="Relaunch a stopped or crashed run from its checkpoint (the trainer's --resume) as the next run of its chain.",
        epilog=EXAMPLES["resume"],
    )(resume_command)
    app.command(
        "stop",
        help="SIGTERM a run's process group, SIGKILL after the grace period, record how it ended (checks the PID is still "
             "the run's); several NAMEs, or --all active runs, one after the other.",
        epilog=EXAMPLES["stop"],
    )(stop_command)


class RunsGroup(TyperGroup):
    """`dfo runs`: its `list` command (`dfo runs [NAME] [OPTIONS]`, `dfo runs --help`) unless the first word names
    one of its other commands (`dfo runs rm ...`, `dfo runs prune ...`). A run named `rm` or `prune` is shown by
    `dfo runs list rm`."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands:
            args = ["list", *args]
        return super().parse_args(ctx, args)


def push_command(host: str = HostOpt, inventory: Optional[Path] = InventoryOpt, as_json: bool = JsonOpt) -> None:
    inv = load_inventory(inventory)
    spec = inv.target(host)
    with Connections(inv) as connections, Store() as store:
        result = push(connections.container(host), spec.workspace, python=spec.python, store=store, target_name=host)
    if as_json:
        print_json({"target": host, "hash": result.sha256, "transferred": result.transferred, "bytes": result.bytes_sent,
                    "replaced": result.replaced, "python_found": result.python_found, "torch_found": result.torch_found})
    elif result.replaced:
        console.print(f"{host}: trainer {result.sha256[:12]}'s files there had changed since it was unpacked; pushed it "
                      f"again ({result.bytes_sent} bytes) to {markup(result.pkg_dir)}", highlight=False, soft_wrap=True)
    elif result.transferred:
        console.print(f"{host}: pushed trainer {result.sha256[:12]} ({result.bytes_sent} bytes) to {markup(result.pkg_dir)}",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"{host}: already has trainer {result.sha256[:12]}; nothing transferred")
    _warn_python(spec, result.python_found, result.torch_found)


def _warn_python(spec: TargetSpec, python_found: bool | None, torch_found: bool | None) -> None:
    if python_found is False:
        _warn(f"warning: {spec.python} not found in {spec.name}: set `python:` for it in the inventory")
    elif torch_found is False:
        _warn(f"warning: {spec.python} in {spec.name} has no torch: install it there (dfo installs nothing)")


def launch_command(
    hosts: list[str] = typer.Option(..., "--host", metavar="TARGET", autocompletion=complete_targets,
                                    help="Target (container name from the inventory), e.g. ct200; repeat it for a "
                                         "multi-node run (procsplit variants; the first target hosts the rendezvous); "
                                         "`host:NAME` (every container of a Proxmox host), a group of the inventory's "
                                         "groups: or `all` give several."),
    variant: str = typer.Option(..., "--variant", help="Variant name from the inventory, e.g. nographs.", metavar="VARIANT",
                                autocompletion=complete_variants),
    name: Optional[str] = typer.Option(None, "--name", metavar="NAME", help="Run name (default: train_<variant>_<YYYYmmdd-HHMM>)."),
    sets: list[str] = typer.Option([], "--set", help="Override a trainer argument: key=value (repeatable).", metavar="KEY=VALUE"),
    force: bool = typer.Option(False, "--force", help="Start even when the target's GPUs look busy."),
    no_preflight: bool = typer.Option(False, "--no-preflight", help="Skip the preflight checks."),
    wandb: str = typer.Option("off", "--wandb", help="Weights & Biases mode passed to the built-in trainer: off|offline|online|auto.", metavar="MODE"),
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = JsonOpt,
    watch: bool = typer.Option(False, "--watch", help="Go straight into `dfo watch` of this run's chain."),
    until_decided: bool = typer.Option(False, "--until-decided", help="Watch (implies --watch) and exit once the chain is decided (0: steady/keep)."),
    no_fallback: bool = typer.Option(False, "--no-fallback", help="With --watch: only report, never stop or launch."),
    chain: Optional[str] = typer.Option(None, "--chain", help="Fallback chain for this run instead of the inventory's, e.g. trees,nographs,eager.", metavar="A,B,C"),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", metavar="ADDR",
                                              help="Multi-node: the first target's address as the others reach it (default: its `hostname -I`)."),
    master_port: Optional[int] = typer.Option(None, "--master-port", min=1, max=65535, metavar="PORT",
                                              help="Multi-node: the rendezvous port on the first target (default: the variant's master_port, 29500)."),
) -> None:
    from ..chains import chain_from_option, rest_of_chain

    if name is not None:
        check_name(name, "run name")  # before any connection: a bad name costs nothing
    watch = watch or until_decided  # --until-decided alone would launch and exit 0 before any decision
    inv = load_inventory(inventory)
    hosts = inv.targets_of(hosts)  # `host:pve1`, `all`: those targets, one node each
    if len(hosts) > 1 or inv.variant(variant).nodes > 1:
        if chain is not None:
            raise UsageError("--chain: a multi-node run falls back along the inventory's fallback: list only "
                             "(docs/multinode.md)")
        _launch_nodes(inv, hosts, variant, name=name, sets=sets, wandb=wandb, force=force, no_preflight=no_preflight,
                      master_addr=master_addr, master_port=master_port, as_json=as_json, watch=watch,
                      until_decided=until_decided, fallback=not no_fallback)
        return
    host = hosts[0]
    chain_list = chain_from_option(chain, variant, inv)
    ahead = rest_of_chain(chain_list, variant) if chain_list else None  # (): a chain of one, None: the inventory's
    spec = runs_lib.spec_for(inv, host, variant, sets=runs_lib.parse_sets(sets), wandb=wandb, chain=ahead)
    target = inv.target(host)
    gate = None if no_preflight else Gate(target, tolerate=TOLERABLE_WHEN_BUSY if force else ())
    with Connections(inv) as connections, Store() as store:
        launched = runs_lib.launch(connections.container(host), spec, store, name=name, gate=gate,
                                   start_grace_s=inv.watch.start_grace_s)
    _warn_tolerated(launched.preflight, target)
    for missing in launched.missing_secrets:
        _warn(f"warning: secret {missing} is not set in this environment; the run starts without it")
    run = launched.run
    if as_json:
        print_json(launch_answer(run.name, [launched]).to_json())
    else:
        console.print(f"launched [bold]{markup(run.name)}[/] on {markup(run.target)} (PID {run.pid})", highlight=False)
        console.print(f"  log:  {markup(run.log_path)}", highlight=False, soft_wrap=True)
        console.print(f"  next: dfo watch {run.name}", highlight=False)
    if watch:
        from .watch import watch_runs

        raise typer.Exit(watch_runs(inv, [run.name], until_decided=until_decided, fallback=not no_fallback, as_json=as_json))


def launch_answer(name: str, nodes: Sequence[runs_lib.Launched], *, rendezvous: str | None = None) -> LaunchAnswer:
    """`dfo launch --json`'s line of the run NAME started as `nodes` (one, or a multi-node run's with its
    rendezvous): events.LaunchAnswer, one shape for both."""
    one = nodes[0].run if rendezvous is None else None
    return LaunchAnswer(at=utc_now(), run=name, target=one and one.target, pid=one and one.pid,
                        log=one and one.log_path, exit=one and one.exit_path, trainer_hash=nodes[0].run.trainer_hash,
                        pushed=any(bool(n.push and n.push.transferred) for n in nodes), rendezvous=rendezvous,
                        nodes=[{"run": n.run.name, "target": n.run.target, "pid": n.run.pid, "log": n.run.log_path,
                                "exit": n.run.exit_path} for n in nodes], next=f"dfo watch {name}")


def _launch_nodes(inv, hosts: list[str], variant: str, *, name: Optional[str], sets: list[str], wandb: str, force: bool,
                  no_preflight: bool, master_addr: Optional[str], master_port: Optional[int], as_json: bool, watch: bool,
                  until_decided: bool, fallback: bool) -> None:
    """`dfo launch --host A --host B ...`: one run over several nodes (orchestrator/multinode.py)."""
    from .. import multinode

    specs = [runs_lib.spec_for(inv, host, variant, sets=runs_lib.parse_sets(sets), wandb=wandb, chain=()) for host in hosts]
    multinode.check_specs(specs, inv.variant(variant), hosts, master_addr)
    targets = [inv.target(host) for host in hosts]
    gates = [None if no_preflight else Gate(t, tolerate=TOLERABLE_WHEN_BUSY if force else ()) for t in targets]
    port = master_port or inv.variant(variant).master_port
    with Connections(inv) as connections, Store() as store:
        remotes = [connections.container(host) for host in hosts]
        rendezvous = multinode.find_rendezvous(remotes[0], specs[0], port, master_addr)
        launched = multinode.launch_nodes(remotes, specs, store, name=name, rendezvous=rendezvous, gates=gates,
                                          start_grace_s=inv.watch.start_grace_s, stop_grace_s=inv.stop_grace(variant))
    for node, target in zip(launched.nodes, targets):
        _warn_tolerated(node.preflight, target)
    if as_json:
        print_json(launch_answer(launched.name, launched.nodes, rendezvous=str(launched.rendezvous)).to_json())
    else:
        console.print(f"launched [bold]{markup(launched.name)}[/] on {len(launched.nodes)} nodes "
                      f"(rendezvous {markup(str(launched.rendezvous))})", highlight=False)
        for rank, node in enumerate(launched.nodes):
            console.print(f"  node {rank}: {markup(node.run.target)} PID {node.run.pid}  log {markup(node.run.log_path)}",
                          highlight=False, soft_wrap=True)
        console.print(f"  next: dfo watch {launched.name}", highlight=False)
    if watch:
        from .watch import watch_runs

        raise typer.Exit(watch_runs(inv, [launched.name], until_decided=until_decided, fallback=fallback,
                                    as_json=as_json))


def _warn_tolerated(report: TargetReport | None, spec: TargetSpec) -> None:
    """Say which failed preflight checks the launch went past (preflight.blocking lets them pass): busy GPUs
    with --force, no GPU answer on a target that lists no GPUs (a CPU run). (A workspace not there yet that the
    launch can create passes its check.)"""
    for check in report.checks if report else ():
        if check.ok or check.skipped:
            continue
        if check.name in TOLERABLE_WHEN_BUSY:
            _warn(f"warning: {check.name}: {check.detail} (starting anyway: --force)")
        elif check.name == "nvidia_smi" and not spec.gpus:
            _warn(f"note: no GPU answered on {spec.name} ({check.detail}); the run starts without GPUs")


def runs_command(
    name: Optional[str] = typer.Argument(None, help="One run: everything the registry holds about it (W&B record included).",
                                         metavar="NAME", autocompletion=complete_runs),
    batch: Optional[str] = typer.Option(None, "--batch", metavar="BATCH", help="Only runs of this batch."),
    active: bool = typer.Option(False, "--active", help="Only launching/running runs."),
    states: list[str] = typer.Option([], "--state", metavar="STATE",
                                     help=f"Only runs in this state (repeatable): {', '.join(RunState)}."),
    since: Optional[str] = typer.Option(None, "--since", metavar="WHEN",
                                        help="Only runs started since WHEN: an age (30m, 2h, 3d, 1w) or an ISO date/time "
                                             "(2026-11-29, 2026-11-29T11:40; local time)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, metavar="N", help="Only the newest N runs (of those chosen)."),
    no_refresh: bool = typer.Option(False, "--no-refresh", help="Show the registry as it is: no look at the targets of active runs."),
    recheck: bool = typer.Option(False, "--recheck", help="Look for every run whose start was never settled "
                                                          "(`unconfirmed`, or `launching` by a dfo that died) now, even one "
                                                          f"tried less than {runs_lib.LOST_RECHECK_S:g} s ago."),
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = JsonOpt,
) -> None:
    from ..history import needs_sync

    def due(run: Run) -> bool:
        return runs_lib.look_due(run, recheck=recheck)

    chosen = dict(batch=batch, active=True if active else None, states=[check_state(state) for state in states],
                  started_since=None if since is None else since_utc(since), limit=limit)

    with Store() as store:
        if name is not None and store.nodes_of(name):  # a multi-node run: its nodes
            nodes = [store.get_run(node) for node in store.nodes_of(name)]
            if not no_refresh and any(map(due, nodes)):
                _refresh(store, nodes, inventory, recheck)
            show_nodes(store, name, as_json)
            return
        runs = [store.get_run(name)] if name is not None else store.list_runs(**chosen)
        behind = [run for run in runs if due(run) or (name is not None and needs_sync(run))]
        if not no_refresh and behind:  # the active runs' rows and histories, a named run's history
            _refresh(store, runs, inventory, recheck, history_of=behind)
        if not no_refresh:
            _say_not_looked_for(store, [run for run in runs if runs_lib.needs_look(run) and not due(run)])
        if name is not None:
            show_run(name, as_json, inventory)
            return
        runs = store.list_runs(**chosen)
    if as_json:
        print_json([run.as_dict() for run in runs])
        return
    if not runs:
        chose = ([f"in batch {batch}"] if batch else []) + ([f"in state {' or '.join(states)}"] if states else []) \
            + ([f"started since {since}"] if since else [])
        what = " ".join([f"{'active ' if active else ''}runs", *chose])
        console.print(f"no {what} (registry: {store.path})", highlight=False, markup=False)
        return
    console.print(runs_table(runs, console.width))


def _say_not_looked_for(store: Store, skipped: list[Run]) -> None:
    """One note for the runs whose start was never settled (runs.start_unsettled: `unconfirmed`, or
    `launching` by a dfo that died) that were not looked for (runs.look_due: their target did not answer lately)
    and still are as they were: not tried again, nor settled by a look at their target made anyway for an active
    run there."""
    waiting = [run for run in skipped if runs_lib.start_unsettled(fresh := store.get_run(run.name))
               and fresh.checked_at == run.checked_at]
    if waiting:
        when = _local_time(max(run.checked_at for run in waiting), datetime.now().astimezone(), seconds=True)
        which = ", ".join(f"{run.name} ({run.state})" for run in waiting)
        _warn(f"note: {counted(len(waiting), 'run')} whose start was never settled not looked "
              f"for again ({which}): "
              f"{'their' if len(waiting) > 1 else 'its'} target did not answer at {when} (tried at most every "
              f"{runs_lib.LOST_RECHECK_S:g} s; `dfo runs --recheck` looks now)")


def show_nodes(store: Store, name: str, as_json: bool) -> None:
    """`dfo runs NAME` of a multi-node run: its nodes' rows and the run's verdict in one line."""
    from ..multinode import summary

    nodes = [store.get_run(node) for node in store.nodes_of(name)]
    if as_json:
        print_json({"run": name, "nodes": [node.as_dict() for node in nodes], "summary": summary(store, name)})
        return
    console.print(runs_table(nodes, console.width))
    console.print(summary(store, name), highlight=False, markup=False, soft_wrap=True)


def why_not_started(store: Store, run: Run) -> str | None:
    """Why the launch of a `failed` run started nothing (its last launch_failed event); None for any other run."""
    failed = store.events(run.name, kind="launch_failed") if run.state == RunState.FAILED else []
    return (failed[-1]["data"] or {}).get("error") if failed else None


LOST_WITHOUT_EXIT = ("its process is gone and wrote no exit status: killed by SIGKILL or the kernel's OOM killer, "
                     "or its container restarted; its log's last lines may say more (`dfo logs {name}`)")


def why_lost(store: Store, run: Run) -> str | None:
    """Why a `lost` run is lost, from its record: its process ended without an exit status (its `ended` event's
    why); None for any other run."""
    if run.state != RunState.LOST:
        return None
    ended = [event for event in store.events(run.name, kind="ended") if (event["data"] or {}).get("state") == "lost"]
    found = (ended[-1]["data"] or {}).get("why") if ended else None
    return LOST_WITHOUT_EXIT.format(name=run.name) + (f" (recorded: {found})" if found else "")


def looked_for_until(run: Run, grace_s: float) -> str | None:
    """Until when an unconfirmed start is looked for before it is marked failed (RFC 3339 UTC text): its
    watch.start_grace_s counted from when dfo gave up on its answer (its ended_at); None for any other run."""
    if not runs_lib.start_unseen(run) or not run.ended_at:
        return None
    return format_ts(datetime.fromisoformat(run.ended_at).timestamp() + grace_s)


def why_unconfirmed(store: Store, run: Run, grace_s: float, now: datetime | None = None) -> str | None:
    """What an `unconfirmed` run's start is (`dfo runs NAME`'s `start:` line): it got no answer (the launch's
    error), until when it is looked for (looked_for_until) and what then; None for any other run."""
    if not runs_lib.start_unseen(run):
        return None
    failed = store.events(run.name, kind="launch_failed")
    error = (failed[-1]["data"] or {}).get("error") if failed else None
    said = f"unconfirmed: it got no answer{f' ({error})' if error else ''}, so the run may be going"
    until = looked_for_until(run, grace_s)
    if until is None:
        return f"{said}: `dfo runs {run.name} --recheck` looks for it by its exit file"
    now = now or datetime.now().astimezone()
    when = _local_time(until, now, seconds=True)
    grace = f"watch.start_grace_s, {grace_s:g} s after dfo gave up on the answer"
    if datetime.fromisoformat(until) > now:
        return (f"{said}: looked for by its exit file until {when} ({grace}), adopted if it shows, then marked "
                f"failed; `dfo runs {run.name} --recheck` looks now")
    return (f"{said}: its grace to show ended at {when} ({grace}); the next look marks it failed unless it "
            f"shows (`dfo runs {run.name} --recheck` looks now)")


def _start_grace_s(run: Run, given: Optional[Path]) -> float:
    """The run's inventory's watch.start_grace_s (the built-in default when that inventory cannot be read)."""
    from ..chains import inventory_for
    from ..inventory import START_GRACE_S

    if not runs_lib.start_unseen(run):
        return START_GRACE_S
    try:
        return inventory_for(run, given)[0].watch.start_grace_s
    except DfoError:
        return START_GRACE_S


def show_run(name: str, as_json: bool, inventory: Optional[Path] = None) -> None:
    """`dfo runs NAME`: one run's record, its verdict and where its W&B run is (URL, or offline directory)."""
    with Store() as store:
        run = store.get_run(name)
        wandb = store.events(name, kind="wandb")
        not_started = why_not_started(store, run)
        lost = why_lost(store, run)
        grace_s = _start_grace_s(run, inventory)
        unconfirmed = why_unconfirmed(store, run, grace_s)
    where = (wandb[-1]["data"] or {}) if wandb else {}
    if as_json:
        print_json({**run.as_dict(), "wandb": where or None, "launch_failed": not_started, "lost_why": lost,
                    "unconfirmed_why": unconfirmed, "looked_for_until": looked_for_until(run, grace_s)})
        return
    decision, unreadable = read_stored(run.decision)
    verdict = str(decision.decision) if decision else ""
    if decision and decision.steady_tok_s is not None:
        verdict += f", {decision.steady_tok_s:,.0f} tok/s"
    rows = [("run", run.name), ("target", run.target), ("variant", run.variant or ""),
            ("state", run.state + (f" (exit code {run.exit_code})" if run.exit_code is not None else "")),
            ("started", run.started_at or ""), ("ended", run.ended_at if run.ended_at and not unconfirmed else ""),
            ("PID", _text(run.pid)),
            ("checked", f"{run.checked_at} (its target did not answer; `dfo runs {run.name} --recheck` looks again)"
                        if runs_lib.start_unsettled(run) and run.checked_at else ""),
            ("log", run.log_path or ""), ("batch", run.batch or ""), ("after", run.parent or ""),
            ("decision", verdict), ("why", (decision.reason if decision else "") or not_started or ""),
            ("lost", lost or ""), ("start", unconfirmed or ""),
            ("registry", f"unreadable: {'; '.join(filter(None, (run.unreadable, unreadable)))} (shown as empty)"
                         if run.unreadable or unreadable else ""),
            *(("shift", LevelShift.describe(shift)) for shift in (decision.level_shifts if decision else ())),
            ("W&B", where.get("url") or (f"offline: {where['dir']} (upload: wandb sync {where['dir']})" if where.get("dir")
                                          else ""))]
    for key, value in rows:
        if value:
            console.print(f"{key + ':':10}{value}", highlight=False, markup=False, soft_wrap=True)


def _refresh(store: Store, runs: list[Run], given: Optional[Path], recheck: bool = False,
             history_of: Optional[list[Run]] = None) -> None:
    """One look at each target holding an active run, all at once, with the inventory each run came from, and
    their stored history brought up to their logs' end (history.sync_runs); a target that cannot be looked at
    is named, its runs shown as last recorded."""
    from ..history import sync_runs

    problems = sync_runs(store, runs, given, recheck=recheck, history_of=history_of)
    for target, why in problems.items():
        _warn(f"note: could not look at {target} ({why}); its runs show their last recorded state")
    for run in filter(runs_lib.may_start_late, runs):  # marked failed, yet its run came up after all: said loudly
        now = store.get_run(run.name)
        if now.state != RunState.FAILED:
            _warn(f"note: {run.name} was marked failed (nothing of it showed within watch.start_grace_s) but its run "
                  f"started after all: now {now.state}" + (f", PID {now.pid}; `dfo stop {run.name}` stops it"
                                                            if now.active else f", exit code {_text(now.exit_code)}"))


RUN_COLUMNS = ("name", "target", "PID", "state", "start", "took", "tok/s", "decision", "variant")
DROPPED_FIRST = ("variant", "took", "start", "tok/s", "decision")
"""Columns given up, in this order, when the table is wider than the terminal (the caption names them): names are
never wrapped, and target and PID are never given up (a target too long for the width folds onto a second line)."""
FOLDED = ("name", "target")


def runs_table(runs: list[Run], width: int, now: datetime | None = None) -> Table:
    """The `dfo runs` table, fitted into `width` columns by leaving out the least useful columns first; before the
    start time is given up it is shortened to its date alone (`11-29`), or its time for a run of today."""
    now = now or datetime.now().astimezone()
    for short in (False, True):
        rows = [_run_row(run, now, short=short) for run in runs]
        hidden: list[str] = []

        def build(shown: list[str], left_out: list[str], rows=rows) -> Table:
            hidden[:] = left_out
            return _table(shown, rows, left_out)
        table = fit_table(RUN_COLUMNS, build, width, DROPPED_FIRST)
        if "start" not in hidden:
            break
    return table


def state_text(run: Run) -> str:
    """`running`, `crashed 1`, `stopped 143`: the state with the exit status when it is news (`dfo runs`, `dfo ui`)."""
    return run.state if run.exit_code is None or run.state == "exited" else f"{run.state} {run.exit_code}"


def _run_row(run: Run, now: datetime, *, short: bool = False) -> dict[str, str]:
    from ..view import duration

    state = state_text(run)
    if runs_lib.start_unsettled(run) and run.checked_at:  # looked for at a target that did not answer
        state += f", checked {_local_time(run.checked_at, now, seconds=True)}"
    decision, unreadable = read_stored(run.decision)
    return {"name": run.name, "target": run.target, "variant": run.variant or "", "state": state,
            "start": _local_time(run.started_at, now, short=short), "PID": _text(run.pid),
            "took": duration(_took_s(run, now)) if run.started_at and (run.ended_at or run.active) else "",
            "tok/s": number(decision.steady_tok_s if decision and not run.unreadable else None),
            "decision": "(unreadable)" if run.unreadable or unreadable else str(decision.decision) if decision else ""}


def _took_s(run: Run, now: datetime) -> float:
    """How long the run ran: start to end, or to now while it is active."""
    end = datetime.fromisoformat(run.ended_at) if run.ended_at else now
    return (end - datetime.fromisoformat(run.started_at)).total_seconds()


def check_state(text: str) -> str:
    """A `--state` value, or a UsageError naming the valid ones (and the closest)."""
    import difflib

    known = [str(state) for state in RunState]
    if text in known:
        return text
    close = difflib.get_close_matches(text, known, n=1, cutoff=0.5)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    raise UsageError(f"--state: unknown state {text!r}{guess}; states: {', '.join(known)}")


AGE_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def since_utc(text: str, now: datetime | None = None, option: str = "--since") -> str:
    """`--since WHEN` as the registry's RFC 3339 UTC text: an age (`30m`, `2h`, `3d`, `1w`) before `now`, or an
    ISO date or date-time (local time unless it names its zone); a UsageError saying both forms otherwise."""
    import re
    from datetime import timedelta, timezone

    now = now or datetime.now().astimezone()
    age = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if age:
        when = now - timedelta(seconds=float(age[1]) * AGE_UNITS_S[age[2]])
    else:
        try:
            when = datetime.fromisoformat(text.strip())
        except ValueError:
            raise UsageError(f"{option}: expected an age (30m, 2h, 3d, 1w) or an ISO date (2026-11-29, "
                             f"2026-11-29T11:40), got {text!r}") from None
        when = when if when.tzinfo else when.replace(tzinfo=now.tzinfo)
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _local_time(utc_text: str | None, now: datetime, *, seconds: bool = False, short: bool = False) -> str:
    """`HH:MM` (`HH:MM:SS` with `seconds`) in the workstation's time zone for a time of today, else `mm-dd HH:MM`
    (`short`: `mm-dd` alone)."""
    if not utc_text:
        return ""
    local = datetime.fromisoformat(utc_text).astimezone(now.tzinfo)
    if local.date() != now.date():
        return f"{local:%m-%d}" if short else f"{local:%m-%d %H:%M}"
    return f"{local:%H:%M:%S}" if seconds else f"{local:%H:%M}"


def _table(columns: list[str], rows: list[dict[str, str]], hidden: list[str] = ()) -> Table:
    caption = f"not shown for lack of width: {', '.join(hidden)} (see dfo runs --json)" if hidden else None
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), caption=caption,
                  caption_justify="left")
    for column in columns:  # only a name or target too long for even the narrowest table is folded (never cut short)
        table.add_column(column, no_wrap=column not in FOLDED, overflow="fold" if column in FOLDED else "ellipsis",
                         justify="right" if column in ("PID", "took", "tok/s") else "left")
    for row in rows:
        table.add_row(*(Text(row[column]) for column in columns))
    return table


GraceOpt = typer.Option(None, "--grace", min=0, metavar="S",
                        help="With --force: seconds between SIGTERM and SIGKILL (default: as dfo stop).")


def rm_command(
    names: list[str] = typer.Argument(..., metavar="NAME", autocompletion=complete_runs,
                                      help="Runs to remove (a multi-node run with all its nodes)."),
    force: bool = typer.Option(False, "--force", help="Stop a run that may still be going first (identity-checked, as "
                                                      "dfo stop), then remove it."),
    grace: Optional[float] = GraceOpt,
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = JsonOpt,
) -> None:
    with Store() as store:
        names = list(dict.fromkeys(names))
        check_known(store, names)  # before anything is removed
        going = [name for name in names if _may_be_going(store, name)]
        if going and not force:
            raise RefusedError(f"{', '.join(going)} may still be running; nothing removed",
                               hint=f"`dfo stop {' '.join(going)}` first, or --force stops and removes "
                                    f"{'it' if len(going) == 1 else 'them'}")
        raise typer.Exit(_remove(store, names, going, grace, inventory, as_json))


def prune_command(
    older_than: str = typer.Option("7d", "--older-than", metavar="AGE",
                                   help="Remove runs that ended (or, never ended, started) more than AGE ago: 30m, 12h, "
                                        "7d, 2w, or before an ISO date (2026-11-29)."),
    force: bool = typer.Option(False, "--force", help="Stop such runs that may still be going first (identity-checked, "
                                                      "as dfo stop), then remove them; without it they are kept."),
    grace: Optional[float] = GraceOpt,
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = JsonOpt,
) -> None:
    cutoff = datetime.fromisoformat(since_utc(older_than, option="--older-than"))
    with Store() as store:
        old = [run.name for run in store.list_runs() if (when := _last_seen(store, run)) and when < cutoff]
        names = list(dict.fromkeys((group[0] if (group := store.node_group(name)) and
                                    set(store.nodes_of(group[0])) <= set(old) else name) for name in old))
        going = [name for name in names if _may_be_going(store, name)]
        kept = [] if force else going
        if kept:
            _warn(f"kept {counted(len(kept), 'run')} that may still be running ({', '.join(kept)}): "
                  f"`dfo stop` {'it' if len(kept) == 1 else 'them'} first, or --force stops and removes "
                  f"{'it' if len(kept) == 1 else 'them'}")
        chosen = [name for name in names if name not in kept]
        if not chosen and not as_json:
            console.print(f"no runs older than {older_than} to remove (registry: {store.path})", highlight=False,
                          markup=False)
            return
        raise typer.Exit(_remove(store, chosen, [] if kept else going, grace, inventory, as_json, kept=kept,
                                 why=f" older than {older_than}"))


def _may_be_going(store: Store, name: str) -> bool:
    """Whether the registry may be behind a run (or a node of it) that is still going: active, or its start never
    seen answered (runs.needs_look)."""
    return any(runs_lib.needs_look(store.get_run(node)) for node in store.nodes_of(name) or [name])


def _last_seen(store: Store, run: Run) -> datetime | None:
    """When a run was last known to be going: its end, else its start, else its first event (a launch that never
    started); None when the registry holds none of them."""
    events = store.events(run.name)
    when = run.ended_at or run.started_at or (events[0]["at"] if events else None)
    return datetime.fromisoformat(when).astimezone() if when else None


def _remove(store: Store, names: list[str], going: list[str], grace: Optional[float], inventory: Optional[Path],
            as_json: bool, *, kept: Sequence[str] = (), why: str = "") -> int:
    """Stop the runs of `going` (each identity-checked, as dfo stop), then remove those that stopped and the rest
    of `names`; one line says what was removed. 1 when a stop failed (that run stays)."""
    failed: dict[str, str] = {}
    for name in going:
        try:
            outcome = _stop_one(store, name, grace, inventory)
        except DfoError as exc:
            failed[name] = str(exc)
            _warn(f"{name}: not stopped, not removed: {exc}")
            continue
        for line in () if as_json else outcome.lines:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    chosen = [name for name in names if name not in failed]
    nodes = [node for name in chosen for node in store.nodes_of(name)]
    store.forget_runs(chosen + nodes)
    if as_json:
        print_json({"removed": chosen, "stopped": [name for name in going if name not in failed], "kept": list(kept),
                    "not_removed": [{"run": name, "error": error} for name, error in failed.items()]})
    elif chosen:
        console.print(f"removed {counted(len(chosen), 'run')}{why}: {', '.join(chosen)} "
                      f"(registry: {store.path}; their logs stay on their targets)", highlight=False, markup=False,
                      soft_wrap=True)
    return 1 if failed else 0


def _warn(text: str) -> None:
    err_console.print(text, highlight=False, soft_wrap=True, markup=False)


def _text(value: object) -> str:
    return "" if value is None else str(value)


def logs_command(
    name: str = typer.Argument(..., help="Run name (see `dfo runs`).", metavar="NAME", autocompletion=complete_runs),
    lines: int = typer.Option(80, "-n", "--lines", metavar="N", min=0, max=runs_lib.MAX_LOG_LINES,
                              help=f"How many lines of the tail to show (0 to {runs_lib.MAX_LOG_LINES:,})."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines until the run ends or Ctrl-C (the run goes on)."),
    exit_status: bool = typer.Option(False, "--exit-status", help="With -f: exit with the run's own exit status once it ends."),
    inventory: Optional[Path] = InventoryOpt,
) -> None:
    with Store() as store:
        run = store.get_run(name)
        inv = _inventory_of(run, inventory)
        with Connections(inv) as connections:
            target = connections.container(run.target)
            if not follow:
                sys.stdout.write(_for_stdout(runs_lib.log_tail(target, run, lines)))
                return
            ended = _follow(target, store, run, lines)
    if exit_status and ended is not None:
        raise typer.Exit(ended.exit_code if ended.exit_code is not None else 1)


def _inventory_of(run: Run, given: Optional[Path]):
    """The inventory `run` was launched from (unless -i says otherwise), saying so when that file changed."""
    from ..chains import inventory_for

    inv, note = inventory_for(run, given)
    if note:
        _warn(note)
    return inv


def _for_stdout(text: str) -> str:
    """The log as written when stdout is a file or pipe; on a terminal, its control characters made visible
    (a log line must not clear the screen or write the clipboard: docs/security.md)."""
    return visible(text, keep_newlines=True) if sys.stdout.isatty() else text


def _follow(target, store: Store, run: Run, lines: int) -> Run | None:
    """Print the log as it grows until the run ends; returns the run as recorded then (None: Ctrl-C)."""
    chunks = runs_lib.follow_log(target, run, lines)
    decode = codecs.getincrementaldecoder("utf-8")("replace")  # a chunk may end inside a character
    try:
        for chunk in chunks:
            if sys.stdout.isatty():
                sys.stdout.write(_for_stdout(decode.decode(chunk)))
                sys.stdout.flush()
            else:
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
    except KeyboardInterrupt:
        _warn(f"stopped following; {run.name} goes on")
        return None
    finally:
        chunks.close()
    try:
        [looked] = runs_lib.look(target, store, [run]) or [run]
    except DfoError:
        looked = run
    if not looked.active:
        return looked
    # the remote `tail -F` never ends by itself: the connection dropped or someone ended the tail
    raise RemoteError(f"following {run.log_path} ended unexpectedly; {run.name} is not affected", where=run.target,
                      hint=f"run `dfo logs {run.name} -f` again")


def stop_command(
    names: Optional[list[str]] = typer.Argument(None, help="Run names (see `dfo runs --active`); several are stopped one "
                                                           "after the other.", metavar="NAME",
                                                autocompletion=complete_runs),
    all_runs: bool = typer.Option(False, "--all", help="Stop every active (launching/running) run of this registry."),
    grace: Optional[float] = typer.Option(
        None, "--grace", min=0, metavar="S",
        help="Seconds between SIGTERM and SIGKILL. Default: the run's variant's `stop_grace_s`, else 90 s, above the "
             "built-in trainer's own bound on writing its checkpoint after a SIGTERM (docs/inventory.md). While it "
             "waits, stop says so every 10 s; Ctrl-C then leaves the run running (no SIGKILL follows)."),
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = JsonOpt,
) -> None:
    names = list(dict.fromkeys(names or ()))  # a name given twice is stopped once
    if all_runs and names:
        raise UsageError("give run names or --all, not both")
    if not all_runs and not names:
        raise UsageError("name the runs to stop (see `dfo runs --active`), or give --all")
    try:
        raise typer.Exit(_stop_command(names, all_runs, grace, inventory, as_json))
    except runs_lib.StopInterrupted:  # said on stderr by the stop it interrupted
        raise typer.Exit(130) from None


def _stop_command(names: list[str], all_runs: bool, grace: Optional[float], inventory: Optional[Path],
                  as_json: bool) -> int:
    with Store() as store:
        if not all_runs and len(names) == 1:  # one run: its own output, its error as the command's
            outcome = _stop_one(store, names[0], grace, inventory)
            if as_json:
                print_json(outcome.json)
            for line in () if as_json else outcome.lines:
                console.print(line, highlight=False, markup=False, soft_wrap=True)
            return 0
        if all_runs:
            names = active_run_names(store)
            if not names:
                if as_json:
                    print_json([])
                else:
                    console.print(f"no active runs to stop (registry: {store.path})", highlight=False, markup=False)
                return 0
            _warn(f"stopping {counted(len(names), 'active run')} of {store.path}"
                  + f": {', '.join(names)}")
        check_known(store, names)  # before anything is stopped
        return _stop_many(store, names, grace, inventory, as_json)


def check_known(store: Store, names: Sequence[str]) -> None:
    """UnknownRun (with its did-you-mean) for the first name that is neither a run nor a multi-node run."""
    for name in names:
        store.nodes_of(name) or store.get_run(name)


def active_run_names(store: Store) -> list[str]:
    """The registry's active (launching/running) runs, oldest first, a multi-node run once by its own name."""
    names = []
    for run in store.list_runs(active=True):
        group = store.node_group(run.name)
        names.append(group[0] if group else run.name)
    return list(dict.fromkeys(names))


def _stop_many(store: Store, names: list[str], grace: Optional[float], inventory: Optional[Path], as_json: bool) -> int:
    """`dfo stop A B`, `dfo stop --all`: each run stopped in turn, identity-checked as one is, a line each (a
    run that could not be stopped says why and the next is stopped all the same); 1 when any failed."""
    results, failed = [], 0
    for done, name in enumerate(names):
        try:
            outcome = _stop_one(store, name, grace, inventory)
        except runs_lib.StopInterrupted:
            if names[done + 1:]:
                _warn(f"not stopped: {', '.join(names[done + 1:])}")
            raise
        except DfoError as exc:
            failed += 1
            results.append({"run": name, "error": str(exc)})
            if not as_json:
                _warn(f"{name}: not stopped: {exc}")
            continue
        results.append(outcome.json)
        for line in () if as_json else outcome.lines:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    if as_json:
        print_json(results)
    elif len(names) > 1 or failed:
        _warn(f"{len(names) - failed} of {counted(len(names), 'run')} stopped or already ended"
              + (f"; {failed} not stopped" if failed else ""))
    return 1 if failed else 0


@dataclass(frozen=True)
class StopOutcome:
    """What `dfo stop` says of one run: its --json object and its lines of text."""

    json: dict
    lines: list[str]


def _stop_one(store: Store, name: str, grace: Optional[float], inventory: Optional[Path]) -> StopOutcome:
    """Stop one run (a multi-node one on every node); a DfoError says why it could not be; Ctrl-C: StopInterrupted
    after its line on stderr (exit 130)."""
    if store.nodes_of(name):
        return _stop_nodes(store, name, grace, inventory)
    run = store.get_run(name)
    inv = _inventory_of(run, inventory)
    stopped = None
    with Connections(inv) as connections:
        target = connections.container(run.target)
        if runs_lib.worth_a_look(run) and run.pid is None:  # a launch a dfo did not finish recording, or a
            run = _look_for_start(target, store, run, inv.watch.start_grace_s)  # start never seen answered
            stopped = None if run.active else runs_lib.Stopped(run, None)  # it ended, or never started
        try:
            stopped = stopped or runs_lib.stop(target, store, name, grace_s=_grace(inv, run, grace),
                                               python=inv.target(run.target).python, on_wait=say_waiting())
        except runs_lib.StopInterrupted as interrupted:
            _warn(str(interrupted))
            raise
    not_started = why_not_started(store, stopped.run)
    run = stopped.run
    as_json = {"run": run.name, "state": run.state, "exit_code": run.exit_code, "signal": stopped.signal,
               **({"launch_failed": not_started} if not_started else {})}
    if not_started:
        line = f"{run.name} never started ({not_started}); nothing to stop"
    elif stopped.signal is None:
        line = f"{run.name} had already ended: {run.state}, exit code {_text(run.exit_code) or 'unknown'}"
    else:
        line = f"stopped {run.name} (SIG{stopped.signal}): exit code {_text(run.exit_code) or 'none (killed)'}"
    return StopOutcome(as_json, [line])


def _grace(inv, run: Run, grace: Optional[float]) -> float:
    """`--grace`, else the run's variant's stop grace (inventory.stop_grace)."""
    return grace if grace is not None else inv.stop_grace(run.variant)


def _look_for_start(target, store: Store, run: Run, grace_s: float) -> Run:
    """A run whose start got no answer (or whose launch a dfo did not finish recording), as its target shows it:
    one just launched may still be coming up, so it is waited for (runs.resolve_launch) until it shows or its
    start grace is over, and the wait is said first."""
    left = runs_lib.start_grace_left(run, grace_s)
    if left > 0:
        _warn(f"{run.name}: its start got no answer; looking for it for up to {left:.0f} s (watch.start_grace_s) "
              "before stopping it")
    return runs_lib.resolve_launch(target, store, run, grace_s=grace_s)


def _stop_nodes(store: Store, name: str, grace: Optional[float], inventory: Optional[Path]) -> StopOutcome:
    from ..multinode import stop_nodes

    nodes = store.nodes_of(name)
    inv = _inventory_of(store.get_run(nodes[0]), inventory)
    with Connections(inv) as connections:
        for node in map(store.get_run, nodes):  # a node whose start got no answer may be coming up: waited for
            if runs_lib.worth_a_look(node) and node.pid is None:
                try:
                    _look_for_start(connections.container(node.target), store, node, inv.watch.start_grace_s)
                except DfoError as exc:  # out of reach: it stays `unconfirmed`, the other nodes are stopped all the same
                    _warn(f"{node.name}: not looked for ({exc}); `dfo runs {name}` looks again later")
        try:
            stopped = stop_nodes(store, name, connections.container, grace_s=_grace(inv, store.get_run(nodes[0]), grace),
                                 python_of=lambda target: inv.target(target).python, on_wait=say_waiting())
        except runs_lib.StopInterrupted as interrupted:
            _warn(str(interrupted))
            raise
    runs = [store.get_run(node) for node in nodes]
    as_json = {"run": name, "nodes": [{"run": r.name, "state": r.state, "exit_code": r.exit_code} for r in runs],
               "signals": [s.signal for s in stopped]}
    lines = [] if stopped else [f"{name} had already ended on every node"]
    lines += [f"{run.name} ({run.target}): {run.state}, exit code {_text(run.exit_code) or 'none'}" for run in runs]
    return StopOutcome(as_json, lines)


def resume_command(
    name: str = typer.Argument(..., metavar="NAME", help="The stopped or crashed run (see `dfo runs`)."),
    watch: bool = typer.Option(False, "--watch", help="Go straight into `dfo watch` of the resumed run."),
    force: bool = typer.Option(False, "--force", help="Resume even though the trainer package changed since the run."),
    inventory: Optional[Path] = InventoryOpt,
    as_json: bool = JsonOpt,
) -> None:
    from .. import multinode
    from ..chains import resume

    with Store() as store:
        nodes = store.nodes_of(name)  # a multi-node run: every node from its own checkpoint
        inv = _inventory_of(store.get_run(nodes[0] if nodes else name), inventory)
        with Connections(inv) as connections:
            if nodes:
                group = multinode.resume(inv, connections, store, name, force=force)
                new, where, started, one = group.name, f"{len(group.nodes)} nodes", [n.run for n in group.nodes], None
            else:
                one = resume(inv, connections, store, name, force=force).run
                new, where, started = one.name, f"{markup(one.target)} (PID {one.pid})", [one]
    if as_json:
        print_json(ResumeAnswer(at=utc_now(), run=new, resumed_from=name, target=one and one.target, pid=one and one.pid,
                                log=one and one.log_path, nodes=[{"run": r.name, "target": r.target, "pid": r.pid,
                                                                  "log": r.log_path} for r in started],
                                next=f"dfo watch {new}").to_json())
    else:
        console.print(f"resumed {markup(name)} as [bold]{markup(new)}[/] on {where}", highlight=False)
        console.print(f"  next: dfo watch {markup(new)}", highlight=False)
    if watch:
        from .watch import watch_runs

        raise typer.Exit(watch_runs(inv, [new], as_json=as_json))
