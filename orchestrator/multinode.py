"""Multi-node runs: one built-in-trainer run over several targets, launched, stopped and judged as one.

`dfo launch --host A --host B --variant V` makes run NAME of nodes NAME.node0 (on A) and NAME.node1 (on B).
Each node is a `runs` row of its own (its log NAME.nodeK.log, exit file, PID and identity, so stop, look and
watch work on it unchanged); the store's run_nodes table ties them to NAME. The order is what makes a
refusal leave nothing behind anywhere:
  1. one call to the first target: its address (`hostname -I`, unless --master-addr) and whether the
     rendezvous port is free there;
  2. every node prepared (runs.prepare: registry row, preflight and probe in the launch call, which then
     waits for dfo's word): one refusal cancels the calls already open, and nothing has started;
  3. the nodes recorded as one run, then every node started (a start that fails stops those started; from
     here on no node's row is forgotten: one not started stays `failed`, saying why). A start that got no
     answer is left `unconfirmed` for the next look, as a single run's is, and the later nodes are started.
The trainers meet on torch.distributed's TCPStore at the first target (trainer/procsplit.py). A node run
never falls back on its own (its chain is empty): a crash anywhere is the run's, and decide/nodes.py names
the node that failed first. group_fallback() is the group's combined decision, which the watch's lifecycle
(lifecycle.Lifecycle.judged) asks while the watch goes on, once every node has a verdict; fall_back(), which
its executor runs, relaunches all nodes with the next variant of the inventory's fallback chain that the
first failure's signature allows (`NAME.<n>-<variant>`, each node the child of its predecessor on the same
target); finish_fallback() carries out a recorded one, which the same executor also runs for a fallback a dfo
that died left open (Lifecycle.finish_open_intents). This module does not judge runs, decides nothing by itself
and holds no SQL.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Callable, Mapping, Sequence

from . import faults
from . import runs as runs_lib
from .chains import (
    MULTINODE_FALLBACK, RELEASE_CHECKS, WATCH_POLICY, Left, NoFreeName, Policy, Refusals, StartUnseen,
    carry_checkpoint, carry_out_fallback, catalogue_for, chain_name, check_resumable, first_launch, gpus_used,
    next_variant_after, record_fallback, successor_name, until_released,
)
from .decide import read_stored
from .decide.policy import rest_of_chain
from .decide.nodes import NodeOutcome, describe, first_failure
from .errors import DfoError, RefusedError, RemoteError, UsageError
from .events import FellBack, Resumed, record
from .launchplan import Gate, one_turn_per_connection
from .package import Package, build_package, parse_probe
from .remote.base import Target
from .report import UNREADABLE
from .store import Run, Store, utc_now

RENDEZVOUS_TIMEOUT = 30.0


class PortTaken(RefusedError):
    """The rendezvous port is in use on the first target."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes meet: the first target's address as the others reach it, and a port free there."""

    addr: str
    port: int

    def __str__(self) -> str:
        return f"{self.addr}:{self.port}"


@dataclass(frozen=True)
class MultiLaunched:
    name: str
    rendezvous: Rendezvous
    nodes: tuple[runs_lib.Launched, ...]


def node_name(run: str, rank: int) -> str:
    return f"{run}.node{rank}"


def rendezvous_script(python: str, port: int) -> str:
    """Print `addrs=` (the target's addresses) and `port=free|taken` (a bind on every interface)."""
    check = ("import socket, sys\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
             "try:\n    s.bind(('', int(sys.argv[1])))\nexcept OSError:\n    print('port=taken')\n"
             "else:\n    print('port=free')")
    return ("addrs=$(hostname -I 2>/dev/null) || addrs=$(ip -4 -o addr show scope global 2>/dev/null | "
            "awk '{sub(\"/.*\", \"\", $4); print $4}' | tr '\\n' ' ')\n"
            'echo "addrs=$addrs"\n'
            f"{shlex.quote(python)} -c {shlex.quote(check)} {int(port)}\n")


def pick_address(addrs: str) -> str | None:
    """The first IPv4 address that is not loopback (else the first other address), from `hostname -I`."""
    parsed = []
    for word in addrs.split():
        try:
            parsed.append(ipaddress.ip_address(word))
        except ValueError:
            continue
    usable = [a for a in parsed if not a.is_loopback and not a.is_link_local]
    ordered = [a for a in usable if a.version == 4] + [a for a in usable if a.version == 6]
    return str(ordered[0]) if ordered else None


def find_rendezvous(target: Target, spec: runs_lib.RunSpec, port: int, addr: str | None) -> Rendezvous:
    """One call to the first target: refuses a taken port; the address is `addr` or the target's own."""
    result = target.run(rendezvous_script(spec.python, port), timeout=RENDEZVOUS_TIMEOUT)
    info = parse_probe(result.stdout)
    if info.get("port") == "taken":
        raise PortTaken(f"rendezvous port {port} is already taken on {spec.target}; nothing was started",
                           hint="pass --master-port with a free port (or set master_port: in the variant)")
    if info.get("port") != "free":
        raise RemoteError(f"cannot check rendezvous port {port} on {spec.target}: {result.tail(2) or 'no answer'}",
                          where=spec.target, hint=f"check that {spec.python} runs there")
    addr = addr or pick_address(info.get("addrs", ""))
    if not addr:
        raise RefusedError(f"cannot tell {spec.target}'s address (hostname -I printed {info.get('addrs', '')!r})",
                           hint="pass --master-addr with the address the other nodes reach it at")
    return Rendezvous(addr, port)


def node_spec(spec: runs_lib.RunSpec, rank: int, nnodes: int, rendezvous: Rendezvous) -> runs_lib.RunSpec:
    """The node's spec: the trainer's node flags added, and no fallback of its own."""
    args = {**spec.args, "nnodes": nnodes, "node_rank": rank, "master_addr": rendezvous.addr,
            "master_port": rendezvous.port}
    return replace(spec, args=args, chain=())


HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def check_master_addr(addr: str | None) -> None:
    """--master-addr must be an IP address or a DNS host name (it reaches every node's command line)."""
    if addr is None:
        return
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        if not HOSTNAME_RE.fullmatch(addr):
            raise UsageError(f"--master-addr {addr!r}: expected an IP address or a host name (letters, digits, "
                             "'-' and '.'), the address the other nodes reach the first one at") from None


def check_specs(specs: Sequence[runs_lib.RunSpec], variant, hosts: Sequence[str], master_addr: str | None = None) -> None:
    """Refuse what cannot be a multi-node run, before any connection."""
    check_master_addr(master_addr)
    if len(set(hosts)) != len(hosts):
        raise UsageError(f"--host {', '.join(hosts)}: a target may be one node only")
    if variant.command is not None or variant.topology != "procsplit":
        raise UsageError(f"variant {specs[0].variant!r} cannot run on {len(hosts)} nodes: multi-node runs need a "
                         "built-in trainer variant with topology: procsplit")
    if variant.nodes not in (1, len(hosts)):
        raise UsageError(f"variant {specs[0].variant!r} asks for {variant.nodes} nodes, got {len(hosts)} --host")


def free_name(store: Store, variant: str, nnodes: int, name: str | None, now: datetime | None) -> str:
    """`name` if neither it nor a node name of it is taken (else RefusedError), or the first free default."""
    def taken(candidate: str) -> bool:
        return bool(store.nodes_of(candidate)) or store.find_run(candidate) is not None or any(
            store.find_run(node_name(candidate, rank)) is not None for rank in range(nnodes))

    if name is not None:
        if taken(name):
            raise RefusedError(f"a run named {name!r} (or one of its nodes) already exists", hint="choose another --name")
        return name
    for candidate in runs_lib.default_names(variant, now):
        if not taken(candidate):
            return candidate
    raise RefusedError(f"no free run name for variant {variant}", hint="pass --name")


def launch_nodes(
    targets: Sequence[Target],
    specs: Sequence[runs_lib.RunSpec],
    store: Store,
    *,
    name: str | None,
    rendezvous: Rendezvous,
    gates: Sequence[Gate | None],
    environ: Mapping[str, str] | None = None,
    package: Package | None = None,
    now: datetime | None = None,
    start_grace_s: float,
    stop_grace_s: float,
) -> MultiLaunched:
    """Prepare every node, then start them all (module docstring); refuses as runs.launch does, naming the node.
    A node whose start got no answer is waited for `start_grace_s` (the inventory's watch.start_grace_s) when a
    later node's start fails and the nodes are stopped (_undo_start), each with `stop_grace_s` between SIGTERM
    and SIGKILL (the variant's, Inventory.stop_grace: a single run's stop rule)."""
    nnodes = len(specs)
    name = free_name(store, specs[0].variant, nnodes, name, now)
    package = package or build_package()
    prepared: list[runs_lib.Prepared] = []
    refusals: list[tuple[str, DfoError]] = []
    try:
        with one_turn_per_connection(targets, [spec.target for spec in specs]):  # nodes of one host: no deadlock
            for rank, (target, spec, gate) in enumerate(zip(targets, specs, gates)):
                try:  # every node is asked, so one answer names every node that refuses
                    prepared.append(runs_lib.prepare(target, node_spec(spec, rank, nnodes, rendezvous), store,
                                                     name=node_name(name, rank), environ=environ, package=package,
                                                     gate=gate))
                except DfoError as exc:
                    refusals.append((spec.target, exc))
        if refusals:
            raise refused_nodes(refusals, nnodes)
        store.add_nodes(name, [p.name for p in prepared], str(rendezvous))
    except BaseException:
        for ready in prepared:
            ready.cancel()
        raise
    faults.pause_at("nodes_recorded")
    launched: list[runs_lib.Launched] = []
    unseen: list[tuple[runs_lib.Prepared, DfoError]] = []
    for index, ready in enumerate(prepared):
        try:
            launched.append(ready.start(recorded=True))
            faults.exit_at(f"node{index}_started", faults.FALLBACK_EXIT_AT)
        except BaseException as exc:
            if isinstance(exc, DfoError) and runs_lib.start_unseen(store.get_run(ready.name)):
                unseen.append((ready, exc))  # it may run all the same: the later nodes are started, the next look settles it
                continue
            _undo_start(prepared, index, store, start_grace_s, stop_grace_s)
            raise
    if unseen:  # `unconfirmed`: a single run's start that got no answer is left the same way
        raise runs_lib.StartsUnseen(name, [(store.get_run(ready.name), exc) for ready, exc in unseen],
                                    [node.run for node in launched], grace_s=start_grace_s)
    return MultiLaunched(name, rendezvous, tuple(launched))


def _undo_start(prepared: Sequence[runs_lib.Prepared], failed: int, store: Store, start_grace_s: float,
                stop_grace_s: float) -> None:
    """Node `failed`'s start failed: the nodes after it are not started (kept `failed`: the run still names
    them), and what runs of those before it is stopped, node 0 first (_stop_if_started)."""
    for later in prepared[failed + 1:]:
        later.cancel(why=f"not started: the start of {prepared[failed].name} before it failed")
    for ready in prepared[:failed + 1]:
        _stop_if_started(ready, store, start_grace_s, stop_grace_s)


def _stop_if_started(ready: runs_lib.Prepared, store: Store, start_grace_s: float, stop_grace_s: float) -> None:
    """Stop node `ready` (`stop_grace_s` between SIGTERM and SIGKILL) if it runs. One whose start got no answer
    (runs.start_unseen) may run all the same: looked for by its exit file path first (runs.resolve_launch,
    through `start_grace_s`); none found, it is marked failed."""
    row = store.find_run(ready.name)
    if row is None:
        return
    if runs_lib.start_unseen(row):
        try:
            row = runs_lib.resolve_launch(ready.target, store, row, grace_s=start_grace_s)
        except DfoError:
            return  # its target went away: the row stays unconfirmed, and `dfo runs` looks again later
    if row.active:
        _stop_quietly(row.name, ready.target, store, ready.spec.python, stop_grace_s)


def refused_nodes(refusals: list[tuple[str, DfoError]], nnodes: int) -> DfoError:
    """One error for the nodes that refused: the only one as it is, several in one line (first one's hint)."""
    if len(refusals) == 1:
        return refusals[0][1]
    what = "; ".join(f"{target}: {exc.message}" for target, exc in refusals)
    return Refusals(f"{len(refusals)} of {nnodes} nodes refused, nothing was started: {what}",
                    [exc for _, exc in refusals], hint=refusals[0][1].hint)


def _stop_quietly(node_run: str, target: Target, store: Store, python: str, grace_s: float) -> None:
    try:
        runs_lib.stop(target, store, node_run, grace_s=grace_s, python=python)
    except DfoError:
        pass  # it ended meanwhile, or its target went away: the registry says which


def stop_nodes(store: Store, run: str, target_of: Callable[[str], Target], *, grace_s: float,
               python_of: Callable[[str], str] | None = None, **options: Any) -> list[runs_lib.Stopped]:
    """Stop every node of `run` that is still active (identity-checked, as runs.stop does, on the python
    `python_of(target)` gives, with its other `options`: on_wait), node 0 first: its SIGTERM alone already makes
    every rank stop at the next logging step."""
    active = [node for node in (store.get_run(name) for name in store.nodes_of(run)) if node.active]
    for node in active:  # asked of all first: a node that ends because node 0 stopped it ended on request
        store.request_stop(node.name)
    stopped, errors = [], []
    for node in active:  # one node out of reach does not keep the others running
        try:
            python = python_of(node.target) if python_of is not None else "python3"
            stopped.append(runs_lib.stop(target_of(node.target), store, node.name, grace_s=grace_s, python=python,
                                         **options))
        except DfoError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return stopped


def outcomes(store: Store, run: str) -> list[NodeOutcome]:
    """Each node's decision from the registry (as the watch left it), read through the one reader of stored
    decisions (decide.read_stored): one it cannot read is `unreadable`, never a guess (no failure, no fallback)."""
    return [node for node, _ in read_nodes(store, run)]


def read_nodes(store: Store, run: str) -> list[tuple[NodeOutcome, str | None]]:
    """node_outcome of each node of `run`, rank by rank."""
    return [node_outcome(rank, store.get_run(name)) for rank, name in enumerate(store.nodes_of(run))]


def node_outcome(rank: int, node: Run) -> tuple[NodeOutcome, str | None]:
    """Node `rank`'s outcome (its stored decision, typed), and why its decision cannot be read (or None)."""
    decision, unreadable = read_stored(node.decision)
    if decision is None:
        return NodeOutcome(rank, node.target, UNREADABLE if unreadable else None, exit_code=node.exit_code), unreadable
    return NodeOutcome(rank, node.target, str(decision.decision), decision.signature, decision.at_ts,
                       node.exit_code), None


def summary(store: Store, run: str) -> str:
    """One line on the whole run (decide/nodes.describe), and why each node whose decision is unreadable is."""
    read = read_nodes(store, run)
    why = [f"node {node.rank} ({node.target}): {UNREADABLE}: {reason}" for node, reason in read if reason]
    return "; ".join([describe(run, [node for node, _ in read]), *why])


def root_of(store: Store, run: str) -> str:
    """The multi-node run a fallback chain started from (`mn` for `mn.3-ps-b`), through node 0's parents."""
    first_node = store.lineage(store.nodes_of(run)[0])[0]
    group = store.node_group(first_node)
    return group[0] if group else run


def group_fallback(inventory, store: Store, run: str, *, policy: Policy = WATCH_POLICY) -> dict | None:
    """The group's combined decision: the fallback multi-node `run` calls for, as its intent's data (`run`,
    `variant`, `first_failed`, `rest`, `reason`), or None. Its first failure (decide/nodes.first_failure over the
    nodes' stored decisions) must fall back (`policy`: the watch's lifecycle's) and the chain must have a next
    variant that can span nodes and that the failure's signature allows. No I/O but the registry's reads."""
    culprit = first_failure(outcomes(store, run))
    if culprit is None or not policy.falls_back(culprit.decision):
        return None
    nodes = [store.get_run(name) for name in store.nodes_of(run)]
    chain = [name for name in inventory.fallback
             if inventory.variants[name].topology == "procsplit" and inventory.variants[name].command is None]
    topologies = {name: v.topology for name, v in inventory.variants.items()}
    # the chain here is the multi-node one (procsplit variants), not the node's: only its verdict's signature counts
    variant = next_variant_after(chain, nodes[culprit.rank], None, culprit.signature, catalogue_for(inventory), topologies)
    if variant is None:
        return None
    return {"run": run, "variant": variant, "first_failed": nodes[culprit.rank].name,
            "rest": list(rest_of_chain(chain, variant)), "reason": culprit.decision}


def fall_back(inventory, connections, store: Store, data: dict, *, gpu_release_s: float = 30.0,
              gpu_poll_s: float = 1.0, on_wait: Callable[[runs_lib.StopWait], None] | None = None) -> dict:
    """Carry out the fallback group_fallback decided for multi-node run `data["run"]` (on the watch's executor,
    lifecycle.Lifecycle): record the intent (once: two dfo deciding it share it), then finish it (finish_fallback).
    Returns the closed intent's data; raises DfoError, the intent left open, as finish_fallback does."""
    intent = record_fallback(store, root_of(store, data["run"]), MULTINODE_FALLBACK, data)
    return finish_fallback(inventory, connections, store, intent, gpu_release_s=gpu_release_s, gpu_poll_s=gpu_poll_s,
                           on_wait=on_wait)


def finish_fallback(inventory, connections, store: Store, intent, *, gpu_release_s: float = 30.0,
                    gpu_poll_s: float = 1.0, on_wait: Callable[[runs_lib.StopWait], None] | None = None) -> dict:
    """Carry out a recorded multi-node fallback once (chains.carry_out_fallback, as a single run's): stop what
    still runs of the run, then launch its successor on every node. A successor a dfo that died left fully
    started is adopted; one it left partly started has its started nodes stopped and is launched again as `-2`.
    Returns the intent's data: `next_run` and `nodes`, or `error` when the launch failed (closed: not tried
    again). A stop that fails, or a node's start that got no answer (chains.StartUnseen: the next finish adopts
    the successor if every node runs, else launches `-2`), leaves the intent open for the next watch (DfoError).
    `on_wait` hears each node's stop waiting for it to exit after its SIGTERM (runs.stop)."""
    def python_of(target: str) -> str:
        return inventory.target(target).python

    def stop(data: dict) -> dict:  # the nodes still running when another failed: the variant's grace, as `dfo stop`'s
        stop_nodes(store, data["run"], connections.container, grace_s=stop_grace_of(inventory, store, data["run"]),
                   python_of=python_of, on_wait=on_wait)
        return {}

    def left(name: str) -> Left:  # what a dfo that died launching the successor left under `name`
        if store.nodes_of(name):  # recorded as one run: nodes may have started
            refresh_nodes(connections, store, name)
            if all(runs_lib.started(store.get_run(node)) for node in store.nodes_of(name)):
                return Left.STARTED
            stop_nodes(store, name, connections.container, grace_s=stop_grace_of(inventory, store, name),
                       python_of=python_of, on_wait=on_wait)  # partly started
            return Left.PASSED
        prepared = [row for row in (store.find_run(node_name(name, rank))
                                    for rank in range(len(store.nodes_of(intent.data["run"])))) if row is not None]
        for row in prepared:  # rows never recorded as a run: nothing of them started (marked failed)
            runs_lib.resolve_launch(connections.container(row.target), store, row,
                                    grace_s=inventory.watch.start_grace_s)
        return Left.PASSED if prepared else Left.NOTHING

    def launch(data: dict) -> dict:
        try:
            name, found = successor_name(next_name(store, data["run"], data["variant"]), left, of=data["run"])
        except NoFreeName as exc:
            return {**data, "next_run": None, "nodes": [], "error": str(exc)}
        if found is Left.STARTED:
            return {**data, "name": name, "next_run": name, "nodes": store.nodes_of(name), "error": None}
        store.update_intent(intent.id, {**data, "name": name})  # what a dfo that dies from here on started
        try:
            launched = successor(inventory, connections, store, data["run"], data["variant"], name=name,
                                 gpu_release_s=gpu_release_s, gpu_poll_s=gpu_poll_s)
        except DfoError as exc:  # a node's start got no answer: left open, settled as a single run's (left)
            StartUnseen.raise_if(name, map(store.find_run, store.nodes_of(name)), exc, again=f"dfo watch {data['run']}")
            return {**data, "name": name, "next_run": None, "nodes": [], "error": f"launching {data['variant']} failed: {exc}"}
        fell = FellBack(at=utc_now(), run=data["run"], chain=root_of(store, data["run"]), next_run=launched.name,
                        variant=data["variant"], nodes=[n.run.name for n in launched.nodes],
                        first_failed=data["first_failed"], rest=data["rest"])
        record(store, fell)
        return {**data, "name": name, "next_run": launched.name, "nodes": [n.run.name for n in launched.nodes],
                "error": None}

    return carry_out_fallback(store, intent, stop, launch)


def stop_grace_of(inventory, store: Store, run: str) -> float:
    """How long a stop of multi-node `run`'s nodes waits between SIGTERM and SIGKILL: its variant's `stop_grace_s`,
    else 90 s (Inventory.stop_grace, the rule of `dfo stop` and of a single run's fallback)."""
    return inventory.stop_grace(store.get_run(store.nodes_of(run)[0]).variant)


def refresh_nodes(connections, store: Store, run: str) -> None:
    """Bring `run`'s nodes' rows up to date (a launch a dfo did not finish recording is found or marked failed)."""
    for name in store.nodes_of(run):
        node = store.get_run(name)
        runs_lib.resolve_launch(connections.container(node.target), store, node,
                                grace_s=connections.inventory.watch.start_grace_s)


def next_name(store: Store, run: str, variant: str) -> str:
    """`<root>.<n>-<variant>` for the successor of multi-node `run` (n = its place in the chain; chains.name_tries
    for the names after it)."""
    return chain_name(root_of(store, run), len(store.lineage(store.nodes_of(run)[0])) + 1, variant)


def resume(inventory, connections, store: Store, run: str, *, force: bool = False) -> MultiLaunched:
    """`dfo resume NAME` of a multi-node run: every node checked as chains.resume checks a run, each node's
    checkpoint copied into its successor's directory on its own target, then all nodes launched with
    --resume (the trainer refuses nodes whose checkpoints are at different steps)."""
    nodes = [store.get_run(name) for name in store.nodes_of(run)]
    package = build_package()
    for node in nodes:
        check_resumable(inventory, node, package, force=force)
    launched = successor(inventory, connections, store, run, nodes[0].variant, resume=True, package=package)
    record(store, Resumed(at=utc_now(), run=launched.name, from_run=run))  # the one shape: on the new run
    return launched


def successor(inventory, connections, store: Store, run: str, variant: str, *, resume: bool = False,
              package: Package | None = None, gpu_release_s: float = 0.0, gpu_poll_s: float = 1.0,
              name: str | None = None) -> MultiLaunched:
    """The next run of multi-node `run`'s chain on the same targets and rendezvous: `NAME.<n>-<variant>`, the
    first launch's --set and W&B mode, each node the child of its predecessor; with `resume`, each node's
    checkpoint carried over first. A preflight that only finds the GPUs busy, or the rendezvous port still
    taken (by the nodes just stopped), is retried for `gpu_release_s`."""
    nodes = [store.get_run(name) for name in store.nodes_of(run)]
    name = name or next_name(store, run, variant)
    first = first_launch(store, store.lineage(nodes[0].name)[0])
    specs = [replace(runs_lib.spec_for(inventory, node.target, variant, sets=dict(first.get("sets") or {}),
                                       wandb=first.get("wandb") or "off", parent=node.name, chain=()), resume=resume)
             for node in nodes]
    targets = [connections.container(node.target) for node in nodes]
    if resume:
        for rank, (target, spec, node) in enumerate(zip(targets, specs, nodes)):
            carry_checkpoint(target, spec, node.name, node_name(name, rank))
    addr, _, port = store.node_group(nodes[0].name)[2].rpartition(":")
    # the GPUs each node's predecessor used (its CUDA_VISIBLE_DEVICES at launch), not all of its target's
    gates = [Gate(replace(inventory.target(node.target), gpus=gpus_used(store, inventory, node.name)),
                  judged=RELEASE_CHECKS) for node in nodes]

    def launch() -> MultiLaunched:
        rendezvous = find_rendezvous(targets[0], specs[0], int(port), addr)
        return launch_nodes(targets, specs, store, name=name, rendezvous=rendezvous, gates=gates, package=package,
                            start_grace_s=inventory.watch.start_grace_s, stop_grace_s=inventory.stop_grace(variant))

    # the nodes just stopped may hold their GPUs and the rendezvous port a moment longer
    return until_released(launch, gpu_release_s, gpu_poll_s, also=(PortTaken,))
