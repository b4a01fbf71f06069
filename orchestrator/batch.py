"""`dfo batch`: an experiments file expanded into cells, run across targets by a resumable scheduler.

    experiments file (YAML) --experiments.load_experiments--> Plan (Experiments + [Cell], deterministic ids)
    Scheduler: CellTable (SQLite rows per cell) + GpuLedger (who holds which GPUs) + a Watcher that judges
      pending --launch--> running --stop_when holds, or the chain ends--> done | failed   (not started: error)

A cell is one (target, variant, settings, GPU count, repeat). Its first run is named `BATCH.CELL`. The
Watcher (open_watcher: policy BATCH_POLICY) judges runs and its Lifecycle, the batch's one (act_for_batch), acts on
them as `dfo watch`'s does: on a verdict BATCH_POLICY falls back on (crash, stall) it stops the run and launches
the next variant the verdict names (chains.Supervisor.fall_back, on a bounded worker of its executor, at most
MAX_PARALLEL_LAUNCHES at once, finished on Ctrl-C within its bound): the intent recorded once (subject the cell's
first run), the successor named by chains' one rule (`BATCH.CELL.<n>-<variant>`) with `parent` set, on the same GPUs
with the same settings (chains.next_spec: those of the cell's first launch) once those GPUs are released, so a
fallback never lands on another cell's GPUs, and followed (ActionDone); with nothing left to fall back to it stops the
run. The scheduler keeps the cell table, the GPU ledger and stop_when (a stop it asks of the Lifecycle: stop_run),
and reads what the Lifecycle left in the cell's chain (its newest run, its verdict, an open intent) to close the
cell. A fallback whose stop fails stays open: the scheduler asks the Lifecycle to carry it out again
(finish_fallbacks) for stop_wait_s, then closes the cell `error`; a batch that dies inside a fallback leaves its
intent open too, and the next `dfo batch` of the file has it finished first (`dfo watch` leaves a batch cell's
fallback to it: carried out there it would be outside the GPU ledger). A too-slow verdict (against a configured baseline only) ends the cell as
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
from .chains import BATCH_POLICY, FALLBACK, FallbacksLeft, rest_of_chain
from .decide import read_stored
from .events import Acting, ActionError, DecisionMade, Event, lease_held_text
from .errors import DfoError, RefusedError
from .experiments import Cell, Plan
from .inventory import Inventory
from .launchplan import Gate
from .lifecycle import Lifecycle
from .logfmt import format_ts, parse_ts
from .preflight import TOLERABLE_WHEN_BUSY, PreflightFailed
from .states import Action, CellState, Verdict
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
    """What the scheduler needs of orchestrator.watch.Watcher: its `lifecycle` is the batch's one (its policy, claims
    and executor: it acts on the cells' verdicts), its stop_run a stop on that executor."""

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
    """A stop of the scheduler's that closes the cell (stop_when, too slow), and the cell's state once
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
    current: Optional[str] = None  # the newest run of its chain when last looked at
    open_since: Optional[float] = None  # when this scheduler first found its fallback left open (Lifecycle.finish_fallbacks)


class Scheduler:
    """Runs a plan's unfinished cells to an outcome; see the module docstring for the state machine.

    A crash or stall verdict is the batch's Lifecycle's to act on (the next variant of the chain on the same GPUs with
    the same settings, as `dfo watch` falls back); a stop_when condition stops the run and closes the cell. The cell's
    GPUs are freed only once its last run has ended.
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
        stop_wait_s: float = STOP_WAIT_S,
        on_interrupt: Optional[Callable[[list[str]], None]] = None,
    ) -> None:
        self.plan, self.store, self.watcher, self.start = plan, store, watcher, start
        self.on_interrupt = on_interrupt or (lambda fallbacks: None)  # Ctrl-C with fallbacks under way: which
        self.table = CellTable(store)
        self.clock, self.poll_s, self.stop_wait_s = clock, poll_s, stop_wait_s
        self.on_progress = on_progress or (lambda progress: None)
        self.ready = ready or (lambda target: None)  # target -> None, or why it cannot take runs now
        concurrency = plan.experiments.concurrency
        self.ledger = GpuLedger(plan.target_gpus, per_target=concurrency.per_target, total=concurrency.total)
        self.records: dict[str, CellRecord] = {}
        self.decisions: dict[str, dict] = {}  # run name -> its latest decision (its JSON) from the watcher
        self.errors: dict[str, str] = {}  # run name -> what the Lifecycle last said went wrong acting on it
        self.active: dict[str, _Active] = {}
        self.news: deque[str] = deque(maxlen=6)
        self.durations: list[float] = []
        # the batch's one Lifecycle, its Watcher's (open_watcher: policy BATCH_POLICY): the policy (the verdicts a cell
        # falls back on) and their fallbacks, the claims, and the one executor of the cells' fallbacks and stops
        # (its own, and stop_when's, too slow's: Lifecycle.stop): bounded worker threads, finished on Ctrl-C within
        # their bounds (finish_actions)
        self.lifecycle = watcher.lifecycle
        cells = {cell.run_name(plan.batch): cell.id for cell in plan.cells}
        self.lifecycle.act_for_batch(plan.batch, at_once=MAX_PARALLEL_LAUNCHES, cell_of=cells.get)
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
            active.open_since, active.current = self.clock(), self._open_fallback(record).data["run"]
            self.lifecycle.finish_fallbacks(record.root_run)
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
            if isinstance(event, ActionError):  # a fallback that did not start: the cell's `why` says it
                self.errors[event.run] = event.error
            elif isinstance(event, Acting) and event.action == Action.FALLBACK and self._cell_of(event.chain):
                typed, _ = read_stored(self.decisions.get(event.run) or self.store.get_run(event.run).decision)
                why = f"{typed.decision}: {typed.reason or ''}".strip(": ") if typed is not None else "?"
                self.news.append(f"{self._cell_of(event.chain)}: {event.run} {why[:60]}; falling back to {event.next_variant}")
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
        chain = self.table.chain(active.record.root_run)
        run = self.store.get_run(chain[-1])
        decision = self.decisions.get(run.name) or run.decision or {}  # the JSON a cell's outcome keeps
        if active.stopping is not None:
            if not run.active or self.clock() - active.stopping.since >= self.stop_wait_s:
                self._after_stop(active, chain)
            return
        if self._left_open(active) or self.lifecycle.busy(run.name):  # the Lifecycle's fallback (or stop) under way
            return
        if active.current != run.name:  # the Lifecycle's fallback launched it (or this scheduler attached it)
            if active.current is not None and run.parent is not None:
                self.news.append(f"{active.record.cell.id}: fell back to {run.name}")
            active.current, active.waiting_since = run.name, None
        typed, _ = read_stored(decision)  # None: none yet, or one it cannot read (no verdict: waited out as none)
        verdict = typed.decision if typed is not None else None
        if self.lifecycle.acts_on(verdict) and self.lifecycle.handled(run.name) is not None:
            if self.lifecycle.handled(run.name):  # acted on, and no successor came: nothing left, or it did not start
                self._fell_short(active, chain, run, decision, typed)
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

    def _fell_short(self, active: _Active, chain: list[str], run: Run, decision: dict, typed) -> None:
        """The Lifecycle is done with the newest run's verdict and launched nothing after it: the cell `failed`, with
        the verdict and why (the fallback's launch failed: the intent's error; nothing left to fall back to: the
        Lifecycle stopped the run, waited for its end up to stop_wait_s)."""
        if typed.action is Action.FALLBACK:
            intents = self.store.intents_about(active.record.root_run, run.name)
            error = (intents[-1].data.get("error") if intents else None) or self.errors.get(run.name) or "no successor launched"
            why = f"{typed.decision}; fallback did not start: {error}"
        elif run.active and not self._waited(active, self.stop_wait_s):
            return
        else:
            why = f"{typed.decision}: {typed.reason or ''}".strip(": ")
        self._finish(active, chain, decision, CellState.FAILED, why)

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
        """Ctrl-C: the cells' fallbacks and stops under way are carried to their end first, each within its bound
        (Lifecycle.finish_actions: on_interrupt says which; a second Ctrl-C, or one still under way past its bound,
        leaves them half done, their intents open for the next `dfo batch`)."""
        return self.lifecycle.finish_actions(self.on_interrupt)

    def _left_open(self, active: _Active) -> bool:
        """Whether the cell's fallback is open (recorded, not carried out to its end): under way on the Lifecycle's
        executor, or left open (its stop failed, the target out of reach; a dfo that died): carried out again by
        the Lifecycle (finish_fallbacks) until stop_wait_s have passed, then the cell is closed as `error` (its GPUs
        released here) with the intent left open: the next `dfo batch` of the file takes the cell up again on its
        GPUs and finishes it first."""
        record = active.record
        intents = [intent for intent in self.store.open_intents(record.root_run) if intent.kind == FALLBACK]
        if not intents:
            active.open_since = None
            return False
        if any(self.lifecycle.busy(intent.data["run"]) for intent in intents):
            return True
        run = intents[-1].data["run"]
        error = self.errors.get(run) or "not carried out"
        active.open_since = active.open_since or self.clock()
        if self.clock() - active.open_since < self.stop_wait_s:
            self.news.append(f"{record.cell.id}: fallback not carried out yet ({error})")
            self.lifecycle.finish_fallbacks(record.root_run)
            return True
        decision = self.decisions.get(run) or self.store.get_run(run).decision or {}
        typed, _ = read_stored(decision)
        self._finish(active, self.store.lineage(run), decision, CellState.ERROR,
                     f"{typed.decision if typed is not None else 'failed'}; fallback did not start: {error} (the "
                     f"fallback stays open: the next `dfo batch` of this file finishes it)")
        return True

    def _cell_of(self, root: Optional[str]) -> Optional[str]:
        """The id of the running cell whose chain `root` is (None: none of this scheduler's)."""
        return next((cell_id for cell_id, active in self.active.items() if active.record.root_run == root), None)

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
    this batch). A cell's fallback does not come here: the batch's Lifecycle launches it (chains.Supervisor.fall_back)."""
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
    """The Watcher of `dfo watch` under BATCH_POLICY: its Lifecycle falls back on crash and stall (once the scheduler
    makes it the batch's, act_for_batch: a fallback keeps its cell's settings and GPUs); too slow only against a
    configured baseline, never against the best peer of the batch (a sweep measures the slow configurations too)."""
    from .watch import Watcher  # the watch loop and its agent channels load only when a batch runs

    return Watcher(inventory, connections, store, peer_baseline=False, policy=BATCH_POLICY, **options)


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
    scheduler = Scheduler(plan, store, watcher, launcher(plan, inventory, connections, store, wandb=wandb, ours=ours),
                          poll_s=poll_s, on_progress=on_progress, on_interrupt=on_interrupt)
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
