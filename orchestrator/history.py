"""A run's history whether or not anyone watched it: its stored steps brought up to its log's end.

    sync_history(store, runs, connections_for)     every command that looks at a run calls it first
      1. chains.refresh: a run that ended while nobody looked gets its end recorded (ended_at: the exit file's
         mtime, runs.look)
      2. catch_up per target, all targets at once: the agent's `--once` snapshot of each run from its stored
         offset, in the file its stored identity names (the agent reads again from 0 when the file is another
         one), the variant's parser (logfmt.make_parser: the one a watch uses), steps above the stored last one
         added with the new offset and identity in one transaction (store.add_samples), snapshot after snapshot
         until one reads every log to its end (less than the agent's budget: a run still logging is not chased
         past it); a run that had ended before the first snapshot is then marked
         history_complete and is never looked at again

A chain a live dfo holds (a watch, a batch: its claim, chains.Claims) is left to it: it stores those steps
itself, so nothing is stored twice. A run the sync looks at is held under its chain's claim while it does.
`dfo ui` and the Watcher (the lines a stopped run wrote on its way out, read once it has exited) use the same
catch_up.

What it must not do: judge, act on a run, render, or keep a channel open after it returns.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .chains import Claims, chain_key, inventory_for, refresh
from .connections import Connections
from .agent.agent import ONCE_BUDGET
from .agent.protocol import ProtocolError
from .errors import DfoError
from .logfmt import StepRecord, make_parser
from .observe import PollObserver
from .package import AGENT_NAME, build_package, push
from .remote.base import Target
from .store import Run, Store

SYNC_TIMEOUT = 60.0  # one target's whole catch-up (every snapshot of every run there)
SNAPSHOT_TIMEOUT = 30.0  # one `agent --once` round trip
MAX_SNAPSHOTS = 64  # 8 MiB of log per run each (the agent's ONCE_BUDGET): 512 MiB, far past any real log


@dataclass
class CaughtUp:
    """What catch_up stored of one run: steps added and the offset reached."""

    run: str
    steps: int = 0
    offset: int | None = None


@dataclass
class _Reading:
    run: Run
    parse: Callable
    last_step: int | None
    caught: CaughtUp
    ident: dict | None = None
    samples: list[dict] = field(default_factory=list)
    moved: bool = False  # the offset moved (or the file was another one) since it was last stored
    more: bool = False  # the last snapshot stopped short of the log's end (the agent's budget; a file read again)
    start: int = 0  # the offset the last snapshot read from

    @property
    def read_to(self) -> int:
        return self.caught.offset if self.caught.offset is not None else (self.run.log_offset or 0)


def needs_sync(run: Run) -> bool:
    """Whether the stored history of `run` may be behind its log: it started (a PID) and was not read to its
    log's end after it ended (history_complete)."""
    return bool(run.log_path) and run.pid is not None and not run.history_complete


def catch_up(target: Target, agent_cmd: Sequence[str], store: Store, runs: Sequence[Run], parser_of: Callable[[Run], Callable],
             *, snapshot_timeout: float = SNAPSHOT_TIMEOUT, deadline: float | None = None) -> list[CaughtUp]:
    """Store what the logs of `runs` (all on `target`) hold past each run's stored offset, exactly once: the steps
    above its stored last step, parsed by parser_of(run), with the offset and the file identity reached, after
    each snapshot. Ends when a snapshot read every log to its end (less than the agent's budget of any: a run still
    logging is not chased, the watch that follows it goes on from there); each run that had ended before the first
    one is then history_complete. Raises DfoError (or agent ProtocolError) when the target does not answer: what was stored
    until then stays, and the next sync goes on from there."""
    observer = PollObserver(target, list(agent_cmd), sink=queue.Queue(), round_trip_timeout=snapshot_timeout)
    readings = {}
    for run in runs:
        readings[run.name] = _Reading(run, parser_of(run), store.last_step(run.name), CaughtUp(run.name), run.log_ident)
        observer.follow(run.name, run.log_path, run.exit_path, run.pid, run.proc_starttime, offset=run.log_offset,
                        ident=run.log_ident)
    for _ in range(MAX_SNAPSHOTS):
        if deadline is not None and time.monotonic() > deadline:
            return [reading.caught for reading in readings.values()]
        for reading in readings.values():
            reading.more, reading.start = False, reading.read_to
        observer.poll_once()
        _take(observer.observations, readings)
        for reading in readings.values():
            reading.more = reading.more or reading.read_to - reading.start >= ONCE_BUDGET // 2  # the agent's budget
            if reading.moved:
                reading.caught.steps += store.add_samples(reading.run.name, reading.samples,
                                                          offset=reading.caught.offset, ident=reading.ident)
                reading.samples, reading.moved = [], False
        if not any(reading.more for reading in readings.values()):  # every log read to its end as it was then
            for reading in readings.values():
                if not reading.run.active:  # it had ended before the first snapshot: its log is read to its end
                    store.update_run(reading.run.name, history_complete=True)
            break
    return [reading.caught for reading in readings.values()]


@dataclass
class WholeLog:
    """A run's log read from its first byte: every line (its text lines too, which the store does not keep), and
    the offset and file identity the reading reached (where a watch follows it on from)."""

    lines: list[str] = field(default_factory=list)
    offset: int | None = None
    ident: dict | None = None
    complete: bool = False  # read to the end it had then (the last snapshot read less than the agent's budget)
    changed: str | None = None  # why the agent found the file not the one the stored identity describes


def read_whole_log(target: Target, agent_cmd: Sequence[str], run: Run, *, snapshot_timeout: float = SNAPSHOT_TIMEOUT,
                   timeout: float = SYNC_TIMEOUT) -> WholeLog:
    """Run `run`'s log from its first byte to its end, snapshot after snapshot over the agent's `--once` (until
    one reads less than the agent's budget): what a watch judges a run it attaches to from (Watcher.attach), so
    that the judge sees the lines before the stored offset too (a crash's traceback, not only the stored steps).
    Raises DfoError (or agent ProtocolError) when the target does not answer or the log is not read within
    `timeout` seconds."""
    observer = PollObserver(target, list(agent_cmd), sink=queue.Queue(), round_trip_timeout=snapshot_timeout)
    # from byte 0, with the stored identity: the agent hashes as many first bytes as the earlier reading did
    # and says (a `truncated` record) when the file is another one now, however little of it that reading saw
    observer.follow(run.name, run.log_path, run.exit_path, run.pid, run.proc_starttime, offset=0, ident=run.log_ident)
    log = WholeLog()
    deadline = time.monotonic() + timeout
    for _ in range(MAX_SNAPSHOTS):
        if time.monotonic() > deadline:
            raise DfoError(f"the log of {run.name} was not read within {timeout:g} s")
        start = log.offset or 0
        observer.poll_once()
        again = False
        while True:
            try:
                obs = observer.observations.get_nowait()
            except queue.Empty:
                break
            if obs.run != run.name:
                continue
            if obs.kind == "lines":
                log.lines.extend(obs.lines)
                log.offset, log.ident = obs.offset, obs.data.get("ident")
            elif obs.kind == "truncated":  # another file now: read again from its start
                log, again = WholeLog(changed=log.changed or obs.data.get("why")), True
        if not again and (log.offset or 0) - start < ONCE_BUDGET // 2:
            log.complete = True
            break
    return log


def _take(observations: queue.Queue, readings: dict[str, _Reading]) -> bool:
    """Fold one snapshot's observations into `readings`; True when any run's log brought a line (or was another
    file, read again from 0)."""
    news = False
    while True:
        try:
            obs = observations.get_nowait()
        except queue.Empty:
            return news
        reading = readings.get(obs.run) if obs.run else None
        if reading is None:
            continue
        if obs.kind == "lines":
            for line in obs.lines:
                record = reading.parse(line, 0.0)
                if isinstance(record, StepRecord) and (reading.last_step is None or record.step > reading.last_step):
                    reading.last_step = record.step
                    reading.samples.append(sample_of(record))
            reading.caught.offset, reading.ident, reading.moved, news = obs.offset, obs.data.get("ident"), True, True
        elif obs.kind == "truncated":
            reading.caught.offset, reading.ident, reading.moved, news = 0, None, True, True
            reading.more = True


SAMPLE_FIELDS = ("step", "ts", "tok_s", "loss", "phase", "acc", "lr", "q_fill", "active", "mem_gb")


def sample_of(record: StepRecord) -> dict[str, Any]:
    """A metric line as a store sample (None fields left out; unknown keys kept as extras)."""
    sample = {name: getattr(record, name) for name in SAMPLE_FIELDS}
    return {**record.extra, **{k: v for k, v in sample.items() if v is not None}}


def sync_history(store: Store, runs: Sequence[Run], connections_for: Callable[[Run], Any], *,
                 timeout: float = SYNC_TIMEOUT, recheck: bool = False,
                 history_of: Sequence[Run] | None = None) -> dict[str, str]:
    """Bring the rows of `runs` up to date (ended, when: chains.refresh) and the stored history of `history_of`
    (default: `runs`) up to their logs' end, every target at once; returns {target: why it could not be read}.
    A run whose chain another live dfo holds is left to it."""
    problems = refresh(store, runs, connections_for, recheck=recheck)
    groups: dict[str, list[Run]] = {}
    for run in runs if history_of is None else history_of:
        fresh = store.find_run(run.name)
        if fresh is not None and needs_sync(fresh) and fresh.target not in problems:
            groups.setdefault(fresh.target, []).append(fresh)
    if not groups:
        return problems
    claims = Claims(store)
    groups = {target: mine for target, group in groups.items()
              if (mine := [run for run in group if claims.holds(chain_key(store.lineage(run.name)[0]))])}
    deadline = time.monotonic() + timeout

    def one(target_name: str, group: list[Run]) -> None:
        try:
            connections = connections_for(group[0])
            spec = connections.inventory.target(target_name)
            target = connections.container(target_name)
            pushed = push(target, spec.workspace, package=build_package(), store=store, target_name=target_name)
            catch_up(target, [spec.python, f"{pushed.pkg_dir}/{AGENT_NAME}"], store, group,
                     lambda run: parser_for(connections.inventory, run), deadline=deadline)
        except (DfoError, ProtocolError) as exc:
            problems[target_name] = str(exc)

    threads = {target: threading.Thread(target=one, args=(target, group), daemon=True) for target, group in groups.items()}
    try:
        for thread in threads.values():
            thread.start()
        for target_name, thread in threads.items():
            thread.join(max(0.0, deadline - time.monotonic()) + 5)
            if thread.is_alive():
                problems[target_name] = f"its logs were not read within {timeout:g} s"
    finally:
        claims.release_all()
    return problems


def sync_before_attach(store: Store, runs: Sequence[Run], connections_for: Callable[[Run], Any]) -> dict[str, str]:
    """What `dfo watch` and `dfo batch` call before they attach `runs`: sync_history of their rows (an end nobody
    saw recorded, ended_at the exit file's time). Their histories are brought up to date by the attach itself,
    which reads each log once (Watcher._replay: judged from its whole log, what is new stored; one that had ended
    is then history_complete, judged at once and never followed; a running one is followed on from there), not
    here first. Returns {target: why it could not be read}."""
    return sync_history(store, runs, connections_for, history_of=[])


def parser_for(inventory: Any, run: Run) -> Callable:
    """The parser a watch of `run` uses: its variant's `metrics:` regex, else logfmt."""
    variant = inventory.variants.get(run.variant) if run.variant else None
    return make_parser(variant.metrics if variant else None)


def sync_runs(store: Store, runs: Sequence[Run], given: Path | None = None, *, recheck: bool = False,
              history_of: Sequence[Run] | None = None) -> dict[str, str]:
    """sync_history for a command that looks at `runs` (`dfo runs`, `metrics`, `compare`, `report`, `dfo ui`):
    each run reached with the inventory it was launched from (chains.inventory_for; `given`: -i), the connections
    opened for this call and closed after it. Returns {target: why it could not be looked at}."""
    opened: dict[str, Connections] = {}
    with ExitStack() as stack:
        def connections_for(run: Run) -> Connections:
            inventory, _ = inventory_for(run, given)
            if inventory.source not in opened:
                opened[inventory.source] = stack.enter_context(Connections(inventory))
            return opened[inventory.source]

        return sync_history(store, runs, connections_for, recheck=recheck, history_of=history_of)
