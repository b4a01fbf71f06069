"""The one run lifecycle `dfo watch` and `dfo batch` hand their decisions to.

    verdict (decide/) --policy says act--> Supervisor.fall_back(run, variant)
        1. intent recorded in the registry (chain root, run, next name, variant)    <- a dfo that dies from
        2. stop: stop intent on the run, then the identity-checked SIGTERM/SIGKILL      here on leaves an open
        3. wait until the run's GPUs are released (gpu_release_s)                       intent: the next watch
        4. launch the next variant as `<root>.<n>-<variant>` with the first launch's    of the chain finishes
           settings (--set, wandb), env (CUDA_VISIBLE_DEVICES) and GPUs, parent linked  it (never repeats it)
        5. intent closed
    1 is record_fallback (once, however many dfo decide it), 2-5 carry_out_fallback under the intent's own
    lease (one dfo acts, the others wait and follow): a multi-node run's fallback is the same two calls
    claims: one owner per chain (a lease row, renewed); the others observe and show, never store or act

A Policy says what differs between the two callers: `dfo watch` falls back on crash, stall and too slow;
`dfo batch` falls back on crash and stall (too slow is a measurement there) and stops at its stop_when.

This module must not judge runs (decide/ does), render, or parse options. It reaches machines only
through runs.py (launch/stop; the GPU release check goes in the successor's launch command, preflight's
`gpus_idle` judged by a launchplan.Gate).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from . import faults
from .decide import Catalogue, next_variant, rest_of_chain
from .errors import DfoError, RefusedError, UsageError
from . import events as ev
from .events import Resumed, record
from .inventory import Inventory, TargetSpec, chain_problems, load_inventory
from .launchplan import Gate
from .package import build_package
from .preflight import PreflightFailed
from .runs import (LATE_START_S, LAUNCH_MARGIN_S, LOOK_TIMEOUT, STOP_MARGIN_S, Launched, RunSpec,
                   StartsUnseen, StopWait, look, look_due, may_start_late, needs_look, out_dir,
                   process_alive, resolve_launch, spec_for, start_unseen, start_unsettled, started)
from .runs import launch as launch_run
from .runs import stop as stop_run
from .states import RunState, Verdict
from .store import Claim, Intent, Run, Store, utc_now

GPU_RELEASE_S = 30.0  # after a stop, how long the run's GPUs get to go idle before the next run starts
GPU_POLL_S = 1.0
RELEASE_CHECKS = ("nvidia_smi", "gpus_idle")
"""What a successor's launch checks on a target that was in use a moment ago (SSH and container always count)."""
MAX_NAME_TRIES = 5
LEASE_S = 15.0  # a claim not renewed for this long is free: its owner died (kill -9) or hangs
FALLBACK = "fallback"
MULTINODE_FALLBACK = "multinode_fallback"  # subject: the multi-node run a chain started from (multinode.py)
INTENT_WAIT_S = 600.0  # how long a dfo waits for another live one to finish an intent it is carrying out
INTENT_POLL_S = 0.5
WAIT_SLICE_S = 0.2  # how often a wait for work on other threads looks (Ctrl-C is taken between looks: wait_until)


# ---------------------------------------------------------------------------------------------- policy

@dataclass(frozen=True)
class Policy:
    """What a caller of the lifecycle acts on. `falls_back_on`: verdicts answered with the chain's next
    variant (the others are results)."""

    name: str
    falls_back_on: frozenset[Verdict]

    def falls_back(self, verdict: str | None) -> bool:
        return Verdict.of(verdict) in self.falls_back_on


WATCH_POLICY = Policy("watch", frozenset({Verdict.CRASH, Verdict.STALL, Verdict.TOO_SLOW}))
BATCH_POLICY = Policy("batch", frozenset({Verdict.CRASH, Verdict.STALL}))  # too slow: a sweep measures it


# ---------------------------------------------------------------------------------------------- chains

def catalogue_for(inventory: Inventory) -> Catalogue:
    """The crash catalogue: the built-in signatures plus the inventory's `signatures:`."""
    return Catalogue().extended([signature.model_dump() for signature in inventory.signatures])


def chain_variants(store: Store, root: str, inventory: Inventory, override: Sequence[str] | None = None) -> tuple[str, ...]:
    """The variants of the chain `root` started: `override` if given, else the chain it was launched with
    (its variant, then what was ahead; an empty remainder is a chain of one, not "no chain"), else the
    inventory's `fallback:`."""
    if override:
        return tuple(override)
    run = store.get_run(root)
    if run.chain is not None:
        return tuple(run.chain) if run.variant in run.chain else (run.variant, *run.chain)
    return tuple(inventory.fallback)


def chain_from_option(text: str | None, variant: str | None = None, inventory: Inventory | None = None) -> list[str] | None:
    """`--chain a,b,c` -> ["a", "b", "c"] (the launched variant first when it is not in the list); each name
    is checked against `inventory`, so a typo is refused before anything starts."""
    if not text:
        return None
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise UsageError(f"--chain {text!r}: expected variant names separated by commas, e.g. trees,nographs,eager")
    if variant is not None and variant not in names:
        names.insert(0, variant)
    for name in names if inventory is not None else ():
        inventory.variant(name)
    for problem in chain_problems(names, names, where="entry"):
        raise UsageError(f"--chain {text}: {problem}", hint=f"e.g. --chain {','.join(dict.fromkeys(names))}")
    return names


def next_variant_after(chain: Sequence[str], run: Run, next_variant_named: str | None, signature_id: str | None,
                       catalogue: Catalogue, topologies: Mapping[str, str]) -> str | None:
    """The variant to launch after `run`'s verdict: the one the verdict names (its `next_variant`), else
    decide.next_variant with the verdict's crash signature (`signature_id`)."""
    if next_variant_named:
        return next_variant_named
    signature = catalogue.by_id(signature_id) if signature_id else None
    return next_variant(chain, run.variant, signature, topologies)


def chain_name(root: str, place: int, variant: str) -> str:
    """The one naming rule, of single runs and multi-node ones: `<root>.<n>-<variant>` for the run at `place`
    (n) of the chain `root` started; name_tries gives the names after it."""
    return f"{root}.{place}-{variant}"


def successor_base(store: Store, run: str, variant: str) -> str:
    """chain_name of `variant` following run `run` (its place counted along its own parents, so a successor
    left half launched, or one passed by, never moves it)."""
    lineage = store.lineage(run)
    return chain_name(lineage[0], len(lineage) + 1, variant)


def next_run_names(store: Store, root: str, variant: str) -> Iterable[str]:
    """chain_name of the next run of chain `root` (after its newest run), then `-2`, `-3`... for names
    already in the registry."""
    return free_names(store, chain_name(root, len(store.chain_runs(root)) + 1, variant))


def free_names(store: Store, base: str) -> Iterable[str]:
    """The name_tries of `base` not in the registry."""
    return (name for name in name_tries(base) if store.find_run(name) is None)


def name_tries(base: str) -> list[str]:
    """`base`, then `base-2`, `base-3`... (MAX_NAME_TRIES names in all). Always from the rule's own name: a
    retry of `base-2` is `base-3`, never `base-2-2`."""
    return [base if suffix == 1 else f"{base}-{suffix}" for suffix in range(1, MAX_NAME_TRIES + 1)]


def first_launch(store: Store, root: str) -> dict[str, Any]:
    """What run `root` (for a chain: its first run) was launched with: `sets` (the user's --set), `env`, `wandb`."""
    launched = store.events(root, kind=ev.Launched.kind)
    return dict((launched[0]["data"] or {}) if launched else {})


def next_spec(inventory: Inventory, store: Store, run: Run, variant: str, chain: Sequence[str]) -> RunSpec:
    """The next run of `run`'s chain: `variant` on the same target, with the first launch's --set (built-in
    trainer variants only), wandb mode and the environment it added to its variant's (CUDA_VISIBLE_DEVICES)."""
    root = store.lineage(run.name)[0]
    first = first_launch(store, root)
    root_run = store.get_run(root)
    root_env = inventory.variants[root_run.variant].env if root_run.variant in inventory.variants else {}
    added_env = {k: v for k, v in (first.get("env") or {}).items() if k not in root_env}
    builtin = inventory.variant(variant).command is None
    spec = spec_for(inventory, run.target, variant, parent=run.name, chain=rest_of_chain(chain, variant),
                    batch=run.batch, sets=dict(first.get("sets") or {}) if builtin else None,
                    wandb=first.get("wandb") or "off")
    return replace(spec, env={**spec.env, **added_env}) if added_env else spec


def visible_gpus(env: Mapping[str, str], target: TargetSpec) -> tuple[int, ...]:
    """The GPUs a run with environment `env` uses: its CUDA_VISIBLE_DEVICES when set (a batch cell's share, a
    variant's `env:`), else the target's."""
    text = env.get("CUDA_VISIBLE_DEVICES")
    if text and all(part.strip().isdigit() for part in text.split(",")):
        return tuple(int(part) for part in text.split(","))
    return target.gpus


def gpus_used(store: Store, inventory: Inventory, name: str) -> tuple[int, ...]:
    """The GPUs run `name` used: visible_gpus of the environment it was launched with (its `launched` event)."""
    return visible_gpus(first_launch(store, name).get("env") or {}, inventory.target(store.get_run(name).target))


def batch_command(store: Store, batch: str) -> str:
    """`dfo batch FILE` for `batch` (the experiments file it last ran from): what finishes its cells' fallbacks,
    which `dfo watch` leaves to it."""
    source = next((row["source"] for row in store.batches() if row["name"] == batch), None)
    return f"dfo batch {shlex.quote(source)}" if source and not source.startswith("<") else f"dfo batch FILE (batch {batch})"


def finishing_command(store: Store, run: str) -> str:
    """The command that finishes an open fallback of `run`'s chain: `dfo batch FILE` for a batch cell's
    (batch_command), else `dfo watch ROOT`."""
    root = store.get_run(store.lineage(run)[0])
    return batch_command(store, root.batch) if root.batch else f"dfo watch {root.name}"


# ---------------------------------------------------------------------------------------------- claims

def owner_id() -> str:
    """A new claim owner: this process, once (host:pid:random)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Claims:
    """The leases one watcher (or scheduler) holds. `holds(key)` takes the claim when it is free or expired, or
    when its holder is a dfo of this workstation that has gone (killed -9: runs.process_alive; one of another
    workstation cannot be looked at, its lease is waited out), and renews it when it is ours; everyone else
    sees who has it."""

    def __init__(self, store: Store, *, ttl_s: float = LEASE_S, clock: Callable[[], float] = time.time) -> None:
        self.store, self.ttl_s, self.clock = store, ttl_s, clock
        self.owner = owner_id()
        self.held: dict[str, float] = {}  # key -> when we last renewed it
        self.others: dict[str, Claim] = {}

    def holds(self, key: str) -> bool:
        now = self.clock()
        if key in self.held and now - self.held[key] < self.ttl_s / 3:
            return True
        current = self.store.claim_of(key)  # a read: its holder is looked at before the one write
        dead = (current.owner if current is not None and current.owner != self.owner and current.expires_at > now
                and not process_alive(current.host, current.pid) else None)  # its holder died: no lease to wait out
        claim = self.store.claim(key, self.owner, pid=os.getpid(), host=socket.gethostname(), ttl_s=self.ttl_s, now=now,
                                 dead_owner=dead)
        if claim.owner == self.owner:
            self.held[key] = now
            self.others.pop(key, None)
            return True
        self.held.pop(key, None)
        self.others[key] = claim
        return False

    def holder(self, key: str) -> Claim | None:
        """The other owner of `key` as last seen (None when it is ours or unknown)."""
        return self.others.get(key)

    def held_elsewhere(self, key: str) -> Claim | None:
        """The other owner of `key` as last seen when it is a dfo of another workstation: its lease is waited out
        (it cannot be looked at from here), where one of this workstation that dies is taken over at once."""
        claim = self.others.get(key)
        return claim if claim is not None and claim.host != socket.gethostname() else None

    def release_all(self) -> None:
        for key in list(self.held):
            self.store.release_claim(key, self.owner)
        self.held.clear()


def chain_key(root: str) -> str:
    return f"chain:{root}"


def carry_out_once(store: Store, intent: Intent, carry: Callable[[dict], dict], *, ttl_s: float = LEASE_S,
                   wait_s: float = INTENT_WAIT_S) -> dict:
    """Carry out a recorded intent once among every dfo that tries: the one holding the claim `intent:<id>`
    (renewed on a thread while `carry` runs) calls carry(data) and closes the intent with what it returns;
    the others wait until it is closed and return its data. A holder that dies (kill -9) stops renewing:
    once its lease runs out one of the others takes over. An exception from `carry` leaves the intent open."""
    key, claims = f"intent:{intent.id}", Claims(store, ttl_s=ttl_s)
    deadline = time.monotonic() + wait_s
    while not claims.holds(key):
        if store.get_intent(intent.id).done_at is not None:
            return store.get_intent(intent.id).data
        holder = claims.holder(key)
        if time.monotonic() >= deadline:
            raise RefusedError(f"another dfo (pid {holder.pid if holder else '?'} on {holder.host if holder else '?'}) "
                               f"is still carrying out {intent.kind} of {intent.data.get('run')}",
                               hint="dfo runs shows what it launched; try again once it is done")
        time.sleep(INTENT_POLL_S)
    done = threading.Event()
    renewer = threading.Thread(target=lambda: [claims.holds(key) for _ in iter(lambda: done.wait(ttl_s / 4), True)],
                               daemon=True)
    renewer.start()
    try:
        current = store.get_intent(intent.id)  # the holder before us may have closed it just before we took it
        if current.done_at is not None:
            return current.data
        data = carry(dict(current.data))
        store.update_intent(intent.id, data, done=True)
        return data
    finally:
        done.set()
        renewer.join(5)
        claims.release_all()


def record_fallback(store: Store, subject: str, kind: str, data: Mapping[str, Any]) -> Intent:
    """Record a fallback of run `data["run"]` before anything is done about it (store.add_intent_once: two dfo
    deciding it share one intent, and one recorded before, open or done, is the one returned)."""
    intent = store.add_intent_once(subject, kind, data)
    faults.exit_at("recorded", faults.FALLBACK_EXIT_AT)
    return intent


def carry_out_fallback(store: Store, intent: Intent, stop: Callable[[dict], Mapping[str, Any]],
                       launch: Callable[[dict], dict]) -> dict:
    """The one way a recorded fallback, of a single run or of a multi-node one, is carried out: once among every
    dfo that tries (carry_out_once), `stop(data)` (what still runs of the run; what it returns is added to the
    data), then `launch(data)` (the successor; a dfo that died after launching it left it to be adopted), whose
    data closes the intent. A `stop` that raises leaves the intent open for the next watch."""
    def carry(data: dict) -> dict:
        data = {**data, **stop(data)}
        faults.exit_at("stopped", faults.FALLBACK_EXIT_AT)
        return launch(data)

    return carry_out_once(store, intent, carry)


# ---------------------------------------------------------------------------------------------- acting

class NoFreeName(RefusedError):
    """Every name a fallback's successor may take is taken (successor_name): the fallback ends there."""


class Left(StrEnum):
    """What a dfo that died inside a fallback's launch left under one of the successor's names (successor_name)."""

    NOTHING = "nothing"  # the name is free: the successor is launched under it
    STARTED = "started"  # the successor really started (its process; every node's): adopted
    PASSED = "passed"  # nothing or part of it started: marked failed, nothing of it left running; passed by


def successor_name(base: str, left: Callable[[str], Left], *, of: str) -> tuple[str, Left]:
    """Where a recorded fallback of run `of` puts its successor, single run or multi-node: the first of
    name_tries(base) under which a dfo that died left nothing (launched there) or a successor that really
    started (adopted), past the names it left half launched (`left(name)` has marked those failed and stopped
    what of them started). A row left `launching` is never taken for a successor by itself. NoFreeName when
    none is left; an error from `left` (a target out of reach) propagates: the fallback stays open."""
    for name in name_tries(base):
        found = left(name)
        if found is not Left.PASSED:
            return name, found
    raise NoFreeName(f"no free run name for the fallback of {of}", hint="remove old runs of this chain")


class GpusStillBusy(RefusedError):
    """A successor not started: the GPUs of the run it follows did not go idle within gpu_release_s."""


class StopFailed(DfoError):
    """A fallback's stop failed (its target out of reach): the fallback stays open for the next watch."""


class StartUnseen(DfoError):
    """A successor's start got no answer (runs.start_unseen): whether it runs is unknown, so the fallback stays
    open; the next look adopts it when it runs, else launches the next name (successor_name)."""

    @classmethod
    def raise_if(cls, name: str, tried: Iterable[Run | None], exc: DfoError, *, again: str) -> None:
        """Raise it (from `exc`, the launch's error) when a row of successor `name` (`tried`: its run, or every
        node of a multi-node one) is start_unseen; `again`: the command that finishes the fallback
        (finishing_command)."""
        if any(run is not None and start_unseen(run) for run in tried):
            answer = exc.answer if isinstance(exc, StartsUnseen) else exc.message  # the target's words, not the launch's
            raise cls(f"the start of {name} got no answer ({answer}); the fallback stays open: `{again}` adopts "
                      f"{name} if it runs, else launches the next name") from exc


@dataclass(frozen=True)
class Outcome:
    """What an action did: the stop (signal sent, or why none), the next run launched, or the error."""

    run: str
    stopped: bool = False
    signal: str | None = None
    launched: Run | None = None
    error: str | None = None
    reason: str | None = None
    note: str | None = None  # why no signal was sent (it had ended, or its PID is another process's now)


def outcome_of(store: Store, data: Mapping[str, Any]) -> Outcome:
    """What a single run's fallback did, from its closed intent's data (carried out here, or by another dfo)."""
    launched = store.find_run(data["next_run"]) if data.get("next_run") else None
    return Outcome(data["run"], stopped=data.get("signal") is not None, signal=data.get("signal"), launched=launched,
                   error=data.get("error"), reason=data.get("reason"), note=data.get("note"))


@dataclass
class Supervisor:
    """Stops runs and launches the next ones for watch and batch (the steps in the module docstring)."""

    inventory: Inventory
    connections: Any
    store: Store
    stop_grace_s: float | None = None  # None: the run's variant's (Inventory.stop_grace)
    gpu_release_s: float = GPU_RELEASE_S
    on_step: Callable[[str, dict], None] = field(default=lambda kind, data: None)  # intent progress, for tests/events
    on_wait: Callable[[StopWait], None] | None = None  # a stop waiting for its run to exit after SIGTERM (each second)

    def stop(self, name: str, reason: str) -> Outcome:
        """Stop it (identity-checked; runs.stop records the stop intent before the signal); `on_wait` hears every
        second while the run has its SIGTERM and its grace."""
        run = self.store.get_run(name)
        if not run.active:
            return Outcome(name, reason=reason, note=f"it had already ended ({run.state})")
        try:
            result = stop_run(self.connections.container(run.target), self.store, name, grace_s=self.grace_s(run),
                              python=self.inventory.target(run.target).python, on_wait=self.on_wait)
        except RefusedError as exc:  # it had ended meanwhile, or its PID is someone else's now
            return Outcome(name, reason=reason, note=str(exc))
        except DfoError as exc:
            return Outcome(name, reason=reason, error=f"stop failed: {exc}")
        return Outcome(name, stopped=result.signal is not None, signal=result.signal, reason=reason)

    def grace_s(self, run: Run) -> float:
        """How long a stop of `run` gives it between SIGTERM and SIGKILL."""
        return self.stop_grace_s if self.stop_grace_s is not None else self.inventory.stop_grace(run.variant)

    def bound_s(self, run: Run, *, launches: bool) -> float:
        """The longest a stop of `run` takes (`launches`: a fallback, the stop then its successor's launch), every
        remote call of it at its timeout: the grace + runs.STOP_MARGIN_S, then the GPUs' release
        (gpu_release_s) and one more launch (runs.LAUNCH_MARGIN_S)."""
        stop = self.grace_s(run) + STOP_MARGIN_S
        return stop + (self.gpu_release_s + LAUNCH_MARGIN_S if launches else 0.0)

    def fall_back(self, run: Run, variant: str, chain: Sequence[str], reason: str, *, subject: str | None = None) -> Outcome:
        """Steps 1-5 for `run`: record the intent (once), stop it, wait for its GPUs, launch `variant`, close."""
        root = self.store.lineage(run.name)[0]
        name = next(iter(free_names(self.store, successor_base(self.store, run.name, variant))), None)
        if name is None:
            return Outcome(run.name, reason=reason, error=f"no free run name for the fallback of {run.name}")
        data = {"run": run.name, "variant": variant, "name": name, "chain": list(chain), "reason": reason}
        return self.carry_out(record_fallback(self.store, subject or root, FALLBACK, data))

    def finish_open(self, subject: str) -> list[Outcome]:
        """Finish the fallbacks a dfo that died left open for `subject` (a chain root or a batch cell)."""
        return [self.carry_out(intent) for intent in self.store.open_intents(subject) if intent.kind == FALLBACK]

    def carry_out(self, intent: Intent) -> Outcome:
        """Steps 2-5 of a recorded fallback, once among every dfo (carry_out_fallback); the name it launches
        under is the intent's. An Outcome with `error` and the intent still open when the stop failed."""
        def stop(data: dict) -> dict:
            if not self.store.get_run(data["run"]).active:
                return {}  # it had ended (a crash), or the dfo that died had stopped it
            stopped = self.stop(data["run"], data["reason"])
            if stopped.error:
                raise StopFailed(stopped.error)
            self.on_step("stopped", data)
            return {"signal": stopped.signal, "note": stopped.note}

        def left(name: str) -> Left:  # what a dfo that died launching the successor left under `name`
            found = self.store.find_run(name)
            if found is None:
                return Left.NOTHING
            if found.parent != intent.data["run"]:
                return Left.PASSED  # another run's name
            found = resolve_launch(self.connections.container(found.target), self.store, found,
                                   grace_s=self.inventory.watch.start_grace_s)
            return Left.STARTED if started(found) else Left.PASSED

        def launch(data: dict) -> dict:
            try:
                # from the rule's name, not the intent's (`base-2` when `base` was taken): its retry is `base-3`
                name, found = successor_name(successor_base(self.store, data["run"], data["variant"]), left, of=data["run"])
            except NoFreeName as exc:
                return {**data, "next_run": None, "error": str(exc)}
            data, error = {**data, "name": name}, None
            launched = self.store.get_run(name) if found is Left.STARTED else None
            try:
                if launched is None:
                    spec = next_spec(self.inventory, self.store, self.store.get_run(data["run"]), data["variant"], data["chain"])
                    self.on_step("launching", data)
                    launched = self.launch_when_released(self.connections.container(spec.target), spec, name,
                                                         after=data["run"])
            except GpusStillBusy as exc:
                error = str(exc)
            except DfoError as exc:
                StartUnseen.raise_if(name, [self.store.find_run(name)], exc,  # None: refused, its row forgotten
                                     again=finishing_command(self.store, data["run"]))
                error = f"launching {data['variant']} failed: {exc}"
            return {**data, "next_run": launched.name if launched else None, "error": error}

        try:
            data = carry_out_fallback(self.store, intent, stop, launch)
        except DfoError as exc:  # the intent stays open: the next watch of the chain tries again
            return Outcome(intent.data["run"], reason=intent.data["reason"], error=str(exc))
        return outcome_of(self.store, data)

    def launch_when_released(self, target, spec: RunSpec, name: str, *, after: str) -> Run:
        """Launch the successor of run `after` with the preflight's GPU checks on its GPUs in the same remote
        command (runs.launch with a Gate); while they still read busy, again every GPU_POLL_S for up to
        gpu_release_s, then GpusStillBusy. A target that lists no `gpus:` is not checked: dfo cannot tell its
        own GPUs from another tenant's."""
        target_spec = self.inventory.target(spec.target)
        gpus = visible_gpus(spec.env, target_spec)
        gate = Gate(replace(target_spec, gpus=gpus), judged=RELEASE_CHECKS) if gpus else None
        try:
            return until_released(lambda: launch_run(target, spec, self.store, name=name, gate=gate).run,
                                  self.gpu_release_s, GPU_POLL_S)
        except PreflightFailed as exc:
            if not only_release_checks(exc):
                raise  # ssh or container: not something waiting mends
            raise GpusStillBusy(f"not launching {spec.variant}: the GPUs of {spec.target} are still busy "
                                f"{self.gpu_release_s:g} s after {after} ended "
                                f"({'; '.join(check.detail for check in exc.failed)})") from None


class Refusals(RefusedError):
    """One launch refused on several targets (a multi-node launch: one error per node that refused)."""

    def __init__(self, message: str, errors: Sequence[DfoError], *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.errors = tuple(errors)


def only_release_checks(exc: Exception) -> bool:
    """The launch was refused only on what a run just stopped may still hold a moment (its GPUs): by the
    preflight's release checks, on every target that refused."""
    if isinstance(exc, Refusals):
        return all(only_release_checks(error) for error in exc.errors)
    return isinstance(exc, PreflightFailed) and all(check.name in RELEASE_CHECKS for check in exc.failed)


def until_released(attempt: Callable[[], Any], release_s: float, poll_s: float, *,
                   also: tuple[type[Exception], ...] = ()) -> Any:
    """`attempt()` for a successor of runs just stopped: again every `poll_s` while it fails only on the
    release checks (or with one of `also`), for up to `release_s`; then that last error. Any other failure
    is raised at once."""
    deadline = time.monotonic() + release_s
    while True:
        try:
            return attempt()
        except (PreflightFailed, Refusals) as exc:
            if not only_release_checks(exc) or time.monotonic() >= deadline:
                raise
        except also:
            if time.monotonic() >= deadline:
                raise
        time.sleep(poll_s)


class FallbacksLeft(KeyboardInterrupt):
    """A second Ctrl-C while `dfo watch` or `dfo batch` was finishing the fallbacks under way (finish_under_way),
    or (`overdue_s`) after a Ctrl-C, fallbacks still under way that long after they started, longer than
    every remote call of theirs can take (Lifecycle.finish_actions): they are left half done (their intents open,
    nothing remote signalled), for the next `dfo watch` or `dfo batch` to finish. `fallbacks`: which (`RUN to
    VARIANT`, a batch's with `(cell CELL)`). Their threads cannot be interrupted: the caller leaves the process
    at once."""

    def __init__(self, fallbacks: list[str], *, overdue_s: float | None = None) -> None:
        super().__init__("; ".join(fallbacks))
        self.fallbacks = fallbacks
        self.overdue_s = overdue_s


def fallback_text(data: Mapping[str, Any]) -> str:
    """`RUN to VARIANT`: a fallback (its intent's data, `run` and `variant`) in the words Ctrl-C's lines use."""
    return f"{data['run']} to {data['variant']}"


def finish_under_way(rough: Sequence[str], describe: Callable[[], list[str]],
                     on_interrupt: Callable[[list[str]], None], wait: Callable[[], Any]) -> FallbacksLeft | None:
    """After Ctrl-C, with fallbacks under way on threads (a watch's actions, a batch's cells): `on_interrupt` is
    told which (`describe()`, or `rough` until that answers) and `wait()` waits for them to end, so each
    successor is started and recorded (through wait_until, so that Ctrl-C reaches it). A second Ctrl-C, while
    that is said or during the wait, leaves them half done: returned as FallbacksLeft. Nothing remote is
    signalled either way."""
    described = list(rough)
    try:  # a second Ctrl-C may come while the line is being written, not only during the wait
        described = describe()
        on_interrupt(described)
        wait()
    except KeyboardInterrupt:
        return FallbacksLeft(described)
    return None


def wait_until(done: Callable[[], bool], deadline: float | None = None) -> bool:
    """Wait until done() (True) or until time.monotonic() reaches `deadline` (False), looking every WAIT_SLICE_S.
    On the main thread Ctrl-C ends such a wait within a slice, whichever thread the OS gave SIGINT to: a join or
    an Event.wait with no timeout sleeps through a SIGINT delivered to another thread until the work ends (and
    Python 3.11 can take a thread whose Thread.join Ctrl-C cut short for ended)."""
    while not done():
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        time.sleep(WAIT_SLICE_S if remaining is None else min(WAIT_SLICE_S, remaining))
    return True


# ---------------------------------------------------------------------------------------------- where runs came from

def inventory_for(run: Run, given: Path | None) -> tuple[Inventory, str | None]:
    """The inventory to reach `run` with: `-i`/$DFO_INVENTORY when given, else the file it was launched from
    (the registry keeps its path and hash), else the built-in one. The note says when that file changed since."""
    if given is not None or os.environ.get("DFO_INVENTORY") or not run.inventory_path:
        return load_inventory(given), None
    path = Path(run.inventory_path)
    if not path.is_file():
        raise UsageError(f"run {run.name} was launched with inventory {path}, which is gone",
                         hint=f"pass the inventory with -i (e.g. dfo ... {run.name} -i lab.yaml)")
    note = None
    if run.inventory_hash and hashlib.sha256(path.read_bytes()).hexdigest() != run.inventory_hash:
        note = f"note: {path} changed since {run.name} was launched; using it as it is now"
    return load_inventory(path), note


# ---------------------------------------------------------------------------------------------- fresh status

def refresh(store: Store, runs: Sequence[Run], connections_for: Callable[[Run], Any], *,
            timeout: float = LOOK_TIMEOUT, recheck: bool = False) -> dict[str, str]:
    """Look at every target holding a run of `runs` that is due a look (runs.look_due: active, but a start never
    settled, runs.start_unsettled, only when not tried within LOST_RECHECK_S; `recheck`: every such start) at once
    (one remote call each, see runs.look) and record what changed; returns {target: why it could not be looked
    at}. A start never settled on a target looked at anyway is looked for too; one whose target did not answer
    gets its checked_at (when it was last tried).
    Bounded: a target that has not answered within `timeout` (plus a little) is left as it was."""
    groups: dict[str, tuple[Any, list[Run]]] = {}
    problems: dict[str, str] = {}
    for run in runs:
        if not look_due(run, recheck=recheck):
            continue
        try:
            connections = groups[run.target][0] if run.target in groups else connections_for(run)
        except DfoError as exc:
            problems[run.target] = str(exc)
            continue
        groups.setdefault(run.target, (connections, []))[1].append(run)
    for run in runs:  # not due, but its target is looked at anyway: free
        if run.target in groups and run not in groups[run.target][1] and (
                needs_look(run) or may_start_late(run, within_s=LATE_START_S)):
            groups[run.target][1].append(run)

    def one(target: str, connections: Any, group: list[Run]) -> None:
        try:
            look(connections.container(target), store, group, timeout=timeout,
                 grace_s=connections.inventory.watch.start_grace_s)
        except DfoError as exc:
            problems[target] = str(exc)

    threads = {target: threading.Thread(target=one, args=(target, *group), daemon=True) for target, group in groups.items()}
    for thread in threads.values():
        thread.start()
    deadline = time.monotonic() + timeout + 5
    for target, thread in threads.items():
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            problems[target] = f"no answer within {timeout:g} s"
    for target, (_, group) in groups.items():
        for run in group if target in problems else ():  # not found: tried at a target that did not answer
            if start_unsettled(run):
                store.update_run(run.name, checked_at=utc_now())
    return problems


# ---------------------------------------------------------------------------------------------- resume

RESUMABLE = (RunState.STOPPED, RunState.CRASHED, RunState.LOST)
"""The states `dfo resume` continues: a run that ran and ended with its checkpoint left behind (lost: it had a PID,
killed by SIGKILL or the OOM killer). Not `unconfirmed`: its start got no answer, so it may be running; a resume
would start a second trainer on the same checkpoint (check_resumable says to look first)."""
CHECKPOINT = "checkpoint.pt"


def resume(inventory: Inventory, connections: Any, store: Store, name: str, *, force: bool = False) -> Launched:
    """Relaunch the stopped or crashed built-in-trainer run `name` from its checkpoint as the next run of its
    chain (same target, variant, first launch's settings; `parent` = name): its checkpoint is copied into the
    new run's directory and the trainer starts with --resume. Refuses a run still going, one that finished,
    one without a checkpoint, and (unless `force`) one whose trainer package has changed since."""
    run = store.get_run(name)
    package = build_package()
    check_resumable(inventory, run, package, force=force)
    root = store.lineage(name)[0]
    spec = replace(next_spec(inventory, store, run, run.variant, chain_variants(store, root, inventory)), resume=True)
    new_name = next(iter(next_run_names(store, root, run.variant)), None)
    if new_name is None:
        raise RefusedError(f"no free run name to resume {name} under", hint="remove old runs of this chain")
    target = connections.container(run.target)
    old = carry_checkpoint(target, spec, name, new_name)
    launched = launch_run(target, spec, store, name=new_name, package=package)
    record(store, Resumed(at=utc_now(), run=new_name, from_run=name, checkpoint=old))
    return launched


def check_resumable(inventory: Inventory, run: Run, package, *, force: bool) -> None:
    """Refuse (RefusedError) a run still going, one whose start is unconfirmed (it may be going), one that finished,
    a user's own command, and (unless `force`) a run whose trainer package has changed since."""
    name = run.name
    if run.active:
        raise RefusedError(f"run {name} is still {run.state}; dfo resume continues a stopped or crashed run",
                           hint=f"dfo stop {name} first (the trainer writes a checkpoint on SIGTERM)")
    if start_unseen(run):
        raise RefusedError(f"run {name}'s start is unconfirmed (it got no answer): it may be running, and a resume "
                           "would start a second trainer on its checkpoint",
                           hint=f"`dfo runs {name} --recheck` looks for it: `dfo stop {name}` if it runs, nothing to "
                                "resume if it is marked failed")
    if run.state not in RESUMABLE:
        raise RefusedError(f"run {name} {run.state} (exit code {run.exit_code}); there is nothing to resume",
                           hint="dfo resume continues a stopped or crashed run")
    if inventory.variant(run.variant).command is not None:
        raise RefusedError(f"run {name} ran its own command (variant {run.variant}); dfo resume needs the built-in trainer")
    if run.trainer_hash and run.trainer_hash != package.sha256 and not force:
        raise RefusedError(f"the trainer package changed since {name} ran ({run.trainer_hash[:12]} then, "
                           f"{package.sha256[:12]} now); its checkpoint may not load",
                           hint=f"dfo resume {name} --force to try anyway")


def carry_checkpoint(target, spec: RunSpec, old_name: str, new_name: str) -> str:
    """Copy run `old_name`'s checkpoint into run `new_name`'s directory on `target` (where the trainer's
    --resume reads it); RefusedError when there is none. Returns the old checkpoint's path."""
    old, new = f"{out_dir(spec, old_name)}/{CHECKPOINT}", out_dir(spec, new_name)
    copied = target.run(f"if [ -f {shlex.quote(old)} ]; then mkdir -p {shlex.quote(new)} && cp -p {shlex.quote(old)} {shlex.quote(new)}/ && echo copied; "
                        f"else echo missing; fi", timeout=60, check=True).stdout.strip()
    if copied != "copied":
        raise RefusedError(f"run {old_name} left no checkpoint ({old} is not on {spec.target})",
                           hint="the built-in trainer writes one when stopped (exit 75) or every run.checkpoint_every steps")
    return old
