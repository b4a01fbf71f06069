"""The run registry: schema, run records, events/pushes/samples, and two real processes writing at once."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap

import pytest

from orchestrator.errors import RefusedError, UnknownRun
from orchestrator.store import MIGRATIONS, Run, Store, dfo_home


@pytest.fixture
def store():
    with Store.in_memory() as s:
        yield s


def test_default_location_follows_dfo_home_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("DFO_HOME", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert dfo_home() == tmp_path / "state" / "dfo"
    monkeypatch.setenv("DFO_HOME", str(tmp_path / "home"))
    assert dfo_home() == tmp_path / "home"
    with Store() as s:
        assert s.path == str(tmp_path / "home" / "dfo.db")
    assert (tmp_path / "home" / "dfo.db").exists()


def test_file_store_uses_wal_and_records_every_migration(tmp_path):
    path = tmp_path / "dfo.db"
    with Store(path) as s:
        assert s.schema_version() == len(MIGRATIONS)
    with Store(path) as s:  # reopening applies nothing twice
        assert s.schema_version() == len(MIGRATIONS)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == len(MIGRATIONS)


def test_run_round_trip_and_json_fields(store):
    store.add_run(Run(name="r1", target="ct200", variant="nographs", chain=["eager"], batch="b1"))
    run = store.update_run("r1", state="running", pid=42, decision={"decision": "steady", "at_step": 3})
    assert (run.state, run.pid, run.chain, run.decision["decision"]) == ("running", 42, ["eager"], "steady")
    assert run.active


def test_taken_name_is_refused(store):
    store.add_run(Run(name="r1", target="a"))
    with pytest.raises(RefusedError, match="already exists"):
        store.add_run(Run(name="r1", target="b"))
    assert store.get_run("r1").target == "a"


def test_unknown_run_and_bad_state_are_rejected(store):
    with pytest.raises(UnknownRun):
        store.get_run("nope")
    with pytest.raises(UnknownRun):
        store.update_run("nope", state="running")
    store.add_run(Run(name="r1", target="a"))
    with pytest.raises(ValueError, match="state"):
        store.update_run("r1", state="sleeping")


def test_list_runs_filters_by_activity_batch_and_target(store):
    store.add_run(Run(name="a", target="t1", state="running", batch="b"))
    store.add_run(Run(name="b", target="t2", state="exited", batch="b"))
    store.add_run(Run(name="c", target="t1", state="launching"))
    assert [r.name for r in store.list_runs(active=True)] == ["a", "c"]
    assert [r.name for r in store.list_runs(active=False)] == ["b"]
    assert [r.name for r in store.list_runs(batch="b", active=True)] == ["a"]
    assert [r.name for r in store.list_runs(target="t1")] == ["a", "c"]


def test_events_pushes_samples_and_offsets(store):
    store.add_run(Run(name="r", target="t"))
    store.add_event("r", "launched", {"pid": 7})
    store.add_event(None, "push", {"hash": "x"})
    assert [e["kind"] for e in store.events("r")] == ["launched"]
    assert store.events("r")[0]["data"] == {"pid": 7}
    assert store.last_push("t") is None
    store.record_push("t", "h1", 100)
    store.record_push("t", "h2", 0)
    assert store.last_push("t")["hash"] == "h2"
    n = store.add_samples("r", [{"step": i, "ts": 1.0 + i, "tok_s": 10.0 * i, "acc": 0.5} for i in range(3)])
    assert n == 3
    assert store.samples("r")[2] == {"step": 2, "ts": 3.0, "tok_s": 20.0, "loss": None, "phase": None, "acc": 0.5}
    store.add_gpu_samples("t", [{"ts": 1.0, "index": 0, "mem_used_mib": 5, "mem_total_mib": 80, "util_pct": 99}], run="r")
    assert store.gpu_samples(run="r")[0]["index"] == 0
    store.set_offset("r", 1234)
    assert store.get_run("r").log_offset == 1234
    assert store.add_samples("r", [{"step": 3, "ts": 4.0, "tok_s": 30.0}], offset=2000) == 1
    assert store.get_run("r").log_offset == 2000 and store.samples("r")[-1]["step"] == 3
    assert store.add_samples("r", [], offset=2100) == 0  # free-text lines only: the offset still moves
    assert store.get_run("r").log_offset == 2100 and len(store.samples("r")) == 4


WRITER = textwrap.dedent(
    """
    import sys
    from orchestrator.store import Run, Store
    path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    s = Store(path)
    for i in range(n):
        name = f"{tag}-{i}"
        s.add_run(Run(name=name, target=tag))
        s.update_run(name, state="running", pid=i)
        s.add_event(name, "launched", {"i": i})
        s.add_samples(name, [{"step": k, "ts": float(k), "tok_s": 1.0} for k in range(5)])
    s.close()
    """
)


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = tmp_path / "dfo.db"
    n = 150
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), tag, str(n)], stderr=subprocess.PIPE)
        for tag in ("p1", "p2")
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    with Store(path) as s:
        runs = s.list_runs(active=True)
        assert len(runs) == 2 * n
        assert {r.target for r in runs} == {"p1", "p2"}
        assert len(s.events(kind="launched")) == 2 * n
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert db.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 2 * n * 5


def test_a_batch_saved_again_keeps_its_cells_states_and_cell_updates_take_known_columns_only(store):
    cells = [{"cell": "c1", "position": 0, "target": "t", "variant": "v", "sets": "{}", "gpus": None, "repeat": 1}]
    store.save_batch("b1", "f.yaml", "{}", cells, "now")
    store.update_cell("b1", "c1", {"state": "done"})
    store.save_batch("b1", "f.yaml", "{}", [{**cells[0], "position": 3}], "later")
    [row] = store.batch_cells("b1")
    assert (row["state"], row["position"]) == ("done", 3)
    assert [b["name"] for b in store.batches()] == ["b1"]
    with pytest.raises(ValueError, match="unknown batch cell field"):
        store.update_cell("b1", "c1", {"state = 'x'; --": 1})


def test_a_registry_from_a_newer_dfo_is_refused_not_mangled(tmp_path):
    from orchestrator.errors import DfoError

    path = tmp_path / "dfo.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO schema_version VALUES (?, 'from the future', 'later')", (len(MIGRATIONS) + 1,))
    db.commit()
    db.close()
    with pytest.raises(DfoError, match=f"schema version {len(MIGRATIONS) + 1}, this dfo knows up to {len(MIGRATIONS)}"):
        Store(path)


def registry_before(path, version: int) -> sqlite3.Connection:
    """A registry file of the dfo before migration `version` (those before it applied), open for rows to be added."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name TEXT, applied_at TEXT)")
    for number, (name, apply) in enumerate(MIGRATIONS[: version - 1], start=1):
        apply(db)
        db.execute("INSERT INTO schema_version VALUES (?, ?, 'then')", (number, name))
    return db


def test_the_unconfirmed_migration_turns_an_old_pid_less_lost_row_into_unconfirmed_and_keeps_a_real_lost_one(tmp_path):
    # a registry of the dfo before migration 10, where a start that got no answer was `lost` without a PID (and a
    # process gone without an exit file was `lost` with its PID): one state for two things
    from orchestrator.runs import start_unseen
    from orchestrator.states import RunState

    path = tmp_path / "dfo.db"
    db = registry_before(path, 10)
    rows = [("unseen", None, None, "2026-11-29T11:40:03.123Z"), ("gone", 4242, None, "2026-11-29T12:40:03.123Z"),
            ("crashed", 4243, 1, "2026-11-29T12:41:03.123Z")]
    for name, pid, code, ended in rows:
        db.execute("INSERT INTO runs (name, target, state, pid, exit_code, ended_at) VALUES (?, 'ct200', ?, ?, ?, ?)",
                   (name, "crashed" if code else "lost", pid, code, ended))
    db.commit()
    db.close()
    with Store(path) as store:
        assert store.schema_version() == len(MIGRATIONS) >= 10
        unseen = store.get_run("unseen")
        assert (unseen.state, unseen.pid, unseen.ended_at) == ("unconfirmed", None, "2026-11-29T11:40:03.123Z")
        assert start_unseen(unseen) and not unseen.active  # looked for as before, by its exit file
        assert [store.get_run(name).state for name in ("gone", "crashed")] == ["lost", "crashed"]
        assert [run.name for run in store.list_runs(states=["lost"])] == ["gone"]
        # settled once: of two dfo that found it running, one records it (UPDATE ... WHERE state IN (...))
        found = [store.transition("unseen", RunState.RUNNING, RunState.unsettled(), pid=pid) for pid in (77, 78)]
        assert found[0] is not None and found[1] is None and store.get_run("unseen").pid == 77
        assert store.transition("gone", RunState.EXITED, RunState.endable(), exit_code=0) is None  # lost is an end
    with Store(path) as store:  # applied once
        assert store.get_run("gone").state == "lost" and store.schema_version() == len(MIGRATIONS)


def test_migration_12_renames_the_registrys_resume_record_apart_from_dfo_resume_jsons_line(tmp_path):
    # before it: `resumed` was both `dfo resume --json`'s line (run, resumed_from, target, ...) and the registry's
    # record of a resume (from_run, checkpoint): the old rows become `resumed_from`, the line keeps its kind
    path = tmp_path / "dfo.db"
    db = registry_before(path, 12)
    db.execute("INSERT INTO events (run, at, kind, data) VALUES ('r.2-eager', 'then', 'resumed', "
               "'{\"from_run\": \"r\", \"checkpoint\": \"/ws/runs/r/checkpoint.pt\"}')")
    db.commit()
    db.close()
    with Store(path) as store:
        [row] = store.events()
        assert (row["run"], row["kind"]) == ("r.2-eager", "resumed_from")
        assert store.schema_version() == len(MIGRATIONS)


def test_migration_11_gives_each_stored_event_kind_one_shape(tmp_path):
    # before it: `launched` was both `dfo launch --json`'s line and the registry's start record (another shape),
    # and `error` both a run's and a target channel's (no run); old rows are renamed, what reads them finds them
    path = tmp_path / "dfo.db"
    db = registry_before(path, 11)
    for run, kind, data in [("r", "launched", '{"pid": 7, "sets": {"steps": "9"}, "env": {}, "wandb": "off"}'),
                            ("r", "error", '{"chain": "r", "text": "its log was not read"}'),
                            (None, "error", '{"target": "ct200", "text": "agent died"}')]:
        db.execute("INSERT INTO events (run, at, kind, data) VALUES (?, 'then', ?, ?)", (run, kind, data))
    db.commit()
    db.close()
    with Store(path) as store:
        assert [(e["run"], e["kind"]) for e in store.events()] == [("r", "started"), ("r", "error"), (None, "target_error")]
        from orchestrator.chains import first_launch

        assert first_launch(store, "r")["sets"] == {"steps": "9"}  # a fallback's successor still takes its sets
