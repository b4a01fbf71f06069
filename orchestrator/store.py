"""The run registry: one SQLite file ($DFO_HOME/dfo.db) holding runs, pushes, events and samples.

WAL mode and a busy timeout let several dfo processes write at once; every write is one short
`BEGIN IMMEDIATE` transaction, so concurrent writers queue instead of failing or losing rows.
The schema is built by numbered migrations recorded in `schema_version`; later features add tables by
appending to MIGRATIONS (never by editing an applied one).

Timestamps: runs/events/pushes use RFC 3339 UTC text; samples and gpu_samples use `ts` as float Unix
seconds (many rows, plotted and compared numerically).

This module must not do remote calls, rendering or decisions, and it never stores secret values: callers
pass commands without them.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import contextlib
import difflib
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from .errors import DfoError, RefusedError, UnknownRun
from .states import RunState
from .words import plural

BUSY_TIMEOUT_MS = 15000
MAX_CHAIN = 100  # runs followed along parent links before giving up (a loop in hand-edited rows)


def utc_now() -> str:
    """Now as RFC 3339 UTC text with milliseconds, e.g. 2026-11-29T11:40:03.123Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def dfo_home() -> Path:
    """$DFO_HOME, else $XDG_STATE_HOME/dfo, else ~/.local/state/dfo."""
    if os.environ.get("DFO_HOME"):
        return Path(os.environ["DFO_HOME"]).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state).expanduser() / "dfo"


# ---------------------------------------------------------------------------------------------- schema

def _m001_initial(db: sqlite3.Connection) -> None:
    db.execute(
        """CREATE TABLE runs (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            target TEXT NOT NULL,
            host TEXT,
            variant TEXT,
            command TEXT,                 -- as launched, never with secret values
            pid INTEGER,
            proc_starttime INTEGER,       -- /proc/PID/stat field 22, for identity checks
            started_at TEXT,
            ended_at TEXT,
            log_path TEXT,
            exit_path TEXT,
            workspace TEXT,
            trainer_hash TEXT,
            parent TEXT,                  -- the run this one fell back from
            chain TEXT,                   -- JSON list: the fallback chain still ahead
            batch TEXT,
            state TEXT NOT NULL DEFAULT 'launching',
            exit_code INTEGER,
            decision TEXT,                -- JSON (docs/design.md decision shape)
            log_offset INTEGER NOT NULL DEFAULT 0
        )"""
    )
    db.execute("CREATE INDEX runs_state ON runs(state)")
    db.execute("CREATE INDEX runs_batch ON runs(batch)")
    db.execute(
        "CREATE TABLE pushes (id INTEGER PRIMARY KEY, target TEXT NOT NULL, hash TEXT NOT NULL,"
        " at TEXT NOT NULL, bytes INTEGER NOT NULL DEFAULT 0)"
    )
    db.execute("CREATE INDEX pushes_target ON pushes(target, id)")
    db.execute(
        "CREATE TABLE events (id INTEGER PRIMARY KEY, run TEXT, at TEXT NOT NULL, kind TEXT NOT NULL, data TEXT)"
    )
    db.execute("CREATE INDEX events_run ON events(run, id)")
    db.execute(
        "CREATE TABLE samples (id INTEGER PRIMARY KEY, run TEXT NOT NULL, step INTEGER, ts REAL,"
        " tok_s REAL, loss REAL, phase TEXT, extra TEXT)"
    )
    db.execute("CREATE INDEX samples_run ON samples(run, step)")
    db.execute(
        "CREATE TABLE gpu_samples (id INTEGER PRIMARY KEY, run TEXT, target TEXT, ts REAL, gpu_index INTEGER,"
        " mem_used_mib REAL, mem_total_mib REAL, util_pct REAL)"
    )
    db.execute("CREATE INDEX gpu_samples_run ON gpu_samples(run, ts)")
    db.execute("CREATE INDEX gpu_samples_target ON gpu_samples(target, ts)")


def _m002_batches(db: sqlite3.Connection) -> None:
    """`dfo batch`: one row per batch and one per cell of its matrix (orchestrator/batch.py reads and writes them)."""
    db.execute(
        "CREATE TABLE batches (name TEXT PRIMARY KEY, source TEXT, spec TEXT, created_at TEXT NOT NULL, updated_at TEXT)"
    )
    db.execute(
        """CREATE TABLE batch_cells (
            batch TEXT NOT NULL,
            cell TEXT NOT NULL,           -- deterministic id from the matrix: the same file gives the same ids
            position INTEGER NOT NULL,    -- order in the expanded matrix
            target TEXT NOT NULL,
            variant TEXT NOT NULL,
            sets TEXT,                    -- JSON mapping of trainer arguments
            gpus INTEGER,                 -- GPUs asked for (null: all of the target's)
            repeat INTEGER NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending',  -- pending | running | done | failed | error
            root_run TEXT,                -- the first run of the cell's fallback chain
            gpu_ids TEXT,                 -- JSON list: the GPU indices it holds (CUDA_VISIBLE_DEVICES)
            started_at TEXT,
            ended_at TEXT,
            outcome TEXT,                 -- JSON: final run, decision, why it ended
            PRIMARY KEY (batch, cell)
        )"""
    )


def _m003_log_ident(db: sqlite3.Connection) -> None:
    """The identity of the log file read up to log_offset (JSON: dev, ino, head, sha: the agent's), so a log
    copytruncated or rotated between two watches is read again from 0 instead of at a stale offset."""
    db.execute("ALTER TABLE runs ADD COLUMN log_ident TEXT")


def _m004_notifications(db: sqlite3.Connection) -> None:
    """Notifications sent (or tried) per run, decision and channel: claimed before sending, so a decision is
    never announced twice, not after a restart and not by two dfo processes watching the same run."""
    db.execute(
        """CREATE TABLE notifications (
            run TEXT NOT NULL,
            key TEXT NOT NULL,            -- which decision: `<decision>:<action>`
            channel TEXT NOT NULL,        -- command | webhook
            claimed_at TEXT NOT NULL,
            done_at TEXT,
            ok INTEGER,                   -- null while sending, then 1 or 0
            detail TEXT,                  -- why it failed (never a secret: no URL query, no command output beyond a line)
            PRIMARY KEY (run, key, channel)
        )"""
    )


def _m005_lifecycle(db: sqlite3.Connection) -> None:
    """orchestrator/chains.py: where a run came from and who launches it, stop intents, claims, intents."""
    for column in ("inventory_path TEXT", "inventory_hash TEXT", "owner TEXT", "stop_requested_at TEXT"):
        db.execute(f"ALTER TABLE runs ADD COLUMN {column}")
    db.execute(
        """CREATE TABLE claims (
            key TEXT PRIMARY KEY,         -- chain:<root run> or cell:<batch>/<cell>
            owner TEXT NOT NULL,          -- a random id per watcher/scheduler
            pid INTEGER,
            host TEXT,
            expires_at REAL NOT NULL,     -- Unix seconds; renewed while the owner lives
            renewed_at REAL NOT NULL
        )"""
    )
    db.execute(
        """CREATE TABLE intents (
            id INTEGER PRIMARY KEY,
            subject TEXT NOT NULL,        -- the chain root (or batch cell key) it is about
            kind TEXT NOT NULL,           -- fallback | stop
            data TEXT NOT NULL,           -- JSON: the run acted on, the next run's name and variant, why
            created_at TEXT NOT NULL,
            done_at TEXT                  -- null until every step of it happened
        )"""
    )
    db.execute("CREATE INDEX intents_open ON intents(subject, done_at)")


def _m006_multinode(db: sqlite3.Connection) -> None:
    """orchestrator/multinode.py: the nodes of a multi-node run, each a `runs` row of its own (RUN.nodeK)."""
    db.execute(
        """CREATE TABLE run_nodes (
            run TEXT NOT NULL,            -- the multi-node run's name (no `runs` row of its own)
            node_rank INTEGER NOT NULL,   -- 0 hosts the rendezvous
            node_run TEXT NOT NULL UNIQUE, -- the node's runs row: RUN.node<rank>
            rendezvous TEXT NOT NULL,     -- ADDR:PORT the nodes meet at
            created_at TEXT NOT NULL,
            PRIMARY KEY (run, node_rank)
        )"""
    )


def _m007_checked_at(db: sqlite3.Connection) -> None:
    """When dfo last tried to look at a run whose start got no answer (`lost` without a PID): `dfo runs` looks
    at such a row again only every runs.LOST_RECHECK_S, since its target may be gone and each try can cost a
    timeout."""
    db.execute("ALTER TABLE runs ADD COLUMN checked_at TEXT")


def _m008_claim_since(db: sqlite3.Connection) -> None:
    """When a claim's owner took it (`since`, kept while that owner renews it): a watch that waits on a lease
    another dfo holds says since when that dfo has held it."""
    db.execute("ALTER TABLE claims ADD COLUMN since REAL")
    db.execute("UPDATE claims SET since = renewed_at")


def _m009_history(db: sqlite3.Connection) -> None:
    """Where a run's ended_at came from (`ended_from`: exit_file, its mtime; last_line, the last log line's ts;
    noticed, when dfo noticed, as every row before this had it), and whether its stored history reached its
    log's end after it ended (`history_complete`: history.sync_history need not look at it again)."""
    db.execute("ALTER TABLE runs ADD COLUMN ended_from TEXT")
    db.execute("ALTER TABLE runs ADD COLUMN history_complete INTEGER NOT NULL DEFAULT 0")
    db.execute("UPDATE runs SET ended_from = 'noticed' WHERE ended_at IS NOT NULL")


def _m010_unconfirmed(db: sqlite3.Connection) -> None:
    """A start that got no answer has a state of its own, `unconfirmed` (states.RunState): the rows that said it
    as `lost` without a PID or an exit status become it; `lost` keeps only a process gone without an exit file."""
    db.execute("UPDATE runs SET state = 'unconfirmed' WHERE state = 'lost' AND pid IS NULL AND exit_code IS NULL")


def _m011_event_kinds(db: sqlite3.Connection) -> None:
    """One shape per event kind (events.py): a process's start record is `started` (`launched` is `dfo launch
    --json`'s line, another shape), a target's channel error `target_error` (`error` is a run's)."""
    db.execute("UPDATE events SET kind = 'started' WHERE kind = 'launched'")
    db.execute("UPDATE events SET kind = 'target_error' WHERE kind = 'error' AND run IS NULL")


def _m012_resumed_from(db: sqlite3.Connection) -> None:
    """One shape per event kind (events.py): the registry's record of a resume is `resumed_from` (`resumed` is `dfo
    resume --json`'s line, events.ResumeAnswer, another shape)."""
    db.execute("UPDATE events SET kind = 'resumed_from' WHERE kind = 'resumed'")


def _m013_owner_seen_at(db: sqlite3.Connection) -> None:
    """When the dfo launching a run last said it lives (`owner_seen_at`, Unix seconds, renewed while the row is
    `launching`): a launcher of another workstation cannot be looked at, so its row is a lease that lapses when
    that dfo dies (runs.launcher_alive). Rows from before it have none: their launcher is taken to live, as before."""
    db.execute("ALTER TABLE runs ADD COLUMN owner_seen_at REAL")


MIGRATIONS: list[tuple[str, Callable[[sqlite3.Connection], None]]] = [
    ("initial: runs, pushes, events, samples, gpu_samples", _m001_initial),
    ("batches and their matrix cells", _m002_batches),
    ("runs.log_ident: the identity of the log file read up to log_offset", _m003_log_ident),
    ("notifications: one per run, decision and channel", _m004_notifications),
    ("lifecycle: inventory per run, launcher, stop intents, claims, intents", _m005_lifecycle),
    ("run_nodes: the nodes of a multi-node run", _m006_multinode),
    ("runs.checked_at: when a start never seen answered was last looked for", _m007_checked_at),
    ("claims.since: when the claim's owner took it", _m008_claim_since),
    ("runs.ended_from, runs.history_complete: where ended_at came from; history read to the log's end", _m009_history),
    ("runs.state unconfirmed: a start that got no answer, once `lost` without a PID", _m010_unconfirmed),
    ("events: kind started (was launched), target_error (was error without a run)", _m011_event_kinds),
    ("events: kind resumed_from (was resumed)", _m012_resumed_from),
    ("runs.owner_seen_at: when the launching dfo last said it lives", _m013_owner_seen_at),
]
"""Applied in order; version N is MIGRATIONS[N-1]. Append only."""


# ---------------------------------------------------------------------------------------------- records

@dataclass
class Run:
    """One row of `runs`, with chain/decision decoded from JSON."""

    name: str
    target: str
    host: str | None = None
    variant: str | None = None
    command: str | None = None
    pid: int | None = None
    proc_starttime: int | None = None
    started_at: str | None = None
    ended_at: str | None = None
    log_path: str | None = None
    exit_path: str | None = None
    workspace: str | None = None
    trainer_hash: str | None = None
    parent: str | None = None
    chain: list[str] | None = None  # the fallback chain still ahead; [] = no more variants, None = none given
    batch: str | None = None
    state: str = RunState.LAUNCHING
    exit_code: int | None = None
    decision: dict[str, Any] | None = None
    log_offset: int = 0
    log_ident: dict[str, Any] | None = None  # which file log_offset is in (see _m003_log_ident)
    inventory_path: str | None = None  # the inventory file it was launched from (None: the built-in one)
    inventory_hash: str | None = None  # sha256 of that file's bytes then
    owner: str | None = None  # `host:pid` of the dfo that launches it, while state is launching
    owner_seen_at: float | None = None  # when that dfo last said it lives (Unix seconds; runs.launcher_alive)
    stop_requested_at: str | None = None  # dfo was asked to stop it: its exit is no verdict of its own
    checked_at: str | None = None  # a start never seen answered: when dfo last tried to look for it (_m007)
    ended_from: str | None = None  # what ended_at is: exit_file (its mtime) | last_line (its ts) | noticed (_m009)
    history_complete: bool = False  # its stored steps reached its log's end after it ended (history.sync_history)
    id: int | None = None
    unreadable: str | None = None  # why part of the row could not be read (that part is None): shown, not a column

    @property
    def active(self) -> bool:
        """Launching or running (states.RunState.active): not an unconfirmed start, which has no process known."""
        return RunState(self.state).is_active()

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Claim:
    """Who acts on a chain or cell: `owner` (dfo `pid` on workstation `host`) since `since`, until `expires_at`
    (Unix seconds), unless it renews."""

    key: str
    owner: str
    pid: int | None
    host: str | None
    expires_at: float
    renewed_at: float
    since: float | None = None


@dataclass(frozen=True)
class Intent:
    """An action recorded before it was taken; `data` grows as its steps happen (see chains.py)."""

    id: int
    subject: str
    kind: str
    data: dict[str, Any]
    created_at: str
    done_at: str | None = None


RUN_COLUMNS = tuple(f.name for f in fields(Run) if f.name not in ("id", "unreadable"))
BATCH_CELL_COLUMNS = frozenset({"state", "root_run", "gpu_ids", "started_at", "ended_at", "outcome"})
JSON_COLUMNS = ("chain", "decision", "log_ident")


def _encode_run_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(values) - set(RUN_COLUMNS)
    if unknown:
        raise ValueError(f"unknown run {plural(len(unknown), 'field')}: {', '.join(sorted(unknown))}")
    if "state" in values and values["state"] not in tuple(RunState):
        raise ValueError(f"run state must be one of {', '.join(RunState)}, got {values['state']!r}")
    encoded = {k: (json.dumps(v) if k in JSON_COLUMNS and v is not None else v) for k, v in values.items()}
    return {k: (str(v) if k == "state" else v) for k, v in encoded.items()}


JSON_SHAPES = {"chain": list, "decision": dict, "log_ident": dict}
DECISION_SHAPES = {"decision": str, "action": str, "reason": str, "steady_tok_s": float, "level_shifts": list}


def _decode_run(row: sqlite3.Row) -> Run:
    """A Run from its row; never raises on a damaged JSON column (not JSON, or not the shape its readers rely on):
    that column is None and `unreadable` says which, so one bad row hides no other."""
    values = dict(row)
    problems = []
    for column, shape in JSON_SHAPES.items():
        values[column], problem = _json_column(values[column], shape)
        if column == "decision" and problem is None:
            problem = _decision_problem(values[column])
        if problem:
            values[column] = None
            problems.append(f"runs.{column} {problem}")
    values["history_complete"] = bool(values.get("history_complete"))
    return Run(**values, unreadable="; ".join(problems) or None)


def _decision_problem(decision: dict[str, Any] | None) -> str | None:
    """Why a decoded decision has not the shape its readers rely on (DECISION_SHAPES), or None."""
    for key, kind in DECISION_SHAPES.items():
        value = (decision or {}).get(key)
        if value is None or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float) if kind is float else kind):
            return f"has a {key} that is not a {'number' if kind is float else kind.__name__}"
    return None


def _json_column(text: Any, shape: type) -> tuple[Any, str | None]:
    """A JSON column's value when it is JSON of `shape` (None when empty), else (None, why not)."""
    if not text:
        return None, None
    try:
        value = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return None, "is not JSON"
    return (value, None) if isinstance(value, shape) else (None, f"is not a JSON {'list' if shape is list else 'object'}")


SAMPLE_COLUMNS = ("step", "ts", "tok_s", "loss", "phase")
GPU_SAMPLE_COLUMNS = ("ts", "index", "mem_used_mib", "mem_total_mib", "util_pct")


# ---------------------------------------------------------------------------------------------- store

class Store:
    """The registry. `Store()` opens $DFO_HOME/dfo.db; `Store(":memory:")` is a private in-memory one for tests.

    One connection per Store, guarded by a lock so watch threads may share it.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        if path is None:
            path = dfo_home() / "dfo.db"
        self.path = str(path)
        if self.path != ":memory:":
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DfoError(f"run registry directory {Path(self.path).parent}: cannot create it: "
                               f"{exc.strerror or exc}", hint="set DFO_HOME to a directory you can write") from None
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
            self._db.row_factory = sqlite3.Row
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if self.path != ":memory:":
                self._wal()
                self._db.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise DfoError(f"run registry {self.path}: {exc}", hint="move the file aside or set DFO_HOME") from exc
        except DfoError:
            self._db.close()
            raise

    def _wal(self) -> None:
        """WAL mode. Switching a new file to it takes a lock SQLite does not wait for (busy_timeout does not
        apply): two dfo processes creating the registry at once retry here instead of failing."""
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        while True:
            try:
                self._db.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    @classmethod
    def in_memory(cls) -> "Store":
        return cls(":memory:")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction: takes the write lock up front, so it waits (busy_timeout) instead of failing."""
        with self._lock, self._failures():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                with contextlib.suppress(sqlite3.Error):  # a damaged file may refuse the rollback too
                    self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock, self._failures():
            return self._db.execute(sql, params).fetchall()

    @contextmanager
    def _failures(self) -> Iterator[None]:
        """SQLite's own failures (a page damaged after the file was opened, a full disk, a lock held past the
        busy timeout) as one DfoError naming the file; a constraint (IntegrityError) is the caller's to map."""
        try:
            yield
        except sqlite3.IntegrityError:
            raise
        except sqlite3.DatabaseError as exc:
            raise DfoError(f"run registry {self.path}: {exc}",
                           hint="move the file aside or set DFO_HOME; `sqlite3 FILE .recover` may save its rows") from None

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """Rows of a read-only SQL statement (tests and diagnostics; modules use the typed methods)."""
        return self._query(sql, params)

    # -- migrations

    def _migrate(self) -> None:
        with self._write() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, name TEXT, applied_at TEXT)"
            )
        newest = self._query("SELECT COALESCE(MAX(version), 0) FROM schema_version")[0][0]
        if newest > len(MIGRATIONS):
            raise DfoError(
                f"run registry {self.path} has schema version {newest}, this dfo knows up to {len(MIGRATIONS)}",
                hint="upgrade dfo, or set DFO_HOME to another directory",
            )
        for version, (name, apply) in enumerate(MIGRATIONS, start=1):
            with self._write() as db:  # checked inside the transaction: two processes never both apply it
                if db.execute("SELECT 1 FROM schema_version WHERE version = ?", (version,)).fetchone():
                    continue
                apply(db)
                db.execute("INSERT INTO schema_version VALUES (?, ?, ?)", (version, name, utc_now()))

    def schema_version(self) -> int:
        return self._query("SELECT COALESCE(MAX(version), 0) FROM schema_version")[0][0]

    # -- runs

    def add_run(self, run: Run) -> Run:
        """Insert a run. Raises RefusedError if the name is taken (names are never reused)."""
        values = _encode_run_fields({k: v for k, v in run.as_dict().items() if k in RUN_COLUMNS})
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        try:
            with self._write() as db:
                db.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", tuple(values.values()))
        except sqlite3.IntegrityError as exc:
            raise RefusedError(f"a run named {run.name!r} already exists", hint="choose another --name") from exc
        return self.get_run(run.name)

    def update_run(self, name: str, **changes: Any) -> Run:
        """Set some fields of a run and return it. Raises UnknownRun."""
        values = _encode_run_fields(changes)
        if values:
            assignments = ", ".join(f"{k} = ?" for k in values)
            with self._write() as db:
                cursor = db.execute(f"UPDATE runs SET {assignments} WHERE name = ?", (*values.values(), name))
            if cursor.rowcount == 0:
                raise UnknownRun(f"no run named {name!r} in the registry", hint="see `dfo runs`")
        return self.get_run(name)

    def transition(self, name: str, to: RunState, expect: Iterable[RunState], **changes: Any) -> Run | None:
        """Move run `name` to state `to` (with `changes`) only if its state is one of `expect`, in one statement
        (`UPDATE runs SET state = ? ... WHERE name = ? AND state IN (...)`): of two dfo that see one end (a watch
        and a look, two looks), one records it; the other gets None and records nothing (no second `ended`
        event, no later ended_at). Returns the run as now recorded, or None when it was in another state.
        Every state change of dfo's goes through here (states.RunState draws them)."""
        expected = tuple(str(RunState(state)) for state in expect)
        values = _encode_run_fields({**changes, "state": RunState(to)})
        assignments = ", ".join(f"{k} = ?" for k in values)
        marks = ", ".join("?" for _ in expected)
        with self._write() as db:
            cursor = db.execute(f"UPDATE runs SET {assignments} WHERE name = ? AND state IN ({marks})",
                                (*values.values(), name, *expected))
        if cursor.rowcount == 0:
            self.get_run(name)  # UnknownRun for a name the registry does not hold
            return None
        return self.get_run(name)

    def renew_launch(self, name: str, owner: str, now: float) -> bool:
        """The launching dfo `owner` says it lives (owner_seen_at = `now`); False once the row is no longer its
        `launching` one (started, given up, forgotten): the renewals end there."""
        with self._write() as db:
            cursor = db.execute("UPDATE runs SET owner_seen_at = ? WHERE name = ? AND state = ? AND owner = ?",
                                (now, name, str(RunState.LAUNCHING), owner))
        return cursor.rowcount > 0

    def delete_run(self, name: str) -> None:
        """Forget a run that never started (a failed launch). Its events stay."""
        with self._write() as db:
            db.execute("DELETE FROM runs WHERE name = ?", (name,))

    def forget_runs(self, names: Sequence[str]) -> list[str]:
        """Remove the runs `names` and everything recorded of them (events, samples, GPU samples, notifications,
        multi-node membership) in one transaction (`dfo runs rm`/`prune`); returns the names it removed."""
        names = list(dict.fromkeys(names))
        if not names:
            return []
        marks = ", ".join("?" for _ in names)
        with self._write() as db:
            found = [row["name"] for row in db.execute(f"SELECT name FROM runs WHERE name IN ({marks}) ORDER BY id", names)]
            for table in ("events", "samples", "gpu_samples", "notifications"):
                db.execute(f"DELETE FROM {table} WHERE run IN ({marks})", names)
            db.execute(f"DELETE FROM run_nodes WHERE node_run IN ({marks}) OR run IN ({marks})", names + names)
            db.execute(f"DELETE FROM runs WHERE name IN ({marks})", names)
        return found

    def find_run(self, name: str) -> Run | None:
        rows = self._query("SELECT * FROM runs WHERE name = ?", (name,))
        return _decode_run(rows[0]) if rows else None

    def get_run(self, name: str) -> Run:
        run = self.find_run(name)
        if run is None:
            close = self.names_like(name)
            guess = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise UnknownRun(f"no run named {name!r} in the registry{guess}", hint="see `dfo runs`")
        return run

    def names_like(self, name: str, n: int = 3) -> list[str]:
        """The run names a mistyped `name` may have meant: up to `n` that it begins (newest first), else the closest."""
        names = [row["name"] for row in self._query("SELECT name FROM runs ORDER BY id DESC")]
        started = [known for known in names if known.startswith(name)]
        return started[:n] or difflib.get_close_matches(name, names, n=1, cutoff=0.6)

    def list_runs(self, *, active: bool | None = None, batch: str | None = None, target: str | None = None,
                  states: Sequence[str] = (), started_since: str | None = None, limit: int | None = None) -> list[Run]:
        """Runs, oldest first, optionally only active (launching/running) or the others, of a batch or target,
        in one of `states`, started at or after `started_since` (RFC 3339 UTC text, as utc_now writes it), the
        newest `limit` of them."""
        clause, params = _where(batch=batch, target=target)
        conditions = [clause[len(" WHERE "):]] if clause else []
        if active is not None:
            conditions.append(f"state {'IN' if active else 'NOT IN'} ({', '.join('?' for _ in RunState.active())})")
            params.extend(str(state) for state in RunState.active())
        if states:
            conditions.append(f"state IN ({', '.join('?' for _ in states)})")
            params.extend(str(state) for state in states)
        if started_since is not None:
            conditions.append("started_at >= ?")
            params.append(started_since)
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        newest = f" ORDER BY id DESC LIMIT {int(limit)}" if limit is not None else " ORDER BY id DESC"
        return [_decode_run(r) for r in reversed(self._query(f"SELECT * FROM runs{where}{newest}", params))]

    def lineage(self, name: str) -> list[str]:
        """The chain of `name` from its root down to `name`, along `parent` links (oldest first)."""
        names = [name]
        while len(names) < MAX_CHAIN:
            rows = self._query("SELECT parent FROM runs WHERE name = ?", (names[0],))
            parent = rows[0]["parent"] if rows else None
            if not parent or parent in names or not self._query("SELECT 1 FROM runs WHERE name = ?", (parent,)):
                break
            names.insert(0, parent)
        return names

    def chain_runs(self, root: str) -> list[str]:
        """`root` and the runs that fell back from it, oldest first (the newest child at each link)."""
        names = [root]
        while len(names) < MAX_CHAIN:
            rows = self._query("SELECT name FROM runs WHERE parent = ? ORDER BY id DESC LIMIT 1", (names[-1],))
            if not rows or rows[0]["name"] in names:
                break
            names.append(rows[0]["name"])
        return names

    def children(self, name: str) -> list[str]:
        return [r["name"] for r in self._query("SELECT name FROM runs WHERE parent = ? ORDER BY id", (name,))]

    def add_nodes(self, run: str, node_runs: Sequence[str], rendezvous: str) -> None:
        """Record `node_runs` (in node-rank order, already in `runs`) as the nodes of multi-node run `run`."""
        now = utc_now()
        try:
            with self._write() as db:
                db.executemany("INSERT INTO run_nodes (run, node_rank, node_run, rendezvous, created_at) VALUES (?, ?, ?, ?, ?)",
                               [(run, rank, node_run, rendezvous, now) for rank, node_run in enumerate(node_runs)])
        except sqlite3.IntegrityError as exc:
            raise RefusedError(f"a multi-node run named {run!r} already exists", hint="choose another --name") from exc

    def nodes_of(self, run: str) -> list[str]:
        """The node runs of multi-node run `run`, node 0 first ([] when `run` is no multi-node run)."""
        return [row["node_run"] for row in self._query("SELECT node_run FROM run_nodes WHERE run = ? ORDER BY node_rank", (run,))]

    def node_group(self, node_run: str) -> tuple[str, int, str] | None:
        """(multi-node run, node rank, rendezvous) of a node run; None for a single-node run."""
        rows = self._query("SELECT run, node_rank, rendezvous FROM run_nodes WHERE node_run = ?", (node_run,))
        return (rows[0]["run"], rows[0]["node_rank"], rows[0]["rendezvous"]) if rows else None

    def request_stop(self, name: str) -> Run:
        """Record that dfo was asked to stop `name` (before any signal goes out): a watch of it then reads its
        exit as `stopped`, never as a crash to fall back from."""
        return self.update_run(name, stop_requested_at=utc_now())

    # -- batches (orchestrator/batch.py's CellTable turns the rows into cells)

    def save_batch(self, name: str, source: str, spec: str, cells: Sequence[Mapping[str, Any]], now: str) -> None:
        """Record a batch and those of its cells not recorded yet (a recorded cell keeps its state, gets its
        new position)."""
        with self._write() as db:
            db.execute(
                "INSERT INTO batches (name, source, spec, created_at, updated_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET source = excluded.source, spec = excluded.spec, updated_at = excluded.updated_at",
                (name, source, spec, now, now),
            )
            db.executemany(
                "INSERT INTO batch_cells (batch, cell, position, target, variant, sets, gpus, repeat)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(batch, cell) DO UPDATE SET position = excluded.position",
                [(name, c["cell"], c["position"], c["target"], c["variant"], c["sets"], c["gpus"], c["repeat"]) for c in cells],
            )

    def batches(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._query("SELECT name, source, created_at, updated_at FROM batches ORDER BY created_at")]

    def batch_cells(self, batch: str) -> list[sqlite3.Row]:
        return self._query("SELECT * FROM batch_cells WHERE batch = ? ORDER BY position", (batch,))

    def update_cell(self, batch: str, cell: str, values: Mapping[str, Any]) -> None:
        """Set columns of a cell (values already encoded; the names are batch.py's, never user input)."""
        unknown = set(values) - BATCH_CELL_COLUMNS
        if unknown:
            raise ValueError(f"unknown batch cell {plural(len(unknown), 'field')}: {', '.join(sorted(unknown))}")
        assignments = ", ".join(f"{key} = ?" for key in values)
        with self._write() as db:
            db.execute(f"UPDATE batch_cells SET {assignments} WHERE batch = ? AND cell = ?", (*values.values(), batch, cell))

    # -- claims: who acts on a chain or batch cell (one owner at a time; the others only look)

    def claim(self, key: str, owner: str, *, pid: int, host: str, ttl_s: float, now: float,
              dead_owner: str | None = None) -> "Claim":
        """Take or renew the claim on `key` for `owner` when it is free, expired, already ours, or still held by
        `dead_owner` (a holder the caller found gone); returns the claim as it stands after (its owner may be
        another one, whose lease has not run out)."""
        with self._write() as db:
            row = db.execute("SELECT * FROM claims WHERE key = ?", (key,)).fetchone()
            if row is None or row["owner"] in (owner, dead_owner) or row["expires_at"] <= now:
                db.execute(
                    "INSERT INTO claims (key, owner, pid, host, expires_at, renewed_at, since) VALUES (?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(key) DO UPDATE SET owner = excluded.owner, pid = excluded.pid, host = excluded.host,"
                    " expires_at = excluded.expires_at, renewed_at = excluded.renewed_at,"
                    " since = CASE WHEN claims.owner = excluded.owner THEN claims.since ELSE excluded.since END",
                    (key, owner, pid, host, now + ttl_s, now, now),
                )
            row = db.execute("SELECT * FROM claims WHERE key = ?", (key,)).fetchone()
        return Claim(**dict(row))

    def claim_of(self, key: str) -> "Claim | None":
        """The claim on `key` as it stands (expired or not), without taking it; None when there is none."""
        rows = self._query("SELECT * FROM claims WHERE key = ?", (key,))
        return Claim(**dict(rows[0])) if rows else None

    def release_claim(self, key: str, owner: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM claims WHERE key = ? AND owner = ?", (key, owner))

    def claims(self) -> list["Claim"]:
        return [Claim(**dict(r)) for r in self._query("SELECT * FROM claims ORDER BY key")]

    # -- intents: what dfo is about to do, written before it acts and closed once it has

    def add_intent(self, subject: str, kind: str, data: Mapping[str, Any]) -> int:
        with self._write() as db:
            cursor = db.execute("INSERT INTO intents (subject, kind, data, created_at) VALUES (?, ?, ?, ?)",
                                (subject, kind, json.dumps(dict(data)), utc_now()))
        return int(cursor.lastrowid)

    def add_intent_once(self, subject: str, kind: str, data: Mapping[str, Any]) -> "Intent":
        """The intent of `kind` on `subject` about run `data["run"]` recorded before (open or done), else a new
        one: in one transaction, so two dfo deciding the same action at once record it once."""
        with self._write() as db:
            for row in db.execute("SELECT * FROM intents WHERE subject = ? AND kind = ? ORDER BY id", (subject, kind)):
                if json.loads(row["data"]).get("run") == data["run"]:
                    return _intent(row)
            cursor = db.execute("INSERT INTO intents (subject, kind, data, created_at) VALUES (?, ?, ?, ?)",
                                (subject, kind, json.dumps(dict(data)), utc_now()))
            row = db.execute("SELECT * FROM intents WHERE id = ?", (cursor.lastrowid,)).fetchone()
        return _intent(row)

    def get_intent(self, intent_id: int) -> "Intent":
        return _intent(self._query("SELECT * FROM intents WHERE id = ?", (intent_id,))[0])

    def update_intent(self, intent_id: int, data: Mapping[str, Any], *, done: bool = False) -> None:
        with self._write() as db:
            db.execute("UPDATE intents SET data = ?, done_at = ? WHERE id = ?",
                       (json.dumps(dict(data)), utc_now() if done else None, intent_id))

    def intents_about(self, subject: str, run: str) -> list["Intent"]:
        """Every intent on `subject` about run `run` (`data["run"]`), open or done, oldest first."""
        rows = self._query("SELECT * FROM intents WHERE subject = ? ORDER BY id", (subject,))
        return [intent for intent in map(_intent, rows) if intent.data.get("run") == run]

    def open_intents(self, subject: str | None = None) -> list["Intent"]:
        """Intents not finished yet (a dfo died while acting), oldest first."""
        clause, params = _where(subject=subject)
        clause = f"{clause} AND done_at IS NULL" if clause else " WHERE done_at IS NULL"
        rows = self._query(f"SELECT * FROM intents{clause} ORDER BY id", params)
        return [_intent(r) for r in rows]

    def set_offset(self, run: str, offset: int) -> None:
        """Remember how far into the run's log the watcher has read."""
        self.update_run(run, log_offset=offset)

    # -- events

    def add_event(self, run: str | None, kind: str, data: Mapping[str, Any] | None = None, *, at: str | None = None) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO events (run, at, kind, data) VALUES (?, ?, ?, ?)",
                (run, at or utc_now(), kind, json.dumps(dict(data)) if data is not None else None),
            )

    def events(self, run: str | None = None, *, kind: str | None = None) -> list[dict[str, Any]]:
        """Events in insertion order, as dicts {run, at, kind, data}."""
        clause, params = _where(run=run, kind=kind)
        rows = self._query(f"SELECT run, at, kind, data FROM events{clause} ORDER BY id", params)
        return [{**dict(r), "data": json.loads(r["data"]) if r["data"] else None} for r in rows]

    # -- pushes

    def record_push(self, target: str, hash: str, nbytes: int) -> None:
        """Note that `target` has package `hash`; nbytes is what was transferred (0 when it was already there)."""
        with self._write() as db:
            db.execute("INSERT INTO pushes (target, hash, at, bytes) VALUES (?, ?, ?, ?)", (target, hash, utc_now(), nbytes))

    def last_push(self, target: str) -> dict[str, Any] | None:
        rows = self._query("SELECT target, hash, at, bytes FROM pushes WHERE target = ? ORDER BY id DESC LIMIT 1", (target,))
        return dict(rows[0]) if rows else None

    def pushes(self, target: str | None = None) -> list[dict[str, Any]]:
        clause, params = _where(target=target)
        return [dict(r) for r in self._query(f"SELECT target, hash, at, bytes FROM pushes{clause} ORDER BY id", params)]

    # -- samples

    def add_samples(self, run: str, samples: Iterable[Mapping[str, Any]], *, offset: int | None = None,
                    ident: Mapping[str, Any] | None = None) -> int:
        """Store parsed metric lines (step, ts, tok_s, loss, phase; other keys go to `extra`). Returns the count.

        `offset`: the log offset the watcher has read up to, recorded in the SAME transaction, so a re-attach
        starts exactly after the stored samples; `ident`: the identity of the file that offset is in (always
        written with the offset: None forgets it)."""
        rows = [
            (run, *(s.get(c) for c in SAMPLE_COLUMNS), _extra(s, SAMPLE_COLUMNS))
            for s in samples
        ]
        if rows or offset is not None:
            with self._write() as db:
                if rows:
                    db.executemany(
                        "INSERT INTO samples (run, step, ts, tok_s, loss, phase, extra) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        rows,
                    )
                if offset is not None:
                    db.execute("UPDATE runs SET log_offset = ?, log_ident = ? WHERE name = ?",
                               (offset, json.dumps(dict(ident)) if ident else None, run))
        return len(rows)

    def last_step(self, run: str) -> int | None:
        """The highest step stored for `run` (None: none yet)."""
        return self._query("SELECT MAX(step) FROM samples WHERE run = ?", (run,))[0][0]

    def samples(self, run: str) -> list[dict[str, Any]]:
        rows = self._query("SELECT step, ts, tok_s, loss, phase, extra FROM samples WHERE run = ? ORDER BY id", (run,))
        return [{**{k: r[k] for k in SAMPLE_COLUMNS}, **(json.loads(r["extra"]) if r["extra"] else {})} for r in rows]

    def add_gpu_samples(self, target: str, samples: Iterable[Mapping[str, Any]], *, run: str | None = None) -> int:
        """Store GPU samples ({ts, index, mem_used_mib, mem_total_mib, util_pct}) of a target (and run). Returns the count."""
        rows = [(run, target, *(s.get(c) for c in GPU_SAMPLE_COLUMNS)) for s in samples]
        if rows:
            with self._write() as db:
                db.executemany(
                    "INSERT INTO gpu_samples (run, target, ts, gpu_index, mem_used_mib, mem_total_mib, util_pct)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
        return len(rows)

    def gpu_samples(self, *, run: str | None = None, target: str | None = None) -> list[dict[str, Any]]:
        clause, params = _where(run=run, target=target)
        rows = self._query(
            f"SELECT run, target, ts, gpu_index AS 'index', mem_used_mib, mem_total_mib, util_pct FROM gpu_samples{clause}"
            " ORDER BY id",
            params,
        )
        return [dict(r) for r in rows]


    # -- notifications

    def claim_notification(self, run: str, key: str, channel: str) -> bool:
        """True for the one caller that may send this notification; False when it was claimed before."""
        with self._write() as db:
            cursor = db.execute("INSERT OR IGNORE INTO notifications (run, key, channel, claimed_at) VALUES (?, ?, ?, ?)",
                                (run, key, channel, utc_now()))
        return cursor.rowcount == 1

    def finish_notification(self, run: str, key: str, channel: str, *, ok: bool, detail: str | None = None) -> None:
        with self._write() as db:
            db.execute("UPDATE notifications SET done_at = ?, ok = ?, detail = ? WHERE run = ? AND key = ? AND channel = ?",
                       (utc_now(), int(ok), detail, run, key, channel))

    def notifications(self, run: str | None = None) -> list[dict[str, Any]]:
        clause, params = _where(run=run)
        rows = self._query(f"SELECT run, key, channel, claimed_at, done_at, ok, detail FROM notifications{clause}"
                           " ORDER BY claimed_at, rowid", params)
        return [{**dict(r), "ok": None if r["ok"] is None else bool(r["ok"])} for r in rows]


def _intent(row: sqlite3.Row) -> Intent:
    return Intent(row["id"], row["subject"], row["kind"], json.loads(row["data"]), row["created_at"], row["done_at"])


def _extra(sample: Mapping[str, Any], known: Sequence[str]) -> str | None:
    rest = {k: v for k, v in sample.items() if k not in known}
    return json.dumps(rest) if rest else None


def _where(**equal: Any) -> tuple[str, list[Any]]:
    """A ` WHERE a = ? AND b = ?` clause for the conditions that are not None (column names are ours, not input)."""
    used = {k: v for k, v in equal.items() if v is not None}
    clause = " WHERE " + " AND ".join(f"{k} = ?" for k in used) if used else ""
    return clause, list(used.values())
