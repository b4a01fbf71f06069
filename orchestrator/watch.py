"""The watch loop: agent channels -> parsed lines -> decide/ -> registry -> actions (fallback chains).

A Watcher follows registered runs through one Observer per container (shared by every run in it, all on
the kept-open host connection), parses their log lines (logfmt, or the variant's `metrics:` regex), feeds
each run's RunJudge, persists samples, GPU samples, offsets, events and decisions, and acts on final
verdicts: on crash / stall / too_slow with action `fallback` it stops the run (identity-checked) and
launches the next variant of its chain on the same target as `<root>.<n>-<variant>` (n = the run's place in
the chain, the root being 1), linked to its parent, and follows it on the same observer.

The clock lives here, never in decide/: ticks are the workstation's time moved onto the container's clock
(the agent's hello carries its time), so a skewed host clock cannot fake a stall.

Re-attaching (`attach` of a run watched before) re-feeds the judge from the stored samples and resumes the
log at the stored offset; a step already stored is never stored again. Actions run on worker threads so a
slow stop never freezes the loop; their outcome comes back through the observation queue.

What it must not do: render (view.py does), parse options (commands/watch.py does), decide anything itself
(decide/ does), or signal a run on close: closing stops watching, never the runs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from .connections import Connections
from .decide import Catalogue, DecideConfig, Decision, ExitObs, GpuObs, RunJudge, StepObs, TickObs, observation_from_record
from .errors import DfoError, RefusedError, UnknownRun, UsageError
from .gpu import NvidiaSmiError, query_gpus
from .inventory import Inventory, TargetSpec
from .logfmt import MalformedLine, StepRecord, make_parser, parse_ts, step_problem
from .notify import Notifier
from .observe import Observation, Observer, ObserverBase, PollObserver
from .package import AGENT_NAME, Package, build_package, push
from .preflight import gpus_idle_check
from .runs import spec_for
from .runs import launch as launch_run
from .runs import stop as stop_run
from .store import Run, Store, utc_now

FALLBACK_VERDICTS = frozenset({"crash", "stall", "too_slow"})
DRAIN_MAX = 5000  # observations handled per step(); the rest wait for the next one
VANISHED_GRACE_S = 3.0  # a dead PID with no exit file yet: wait this long for the wrapper to write it
CATCH_UP_S = 3.0  # after a (re)connect, ticks wait this long for the log written meanwhile to arrive
MAX_NAME_TRIES = 5
SPARK_POINTS = 60
RECENT_LINES = 6
ACTION_JOIN_S = 5.0
GPU_RELEASE_S = 30.0  # after a stop, how long the target's GPUs get to go idle before the fallback starts
GPU_POLL_S = 1.0
GPU_QUERY_TIMEOUT_S = 15.0
MALFORMED_EVENTS = 20  # malformed-line events per run; after these the view's count goes on alone
SAMPLE_FIELDS = ("step", "ts", "tok_s", "loss", "phase", "acc", "lr", "q_fill", "active", "mem_gb")
Event = dict[str, Any]


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
    last_stored_step: int | None = None  # steps at or below this are already in the store
    throughput: deque = field(default_factory=lambda: deque(maxlen=SPARK_POINTS))
    latest: StepRecord | None = None
    lines: deque = field(default_factory=lambda: deque(maxlen=RECENT_LINES))
    gpu_now: list[dict] = field(default_factory=list)
    idle_reported: set = field(default_factory=set)  # (GPU index, idle since) already sent as gpu_idle events
    alive: bool | None = None
    exit_code: int | None = None
    gone_at: float | None = None  # when the PID was first seen dead without an exit status
    handled: bool = False  # the final decision was acted on (or reported, with --no-fallback)
    acting: bool = False  # an action (stop / launch) is in flight
    stopping: bool = False  # dfo stops this run: its exit is no verdict
    stopped_reason: str | None = None
    lost: bool = False  # its container was unreachable for longer than unreachable_s: the watch gave up on it
    dirty: bool = False  # fed since the decision was last read
    malformed: int = 0  # metric lines with a field out of range (ts=1e20 ...): shown, never stored or judged
    last_malformed: str | None = None  # why the last one was refused

    @property
    def name(self) -> str:
        return self.run.name


@dataclass
class ChainState:
    """The runs of one fallback chain, oldest first; the last one is the chain's current run."""

    root: str
    runs: list[str]
    variants: tuple[str, ...]


@dataclass(frozen=True)
class ActionDone:
    """What an action thread did, handed back to the loop through the observation queue."""

    run: str
    stopped: bool = False
    signal: str | None = None
    launched: Run | None = None
    error: str | None = None
    reason: str | None = None
    note: str | None = None  # why no signal was sent (it had ended, or its PID is another process's now)


@dataclass
class Link:
    """The state of one container's channel, for the view."""

    connected: bool = False
    reconnects: int = 0
    last_gap_s: float | None = None
    reason: str | None = None
    gpu_error: str | None = None
    ticks_from: float = 0.0  # no ticks before this time (the run's news since the drop is still on its way)
    down_since: float | None = None  # when the current outage began (None: connected, or never connected)

    def ticking(self, now: float) -> bool:
        """Whether silence means anything now: not while the channel is down or catching up."""
        return self.connected and now >= self.ticks_from


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
        on_event: Callable[[Event], None] | None = None,
        heartbeat_timeout: float = 5.0,
        stop_grace_s: float = 30.0,
        peer_baseline: bool = True,
        unreachable_s: float | None = None,
        gpu_release_s: float = GPU_RELEASE_S,
    ) -> None:
        self.inventory = inventory
        self.connections = connections
        self.store = store
        self.config = decide_config or config_from_inventory(inventory)
        self.catalogue = Catalogue().extended([s.model_dump() for s in inventory.signatures])
        self.fallback = fallback
        self.poll = poll
        self.chain_override = tuple(chain_override) if chain_override else None
        for variant in self.chain_override or ():
            inventory.variant(variant)
        self.on_event = on_event
        self.notifier = Notifier(inventory, store)
        self.heartbeat_timeout = heartbeat_timeout
        self.stop_grace_s = stop_grace_s
        self.peer_baseline = peer_baseline  # False: too slow only against a configured baseline_tok_s
        # A container silent this long is given up on (its runs end the watch undecided); shorter outages resume.
        self.unreachable_s = unreachable_s if unreachable_s is not None else inventory.watch.unreachable_s
        self.gpu_release_s = gpu_release_s
        self.queue: queue.Queue = queue.Queue()
        self.observers: dict[str, ObserverBase] = {}
        self.links: dict[str, Link] = {}
        self.skew: dict[str, float] = {}  # container clock minus workstation clock, per observer
        self.watched: dict[str, WatchedRun] = {}
        self._chains: dict[str, ChainState] = {}
        self._package: Package | None = None
        self._actions: list[threading.Thread] = []
        self._events: list[Event] = []
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ public

    def attach(self, name: str) -> WatchedRun:
        """Start (or resume, from the stored offset) following the registered run `name`."""
        with self._lock:
            if name in self.watched:
                return self.watched[name]
            run = self.store.get_run(name)
            observer = self._observer_for(run.target)  # first: a target out of reach registers nothing
            root, chain_runs = self._lineage(run)
            state = self._chains.get(root)
            if state is None:
                state = self._chains[root] = ChainState(root, chain_runs, self._chain_variants(root))
            elif name not in state.runs:
                state.runs.append(name)
            watched = self._new_watched(run, root, state.variants)
            self.watched[name] = watched
            stored = self._resume(watched)
            observer.follow(run.name, run.log_path, run.exit_path, run.pid, run.proc_starttime, offset=run.log_offset,
                            ident=run.log_ident)
            self._emit("attached", watched, {"target": run.target, "variant": run.variant, "offset": run.log_offset,
                                              "steps_stored": stored})
            return watched

    def step(self, timeout: float = 0.25) -> list[Event]:
        """Handle what arrived within `timeout` seconds: parse, persist, judge, act. Returns the new events."""
        items = self._drain(timeout)
        with self._lock:
            writes = Writes()
            for item in items:
                if isinstance(item, ActionDone):
                    self._action_done(item)
                else:
                    self._observed(item, writes)
            self._persist(writes)
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

    def final_decisions(self) -> list[dict[str, Any]]:
        """The current decision of each chain, in DESIGN.md's JSON shape (plus reason, evidence, chain)."""
        return [{**summary["decision"], "chain": summary["root"]} for summary in self.chains()]

    def stop_run(self, name: str, reason: str) -> None:
        """Stop a followed run for the caller's own reason (batch's stop_when); no fallback follows."""
        with self._lock:
            watched = self.watched.get(name)
            if watched is None:
                raise UnknownRun(f"run {name!r} is not followed by this watch", hint="attach it first")
            if watched.stopping:
                return
            watched.stopping = watched.acting = True
            watched.stopped_reason = reason
            self._emit("stopping", watched, {"reason": reason})
        self._start_action(watched, launch_next=None, reason=reason)

    def close(self) -> None:
        """Stop watching: close every channel (the agents exit; the runs keep running)."""
        for observer in list(self.observers.values()):
            observer.close()
        for thread in self._actions:
            thread.join(ACTION_JOIN_S)

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ attaching

    def _lineage(self, run: Run) -> tuple[str, list[str]]:
        """The chain root of `run` and the chain's runs from the root down to `run`."""
        names = [run.name]
        current = run
        while current.parent and len(names) < 100:
            parent = self.store.find_run(current.parent)
            if parent is None:
                break
            names.insert(0, parent.name)
            current = parent
        return names[0], names

    def _chain_variants(self, root: str) -> tuple[str, ...]:
        """The chain the root was launched with (its variant, then its stored chain ahead), else the override
        or the inventory's `fallback:`."""
        if self.chain_override:
            return self.chain_override
        run = self.store.get_run(root)
        if run.chain:
            return (run.variant, *run.chain) if run.variant not in run.chain else tuple(run.chain)
        return tuple(self.inventory.fallback)

    def _new_watched(self, run: Run, root: str, chain: tuple[str, ...]) -> WatchedRun:
        spec = self.inventory.target(run.target)
        variant = self.inventory.variants.get(run.variant) if run.variant else None
        judge = RunJudge(
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
        return WatchedRun(run, root, chain, judge, make_parser(variant.metrics if variant else None),
                          source=run.target, gpus=spec.gpus, decision=judge.decision())

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
        root, _ = self._lineage(run)
        peers = [r for r in self.store.list_runs(target=run.target)
                 if r.name != run.name and (self._lineage(r)[0] == root or (run.batch and r.batch == run.batch))]
        figures = [r.decision.get("steady_tok_s") for r in peers if r.decision and r.decision.get("steady_tok_s")]
        return max(figures) if figures else None

    def _resume(self, watched: WatchedRun) -> int:
        """Re-feed the judge from the stored samples (the view shows the last one); restore a final verdict an
        earlier watch reached. Returns how many steps were stored."""
        stored = 0
        for sample in self.store.samples(watched.name):
            if step_problem(sample.get("step"), sample.get("ts"), sample.get("tok_s")):
                continue  # stored by a dfo that did not check ranges (ts=1e20): skipped, so the watch recovers
            obs = StepObs(sample["ts"], int(sample["step"]), float(sample["tok_s"]), sample.get("loss"),
                          sample.get("phase") or "train", sample.get("active"))
            watched.judge.observe(obs)
            watched.last_stored_step = obs.step
            watched.throughput.append(obs.tok_s)
            stored += 1
            last = sample
        if stored:
            known = {name: last.get(name) for name in SAMPLE_FIELDS if last.get(name) is not None}
            watched.latest = StepRecord(**{**known, "ts": float(last.get("ts") or 0.0), "step": int(last["step"]),
                                           "tok_s": float(last["tok_s"])})
        watched.decision = watched.judge.decision()
        earlier = watched.run.decision
        if earlier and earlier.get("decision") in FALLBACK_VERDICTS:
            watched.decision = Decision(**{k: v for k, v in earlier.items() if k in Decision.__dataclass_fields__})
            children = [r for r in self.store.list_runs() if r.parent == watched.name]
            watched.handled = bool(children) or not watched.run.active
        return stored

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
            if watched is not None:
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
            self._emit_source("disconnected", obs.source, {"reason": link.reason})
        elif obs.kind == "gap":
            link.reconnects += 1
            link.last_gap_s = obs.data.get("duration_s")
            self._emit_source("gap", obs.source, {"duration_s": link.last_gap_s})
        elif obs.kind == "gpu":
            link.gpu_error = None
            self._gpu_observed(obs, writes)
        elif obs.kind == "gpu_error":
            link.gpu_error = str(obs.data.get("text") or "").strip()[:200]
            self._emit_source("gpu_error", obs.source, dict(obs.data))
        elif obs.kind == "error":
            self._emit_source("error", obs.source, dict(obs.data))

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
            self._emit("truncated", watched, dict(obs.data))
        elif obs.kind == "proc":
            self._proc(watched, obs)
        elif obs.kind == "error":
            self._emit("error", watched, dict(obs.data))

    def _line(self, watched: WatchedRun, line: str, received: float, writes: "Writes") -> None:
        record = watched.parse(line, received)
        if isinstance(record, StepRecord):
            if watched.last_stored_step is not None and record.step <= watched.last_stored_step:
                return  # stored by an earlier watch (or repeated by the log): never counted twice
            watched.last_stored_step = record.step
            watched.latest = record
            watched.throughput.append(record.tok_s)
            writes.samples.setdefault(watched.name, []).append(sample_of(record))
            self._emit("step", watched, {"step": record.step, "tok_s": record.tok_s, "loss": record.loss,
                                         "phase": record.phase}, store=False)
        elif isinstance(record, MalformedLine):
            watched.malformed += 1
            watched.last_malformed = record.reason
            watched.lines.append(f"[dfo: malformed metric line ignored: {record.reason}] {line[:200]}")
            if watched.malformed <= MALFORMED_EVENTS:
                self._emit("malformed", watched, {"reason": record.reason, "count": watched.malformed})
        else:
            watched.lines.append(line[:300])
        watched.judge.observe(observation_from_record(record, received))
        watched.dirty = True

    def _proc(self, watched: WatchedRun, obs: Observation) -> None:
        watched.alive, watched.exit_code = obs.data.get("alive"), obs.data.get("exit_code")
        if watched.alive or watched.stopping:  # dfo's own stop records how it ended
            watched.gone_at = None
            return
        if watched.exit_code is None:
            watched.gone_at = watched.gone_at or obs.at
            return
        self._ended(watched, watched.exit_code, self._clock(obs.source, obs.at))

    def _ended(self, watched: WatchedRun, code: int, ts: float, why: str | None = None) -> None:
        watched.judge.observe(ExitObs(ts, code))
        watched.dirty = True
        state = "exited" if code == 0 else "crashed"
        data = {"exit_code": code if code >= 0 else None, "state": state, "why": why or f"exit status {code}"}
        self._emit("ended", watched, data)
        run = self.store.find_run(watched.name)
        if run is not None and run.active:
            watched.run = self.store.update_run(watched.name, state=state, exit_code=data["exit_code"], ended_at=utc_now())

    def _gpu_observed(self, obs: Observation, writes: "Writes") -> None:
        gpus = [g for g in obs.data.get("gpus") or [] if isinstance(g, dict)]
        ts = obs.data.get("ts") if isinstance(obs.data.get("ts"), (int, float)) else self._clock(obs.source, obs.at)
        followed = [w for w in self.watched.values() if w.source == obs.source and not w.stopping]
        for watched in followed:
            mine = tuple(g for g in gpus if not watched.gpus or g.get("index") in watched.gpus)
            watched.gpu_now = list(mine)
            watched.judge.observe(GpuObs(ts, mine))
            self._emit("gpu", watched, {"gpus": list(mine)}, store=False)  # the GPU store table holds them
            self._report_idle_gpus(watched)
        active = [w for w in followed if w.alive is not False]
        owner = active[0].name if len(active) == 1 else None
        writes.gpu_samples.append((obs.source, owner, [{**g, "ts": ts} for g in gpus]))

    def _report_idle_gpus(self, watched: WatchedRun) -> None:
        """A `gpu_idle` event for each GPU of the run newly seen idle while its others stay busy."""
        for idle in watched.judge.idle_gpus.flagged.values():
            if (idle.index, idle.since) not in watched.idle_reported:
                watched.idle_reported.add((idle.index, idle.since))
                self._emit("gpu_idle", watched, {**idle.to_json(), "text": idle.describe()})

    def _persist(self, writes: "Writes") -> None:
        """Each run's samples and log offset in one transaction (a re-attach resumes right after them), then
        the GPU samples."""
        for name in writes.samples.keys() | writes.offsets.keys():
            self.store.add_samples(name, writes.samples.get(name, ()), offset=writes.offsets.get(name),
                                   ident=writes.idents.get(name))
        for source, run, samples in writes.gpu_samples:
            self.store.add_gpu_samples(source, samples, run=run)

    # ------------------------------------------------------------------ judging and acting

    def _tick(self) -> None:
        now = time.time()
        self._give_up_on_unreachable(now)
        for watched in self.watched.values():
            if watched.stopping or watched.handled or not self.links[watched.source].ticking(now):
                continue  # while the channel is down, silence says nothing about the run
            if watched.gone_at is not None and now - watched.gone_at > VANISHED_GRACE_S:
                watched.gone_at = None
                self._ended(watched, -1, self._clock(watched.source, now), why="the process is gone and left no exit status")
            watched.judge.observe(TickObs(self._clock(watched.source, now)))
            watched.dirty = True

    def _give_up_on_unreachable(self, now: float) -> None:
        """A container out of reach for longer than unreachable_s: its undecided runs end the watch, undecided,
        with the outage as the reason (silence from an unreachable host says nothing about its runs)."""
        for source, link in self.links.items():
            if link.connected or link.down_since is None or now - link.down_since < self.unreachable_s:
                continue
            for watched in self.watched.values():
                if watched.source != source or watched.lost or watched.acting or watched.stopped_reason is not None:
                    continue
                if watched.decision.final:
                    continue  # a verdict reached before the outage stands
                watched.lost = True
                down_s = now - link.down_since
                decision = watched.judge.decision().to_json()
                decision["reason"] = (f"{source} unreachable for {down_s:.0f} s (limit {self.unreachable_s:g} s: "
                                      f"{link.reason or 'no answer'}); the run may still be going: "
                                      f"dfo watch {watched.name} resumes it")
                decision["evidence"] = {**decision["evidence"], "unreachable_s": round(down_s, 1),
                                        "unreachable_reason": link.reason}
                watched.decision = Decision(**decision)
                self._record_decision(watched)
                self._emit("unreachable", watched, {"target": source, "duration_s": round(down_s, 1),
                                                    "reason": link.reason})

    def _found_again(self, source: str) -> None:
        """A container given up on answers again: its runs are judged again from where they were."""
        for watched in self.watched.values():
            if watched.source == source and watched.lost:
                watched.lost, watched.dirty = False, True
                watched.decision = watched.judge.decision()
                self._record_decision(watched)

    def _judge(self) -> None:
        for watched in list(self.watched.values()):
            if not watched.dirty or watched.stopping or watched.handled or watched.lost:
                continue
            watched.dirty = False
            if watched.decision.decision in FALLBACK_VERDICTS:  # restored from an earlier watch: final
                self._act(watched)
                continue
            decision = watched.judge.decision()
            if decision_key(decision) != decision_key(watched.decision):
                watched.decision = decision
                self._record_decision(watched)
            if decision.decision in FALLBACK_VERDICTS and not watched.handled:
                self._act(watched)

    def _record_decision(self, watched: WatchedRun) -> None:
        decision = watched.decision.to_json()
        self.store.update_run(watched.name, decision=decision)
        self._emit("decision", watched, {"decision": decision})
        self.notifier.decision(watched.name, decision)

    def _act(self, watched: WatchedRun) -> None:
        """A final verdict: with fallback on, stop the run (if it still runs) and launch the next variant."""
        watched.handled = True
        decision = watched.decision
        if not self.fallback or decision.action not in ("fallback", "stop"):
            return  # --no-fallback only reports
        watched.stopping = watched.acting = True
        self._emit("acting", watched, {"action": decision.action, "next_variant": decision.next_variant})
        self._start_action(watched, launch_next=decision.next_variant if decision.action == "fallback" else None,
                           reason=decision.decision + (f" [{decision.signature}]" if decision.signature else ""))

    def _start_action(self, watched: WatchedRun, *, launch_next: str | None, reason: str) -> None:
        running = watched.alive is not False and watched.run.active
        thread = threading.Thread(target=self._action_worker, args=(watched, running, launch_next, reason),
                                  name=f"act-{watched.name}", daemon=True)
        self._actions.append(thread)
        thread.start()

    def _action_worker(self, watched: WatchedRun, running: bool, launch_next: str | None, reason: str) -> None:
        """Runs on its own thread: stop, then launch; the outcome goes back to the loop as an ActionDone."""
        stopped, signal, launched, error, note = False, None, None, None, None
        target = self.connections.container(watched.run.target)
        try:
            if running:
                result = stop_run(target, self.store, watched.name, grace_s=self.stop_grace_s)
                stopped, signal = result.signal is not None, result.signal
        except RefusedError as exc:  # it had ended meanwhile, or its PID is someone else's now
            note = str(exc)
        except DfoError as exc:
            self.queue.put(ActionDone(watched.name, error=f"stop failed: {exc}", reason=reason))
            return
        try:
            busy = self._gpus_still_busy(target, self.inventory.target(watched.run.target)) if launch_next else None
            if busy:
                error = (f"not launching {launch_next}: the GPUs of {watched.run.target} are still busy "
                         f"{self.gpu_release_s:g} s after {watched.name} ended ({busy})")
            elif launch_next:
                launched = self._launch_next(target, watched, launch_next)
        except DfoError as exc:
            error = f"launching {launch_next} failed: {exc}"
        self.queue.put(ActionDone(watched.name, stopped, signal, launched, error, reason, note))

    def _gpus_still_busy(self, target, spec: TargetSpec) -> str | None:
        """The preflight's GPU check before a fallback starts (the rest of the preflight held a moment ago):
        None once the target's GPUs are idle, else why not after gpu_release_s. A target that lists no `gpus:`
        is not checked: dfo cannot tell its own GPUs from another tenant's."""
        if not spec.gpus:
            return None
        deadline = time.monotonic() + self.gpu_release_s
        while True:
            try:
                check = gpus_idle_check(query_gpus(target, timeout=GPU_QUERY_TIMEOUT_S), spec)
                why = None if check.ok else check.detail
            except NvidiaSmiError as exc:
                why = str(exc)
            if why is None or time.monotonic() >= deadline:
                return why
            time.sleep(GPU_POLL_S)

    def _overrides(self, root: str) -> dict[str, str]:
        """The `--set` overrides the chain's first run was launched with (runs.launch records them)."""
        launched = self.store.events(root, kind="launched")
        data = (launched[0]["data"] or {}) if launched else {}
        return dict(data.get("sets") or {})

    def _launch_next(self, target, watched: WatchedRun, variant: str) -> Run:
        chain = watched.chain
        rest = chain[chain.index(variant) + 1:] if variant in chain else ()
        builtin = self.inventory.variant(variant).command is None  # a user's command takes no trainer arguments
        spec = spec_for(self.inventory, watched.run.target, variant, parent=watched.name, chain=tuple(rest),
                        batch=watched.run.batch, sets=self._overrides(watched.root) if builtin else None)
        for name in fallback_names(watched.root, len(self._chains[watched.root].runs) + 1, variant):
            try:
                return launch_run(target, spec, self.store, name=name).run
            except RefusedError as exc:
                if "already exists" not in str(exc):
                    raise
        raise RefusedError(f"no free run name for the fallback of {watched.name}", hint="remove old runs of this chain")

    def _action_done(self, done: ActionDone) -> None:
        watched = self.watched.get(done.run)
        if watched is None:
            return
        watched.acting = False
        self.observers[watched.source].unfollow(watched.name)
        refreshed = self.store.find_run(watched.name)
        watched.run = refreshed or watched.run
        if done.stopped:
            self._emit("stopped", watched, {"signal": done.signal, "reason": done.reason})
        if done.note:
            self._emit("not_signalled", watched, {"why": done.note})
        if done.error:
            self._emit("action_error", watched, {"error": done.error})
        if done.launched is not None:
            self._chains[watched.root].runs.append(done.launched.name)
            decision = watched.decision.to_json()
            decision["next_run"] = done.launched.name
            watched.decision = Decision(**decision)
            self._record_decision(watched)
            self._emit("fell_back", watched, {"next_run": done.launched.name, "variant": done.launched.variant})
            try:
                self.attach(done.launched.name)
            except DfoError as exc:  # it runs; `dfo watch` can pick it up once the target answers
                self._emit("action_error", watched, {"error": f"cannot follow {done.launched.name}: {exc}"})

    # ------------------------------------------------------------------ chains and events

    def _chain_summary(self, state: ChainState) -> dict[str, Any]:
        current = state.runs[-1]
        watched = self.watched.get(current)
        if watched is None:
            run = self.store.find_run(current)
            decision = (run.decision if run else None) or {"decision": "undecided", "run": current}
            return {"root": state.root, "runs": list(state.runs), "current": current, "decision": decision,
                    "settled": False}
        if watched.stopped_reason is not None or watched.lost:
            settled = not watched.acting
        else:
            settled = watched.decision.final and not watched.acting and (
                watched.handled or watched.decision.decision not in FALLBACK_VERDICTS)
        return {"root": state.root, "runs": list(state.runs), "current": current,
                "decision": watched.decision.to_json(), "settled": settled}

    def _emit(self, kind: str, watched: WatchedRun, data: dict, *, store: bool = True) -> None:
        self._publish({"kind": kind, "at": utc_now(), "run": watched.name, "chain": watched.root, **data},
                      watched.name if store else None, store)

    def _emit_source(self, kind: str, source: str, data: dict) -> None:
        self._publish({"kind": kind, "at": utc_now(), "target": source, **data}, None, True)

    def _publish(self, event: Event, run: str | None, store: bool) -> None:
        if store:
            data = {k: v for k, v in event.items() if k not in ("kind", "at", "run")}
            self.store.add_event(run, event["kind"], data, at=event["at"])
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
    return DecideConfig.from_mapping(inventory.watch.model_dump())


def decision_key(decision: Decision) -> tuple:
    return decision.decision, decision.action, decision.next_run, decision.signature


def fallback_names(root: str, position: int, variant: str) -> Iterable[str]:
    """`<root>.<n>-<variant>` (n = the new run's place in its chain), then with `-2`, `-3`, ... if taken."""
    base = f"{root}.{position}-{variant}"
    yield base
    for suffix in range(2, MAX_NAME_TRIES + 1):
        yield f"{base}-{suffix}"


def sample_of(record: StepRecord) -> dict[str, Any]:
    """A metric line as a store sample (None fields left out; unknown keys kept as extras)."""
    sample = {name: getattr(record, name) for name in SAMPLE_FIELDS}
    sample = {k: v for k, v in sample.items() if v is not None}
    return {**record.extra, **sample}


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
    return names
