"""The watch loop, the follower: agent channels -> parsed lines -> decide/ -> registry and events; no action.

A Watcher follows registered runs through one Observer per container (shared by every run in it, all on
the kept-open host connection), parses their log lines (logfmt, or the variant's `metrics:` regex), feeds
each run's RunJudge, persists samples, GPU samples, offsets, events and decisions, and hands each decision to
its lifecycle controller (lifecycle.Lifecycle), which owns the policy, the claims and the one executor of actions:
on crash / stall / too_slow with action `fallback` it has chains.Supervisor stop the run and launch the next
variant as `<root>.<n>-<variant>` (linked); the Watcher then follows the new run on the same observer. A
multi-node run's nodes are followed as runs of their own; the lifecycle decides their group as one (Lifecycle.judged,
after each judgement) and the Watcher follows the successor's nodes the same way.

Claims: a watcher stores for a chain (and its lifecycle acts) only while its lifecycle holds the chain's lease in
the registry (chains.Claims, renewed on each step by Lifecycle.renew_claims). A second watcher of the same chain
observes and shows, but stores nothing and acts on nothing; when the lease runs out (the first one was killed) its
lifecycle takes the chain over and the Watcher stores the steps the first one had not stored (took_over).

The clock lives here, never in decide/: ticks are the workstation's time moved onto the container's clock
(the agent's hello carries its time), so a skewed host clock cannot fake a stall.

Re-attaching (`attach` of a run with a stored history: watched before, or looked at) judges it from its whole
log, read again from its start (the stored steps miss its text lines), stores what it logged since, and follows
the log from there; a step already stored is never stored again; a run that had ended is judged at once and
not followed (_ended_before). The lifecycle's actions run on worker threads so a slow stop never freezes the loop;
their outcome comes back through the observation queue (lifecycle.ActionDone, a group's GroupDone) and the lifecycle
takes it there.

What it must not do: render (view.py does), parse options (commands/watch.py does), decide anything itself
(decide/ does), act on a decision or know which verdicts are acted on (lifecycle.py does), or signal a run on
close: closing stops watching, never the runs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from . import events as ev
from .agent.protocol import ProtocolError
from .chains import GPU_RELEASE_S, WATCH_POLICY, Claims, Policy, catalogue_for, chain_variants
from .connections import Connections
from .decide import (
    DecideConfig, Decision, ExitObs, GpuObs, Observation as JudgeObs, RunJudge, StepObs, TickObs, decision_key,
    held_state, observation_from_record, read_stored, verdict_key,
)
from .errors import DfoError, UnknownRun
from .gpu import failure_kind
from .history import SAMPLE_FIELDS, WholeLog, catch_up, read_whole_log, sample_of
from .inventory import Inventory
from .lifecycle import OUTCOMES, Lifecycle
from .logfmt import EventRecord, MalformedLine, StepRecord, format_ts, make_parser, parse_ts, step_problem
from .notify import Notifier
from .observe import Observation, Observer, ObserverBase, PollObserver
from .package import AGENT_NAME, Package, build_package, push
from .runs import (LOOK_POLL_S, StopWait, launch_under_way, never_started, resolve_launch, start_grace_left,
                   worth_a_look)
from .states import RunState, Verdict
from .store import Run, Store, utc_now
from .words import counted

DRAIN_MAX = 5000  # observations handled per step(); the rest wait for the next one
LAUNCHING_POLL_S = 0.5  # how often the runs another dfo is launching are looked up in the registry
VANISHED_GRACE_S = 3.0  # a dead PID with no exit file yet: wait this long for the wrapper to write it
CATCH_UP_S = 3.0  # after a (re)connect, ticks wait this long for the log written meanwhile to arrive
SPARK_POINTS = 60
RECENT_LINES = 6
MALFORMED_EVENTS = 20  # malformed-line events per run; after these the view's count goes on alone
UNSAVED_MAX = 100_000  # steps an observing (not owning) watcher keeps for the day it takes over


@dataclass
class WatchedRun:
    """One followed run: its judge, what the view shows, and where the watcher stands with it."""

    run: Run
    root: str
    chain: tuple[str, ...]  # the chain's full variant list (the judge's view of it)
    judge: RunJudge
    parse: Callable
    source: str  # the observer (container) it is followed on
    gpus: tuple[int, ...]  # the target's GPUs; empty: every GPU the container shows
    decision: Decision
    last_stored_step: int | None = None  # steps at or below this are already in the store (or seen, when observing)
    unsaved: list = field(default_factory=list)  # samples seen while another watcher owned the chain
    unsaved_offset: int | None = None
    unsaved_ident: dict | None = None
    stored_floor: int | None = None  # after a take-over: steps up to here its former owner stored (not stored again)
    throughput: deque = field(default_factory=lambda: deque(maxlen=SPARK_POINTS))
    latest: StepRecord | None = None
    steps_total: int | None = None  # the trainer's own step count (its event=start steps=), when it says
    compiles: bool = False  # its event=start names a compiled variant (not eager): before its first step it compiles
    step_times: deque = field(default_factory=lambda: deque(maxlen=SPARK_POINTS))  # (ts, step) of recent steps
    lines: deque = field(default_factory=lambda: deque(maxlen=RECENT_LINES))
    gpu_now: list[dict] = field(default_factory=list)
    idle_reported: set = field(default_factory=set)  # (GPU index, idle since) already sent as gpu_idle events
    shifts_reported: set = field(default_factory=set)  # (at_step, declared) of level_shift events already sent
    unstored_shifts: list = field(default_factory=list)  # level_shift events shown while another watcher owned the chain
    alive: bool | None = None
    exit_code: int | None = None
    gone_at: float | None = None  # when the PID was first seen dead without an exit status
    handled: bool = False  # the final decision was acted on (or reported, with --no-fallback)
    acting: bool = False  # an action (stop / launch) is in flight
    stopping: bool = False  # dfo stops this run: its exit is no verdict
    stopped_reason: str | None = None
    exit_wait: "ExitWait | None" = None  # dfo's stop of it sent SIGTERM and waits for it to checkpoint and exit
    lost: bool = False  # its container was unreachable for longer than unreachable_s: the watch gave up on it
    nothing_ran: bool = False  # its launch started nothing (Watcher._nothing_ran): undecided, settled, not followed
    dirty: bool = False  # fed since the decision was last read
    held: tuple = ()  # the judge's decide.held_state when last fed (Watcher._feed)
    reached: Decision | None = None  # the decision as it stood when its verdict was reached, if that was in the
    # observations fed since the last _judge: its figure is that moment's (the one a shift's declared_tok_s records,
    # dfo replay --timeline's), not one refined over whatever else the same read of the log brought
    ended: bool = False  # no longer followed: dfo stopped it and read its log to the end (Watcher.read_to_end),
    # or it had ended before the watch (Watcher._ended_before)
    replaying: bool = False  # its log read again from the start to judge it (Watcher._replay): an event kind stored
    replay_floor: int | None = None  # before is not stored again, nor a step event sent for a step up to this one
    launching: bool = False  # another dfo that lives is launching it (no PID yet): followed once it records one;
    # or its start was never seen answered and its process is not there yet: looked for until its grace is over
    # (Watcher._follow_launched); followed without one, "no process, no exit file" would read as a crash
    looked_for_at: float = 0.0  # when that process was last looked for (time.monotonic)
    malformed: int = 0  # metric lines with a field out of range (ts=1e20 ...): shown, never stored or judged
    last_malformed: str | None = None  # why the last one was refused

    @property
    def name(self) -> str:
        return self.run.name

    @property
    def given_up(self) -> bool:
        """No longer judged: its container out of reach too long (lost), or nothing of it ever ran (nothing_ran)."""
        return self.lost or self.nothing_ran


@dataclass
class ChainState:
    """The runs of one fallback chain, oldest first; the last one is the chain's current run."""

    root: str
    runs: list[str]
    variants: tuple[str, ...]


@dataclass(frozen=True)
class ExitWait:
    """A stop of the run waiting for it to exit after its SIGTERM (runs.StopWait, about every second): when the
    SIGTERM went out (workstation clock) and the grace before SIGKILL."""

    term_at: float
    grace_s: float

    def left_s(self, now: float) -> float:
        """Seconds of the grace left at `now` (0 once SIGKILL is due)."""
        return max(0.0, self.term_at + self.grace_s - now)


@dataclass
class Link:
    """The state of one container's channel, for the view."""

    connected: bool = False
    reconnects: int = 0
    last_gap_s: float | None = None
    reason: str | None = None
    gpu_error: str | None = None
    gpu_error_code: int | None = None  # nvidia-smi's exit status with gpu_error
    ticks_from: float = 0.0  # no ticks before this time (the run's news since the drop is still on its way)
    down_since: float | None = None  # when the current outage began (None: connected, or never connected)

    @property
    def no_nvidia_smi(self) -> bool:
        """nvidia-smi is not installed there: a CPU-only target."""
        return self.gpu_error is not None and failure_kind(self.gpu_error_code) == "missing"

    def ticking(self, now: float) -> bool:
        """Whether silence means anything now: not while the channel is down or catching up."""
        return self.connected and now >= self.ticks_from


def log_changed_since(ident: dict | None, offset: int | None, now: WholeLog) -> str | None:
    """Why the log read now from its first byte (with `ident` handed to the agent: read_whole_log) is not the file
    an earlier reading stopped in at `offset` with file identity `ident` (agent's Follow.changed: replaced,
    truncated, rewritten), or None."""
    if not ident or not offset or now.ident is None:
        return None
    if (ident.get("dev"), ident.get("ino")) != (now.ident.get("dev"), now.ident.get("ino")):
        return "replaced"
    if (now.offset or 0) < offset:
        return "truncated"
    return "rewritten" if now.changed else None  # the agent compared as many first bytes as `ident` hashed


def current_decision(summary: dict[str, Any]) -> Decision:
    """A chain's current decision (a Watcher.chains() summary's), read as the typed Decision (decide.read_stored); one
    the watch holds no readable decision of (a successor it could not follow, a damaged stored one) is `undecided`,
    saying why."""
    decision, why = read_stored(summary["decision"])
    if decision is None:
        decision = Decision.from_json({"decision": Verdict.UNDECIDED, "run": summary["current"],
                                       "reason": why or "no decision"})
    return decision


class Watcher:
    """Follow runs, judge them, persist everything, act on verdicts. Drive it by calling `step()`."""

    def __init__(
        self,
        inventory: Inventory,
        connections: Connections,
        store: Store,
        *,
        decide_config: DecideConfig | None = None,
        fallback: bool = True,
        poll: float | None = None,
        chain_override: Sequence[str] | None = None,
        on_event: Callable[[ev.Event], None] | None = None,
        heartbeat_timeout: float = 5.0,
        stop_grace_s: float | None = None,
        peer_baseline: bool = True,
        unreachable_s: float | None = None,
        gpu_release_s: float = GPU_RELEASE_S,
        claims: Claims | None = None,
        policy: Policy = WATCH_POLICY,
        on_wait: Callable[[StopWait], None] | None = None,
        began: str | None = None,
    ) -> None:
        self.inventory = inventory
        self.connections = connections
        self.store = store
        self.config = decide_config or config_from_inventory(inventory)
        self.catalogue = catalogue_for(inventory)
        self.fallback = fallback
        self.poll = poll
        self.chain_override = tuple(chain_override) if chain_override else None
        for variant in self.chain_override or ():
            inventory.variant(variant)
        self.on_event = on_event
        self.on_wait = on_wait  # a stop's wait for its run to exit, said where no view shows it (dfo watch --json)
        self.notifier = Notifier(inventory, store)
        self.heartbeat_timeout = heartbeat_timeout
        self.stop_grace_s = stop_grace_s
        self.peer_baseline = peer_baseline  # False: too slow only against a configured baseline_tok_s
        # A container silent this long is given up on (its runs end the watch undecided); shorter outages resume.
        self.unreachable_s = unreachable_s if unreachable_s is not None else inventory.watch.unreachable_s
        self.queue: queue.Queue = queue.Queue()
        # what is done about the decisions (policy, claims, the executor of stops and fallbacks): never here
        self.lifecycle = Lifecycle.for_watch(self, inventory, connections, store, stop_grace_s=stop_grace_s,
                                             gpu_release_s=gpu_release_s, fallback=fallback, policy=policy, claims=claims,
                                             began=began)
        self.observers: dict[str, ObserverBase] = {}
        self.links: dict[str, Link] = {}
        self.skew: dict[str, float] = {}  # container clock minus workstation clock, per observer
        self.watched: dict[str, WatchedRun] = {}
        self._chains: dict[str, ChainState] = {}
        self._package: Package | None = None
        self._events: list[ev.Event] = []
        self._launching_looked_at = 0.0  # when the runs another dfo is launching were last looked up
        self._lock = threading.RLock()

    @property
    def claims(self) -> Claims:
        """The chain claims, its lifecycle's: a chain is stored (and acted on) only by the dfo that holds its claim."""
        return self.lifecycle.claims

    # ------------------------------------------------------------------ public

    def attach(self, name: str) -> WatchedRun:
        """Start (or resume, from the stored offset) following the registered run `name`."""
        with self._lock:
            if name in self.watched:
                return self.watched[name]
            run = self.store.get_run(name)
            observer = self._observer_for(run.target)  # first: a target out of reach registers nothing
            grace_s = self.inventory.watch.start_grace_s
            if worth_a_look(run) and run.pid is None:  # a launch a dfo did not finish recording, or a start it
                # never saw answered: looked for first (followed without a PID, "no process, no exit file" would
                # read as a crash); a slow start not there yet is waited for by _follow_launched, look by look,
                # not here asleep with the watch's lock held (the live view froze for up to start_grace_s)
                run = resolve_launch(self.connections.container(run.target), self.store, run, grace_s=grace_s,
                                     wait=False)
            chain_runs = self.store.lineage(run.name)
            root = chain_runs[0]
            state = self._chains.get(root)
            if state is None:
                state = self._chains[root] = ChainState(root, chain_runs,
                                                        chain_variants(self.store, root, self.inventory, self.chain_override))
            elif name not in state.runs:
                state.runs.append(name)
            self.lifecycle.claim(root)
            watched = self._new_watched(run, root, state.variants)
            self.watched[name] = watched
            finished = not run.active and run.pid is not None  # it ran, and ended before this watch (its row
            # brought up to date: sync_before_attach)
            if finished and self.lifecycle.stores_for(root) and self.lifecycle.acted_before(
                    run, root, read_stored(run.decision)[0]):  # its verdict acted on by an earlier dfo: not judged again,
                self._read_rest(watched, observer)  # its log's rest stored as a look stores it (history_complete)
            samples = self._resume(watched)
            stored = len(samples)
            offset, ident = run.log_offset, run.log_ident
            if (offset or finished) and not watched.handled:  # judged once, from its whole log, read once
                offset, ident, stored = self._replay(watched, observer, samples, show_all=finished)
            else:
                self._judge_stored(watched, samples)
            ended = not run.active and self.store.get_run(name).history_complete  # its end and every step stored
            watched.launching = launch_under_way(run) or start_grace_left(run, grace_s) > 0
            if never_started(run):  # followed without a PID, "no process, no exit file" read as a crash (exit -1)
                self._never_started(watched, run)
            elif not ended and not watched.launching:
                observer.follow(run.name, run.log_path, run.exit_path, run.pid, run.proc_starttime, offset=offset,
                                ident=ident)
            self.emit(watched, ev.Attached, target=run.target, variant=run.variant, offset=offset,
                       steps_stored=stored, owner=self.lifecycle.stores_for(root), claimed_by=self.lifecycle.holder_of(root))
            if ended:
                self._ended_before(watched)
            self.lifecycle.attached(root)  # open intents: finished here, or awaited from the holder (said to hold it)
            if watched.nothing_ran and (newest := self.store.chain_runs(root)[-1]) not in state.runs:
                self.attach(newest)  # its chain went on past it (a fallback another dfo finished passed it by)
            return watched

    def owns(self, name: str) -> bool:
        """Whether this watcher stores and acts for the chain of run `name` (else another watcher does)."""
        with self._lock:
            watched = self.watched.get(name)
            return watched is not None and self.lifecycle.stores_for(watched.root)

    def step(self, timeout: float = 0.25) -> list[ev.Event]:
        """Handle what arrived within `timeout` seconds: parse, persist, judge, act. Returns the new events."""
        items = self._drain(timeout)
        with self._lock:
            self.lifecycle.renew_claims()  # a chain whose holder's lease ran out taken over (took_over)
            self.lifecycle.look_at_awaited()
            self._follow_launched()
            writes = Writes()
            for item in items:
                if isinstance(item, StopWait):
                    self._exit_awaited(item)
                elif not isinstance(item, OUTCOMES):
                    self._observed(item, writes)
            self._persist(writes)  # first: a stopped run's log is read to its end from what is stored
            for item in items:
                if isinstance(item, OUTCOMES):
                    self.lifecycle.done(item)
            self._tick()
            self._judge()
            events, self._events = self._events, []
        return events

    def runs(self) -> list[WatchedRun]:
        """Every followed run, in the order they were attached."""
        with self._lock:
            return list(self.watched.values())

    def chains(self) -> list[dict[str, Any]]:
        """Each chain: root, runs (oldest first), current run, its decision (JSON) and whether it is settled."""
        with self._lock:
            return [self._chain_summary(state) for state in self._chains.values()]

    def settled(self) -> bool:
        """True when every chain holds a final decision with nothing left to do (no action in flight)."""
        with self._lock:
            return bool(self._chains) and all(self._chain_summary(s)["settled"] for s in self._chains.values())

    def final_decisions(self) -> list[Decision]:
        """The current decision of each chain (in chains() order), typed: current_decision."""
        return [current_decision(summary) for summary in self.chains()]

    def stop_run(self, name: str, reason: str) -> None:
        """Stop a followed run for the caller's own reason (batch's stop_when); no fallback follows."""
        with self._lock:
            watched = self.watched.get(name)
            if watched is None:
                raise UnknownRun(f"run {name!r} is not followed by this watch", hint="attach it first")
            self.lifecycle.stop(watched, reason)

    def stop_waiting(self, wait: StopWait) -> None:
        """A stop of a followed run waits for it to exit after its SIGTERM (runs.StopWait, about every second): this
        watcher's own stops, and `dfo batch`'s fallbacks (its Supervisor's on_wait). Thread-safe: handed to the
        loop's queue; the view shows it until the run has exited, and `on_wait` hears it (from the stop's thread)."""
        self.queue.put(wait)
        if self.on_wait is not None:
            self.on_wait(wait)

    def close(self) -> None:
        """Stop watching: close every channel (the agents exit; the runs keep running), give up the claims."""
        for observer in list(self.observers.values()):
            observer.close()
        self.lifecycle.close()

    def chain_runs(self, root: str) -> list[str]:
        """The runs of chain `root` this watch knows, oldest first (the last one is the chain's current run)."""
        return self._chains[root].runs

    def chain_roots(self) -> list[str]:
        """The chains this watch follows (their roots), in the order they were attached."""
        return list(self._chains)

    def follows_chain(self, root: str) -> bool:
        """Whether this watch follows a run of chain `root`."""
        return root in self._chains

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ attaching

    def _new_watched(self, run: Run, root: str, chain: tuple[str, ...]) -> WatchedRun:
        spec = self.inventory.target(run.target)
        variant = self.inventory.variants.get(run.variant) if run.variant else None
        judge = self._new_judge(run, chain)
        return WatchedRun(run, root, chain, judge, make_parser(variant.metrics if variant else None),
                          source=run.target, gpus=spec.gpus, decision=judge.decision())

    def _new_judge(self, run: Run, chain: tuple[str, ...]) -> RunJudge:
        return RunJudge(
            self.config,
            self._baseline(run, chain),
            run=run.name,
            variant=run.variant,
            chain=chain,
            fallback=self.fallback,
            catalogue=self.catalogue,
            started_ts=parse_ts(run.started_at) if run.started_at else None,
            topologies={name: v.topology for name, v in self.inventory.variants.items()},
        )

    def _baseline(self, run: Run, chain: tuple[str, ...]) -> float | None:
        """The too-slow baseline: the variant's, else the inventory's, else the best steady figure among the
        runs of the same chain (and of the same batch on the same target)."""
        variant = self.inventory.variants.get(run.variant) if run.variant else None
        if variant is not None and variant.baseline_tok_s:
            return variant.baseline_tok_s
        if self.inventory.watch.baseline_tok_s:
            return self.inventory.watch.baseline_tok_s
        if not self.peer_baseline:
            return None
        root = self.store.lineage(run.name)[0]
        peers = [r for r in self.store.list_runs(target=run.target)
                 if r.name != run.name and (self.store.lineage(r.name)[0] == root or (run.batch and r.batch == run.batch))]
        figures = [r.decision.get("steady_tok_s") for r in peers if r.decision and r.decision.get("steady_tok_s")]
        return max(figures) if figures else None

    def _resume(self, watched: WatchedRun) -> list[dict]:
        """Where an earlier watch (or a look) left the run: its stored samples (returned; the view shows the last
        one, and a step up to it is not stored again), the level shifts it sent, and the decision it recorded,
        which is what a decision of this watch is news against; a final verdict it reached is restored (acted on
        already when its successor exists or the run ended; a cell of the batch's own once its fallback or stop was
        recorded: Lifecycle.acted_before). The judge is fed once, by the caller: from the
        whole log (_replay), else from these samples (_judge_stored)."""
        samples = [sample for sample in self.store.samples(watched.name)  # a dfo that did not check ranges
                   if not step_problem(sample.get("step"), sample.get("ts"), sample.get("tok_s"))]  # stored ts=1e20
        if samples:
            last = samples[-1]
            known = {name: last.get(name) for name in SAMPLE_FIELDS if last.get(name) is not None}
            watched.latest = StepRecord(**{**known, "ts": float(last.get("ts") or 0.0), "step": int(last["step"]),
                                           "tok_s": float(last["tok_s"])})
            watched.last_stored_step = watched.latest.step
            watched.throughput.extend(float(sample["tok_s"]) for sample in samples)
        watched.shifts_reported = self._stored_shifts(watched.name)
        earlier, _ = read_stored(watched.run.decision)  # one it cannot read: no decision said yet
        watched.decision = earlier or watched.decision
        watched.handled = self.lifecycle.acted_before(watched.run, watched.root, earlier)
        return samples

    def _read_rest(self, watched: WatchedRun, observer: ObserverBase) -> None:
        """An ended run not judged again: what its log holds past the stored offset is stored (history.catch_up, once,
        as a look does; read to its end: history_complete); a log that cannot be read is followed instead."""
        run = self.store.get_run(watched.name)
        if run.pid is None or run.history_complete:
            return
        try:
            catch_up(observer.target, observer.agent_cmd, self.store, [run], lambda _: watched.parse)
        except (DfoError, ProtocolError) as exc:
            self.emit(watched, ev.RunError, text=f"the end of its log was not read ({exc})")
        watched.run = self.store.get_run(watched.name)

    def _judge_stored(self, watched: WatchedRun, samples: list[dict]) -> None:
        """Judge the run from its stored samples (its log is not read again: a run never read before, one whose
        verdict was acted on, or one whose log cannot be read now); a final verdict restored by _resume stands."""
        for sample in samples:
            self._feed(watched, StepObs(sample["ts"], int(sample["step"]), float(sample["tok_s"]), sample.get("loss"),
                                        sample.get("phase") or "train", sample.get("active")))
        if not self.lifecycle.acts_on(watched.decision.decision):
            watched.decision = watched.judge.decision()

    def _replay(self, watched: WatchedRun, observer: ObserverBase, samples: list[dict], *,
                show_all: bool = False) -> tuple[int | None, dict | None, int]:
        """A run with a stored history (an earlier watch's, or a look's: history.sync_history, which `dfo watch` and
        `dfo batch` call first) is judged from its whole log, read again from its first byte (history.read_whole_log),
        as a watch that followed it from its start would have judged it: the stored steps alone miss its text
        lines (a crash's traceback or error line, which gives its signature). Steps above the stored ones are
        stored (or kept, when another watcher owns the chain), the stored ones shown in the view, not stored or
        sent again as `step` events (`show_all`, a run that had ended: every step sent, its whole run shown at
        once). Returns the offset and file identity to follow on from, and the steps stored. A log that
        cannot be read: judged from the stored steps (_judge_stored), followed from the stored offset."""
        run, stored = watched.run, len(samples)
        try:
            log = read_whole_log(observer.target, observer.agent_cmd, run)
        except (DfoError, ProtocolError) as exc:
            self.emit(watched, ev.RunError, text=f"its log was not read from its start ({exc}): judged from its "
                                                  f"stored steps")
            self._judge_stored(watched, samples)
            return run.log_offset, run.log_ident, stored
        floor = watched.last_stored_step
        watched.throughput.clear()
        watched.step_times.clear()
        watched.last_stored_step, watched.replay_floor, watched.replaying = None, None if show_all else floor, True
        writes, ts = Writes(), parse_ts(run.started_at or "") or 0.0
        try:
            for line in log.lines:
                self._line(watched, line, ts, writes)
                ts = watched.latest.ts if watched.latest is not None else ts
        finally:
            watched.replaying, watched.replay_floor = False, None
        new = [sample for sample in writes.samples.get(run.name, []) if floor is None or sample["step"] > floor]
        changed = log_changed_since(run.log_ident, run.log_offset, log)
        if changed is not None:  # said as a follow that met it says it (the agent's `truncated` record)
            watched.lines.append(f"[dfo: log {changed} ({counted(log.offset or 0, 'byte')}, read to {run.log_offset}); "
                                 "read again from 0]")
            self.emit(watched, ev.Truncated, size=log.offset or 0, why=changed, was=run.log_offset)
        if log.offset is None:  # an empty log: followed from where it was
            return run.log_offset, run.log_ident, stored
        self._persist(Writes(samples={run.name: new}, offsets={run.name: log.offset}, idents={run.name: log.ident}))
        if show_all and log.complete and self.lifecycle.stores_for(watched.root):  # it had ended: every step stored
            self.store.update_run(run.name, history_complete=True)
        watched.last_stored_step = max((step for step in (floor, watched.last_stored_step) if step is not None),
                                       default=None)
        return log.offset, log.ident, stored + len(new)

    def _ended_before(self, watched: WatchedRun) -> None:
        """A run that had ended before this watch, its end and every step stored (sync_history): its end as recorded
        (ended_at: the exit file's time) is what the judge hears, at once; it is never followed and nothing of it is
        stored again. A verdict an earlier watch acted on stands (_resume)."""
        run = watched.run
        watched.ended, watched.alive, watched.exit_code = True, False, run.exit_code
        code = run.exit_code if run.exit_code is not None else -1
        at = parse_ts(run.ended_at or "") or (watched.latest.ts if watched.latest is not None else time.time())
        self._ended(watched, code, at, why=None if run.exit_code is not None else f"{run.state}, no exit status")

    def _follow_launched(self) -> None:
        """The runs another dfo was launching when they were attached, followed once it recorded their PID, or once
        it is gone (resolve_launch settles what it left: adopted, or failed); and the starts never seen answered
        that were not there yet, looked for every LOOK_POLL_S while their grace lasts (adopted once found, failed
        after it)."""
        now = time.monotonic()
        if now - self._launching_looked_at < LAUNCHING_POLL_S:
            return
        self._launching_looked_at = now
        for watched in [w for w in self.watched.values() if w.launching]:
            run = self.store.find_run(watched.name)
            if run is None:  # its launch was refused or failed before any start: no run to follow
                self._nothing_ran(watched, "its launch by another dfo ended before any start")
                continue
            grace_s = self.inventory.watch.start_grace_s
            if launch_under_way(run):  # its launcher records the start (or gives it up): waited for here
                continue
            if worth_a_look(run) and run.pid is None:  # its launcher died before recording it, or a start not seen
                # answered: one look (within its grace, every LOOK_POLL_S: the watch goes on meanwhile)
                if start_grace_left(run, grace_s) > 0 and now - watched.looked_for_at < LOOK_POLL_S:
                    continue
                watched.looked_for_at = now
                try:
                    run = resolve_launch(self.connections.container(run.target), self.store, run, grace_s=grace_s,
                                         wait=False)
                except DfoError:  # its target is out of reach (the link's state says so): looked at on the next poll
                    continue
                if start_grace_left(run, grace_s) > 0:  # not there yet
                    continue
            if never_started(run):  # its launcher gave it up, or died before recording a start that shows nowhere
                self._never_started(watched, run)
                continue
            watched.run, watched.launching = run, False
            self.observers[watched.source].follow(run.name, run.log_path, run.exit_path, run.pid,
                                                  run.proc_starttime, offset=run.log_offset, ident=run.log_ident)

    def _nothing_ran(self, watched: WatchedRun, why: str) -> None:
        """A followed run whose launch started nothing: given up on (settled, no verdict acted on), undecided."""
        watched.launching, watched.nothing_ran = False, True
        watched.decision = replace(watched.judge.decision(), reason=f"{why}: nothing ran")

    def _never_started(self, watched: WatchedRun, run: Run) -> None:
        """`run` (watched's row as now recorded) is `failed` with no PID (runs.never_started): nothing ran."""
        watched.run = run
        self._nothing_ran(watched, f"its launch never started on {run.target} (`failed`, no process found)")

    def follow_newer(self, root: str) -> None:
        """Attach the runs another watcher added to the chain (its fallbacks), so this one shows them too."""
        runs, last = self.store.chain_runs(root), self._chains[root].runs[-1]
        for name in runs[runs.index(last) + 1:] if last in runs else ():
            try:
                self.attach(name)
            except DfoError as exc:  # its target is out of reach now: tried again on the next look
                self.emit(self.watched[last], ev.ActionError, error=f"cannot follow {name}: {exc}")

    def took_over(self, root: str) -> None:
        """This dfo now holds `root`'s chain (Lifecycle.renew_claims): the steps its former owner had not stored are
        stored, and it is judged (and acted on) from here on."""
        for watched in [w for w in self.watched.values() if w.root == root]:
            stored = self.store.last_step(watched.name)
            rows = [s for s in watched.unsaved if stored is None or s["step"] > stored]
            self.store.add_samples(watched.name, rows, offset=watched.unsaved_offset, ident=watched.unsaved_ident)
            watched.stored_floor = self.store.last_step(watched.name)  # a former owner just gone (its pid) stored
            watched.unsaved, watched.unsaved_offset, watched.unsaved_ident = [], None, None  # lines still on their way
            self._store_shown_shifts(watched)
            watched.handled = watched.handled or self.lifecycle.acted_on(watched)
            watched.dirty = True
            self.emit(watched, ev.TookOver, steps_stored=len(rows))

    def _stored_shifts(self, name: str) -> set[tuple[int, bool]]:
        """(at_step, declared) of the level_shift events the registry holds for run `name`."""
        return {(e["data"]["at_step"], e["data"]["declared"]) for e in self.store.events(name, kind=ev.LevelShift.kind)}

    def _store_shown_shifts(self, watched: WatchedRun) -> None:
        """On a take-over: the level_shift events this watcher showed while observing and the former owner did not
        store are stored now (not sent again), with the decision that names them."""
        stored = self._stored_shifts(watched.name)
        missing = [e for e in watched.unstored_shifts if (e.at_step, e.declared) not in stored]
        for event in missing:
            self.store.add_event(watched.name, event.kind, event.stored_data(), at=event.at)
        watched.unstored_shifts = []
        if missing:
            self.store.update_run(watched.name, decision=watched.decision.to_json())

    def _observer_for(self, target_name: str) -> ObserverBase:
        if target_name in self.observers:
            return self.observers[target_name]
        spec = self.inventory.target(target_name)
        target = self.connections.container(target_name)
        self._package = self._package or build_package()
        pushed = push(target, spec.workspace, package=self._package, store=self.store, target_name=target_name)
        agent_cmd = [spec.python, f"{pushed.pkg_dir}/{AGENT_NAME}"]
        if self.poll:
            observer: ObserverBase = PollObserver(target, agent_cmd, interval=self.poll, sink=self.queue)
        else:
            observer = Observer(target, agent_cmd, sink=self.queue, heartbeat_timeout=self.heartbeat_timeout)
        observer.source = target_name  # two ctid-less targets share a host Target (and its name)
        self.observers[target_name] = observer
        self.links[target_name] = Link()
        return observer.start()

    # ------------------------------------------------------------------ observing

    def _drain(self, timeout: float) -> list:
        items = []
        try:
            items.append(self.queue.get(timeout=timeout))
            while len(items) < DRAIN_MAX:
                items.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return items

    def _clock(self, source: str, at: float) -> float:
        """A workstation time on the container's clock."""
        return at + self.skew.get(source, 0.0)

    def _observed(self, obs: Observation, writes: "Writes") -> None:
        if obs.run is not None:
            watched = self.watched.get(obs.run)
            if watched is not None and not watched.ended:
                self._run_observed(watched, obs, writes)
        elif obs.source in self.links:
            self._link_observed(self.links[obs.source], obs, writes)

    def _link_observed(self, link: Link, obs: Observation, writes: "Writes") -> None:
        """News about a container's channel or GPUs (not about one run)."""
        if obs.kind == "connected":
            link.connected, link.reason, link.ticks_from = True, None, obs.at + CATCH_UP_S
            link.down_since = None
            if isinstance(obs.data.get("ts"), (int, float)):
                self.skew[obs.source] = float(obs.data["ts"]) - obs.at
            self._found_again(obs.source)
        elif obs.kind == "disconnected":
            link.connected, link.reason = False, obs.data.get("reason")
            link.down_since = link.down_since or obs.at
            self._emit_source(ev.Disconnected, obs.source, reason=link.reason)
        elif obs.kind == "gap":
            link.reconnects += 1
            link.last_gap_s = obs.data.get("duration_s")
            self._emit_source(ev.Gap, obs.source, duration_s=link.last_gap_s)
        elif obs.kind == "gpu":
            link.gpu_error = link.gpu_error_code = None
            self._gpu_observed(obs, writes)
        elif obs.kind == "gpu_error":
            link.gpu_error = str(obs.data.get("text") or "").strip()[:200]
            link.gpu_error_code = obs.data.get("code")
            self._emit_source(ev.GpuError, obs.source, text=obs.data.get("text"), code=obs.data.get("code"))
        elif obs.kind == "error":
            self._emit_source(ev.TargetError, obs.source, text=obs.data.get("text"))

    def _run_observed(self, watched: WatchedRun, obs: Observation, writes: "Writes") -> None:
        if obs.kind == "lines":
            received = self._clock(obs.source, obs.at)
            for line in obs.lines:
                self._line(watched, line, received, writes)
            writes.offsets[watched.name] = obs.offset
            writes.idents[watched.name] = obs.data.get("ident")
        elif obs.kind == "truncated":
            why = obs.data.get("why") or "truncated"
            watched.lines.append(f"[dfo: log {why} ({obs.data.get('size')} bytes, read to {obs.data.get('was')}); "
                                 f"reading again from 0]")
            writes.offsets[watched.name], writes.idents[watched.name] = 0, None
            self.emit(watched, ev.Truncated, size=obs.data.get("size"), why=obs.data.get("why"), was=obs.data.get("was"))
        elif obs.kind == "proc":
            self._proc(watched, obs)
        elif obs.kind == "error":
            self.emit(watched, ev.RunError, text=obs.data.get("text"))

    def _line(self, watched: WatchedRun, line: str, received: float, writes: "Writes") -> None:
        record = watched.parse(line, received)
        if isinstance(record, StepRecord):
            if watched.last_stored_step is not None and record.step <= watched.last_stored_step:
                return  # stored by an earlier watch (or repeated by the log): never counted twice
            watched.last_stored_step = record.step
            watched.latest = record
            watched.throughput.append(record.tok_s)
            watched.step_times.append((record.ts, record.step))
            writes.samples.setdefault(watched.name, []).append(sample_of(record))
            if watched.replay_floor is None or record.step > watched.replay_floor:  # a resumed step is no news
                self.emit(watched, ev.Step, step=record.step, tok_s=record.tok_s, loss=record.loss, phase=record.phase)
        elif isinstance(record, MalformedLine):
            watched.malformed += 1
            watched.last_malformed = record.reason
            watched.lines.append(f"[dfo: malformed metric line ignored: {record.reason}] {line[:200]}")
            if watched.malformed <= MALFORMED_EVENTS:
                self.emit(watched, ev.Malformed, reason=record.reason, count=watched.malformed)
        else:
            watched.lines.append(line[:300])
            if isinstance(record, EventRecord) and record.event == "start" and record.count("steps") is not None:
                watched.steps_total = record.count("steps")
            if isinstance(record, EventRecord) and record.event == "start":
                watched.compiles = record.fields.get("variant", "eager") != "eager"
            if isinstance(record, EventRecord) and record.event == "wandb":  # where its W&B record is: kept
                self.emit(watched, ev.Wandb, **{k: record.fields[k] for k in ("mode", "url", "dir") if k in record.fields})
        self._feed(watched, observation_from_record(record, received))

    def _feed(self, watched: WatchedRun, obs: JudgeObs) -> None:
        """The run's judge takes `obs`; when its verdict moved on it (decide.held_state), the decision as it
        stands now is kept (`reached`): a read of the log brings many lines at once, and _judge, after them all,
        says the verdict with the figure of the line that reached it, as dfo replay --timeline does."""
        watched.judge.observe(obs)
        watched.dirty = True
        held = held_state(watched.judge)
        if held != watched.held:
            watched.held, watched.reached = held, watched.judge.decision()

    def _proc(self, watched: WatchedRun, obs: Observation) -> None:
        watched.alive, watched.exit_code = obs.data.get("alive"), obs.data.get("exit_code")
        if watched.alive or watched.stopping:  # dfo's own stop records how it ended
            watched.gone_at = None
            return
        if watched.exit_code is None:
            watched.gone_at = watched.gone_at or obs.at
            return
        self._ended(watched, watched.exit_code, self._clock(obs.source, obs.at), exit_mtime=obs.data.get("ended_at"))

    def _ended(self, watched: WatchedRun, code: int, ts: float, why: str | None = None,
               exit_mtime: float | None = None) -> None:
        """The run's process ended. A stop someone asked for (`dfo stop`, a batch) is in the registry before
        its signal went out: the judge hears of it with the exit, so the exit is no crash to fall back from.
        `exit_mtime`: when its exit file was written (the agent's stat of it), recorded as ended_at (exit_file);
        without one (no exit file) ended_at is when the watch saw the end (noticed)."""
        run = self.store.find_run(watched.name)
        stop_requested = bool(run and run.stop_requested_at)
        watched.exit_wait = None
        self._feed(watched, ExitObs(ts, code, stop_requested=stop_requested))
        if stop_requested:
            watched.stopped_reason = watched.stopped_reason or "stopped on request (dfo stop)"
        state = str(RunState.STOPPED if stop_requested else RunState.after_exit(code))  # -1 (no exit file): crashed
        exit_code = code if code >= 0 else None
        event = ev.Ended(at=utc_now(), run=watched.name, chain=watched.root, exit_code=exit_code, state=state,
                         why=why or f"exit status {code}")
        recorded = None
        if run is not None and run.active and self.lifecycle.stores_for(watched.root):  # seen as it happens: `noticed`
            ended_at = format_ts(exit_mtime) if exit_mtime is not None else None
            recorded = self.store.transition(watched.name, RunState(state), RunState.endable(), exit_code=exit_code,
                                             ended_at=ended_at or event.at, ended_from="exit_file" if ended_at else "noticed")
            watched.run = recorded or self.store.get_run(watched.name)
        self.publish(event, watched.name, recorded is not None)  # shown always; stored by whoever recorded the end

    def _gpu_observed(self, obs: Observation, writes: "Writes") -> None:
        gpus = [g for g in obs.data.get("gpus") or [] if isinstance(g, dict)]
        ts = obs.data.get("ts") if isinstance(obs.data.get("ts"), (int, float)) else self._clock(obs.source, obs.at)
        followed = [w for w in self.watched.values() if w.source == obs.source and not w.stopping and not w.ended]
        for watched in followed:
            mine = tuple(g for g in gpus if not watched.gpus or g.get("index") in watched.gpus)
            watched.gpu_now = list(mine)
            self._feed(watched, GpuObs(ts, mine))
            self.emit(watched, ev.Gpu, gpus=list(mine))
            self._report_idle_gpus(watched)
        active = [w for w in followed if w.alive is not False]
        owner = active[0].name if len(active) == 1 else None
        writes.gpu_samples.append((obs.source, owner, [{**g, "ts": ts} for g in gpus]))

    def _report_idle_gpus(self, watched: WatchedRun) -> None:
        """A `gpu_idle` event for each GPU of the run newly seen idle while its others stay busy."""
        for idle in watched.judge.idle_gpus.flagged.values():
            if (idle.index, idle.since) not in watched.idle_reported:
                watched.idle_reported.add((idle.index, idle.since))
                self.emit(watched, ev.GpuIdle, **idle.to_json(), text=idle.describe())

    def _persist(self, writes: "Writes") -> None:
        """Each run's samples and log offset in one transaction (a re-attach resumes right after them), then
        the GPU samples. Only for the chains this watcher owns: an observer keeps them for a take-over."""
        for name in writes.samples.keys() | writes.offsets.keys():
            watched = self.watched[name]
            if self.lifecycle.stores_for(watched.root):
                samples = writes.samples.get(name, [])
                if watched.stored_floor is not None:  # right after a take-over: its former owner stored these
                    samples = [sample for sample in samples if sample["step"] > watched.stored_floor]
                    watched.stored_floor = None if samples else watched.stored_floor
                self.store.add_samples(name, samples, offset=writes.offsets.get(name), ident=writes.idents.get(name))
                continue
            watched.unsaved = (watched.unsaved + writes.samples.get(name, []))[-UNSAVED_MAX:]
            if writes.offsets.get(name) is not None:
                watched.unsaved_offset = writes.offsets[name]
                watched.unsaved_ident = writes.idents.get(name)
        for source, run, samples in writes.gpu_samples:
            if any(w.source == source and self.lifecycle.stores_for(w.root) for w in self.watched.values()):
                self.store.add_gpu_samples(source, samples, run=run)

    # ------------------------------------------------------------------ judging and acting

    def _tick(self) -> None:
        now = time.time()
        self._give_up_on_unreachable(now)
        for watched in self.watched.values():
            if watched.stopping or watched.handled or watched.launching or not self.links[watched.source].ticking(now):
                continue  # while the channel is down, silence says nothing about the run
            if watched.gone_at is not None and now - watched.gone_at > VANISHED_GRACE_S:
                watched.gone_at = None
                recorded = self.store.find_run(watched.name)  # a `dfo stop` elsewhere may have read its exit file
                if recorded is not None and not recorded.active and recorded.exit_code is not None:
                    self._ended(watched, recorded.exit_code, self._clock(watched.source, now))
                else:
                    self._ended(watched, -1, self._clock(watched.source, now), why="the process is gone and left no exit status")
            self._feed(watched, TickObs(self._clock(watched.source, now)))

    def _give_up_on_unreachable(self, now: float) -> None:
        """A container out of reach for longer than unreachable_s: its undecided runs end the watch, undecided,
        with the outage as the reason (silence from an unreachable host says nothing about its runs)."""
        for source, link in self.links.items():
            if link.connected or link.down_since is None or now - link.down_since < self.unreachable_s:
                continue
            for watched in self.watched.values():
                if watched.source != source or watched.given_up or watched.acting or watched.stopped_reason is not None:
                    continue
                if watched.decision.final:
                    continue  # a verdict reached before the outage stands
                watched.lost = True
                down_s = now - link.down_since
                judged = watched.judge.decision()
                watched.decision = replace(
                    judged, reason=(f"{source} unreachable for {down_s:.0f} s (limit {self.unreachable_s:g} s: "
                                    f"{link.reason or 'no answer'}); the run may still be going: "
                                    f"dfo watch {watched.name} resumes it"),
                    evidence={**judged.evidence, "unreachable_s": round(down_s, 1), "unreachable_reason": link.reason})
                self.record_decision(watched)
                self.emit(watched, ev.Unreachable, target=source, duration_s=round(down_s, 1), reason=link.reason)

    def _found_again(self, source: str) -> None:
        """A container given up on answers again: its runs are judged again from where they were."""
        for watched in self.watched.values():
            if watched.source == source and watched.lost:
                watched.lost, watched.dirty = False, True
                watched.decision = watched.judge.decision()
                self.record_decision(watched)

    def _judge(self) -> None:
        for watched in list(self.watched.values()):
            reached, watched.reached = watched.reached, None
            if not watched.dirty or watched.stopping or watched.handled or watched.given_up:
                continue
            watched.dirty = False
            if self.lifecycle.acts_on(watched.decision.decision):  # restored from an earlier watch: final
                self.lifecycle.decided(watched)
                continue
            shifted = self._report_shifts(watched)
            decision = watched.judge.decision()
            if reached is not None and verdict_key(reached) == verdict_key(decision) and (
                    shifted or decision_key(reached) != decision_key(watched.decision)):
                watched.decision = reached  # the verdict held now, said with the figure it was reached with
                self.record_decision(watched)
                shifted = False
            if shifted or decision_key(decision) != decision_key(watched.decision):  # a shift: the new figure
                watched.decision = decision  # (or news since it was reached: a shift suspected, memory climbing)
                self.record_decision(watched)
            self.lifecycle.decided(watched)  # it acts (or not): the policy is its
        self.lifecycle.judged()  # a multi-node group whose nodes all have a verdict: decided as one there

    def _report_shifts(self, watched: WatchedRun) -> bool:
        """A `level_shift` event for each level shift the judge newly recorded, and one more when a shift seen
        before its new level held gets it declared; none the registry already holds (a re-attach re-finds the
        shifts from the stored steps). True when any was sent."""
        sent = False
        for shift in watched.judge.level_shifts():
            declared = shift["declared_tok_s"] is not None
            if (shift["at_step"], declared) in watched.shifts_reported:
                continue
            watched.shifts_reported |= {(shift["at_step"], declared), (shift["at_step"], False)}
            event = self.emit(watched, ev.LevelShift, **ev.LevelShift.fields_of(shift, declared))
            if not self.lifecycle.stores_for(watched.root):
                watched.unstored_shifts.append(event)
            sent = True
        return sent

    def record_decision(self, watched: WatchedRun, *, said: bool = True) -> None:
        """Store the run's decision (its owner) and, `said`, emit it and notify. Not `said`: the decision's
        next_run, once its fallback launched, is stored only; the `fell_back` event says it (the verdict is said once)."""
        decision = watched.decision.to_json()
        if self.lifecycle.stores_for(watched.root):
            self.store.update_run(watched.name, decision=decision)
        if not said:
            return
        self.emit(watched, ev.DecisionMade, decision=decision)
        self.notifier.decision(watched.name, watched.decision)

    def _exit_awaited(self, wait: StopWait) -> None:
        """A stop under way (stop_waiting) waits for its run to exit after SIGTERM: for the view, until it exits."""
        watched = self.watched.get(wait.name)
        if watched is not None and watched.alive is not False:
            watched.exit_wait = ExitWait(time.time() - wait.waited_s, wait.grace_s)

    def read_to_end(self, watched: WatchedRun) -> None:
        """A run this watch stopped (a fallback, a stop of its own or a batch's stop_when) is no longer followed;
        what it logged on its way out (its last steps, its `done` line), written after the agent's last read, is
        read to its log's end once it has exited (history.catch_up over the same channel's target, from the
        offset stored with its steps): never lost. Lines of it still on their way are dropped (ended)."""
        observer = self.observers[watched.source]
        observer.unfollow(watched.name)
        watched.ended = True
        run = self.store.find_run(watched.name)
        if (not self.lifecycle.stores_for(watched.root) or run is None or run.active or run.pid is None
                or run.history_complete):
            return  # an observer stores nothing; a run still going (its stop failed) is read by the next look
        try:
            catch_up(observer.target, observer.agent_cmd, self.store, [run], lambda _: watched.parse)
        except (DfoError, ProtocolError) as exc:
            self.emit(watched, ev.ActionError, error=f"the end of {watched.name}'s log was not read ({exc}); "
                                                      f"`dfo metrics {watched.name}` reads it")
            return
        watched.last_stored_step = self.store.last_step(watched.name)

    # ------------------------------------------------------------------ chains and events

    def _chain_summary(self, state: ChainState) -> dict[str, Any]:
        current = state.runs[-1]
        watched = self.watched.get(current)
        if watched is None:
            run = self.store.find_run(current)
            decision = (run.decision if run else None) or {"decision": "undecided", "run": current, "action": "none",
                                                           "reason": "no decision: not followed by this watch"}
            return {"root": state.root, "runs": list(state.runs), "current": current, "decision": decision,
                    "settled": False}
        return {"root": state.root, "runs": list(state.runs), "current": current,
                "decision": watched.decision.to_json(), "settled": self.lifecycle.settled(watched)}

    def emit(self, watched: WatchedRun, cls: type[ev.RunEvent], **data: Any) -> ev.RunEvent:
        event = cls(at=utc_now(), run=watched.name, chain=watched.root, **data)
        # an observing watcher shows, its owner stores (a kind an ended run's earlier watch stored: not again)
        stored = event.stored and self.lifecycle.stores_for(watched.root) and not (
            watched.replaying and self.store.events(watched.name, kind=event.kind))
        self.publish(event, watched.name, stored)
        return event

    def _emit_source(self, cls: type[ev.TargetEvent], source: str, **data: Any) -> None:
        self.publish(cls(at=utc_now(), target=source, **data), None, self.lifecycle.stores_any())

    def publish(self, event: ev.Event, run: str | None, store: bool) -> None:
        if store:
            self.store.add_event(run, event.kind, event.stored_data(), at=event.at)
        self._events.append(event)
        if self.on_event is not None:
            self.on_event(event)


@dataclass
class Writes:
    """What one step() collected for the store, written at its end (samples + offset: one transaction a run)."""

    samples: dict[str, list[dict]] = field(default_factory=dict)
    gpu_samples: list[tuple[str, str | None, list[dict]]] = field(default_factory=list)
    offsets: dict[str, int | None] = field(default_factory=dict)
    idents: dict[str, dict | None] = field(default_factory=dict)  # the log file each offset is in


def config_from_inventory(inventory: Inventory) -> DecideConfig:
    """The decision thresholds of the inventory's `watch:` section."""
    return DecideConfig.from_mapping(inventory.watch.decide_mapping())
