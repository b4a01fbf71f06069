"""`dfo batch`: an experiments file expanded into cells, run across targets by a resumable scheduler.

    experiments file (YAML) --experiments.load_experiments--> Plan (Experiments + [Cell], deterministic ids)
    Scheduler: CellTable (SQLite rows per cell) + GpuLedger (who holds which GPUs) + a Watcher that judges
      pending --launch--> running --stop_when holds, or the chain ends--> done | failed   (not started: error)

A cell is one (target, variant, settings, GPU count, repeat). Its first run is named `BATCH.CELL`. The
Watcher (built with fallback=False and policy BATCH_POLICY) judges runs; its Lifecycle is the batch's one (its
claims, and the executor of every fallback and stop of a cell, which one Ctrl-C finishes). On a verdict
chains.BATCH_POLICY falls back on (crash, stall) the scheduler hands the fallback to chains.Supervisor.fall_back, `dfo watch`'s
own, on that Lifecycle's executor (a bounded worker thread, finished on Ctrl-C within its bound: Lifecycle.carry_out): the
intent recorded once (subject the cell's first run), then the run stopped and the next variant of the chain
(chains.next_variant_after) launched once under chains' one naming rule (`BATCH.CELL.<n>-<variant>`) with
`parent` set, on the same GPUs with the same settings (chains.next_spec: those of the cell's first launch)
once those GPUs are released, so a fallback never lands on another cell's GPUs. A batch that dies inside a
fallback leaves its intent open: the next `dfo batch` of the file finishes it first (`dfo watch` leaves a batch
cell's fallback to it: carried out there it would be outside the GPU ledger). A too-slow verdict (against a configured baseline only) ends the cell as
`done`: its steady figure is the result, and a sweep is there to measure the slow configurations too. Two cells never hold one GPU at once: a cell without `gpus:` takes the whole
target; one with `gpus: N` takes N of the target's listed GPUs and runs with CUDA_VISIBLE_DEVICES set to
them; GPUs are released only once the cell's last run has ended. Everything the scheduler learns goes to
the store first, so running the same file again skips finished cells, reattaches to running chains and
starts the rest; a cell that could not start (`error`) is tried again.

This module must not render (the CLI draws Progress snapshots), parse logs or judge runs (the Watcher and
decide/ do), or reach a machine except through runs.launch, preflight and the Watcher.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol

from . import runs
from .chains import (BATCH_POLICY, FALLBACK, FallbacksLeft, Outcome, catalogue_for, fallback_text,
                     next_variant_after, rest_of_chain)
from .decide import Catalogue, Decision, read_stored
from .events import DecisionMade, Event, lease_held_text
from .errors import DfoError, RefusedError
from .experiments import Cell, Plan
from .inventory import Inventory
from .launchplan import Gate
from .lifecycle import Lifecycle, UnderWay
from .logfmt import format_ts, parse_ts
from .preflight import TOLERABLE_WHEN_BUSY, PreflightFailed
from .states import CellState, Verdict
from .store import Intent, Run, Store

EXIT_GRACE_S = 15.0  # time the Watcher gets to judge a run that ended before its cell is closed without a verdict
STOP_WAIT_S = 120.0  # a stop that has not ended the run by then (target unreachable) closes the cell anyway
MAX_PARALLEL_LAUNCHES = 16  # cells launched at once, and cell fallbacks carried out at once (the rest wait their turn)


# ---------------------------------------------------------------------------------------------- GPU ledger

class GpuLedger:
    """Which cell holds which GPUs of which target. A cell with `gpus: None` holds its whole target.

    `take` gives a cell GPUs only when none of them is held, the target has fewer than `per_target` cells
    and the batch fewer than `total`; otherwise it returns None and the cell waits.
    """

    def __init__(self, target_gpus: Mapping[str, tuple[int, ...]], *, per_target: int, total: Optional[int]) -> None:
        self.target_gpus = dict(target_gpus)
        self.per_target, self.total = per_target, total
        self.held: dict[str, tuple[str, tuple[int, ...], bool]] = {}  # cell id -> (target, gpu ids, whole target)

    def take(self, cell: Cell) -> Optional[tuple[int, ...]]:
        on_target = [entry for entry in self.held.values() if entry[0] == cell.target]
        if len(on_target) >= self.per_target or (self.total is not None and len(self.held) >= self.total):
            return None
        if any(whole for _, _, whole in on_target):
            return None
        listed = self.target_gpus.get(cell.target, ())
        if cell.gpus is None:
            return None if on_target else self.hold(cell.id, cell.target, listed, whole=True)
        busy = {index for _, ids, _ in on_target for index in ids}
        free = [index for index in listed if index not in busy]
        return self.hold(cell.id, cell.target, tuple(free[: cell.gpus])) if len(free) >= cell.gpus else None

    def hold(self, cell_id: str, target: str, gpu_ids: Iterable[int], *, whole: bool = False) -> tuple[int, ...]:
        ids = tuple(gpu_ids)
        self.held[cell_id] = (target, ids, whole)
        return ids

    def release(self, cell_id: str) -> None:
        self.held.pop(cell_id, None)


# ---------------------------------------------------------------------------------------------- cell table

@dataclass
class CellRecord:
    """A cell and what the store knows of it."""

    cell: Cell
    state: str = "pending"
    root_run: Optional[str] = None
    gpu_ids: tuple[int, ...] = ()
    started_at: Optional[str] = None
    ended_at: Optional[str] = None
    outcome: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        cell = self.cell
        return {"cell": cell.id, "target": cell.target, "variant": cell.variant, "sets": dict(cell.sets), "gpus": cell.gpus,
                "repeat": cell.repeat, "state": self.state, "root_run": self.root_run, "gpu_ids": list(self.gpu_ids),
                "started_at": self.started_at, "ended_at": self.ended_at, "outcome": self.outcome}


class CellTable:
    """A batch's cells as CellRecords, over the store's `batches` and `batch_cells` tables (migration 2)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def save_plan(self, plan: Plan, now: str) -> None:
        """Record the batch and any cell not recorded yet (cells already there keep their state)."""
        cells = [{"cell": c.id, "position": c.position, "target": c.target, "variant": c.variant,
                  "sets": json.dumps(dict(c.sets)), "gpus": c.gpus, "repeat": c.repeat} for c in plan.cells]
        self.store.save_batch(plan.batch, plan.source, plan.experiments.model_dump_json(), cells, now)

    def batches(self) -> list[dict[str, Any]]:
        return self.store.batches()

    def records(self, batch: str) -> list[CellRecord]:
        return [_record(row) for row in self.store.batch_cells(batch)]

    def update(self, batch: str, cell_id: str, **values: Any) -> None:
        encoded = {k: json.dumps(list(v) if k == "gpu_ids" else v) if k in ("gpu_ids", "outcome") else v for k, v in values.items()}
        self.store.update_cell(batch, cell_id, encoded)

    def chain(self, root: str) -> list[str]:
        """The run names from `root` along `parent` links (the fallbacks the scheduler started), oldest first."""
        return self.store.chain_runs(root)

    def last_step(self, run: str) -> Optional[int]:
        return self.store.last_step(run)


def _record(row: Any) -> CellRecord:
    sets = tuple(sorted(json.loads(row["sets"] or "{}").items()))
    cell = Cell(row["cell"], row["position"], row["target"], row["variant"], sets, row["gpus"], row["repeat"])
    return CellRecord(cell, row["state"], row["root_run"], tuple(json.loads(row["gpu_ids"] or "[]")), row["started_at"],
                      row["ended_at"], json.loads(row["outcome"] or "{}"))


# ---------------------------------------------------------------------------------------------- scheduler

class WatcherLike(Protocol):
    """What the scheduler needs of orchestrator.watch.Watcher (built with fallback=False: the batch falls back):
    its `lifecycle` is the batch's one (its executor, claims and policy), its stop_run a stop on that executor."""

    lifecycle: Lifecycle

    def attach(self, run_name: str) -> Any: ...
    def step(self, timeout: float) -> list[Event]: ...
    def stop_run(self, name: str, reason: str) -> Any: ...
    def stop_waiting(self, wait: runs.StopWait) -> None: ...


class Starter(Protocol):
    """Starts a cell's first run `name` of `variant` on the given GPUs (runs.launch in the field). A name
    already in the registry is adopted, never started twice."""

    def __call__(self, cell: Cell, gpu_ids: tuple[int, ...], variant: str, name: str) -> str: ...


@dataclass
class Progress:
    """A snapshot for the live view: counts per state, the running cells, an ETA and recent news."""

    batch: str
    counts: dict[str, int]
    running: list[tuple[str, str]]  # (cell id, current run)
    eta_s: Optional[float]
    news: list[str]


@dataclass
class _Stopping:
    """A stop that closes the cell (stop_when, too slow, nothing left to fall back to), and the cell's state once
    the run has ended. Kept in the cell's outcome until then, so a resumed batch still knows that a run it finds
    ended (exit 143) was stopped on purpose. (A fallback's stop is the fallback intent's: chains.)"""

    run: str
    reason: str
    state: str  # the cell's state once the run has ended
    decision: dict  # the verdict that led to the stop (a later one about the stopped run is not the result)
    since: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "reason": self.reason, "state": self.state, "decision": self.decision}


@dataclass
class _Active:
    record: CellRecord
    started: float  # epoch seconds
    waiting_since: Optional[float] = None  # when the chain's last run was first seen ended without a verdict
    stopping: Optional[_Stopping] = None
    falling_back: Optional[UnderWay] = None  # the fallback being carried out (its Outcomes), on the Lifecycle's executor
    fell_from: Optional[dict] = None  # the verdict it follows (a later `stopped` about that run is not the result)
    falling_since: Optional[float] = None  # when this scheduler began carrying it out


class Scheduler:
    """Runs a plan's unfinished cells to an outcome; see the module docstring for the state machine.

    A crash or stall verdict stops the run and starts the next variant of the plan's chain on
    the same GPUs with the same settings (decide.next_variant, as `dfo watch` does); a stop_when condition
    stops it and closes the cell. The cell's GPUs are freed only once its last run has ended.
    """

    def __init__(
        self,
        plan: Plan,
        store: Store,
        watcher: WatcherLike,
        start: Starter,
        *,
        clock: Callable[[], float] = time.time,
        poll_s: float = 1.0,
        on_progress: Optional[Callable[[Progress], None]] = None,
        ready: Optional[Callable[[str], Optional[str]]] = None,
        catalogue: Optional[Catalogue] = None,
        stop_wait_s: float = STOP_WAIT_S,
        on_interrupt: Optional[Callable[[list[str]], None]] = None,
    ) -> None:
        self.plan, self.store, self.watcher, self.start = plan, store, watcher, start
        self.on_interrupt = on_interrupt or (lambda fallbacks: None)  # Ctrl-C with fallbacks under way: which
        self.turns = threading.BoundedSemaphore(MAX_PARALLEL_LAUNCHES)  # the cell fallbacks carried out at once
        self.table = CellTable(store)
        self.clock, self.poll_s, self.stop_wait_s = clock, poll_s, stop_wait_s
        self.on_progress = on_progress or (lambda progress: None)
        self.ready = ready or (lambda target: None)  # target -> None, or why it cannot take runs now
        self.catalogue = catalogue or Catalogue()
        concurrency = plan.experiments.concurrency
        self.ledger = GpuLedger(plan.target_gpus, per_target=concurrency.per_target, total=concurrency.total)
        self.records: dict[str, CellRecord] = {}
        self.decisions: dict[str, dict] = {}  # run name -> its latest decision (its JSON) from the watcher
        self.active: dict[str, _Active] = {}
        self.news: deque[str] = deque(maxlen=6)
        self.durations: list[float] = []
        # the batch's one Lifecycle, its Watcher's (open_watcher: policy BATCH_POLICY): the policy (the verdicts a cell
        # falls back on), the claims, and the one executor of the cells' fallbacks and stops (stop_when, too slow,
        # nothing left to fall back to): bounded worker threads, finished on Ctrl-C within their bounds
        # (Lifecycle.carry_out, Lifecycle.stop, finish_actions)
        self.lifecycle = watcher.lifecycle
        self.supervisor, self.claims = self.lifecycle.supervisor, self.lifecycle.claims
        self.elsewhere: set[str] = set()  # unfinished cells another live `dfo batch` holds: watched, not touched

    # -- the loop

    def run(self) -> list[CellRecord]:
        """Until every cell is done, failed or could not start; returns the cells in plan order."""
        self.table.save_plan(self.plan, format_ts(self.clock()))
        wanted = {cell.id for cell in self.plan.cells}
        self.records = {r.cell.id: r for r in self.table.records(self.plan.batch) if r.cell.id in wanted}
        left: Optional[FallbacksLeft] = None
        try:
            self._resume()
            while True:
                self._start_ready()
                if not self.active and not self.elsewhere:
                    break
                self._watch_for(self.poll_s)
                for active in list(self.active.values()):
                    self._check(active)
                self._look_elsewhere()
                self._report()
        except KeyboardInterrupt:
            left = self._finish_fallbacks()
            if left is not None:
                raise left from None
            raise
        finally:
            # a fallback under way gets ACTION_JOIN_S to end (its intent stays open), unless Ctrl-C twice left it
            if left is None:
                self.lifecycle.close()
            self.claims.release_all()
        self._report()
        return [self.records[cell.id] for cell in self.plan.cells]

    def _mine(self, record: CellRecord) -> bool:
        """Whether this scheduler holds (or now takes) the cell's claim; a cell another live `dfo batch` of the
        same batch holds is left to it (watched until it finishes or its lease runs out)."""
        key = f"cell:{self.plan.batch}/{record.cell.id}"
        if self.claims.holds(key):
            self.elsewhere.discard(record.cell.id)
            return True
        if record.cell.id not in self.elsewhere:
            holder = self.claims.holder(key)
            self.news.append(f"{record.cell.id}: " + (
                "run by another dfo batch" if holder is None else lease_held_text(
                    holder.host, holder.pid, format_ts(holder.since) if holder.since else None,
                    holder.expires_at - holder.renewed_at, what="cell", by="batch",
                    here=self.claims.held_elsewhere(key) is None)))
        self.elsewhere.add(record.cell.id)
        return False

    def _look_elsewhere(self) -> None:
        """Cells another scheduler held: take their news from the registry; take over those whose lease ran
        out (that dfo was killed), as a resumed invocation would."""
        for cell_id in list(self.elsewhere):
            fresh = next(r for r in self.table.records(self.plan.batch) if r.cell.id == cell_id)
            self.records[cell_id] = fresh
            if CellState(fresh.state).is_final():
                self.elsewhere.discard(cell_id)
            elif self._mine(fresh):
                self.news.append(f"{cell_id}: taken over from a dfo batch that went away")
                self._resume_cell(fresh)

    def _resume(self) -> None:
        """Cells left running by an earlier invocation: reattach to their chain's last run, or start again
        when the run was never recorded (dfo stopped between reserving the cell and launching)."""
        for record in self.records.values():
            if not CellState(record.state).is_final() and self._mine(record):
                self._resume_cell(record)

    def _resume_cell(self, record: CellRecord) -> None:
        """Reattach a running cell to its chain's last run (or start it again when that run was never recorded);
        a cell that could not start is pending again."""
        if record.state == "error":  # could not start; or its fallback was left open: finished first, on its GPUs
            self._set(record, state="running" if record.root_run and self._open_fallback(record) else "pending")
        if record.state != "running":
            return
        if record.root_run is None or self.store.find_run(record.root_run) is None:
            self._set(record, state="pending", root_run=None)
            return
        self.ledger.hold(record.cell.id, record.cell.target, record.gpu_ids, whole=record.cell.gpus is None)
        active = _Active(record, parse_ts(record.started_at or "") or self.clock())
        self.active[record.cell.id] = active
        if self._open_fallback(record):  # an earlier invocation died inside a fallback: finished first
            self.news.append(f"{record.cell.id}: finishing the fallback a dfo that went away left half done")
            self._finish_open(active)
            return
        last = self.table.chain(record.root_run)[-1]
        self._attach(active, last)
        self.news.append(f"{record.cell.id}: reattached to {last}")
        intent = record.outcome.get("stopping")
        if intent and intent.get("run") == last:  # an earlier invocation was stopping it: finish that
            active.stopping = _Stopping(intent["run"], intent["reason"], intent["state"], intent["decision"], self.clock())
            self._request_stop(self.store.get_run(last), intent["reason"])

    def _start_ready(self) -> None:
        """Give GPUs to every pending cell that fits now, and launch those cells at once (one thread each)."""
        starting: list[tuple[CellRecord, tuple[int, ...]]] = []
        blocked: dict[str, Optional[str]] = {}
        for record in self.records.values():
            if record.state != "pending" or record.cell.id in self.elsewhere or not self._mine(record):
                continue
            target = record.cell.target
            if target not in blocked:
                blocked[target] = self.ready(target)
            if blocked[target]:
                self._set(record, state="error", outcome={"error": blocked[target]})
                continue
            gpu_ids = self.ledger.take(record.cell)
            if gpu_ids is not None:
                starting.append((record, gpu_ids))
        if not starting:
            return
        for record, gpu_ids in starting:
            self._set(record, state="running", root_run=record.cell.run_name(self.plan.batch), gpu_ids=gpu_ids,
                      started_at=format_ts(self.clock()), ended_at=None, outcome={})
        with ThreadPoolExecutor(max_workers=min(len(starting), MAX_PARALLEL_LAUNCHES), thread_name_prefix="launch") as pool:
            results = list(pool.map(lambda pair: self._launch_root(*pair), starting))
        for (record, _), error in zip(starting, results):
            if error is None:
                active = self.active[record.cell.id] = _Active(record, self.clock())
                self._attach(active, record.root_run)
            else:
                self.ledger.release(record.cell.id)
                self._set(record, state="error", root_run=None, ended_at=format_ts(self.clock()), outcome={"error": error})

    def _launch_root(self, record: CellRecord, gpu_ids: tuple[int, ...]) -> Optional[str]:
        """Launch a cell's first run; the error text if it could not start."""
        cell = record.cell
        try:
            self.start(cell, gpu_ids, cell.variant, record.root_run)
        except DfoError as exc:
            self.news.append(f"{cell.id}: could not start: {exc}")
            return str(exc)
        self.news.append(f"{cell.id}: started {record.root_run}" + (f" on GPUs {','.join(map(str, gpu_ids))}" if cell.gpus else ""))
        return None

    def _attach(self, active: _Active, run: str) -> None:
        try:
            self.watcher.attach(run)
        except DfoError as exc:  # unreachable now: the chain is looked at again on every pass
            self.news.append(f"{active.record.cell.id}: cannot watch {run} yet: {exc}")

    def _watch_for(self, seconds: float) -> None:
        """Let the watcher work for `seconds` (it returns early whenever records arrive), keeping its decisions."""
        started = self.clock()
        while True:
            left = seconds - (self.clock() - started)
            if left <= 0:
                return
            self._take_news(self.watcher.step(left))

    def _take_news(self, events: Iterable[Event]) -> None:
        for event in events:
            raw = decision_of(event)
            decision, _ = read_stored(raw)
            if decision is None or not decision.run:
                continue
            self.decisions[decision.run] = raw  # kept as sent: a cell's outcome stores it as it is
            if decision.decision != Verdict.UNDECIDED:
                self.news.append(f"{decision.run}: {decision.decision}")

    # -- one cell

    def _check(self, active: _Active) -> None:
        if not self._mine(active.record):  # this dfo hung past its lease: the cell is another scheduler's now
            self.ledger.release(active.record.cell.id)
            self.active.pop(active.record.cell.id, None)
            return
        if active.falling_back is not None:
            if active.falling_back.ended.is_set():
                self._after_fallback(active)
            return
        chain = self.table.chain(active.record.root_run)
        run = self.store.get_run(chain[-1])
        decision = self.decisions.get(run.name) or run.decision or {}  # the JSON a cell's outcome keeps
        if active.stopping is not None:
            if not run.active or self.clock() - active.stopping.since >= self.stop_wait_s:
                self._after_stop(active, chain)
            return
        typed, _ = read_stored(decision)  # None: none yet, or one it cannot read (no verdict: waited out as none)
        verdict = typed.decision if typed is not None else None
        if self.lifecycle.acts_on(verdict):
            following = self._next_variant(run, typed)
            why = f"{verdict}: {typed.reason or ''}".strip(": ")
            if following is None:
                self._stop(active, run, decision, why, "failed")
            else:
                self.news.append(f"{active.record.cell.id}: {run.name} {why[:60]}; falling back to {following}")
                active.fell_from = decision
                self._carry_out(active, [{"run": run.name, "variant": following}],
                                self.supervisor.bound_s(run, launches=True),
                                lambda: [self.supervisor.fall_back(run, following, list(self.plan.chain),
                                                                   f"batch {self.plan.batch}: {why}")])
            return
        if verdict == Verdict.TOO_SLOW:
            self._stop(active, run, decision, f"too_slow: {typed.reason or ''}".rstrip(": "), "done")
            return
        reached = self._stop_reason(active, run.name, verdict)
        if reached:
            self._stop(active, run, decision, f"stop_when {reached}", "done")
        elif not run.active and (verdict in (Verdict.EXITED, Verdict.STEADY) or self._waited(active, EXIT_GRACE_S)):
            state = CellState.DONE if run.state == "exited" or verdict in (Verdict.EXITED, Verdict.STEADY) else CellState.FAILED
            self._finish(active, chain, decision, state, f"run ended ({run.state}, exit code {run.exit_code})")
        elif run.active:
            active.waiting_since = None

    def _next_variant(self, run: Run, decision: Decision) -> Optional[str]:
        return next_variant_after(self.plan.chain, run, decision.next_variant, decision.signature, self.catalogue,
                                  self.plan.topologies)

    def _stop_reason(self, active: _Active, run: str, verdict: Optional[Verdict]) -> Optional[str]:
        stop_when = self.plan.experiments.stop_when
        if stop_when.kind == "steady":
            return "steady" if verdict == "steady" else None
        if stop_when.kind == "steps":
            step = self.table.last_step(run)
            return f"reached step {step}" if step is not None and step >= stop_when.value else None
        elapsed = self.clock() - active.started
        return f"{elapsed / 60:.1f} minutes" if elapsed >= stop_when.value * 60 else None

    def _waited(self, active: _Active, limit_s: float) -> bool:
        """True once the chain's last run has been over, with no verdict, for `limit_s`."""
        now = self.clock()
        active.waiting_since = active.waiting_since or now
        return now - active.waiting_since >= limit_s

    def _stop(self, active: _Active, run: Run, decision: dict, reason: str, state: str) -> None:
        """Record why `run` is being stopped, then ask the watcher to stop it; `_after_stop` goes on once it has ended."""
        active.stopping = _Stopping(run.name, reason, state, decision, self.clock())
        self._set(active.record, outcome={"stopping": active.stopping.to_json()})
        self._request_stop(run, reason)

    def _request_stop(self, run: Run, reason: str) -> None:
        if not run.active:
            return
        try:
            self.watcher.stop_run(run.name, f"batch {self.plan.batch}: {reason}")
        except (DfoError, KeyError) as exc:  # ended meanwhile, or not followed: the outcome stands
            self.news.append(f"{run.name}: stop failed: {exc}")

    def _after_stop(self, active: _Active, chain: list[str]) -> None:
        stopping = active.stopping
        active.stopping = None
        self._finish(active, chain, stopping.decision, stopping.state, stopping.reason)

    # -- a cell's fallback

    def _open_fallback(self, record: CellRecord) -> Optional[Intent]:
        """The cell's fallback intent still open (a stop or launch not carried out yet), or None."""
        return next((intent for intent in self.store.open_intents(record.root_run) if intent.kind == FALLBACK), None)

    def _finish_fallbacks(self) -> Optional[FallbacksLeft]:
        """Ctrl-C: the cells' fallbacks under way are carried to their end first, each within its bound
        (Lifecycle.finish_actions: on_interrupt says which; a second Ctrl-C, or one still under way past its bound,
        leaves them half done, their intents open for the next `dfo batch`)."""
        return self.lifecycle.finish_actions(self.on_interrupt)

    def _carry_out(self, active: _Active, fallbacks: list[dict[str, Any]], bound_s: float,
                   fallback: Callable[[], list[Outcome]]) -> None:
        """Carry out a cell's fallback (`fallbacks`: each `run` and `variant`) on the Lifecycle's executor (its stop
        waits for the run to end, its launch for the GPUs) while the other cells are watched; at most
        MAX_PARALLEL_LAUNCHES at once, the rest wait their turn (inside their bound); _check goes on once it is done."""
        def in_turn() -> list[Outcome]:
            with self.turns:
                return fallback()

        active.falling_since = active.falling_since or self.clock()
        what = "; ".join(fallback_text(data) for data in fallbacks) or "a fallback"
        active.falling_back = self.lifecycle.carry_out(f"{what} (cell {active.record.cell.id})", bound_s, in_turn)

    def _finish_open(self, active: _Active) -> None:
        """Carry out again the cell's fallback intents left open (a dfo that died, a stop that failed)."""
        root = active.record.root_run
        intents = [intent for intent in self.store.open_intents(root) if intent.kind == FALLBACK]
        bound_s = sum(self.supervisor.bound_s(self.store.find_run(intent.data["run"]) or self.store.get_run(root),
                                              launches=True) for intent in intents)
        self._carry_out(active, [intent.data for intent in intents], bound_s, lambda: self.supervisor.finish_open(root))

    def _after_fallback(self, active: _Active) -> None:
        """Attach the successor the fallback launched (or adopted), or close the cell when none started. A
        fallback whose stop failed is still open: carried out again (chains.carry_out_fallback, once) until
        stop_wait_s have passed, then the cell is closed as `error` (its GPUs released here) with the intent left
        open: the next `dfo batch` of the file takes the cell up again on its GPUs and finishes it first."""
        record, done = active.record, active.falling_back
        active.falling_back = None
        if isinstance(done.raised, DfoError):  # another dfo is still carrying it out past INTENT_WAIT_S: tried again
            outcomes = [Outcome(record.root_run, error=str(done.raised))]
        elif done.raised is not None:  # a Ctrl-C inside it, or a bug: raised on the loop
            raise done.raised
        else:
            outcomes = done.result
        if self._open_fallback(record):  # its stop failed (the target out of reach): again, for stop_wait_s
            error = "; ".join(outcome.error for outcome in outcomes if outcome.error) or "not carried out"
            if self.clock() - active.falling_since < self.stop_wait_s:
                self.news.append(f"{record.cell.id}: fallback not carried out yet ({error})")
                self._finish_open(active)
                return
            outcomes = [Outcome(outcomes[-1].run if outcomes else record.root_run,
                                error=f"{error} (the fallback stays open: the next `dfo batch` of this file "
                                      f"finishes it)")]
        launched = next((outcome.launched for outcome in outcomes if outcome.launched is not None), None)
        if launched is not None:
            self.news.append(f"{record.cell.id}: fell back to {launched.name}")
            active.waiting_since = active.falling_since = active.fell_from = None
            self._attach(active, launched.name)
            return
        errors = "; ".join(outcome.error for outcome in outcomes if outcome.error) or "no successor launched"
        last = outcomes[-1].run if outcomes else self.table.chain(record.root_run)[-1]
        verdict = active.fell_from or self.store.get_run(last).decision or {}
        typed, _ = read_stored(verdict)
        left_open = self._open_fallback(record) is not None  # taken up again by the next invocation
        self._finish(active, self.store.lineage(last), verdict, CellState.ERROR if left_open else CellState.FAILED,
                     f"{typed.decision if typed is not None else 'failed'}; fallback did not start: {errors}")

    def _finish(self, active: _Active, chain: list[str], decision: dict, state: str, why: str) -> None:
        """Close the cell: it ended when its final run did (the run's ended_at: its exit file's time), else (a run
        still going, its stop failed) now."""
        record = active.record
        outcome = {"final_run": chain[-1], "runs": chain, "decision": decision or None, "why": why}
        final = self.store.find_run(chain[-1])
        ended_at = final.ended_at if final is not None and not final.active and final.ended_at else format_ts(self.clock())
        self._set(record, state=state, ended_at=ended_at, outcome=outcome)
        self.ledger.release(record.cell.id)
        self.active.pop(record.cell.id, None)
        self.durations.append(self.clock() - active.started)
        self.news.append(f"{record.cell.id}: {state} ({why[:80]})")

    # -- bookkeeping

    def _set(self, record: CellRecord, **values: Any) -> None:
        self.table.update(self.plan.batch, record.cell.id, **values)
        for key, value in values.items():
            setattr(record, key, tuple(value) if key == "gpu_ids" else value)

    def _report(self) -> None:
        counts = {str(state): 0 for state in CellState}
        for record in self.records.values():
            counts[record.state] += 1
        running = [(cell_id, self.table.chain(a.record.root_run)[-1]) for cell_id, a in self.active.items()]
        self.on_progress(Progress(self.plan.batch, counts, running, self._eta(counts), list(self.news)))

    def _eta(self, counts: dict[str, int]) -> Optional[float]:
        """Mean cell duration so far x the rounds of cells still to go, less the time the running ones have had."""
        if not self.durations or not self.active:
            return None
        mean = sum(self.durations) / len(self.durations)
        rounds = math.ceil((counts["pending"] + len(self.active)) / len(self.active))
        spent = sum(self.clock() - a.started for a in self.active.values()) / len(self.active)
        return max(0.0, rounds * mean - min(spent, mean))


def decision_of(event: Event) -> Optional[dict]:
    """The Decision JSON carried by a watcher `decision` event; None for any other event."""
    return dict(event.decision) if isinstance(event, DecisionMade) else None


# ---------------------------------------------------------------------------------------------- the field

def run_spec(plan: Plan, inventory: Inventory, cell: Cell, gpu_ids: tuple[int, ...], variant: str, *,
             wandb: str = "off") -> runs.RunSpec:
    """A cell's first run: `variant` with the cell's settings, on its GPUs, in the batch (a fallback carries
    them on from its launch: chains.next_spec)."""
    chain = rest_of_chain(plan.chain, variant)
    builtin = inventory.variant(variant).command is None
    spec = runs.spec_for(inventory, cell.target, variant, sets=dict(cell.sets) if builtin else None, wandb=wandb,
                         batch=plan.batch, chain=chain)
    if cell.gpus:
        spec = replace(spec, env={**spec.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))})
    return spec


def launcher(plan: Plan, inventory: Inventory, connections: Any, store: Store, *, wandb: str = "off",
             ours: frozenset[str] = frozenset()) -> Starter:
    """A Starter that launches through runs.launch; a run already recorded under the name (an earlier
    invocation stopped right after launching it) is adopted, never started twice.

    A target's first launch carries its preflight (one remote call for both: runs.launch with a Gate); its
    other cells wait for that verdict and share it. Busy GPUs pass on targets in `ours` (running cells of
    this batch). A cell's fallback does not come here: chains.Supervisor.fall_back launches it."""
    verdicts: dict[str, Optional[str]] = {}  # target -> None (passed) or why its preflight refused
    locks: dict[str, threading.Lock] = {target: threading.Lock() for target in plan.target_gpus}

    def start(cell: Cell, gpu_ids: tuple[int, ...], variant: str, name: str) -> str:
        if store.find_run(name) is not None:
            return name
        spec = run_spec(plan, inventory, cell, gpu_ids, variant, wandb=wandb)
        target = connections.container(cell.target)
        with locks[cell.target]:
            if cell.target not in verdicts:
                tolerate = TOLERABLE_WHEN_BUSY if cell.target in ours else ()
                try:
                    runs.launch(target, spec, store, name=name, gate=Gate(inventory.target(cell.target), tolerate=tolerate),
                                start_grace_s=inventory.watch.start_grace_s)
                except PreflightFailed as exc:
                    verdicts[cell.target] = "preflight failed: " + "; ".join(f"{c.name}: {c.detail}" for c in exc.failed)
                    raise RefusedError(verdicts[cell.target]) from None
                verdicts[cell.target] = None
                return name
        if verdicts[cell.target]:
            raise RefusedError(verdicts[cell.target])
        runs.launch(target, spec, store, name=name, start_grace_s=inventory.watch.start_grace_s)
        return name

    return start


def open_watcher(inventory: Inventory, connections: Any, store: Store, **options: Any) -> Any:
    """The Watcher of `dfo watch`, judging only: the scheduler stops runs and falls back itself, so a fallback
    keeps its cell's settings and GPUs; too slow only against a configured baseline, never against the best
    peer of the batch (a sweep measures the slow configurations too)."""
    from .watch import Watcher  # the watch loop and its agent channels load only when a batch runs

    return Watcher(inventory, connections, store, fallback=False, peer_baseline=False, policy=BATCH_POLICY, **options)


def run_batch(
    plan: Plan,
    inventory: Inventory,
    connections: Any,
    store: Store,
    watcher: WatcherLike,
    *,
    on_progress: Optional[Callable[[Progress], None]] = None,
    on_interrupt: Optional[Callable[[list[str]], None]] = None,
    wandb: str = "off",
    poll_s: float = 1.0,
) -> list[CellRecord]:
    """Preflight the targets that still have cells to start, then schedule until every cell has an outcome."""
    from .history import sync_before_attach  # agent channels load only when a batch runs

    table = CellTable(store)
    table.save_plan(plan, format_ts(time.time()))
    records = [r for r in table.records(plan.batch) if not CellState(r.state).is_final()]
    ours = frozenset(r.cell.target for r in records if r.state == "running")
    # the runs the cells left running: rows and histories up to date before they are attached, as `dfo watch` does
    # (history.sync_before_attach): one that ended meanwhile is judged at once from its whole log, not followed
    last = [run for r in records if r.state == "running" and r.root_run and store.find_run(r.root_run) is not None
            if (run := store.find_run(table.chain(r.root_run)[-1])) is not None]
    problems = sync_before_attach(store, last, lambda run: connections) if last else {}
    catalogue = catalogue_for(inventory)
    scheduler = Scheduler(plan, store, watcher, launcher(plan, inventory, connections, store, wandb=wandb, ours=ours),
                          poll_s=poll_s, on_progress=on_progress, catalogue=catalogue, on_interrupt=on_interrupt)
    scheduler.news.extend(f"could not read the logs on {target} before resuming ({why})" for target, why in problems.items())
    return scheduler.run()


def plan_rows(plan: Plan, store: Optional[Store] = None) -> list[dict[str, Any]]:
    """The dry-run plan: one row per cell with its run name and what a real run would do with it now."""
    known = {r.cell.id: r for r in CellTable(store).records(plan.batch)} if store is not None else {}
    rows = []
    for cell in plan.cells:
        record = known.get(cell.id)
        state = record.state if record else "pending"
        action = {"done": "skip (done)", "failed": "skip (failed)", "running": "reattach"}.get(state, "start")
        rows.append({"cell": cell.id, "target": cell.target, "variant": cell.variant, "sets": dict(cell.sets),
                     "gpus": cell.gpus, "repeat": cell.repeat, "run": cell.run_name(plan.batch), "state": state, "action": action})
    return rows
