"""What users of ops tools (docker, gh, sky) reach for first: `dfo stop A B` and `dfo stop --all`, `dfo runs`
filters and columns, `dfo runs rm/prune`. Runs are `command:` variants on the local target `here`, driven
through the CLI in this process (harness.cli.dfo)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from rich.console import Console

from harness import write_inventory
from harness.cli import dfo

from orchestrator.commands.runs import runs_table
from orchestrator.store import Run, Store


def local_inventory(tmp_path: Path) -> Path:
    return write_inventory(tmp_path, {
        "defaults": {"workspace": str(tmp_path / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {"long": {"command": "echo started; exec sleep 300"}}})


@pytest.fixture
def lab(tmp_path):
    """An inventory with a 5-minute `long` variant and two registries (`a`, `b`); every run still going at the
    end is killed (its process group), whatever the test did."""
    inventory = local_inventory(tmp_path)
    homes = {key: tmp_path / key for key in ("a", "b")}
    yield inventory, {key: {"DFO_HOME": str(home)} for key, home in homes.items()}
    for home in homes.values():
        if (home / "dfo.db").exists():
            with Store(home / "dfo.db") as store:
                for run in store.list_runs():
                    if run.pid and run.state == "running":
                        try:
                            os.killpg(run.pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass


def launch(inventory: Path, env: dict, name: str) -> int:
    done = dfo("launch", "--host", "here", "--variant", "long", "--name", name, "--no-preflight", "-i", inventory,
               "--json", env=env)
    assert done.returncode == 0, done.output
    return json.loads(done.stdout)["pid"]


def alive(pid: int) -> bool:
    """The process is there and not a zombie (a run's wrapper may be this process's child, unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stop_takes_several_names_and_says_one_line_each(lab):
    inventory, env = lab
    pids = [launch(inventory, env["a"], name) for name in ("s1", "s2")]
    stopped = dfo("stop", "s1", "s2", "--grace", "10", env=env["a"])
    assert stopped.returncode == 0, stopped.output  # before: "Got unexpected extra argument (s2)", exit 2
    lines = stopped.stdout.splitlines()
    assert [line.split(" (SIG")[0] for line in lines] == ["stopped s1", "stopped s2"], stopped.output
    assert not any(map(alive, pids))
    states = {run["name"]: run["state"] for run in json.loads(dfo("runs", "--json", "--no-refresh", env=env["a"]).stdout)}
    assert states == {"s1": "stopped", "s2": "stopped"}
    again = dfo("stop", "s1", "s2", "--json", env=env["a"])
    assert again.returncode == 1  # as `dfo stop s1` alone: nothing to stop is refused, in a list of one object each
    assert [(r["run"], "not running (state stopped)" in r["error"]) for r in json.loads(again.stdout)] == [
        ("s1", True), ("s2", True)]


def test_stop_of_several_names_refuses_an_unknown_one_before_stopping_any(lab):
    inventory, env = lab
    pid = launch(inventory, env["a"], "k1")
    refused = dfo("stop", "k1", "k2x", env=env["a"])
    assert refused.returncode == 2 and "no run named 'k2x'" in refused.stderr, refused.output
    assert alive(pid)


def test_stop_goes_on_past_a_run_it_cannot_stop_and_exits_non_zero(lab):
    inventory, env = lab
    with Store(Path(env["a"]["DFO_HOME"]) / "dfo.db") as store:  # a run on a target the inventory no longer has
        store.add_run(Run(name="gone", target="ct999", state="running", pid=4242))
    pid = launch(inventory, env["a"], "g1")
    stopped = dfo("stop", "gone", "g1", "--grace", "10", "-i", inventory, env=env["a"])
    assert stopped.returncode == 1, stopped.output
    assert stopped.stderr.startswith("gone: not stopped: ") and "ct999" in stopped.stderr
    assert stopped.stdout.startswith("stopped g1 (SIGTERM)") and not alive(pid)
    assert "1 of 2 runs stopped or already ended; 1 not stopped" in stopped.stderr


def test_stop_all_stops_this_registrys_active_runs_only_and_says_how_many(lab):
    inventory, env = lab
    mine = [launch(inventory, env["a"], name) for name in ("m1", "m2")]
    theirs = launch(inventory, env["b"], "t1")
    with Store(Path(env["a"]["DFO_HOME"]) / "dfo.db") as store:  # an ended run is not stopped again
        store.add_run(Run(name="old", target="here", state="exited", exit_code=0))
    stopped = dfo("stop", "--all", "--grace", "10", "--json", env=env["a"])
    assert stopped.returncode == 0, stopped.output
    assert [(r["run"], r["state"]) for r in json.loads(stopped.stdout)] == [("m1", "stopped"), ("m2", "stopped")]
    assert "stopping 2 active runs of" in stopped.stderr and "m1, m2" in stopped.stderr
    assert not any(map(alive, mine)) and alive(theirs)
    none_left = dfo("stop", "--all", env=env["a"])
    assert none_left.returncode == 0 and "no active runs to stop" in none_left.stdout
    both = dfo("stop", "--all", "t1", env=env["b"])
    assert both.returncode == 2 and "give run names or --all, not both" in both.stderr and alive(theirs)
    assert dfo("stop", env=env["b"]).returncode == 2


def registry_of_runs(home: Path, now: datetime | None = None) -> None:
    """Five runs started 10 min, 1 h, 3 h, 2 days and 10 days before `now` (default: the clock's), in several
    states."""
    now = (now or datetime.now()).astimezone(timezone.utc)

    def ago(**delta) -> str:
        return (now - timedelta(**delta)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    with Store(home / "dfo.db") as store:
        store.add_run(Run(name="old", target="ct200", state="exited", exit_code=0, pid=1001, started_at=ago(days=10),
                          ended_at=ago(days=10, minutes=-5)))
        store.add_run(Run(name="twodays", target="ct200", state="crashed", exit_code=1, pid=1002, started_at=ago(days=2),
                          ended_at=ago(days=2, seconds=-42), decision={"decision": "crash"}))
        store.add_run(Run(name="threeh", target="ct201", state="stopped", exit_code=75, pid=1003, started_at=ago(hours=3),
                          ended_at=ago(hours=1), decision={"decision": "steady", "steady_tok_s": 7129.4}))
        store.add_run(Run(name="oneh", target="ct201", state="running", pid=1004, started_at=ago(hours=1)))
        store.add_run(Run(name="tenmin", target="ct202", state="failed", started_at=ago(minutes=10)))


def names(ran) -> list[str]:
    assert ran.returncode == 0, ran.output
    return [run["name"] for run in json.loads(ran.stdout)]


def test_runs_filters_by_state_age_and_count(tmp_path):
    registry_of_runs(tmp_path)
    env = {"DFO_HOME": str(tmp_path)}

    def runs(*args: str):
        return dfo("runs", "--json", "--no-refresh", *args, env=env)
    assert names(runs("--state", "crashed", "--state", "stopped")) == ["twodays", "threeh"]
    assert names(runs("--since", "2h")) == ["oneh", "tenmin"]
    assert names(runs("--since", "3d")) == ["twodays", "threeh", "oneh", "tenmin"]
    assert names(runs("--since", (datetime.now() - timedelta(days=5)).strftime("%Y-%m-%d"))) == [
        "twodays", "threeh", "oneh", "tenmin"]
    assert names(runs("--limit", "2")) == ["oneh", "tenmin"]  # the newest two, oldest first as always
    assert names(runs("--limit", "1", "--state", "exited", "--state", "crashed")) == ["twodays"]
    typo = runs("--state", "runing")
    assert typo.returncode == 2 and typo.stdout == ""
    assert ("dfo: error: --state: unknown state 'runing' (did you mean 'running'?); states: launching, unconfirmed, "
            "running, exited, crashed, stopped, lost, failed") in typo.stderr
    for bad in ("yesterday", "2 hours", "-3d"):
        refused = runs("--since", bad)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.output
        assert "--since: expected an age (30m, 2h, 3d, 1w) or an ISO date" in refused.stderr
    none = dfo("runs", "--no-refresh", "--state", "lost", env=env)
    assert none.returncode == 0 and "no runs in state lost" in none.stdout


def test_runs_shows_start_duration_and_steady_tok_s_and_keeps_target_and_pid_at_80_columns(tmp_path):
    # a fixed noon: the run of 3 h ago started today (its time alone), whatever the hour the test runs at
    noon = datetime.now().astimezone().replace(hour=12, minute=0, second=0, microsecond=0)
    registry_of_runs(tmp_path, noon)
    console = Console(width=120, file=io.StringIO())  # the table as a 120-column terminal shows it
    with Store(tmp_path / "dfo.db") as store:
        console.print(runs_table(store.list_runs(), 120, now=noon))
    header, _, *rows = console.file.getvalue().splitlines()
    assert header.split() == ["name", "target", "PID", "state", "start", "took", "tok/s", "decision", "variant"]
    row = {line.split()[0]: line for line in rows}
    assert re.search(r"\bstopped 75\s+\d\d:\d\d\s+2h00m\s+7,129\s+steady", row["threeh"]), rows
    assert re.search(r"\bcrashed 1\s+\d\d-\d\d \d\d:\d\d\s+42s\s+crash", row["twodays"]), rows
    assert re.search(r"running\s+\d\d:\d\d\s+1h00m", row["oneh"]), rows  # an active run: so far
    long_names = tmp_path / "long"
    long_names.mkdir()
    with Store(long_names / "dfo.db") as store:
        for pid, name in enumerate(["train_nographs_20261129-1140-2", "sweep.trees.ct200.r1.2-nographs"], start=123456):
            store.add_run(Run(name=name, target="ct200", state="crashed", exit_code=1, pid=pid,
                              started_at="2026-11-29T11:40:03.123Z", decision={"decision": "crash"}))
    narrow = dfo("runs", "--no-refresh", env={"DFO_HOME": str(long_names), "COLUMNS": "80"})
    lines = narrow.stdout.splitlines()
    assert max(map(len, lines)) <= 80, narrow.stdout
    assert re.search(r"^train_nographs_20261129-1140-2\s+ct200\s+123456\s+crashed 1", narrow.stdout, re.M)
    assert "not shown for lack of width:" in narrow.stdout  # what it left out is said, never target or PID


def test_runs_rm_removes_ended_runs_and_refuses_a_running_one_unless_forced(lab):
    inventory, env = lab
    home = Path(env["a"]["DFO_HOME"])
    pid = launch(inventory, env["a"], "live")
    with Store(home / "dfo.db") as store:
        store.add_run(Run(name="done1", target="here", state="exited", exit_code=0, started_at="2026-11-29T11:40:03.123Z"))
        store.add_event("done1", "decision", {"decision": "steady"})
        store.add_samples("done1", [{"step": 1, "ts": 1.0, "tok_s": 100.0}])
    refused = dfo("runs", "rm", "done1", "live", env=env["a"])
    assert refused.returncode == 1, refused.output  # before: "Got unexpected extra argument", exit 2
    assert "live may still be running; nothing removed" in refused.stderr and "dfo stop live" in refused.stderr
    assert names(dfo("runs", "--json", "--no-refresh", env=env["a"])) == ["live", "done1"] and alive(pid)
    unknown = dfo("runs", "rm", "done1", "nope", env=env["a"])
    assert unknown.returncode == 2 and "no run named 'nope'" in unknown.stderr
    removed = dfo("runs", "rm", "done1", "--json", env=env["a"])
    assert removed.returncode == 0 and json.loads(removed.stdout)["removed"] == ["done1"], removed.output
    with Store(home / "dfo.db") as store:
        assert store.find_run("done1") is None and store.events("done1") == [] and store.samples("done1") == []
    forced = dfo("runs", "rm", "live", "--force", "--grace", "10", env=env["a"])
    assert forced.returncode == 0, forced.output
    assert forced.stdout.startswith("stopped live (SIGTERM)") and "removed 1 run: live" in forced.stdout
    assert not alive(pid) and names(dfo("runs", "--json", "--no-refresh", env=env["a"])) == []


def test_runs_prune_removes_old_runs_and_keeps_a_running_one_unless_forced(lab):
    inventory, env = lab
    home = Path(env["a"]["DFO_HOME"])
    registry_of_runs(home)  # started 10 min .. 10 days ago; "oneh" says running (PID 1004, not this test's)
    pid = launch(inventory, env["a"], "live")
    long_ago = (datetime.now(timezone.utc) - timedelta(days=9)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    with Store(home / "dfo.db") as store:
        store.update_run("live", started_at=long_ago)
    pruned = dfo("runs", "prune", env=env["a"])  # 7 days by default
    assert pruned.returncode == 0, pruned.output
    assert "removed 1 run older than 7d: old" in pruned.stdout
    assert "kept 1 run that may still be running (live)" in pruned.stderr and alive(pid)
    assert names(dfo("runs", "--json", "--no-refresh", env=env["a"])) == ["twodays", "threeh", "oneh", "tenmin", "live"]
    forced = dfo("runs", "prune", "--older-than", "1d", "--force", "--grace", "10", "--json", env=env["a"])
    assert forced.returncode == 0, forced.output
    assert json.loads(forced.stdout) == {"removed": ["twodays", "live"], "stopped": ["live"], "kept": [],
                                         "not_removed": []}
    assert not alive(pid)
    bad = dfo("runs", "prune", "--older-than", "soon", env=env["a"])
    assert bad.returncode == 2 and "--older-than: expected an age (30m, 2h, 3d, 1w) or an ISO date" in bad.stderr


def test_launch_takes_host_all_and_host_name_as_preflight_and_batch_do(lab):
    inventory, env = lab
    launched = dfo("launch", "--host", "all", "--variant", "long", "--name", "a1", "--no-preflight", "-i", inventory,
                   "--json", env=env["a"])
    assert launched.returncode == 0, launched.output  # before: "unknown target 'all'"
    assert json.loads(launched.stdout)["target"] == "here"
    by_host = dfo("launch", "--host", "host:local", "--variant", "long", "--name", "a2", "--no-preflight", "-i",
                  inventory, "--json", env=env["a"])
    assert by_host.returncode == 0 and json.loads(by_host.stdout)["target"] == "here", by_host.output
    unknown = dfo("launch", "--host", "host:pve9", "--variant", "long", "-i", inventory, env=env["a"])
    assert unknown.returncode == 2 and "--host: unknown host 'pve9'; known hosts: local" in unknown.stderr
    assert dfo("stop", "--all", "--grace", "10", env=env["a"]).returncode == 0


def test_a_lost_run_says_why_in_runs_name_and_its_json(tmp_path):
    with Store(tmp_path / "dfo.db") as store:
        store.add_run(Run(name="gone", target="ct200", state="lost", pid=4242, started_at="2026-11-29T11:40:03.123Z",
                          ended_at="2026-11-29T12:40:03.123Z"))
        store.add_event("gone", "ended", {"state": "lost", "exit_code": None, "why": "ended while nobody watched"})
    env = {"DFO_HOME": str(tmp_path)}
    shown = dfo("runs", "gone", "--no-refresh", env=env)
    assert shown.returncode == 0, shown.output
    said = " ".join(line for line in shown.stdout.splitlines() if line.startswith("lost:"))
    assert "its process is gone and wrote no exit status" in said and "OOM killer" in said, shown.stdout
    assert "(recorded: ended while nobody watched)" in " ".join(shown.stdout.split())
    assert "start:" not in shown.stdout
    gone = json.loads(dfo("runs", "gone", "--no-refresh", "--json", env=env).stdout)
    assert gone["lost_why"].startswith("its process is gone") and gone["unconfirmed_why"] is None


def test_a_start_that_got_no_answer_is_unconfirmed_in_dfo_runs_saying_until_when_it_is_looked_for(lab):
    # the start script waits 3 s before it starts the run; dfo gives up on its answer after 1 s (DFO_TEST_SLOW_START).
    # Before, its row was `lost` (with no PID), the state of a run whose process died without an exit file, and
    # `dfo runs NAME` said `lost:` for both.
    inventory, env = lab
    launched = dfo("launch", "--host", "here", "--variant", "long", "--name", "slow", "--no-preflight", "-i", inventory,
                   env={**env["a"], "DFO_TEST_SLOW_START": "slow:3"})
    assert launched.returncode == 1, launched.output
    assert "left `unconfirmed`: it may still come up" in " ".join(launched.stderr.split()), launched.stderr
    [row] = json.loads(dfo("runs", "--no-refresh", "--json", env=env["a"]).stdout)
    assert (row["name"], row["state"], row["pid"], row["exit_code"]) == ("slow", "unconfirmed", None, None)
    assert names(dfo("runs", "--no-refresh", "--json", "--state", "unconfirmed", env=env["a"])) == ["slow"]
    assert names(dfo("runs", "--no-refresh", "--json", "--state", "lost", env=env["a"])) == []
    gave_up = datetime.fromisoformat(row["ended_at"])  # when dfo gave up on the answer: its start grace counts from it
    until = (gave_up + timedelta(seconds=30)).astimezone()  # the built-in watch.start_grace_s
    shown = dfo("runs", "slow", "-i", inventory, env=env["a"])  # looked at: nothing shows yet, within its grace
    assert shown.returncode == 0, shown.output
    said = " ".join(shown.stdout.split())
    assert "state: unconfirmed" in said and "lost:" not in said, shown.stdout
    assert (f"start: unconfirmed: it got no answer (local: the launch script gave no start within 1s), so the run may "
            f"be going: looked for by its exit file until {until:%H:%M:%S} (watch.start_grace_s, 30 s after dfo gave "
            f"up on the answer), adopted if it shows, then marked failed; `dfo runs slow --recheck` looks now") in said, said
    as_json = json.loads(dfo("runs", "slow", "--no-refresh", "--json", env=env["a"]).stdout)
    assert as_json["state"] == "unconfirmed" and as_json["lost_why"] is None
    assert datetime.fromisoformat(as_json["looked_for_until"]) == gave_up + timedelta(seconds=30)
    assert as_json["unconfirmed_why"].startswith("unconfirmed: it got no answer (local: the launch script"), as_json

    with Store(Path(env["a"]["DFO_HOME"]) / "dfo.db") as store:  # its grace made over: the next look settles it
        store.update_run("slow", ended_at=(gave_up - timedelta(seconds=31)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z")
    over = json.loads(dfo("runs", "slow", "--no-refresh", "--json", env=env["a"]).stdout)
    assert "its grace to show ended at" in over["unconfirmed_why"] and "the next look marks it failed" in over["unconfirmed_why"]
    settled = json.loads(dfo("runs", "slow", "--recheck", "--json", "-i", inventory, env=env["a"]).stdout)
    assert (settled["state"], settled["launch_failed"], settled["unconfirmed_why"]) == (
        "failed", "its start got no answer; no process found", None)


def test_stop_all_names_a_multinode_run_once_and_says_each_run_it_could_not_stop(tmp_path):
    with Store(tmp_path / "dfo.db") as store:  # targets the (built-in) inventory does not have: nothing is reached
        for rank in range(2):
            store.add_run(Run(name=f"mn.node{rank}", target=f"gone{rank}", state="running", pid=4242 + rank))
        store.add_nodes("mn", ["mn.node0", "mn.node1"], "10.0.0.1:29500")
        store.add_run(Run(name="solo", target="gone", state="running", pid=4250))
    stopped = dfo("stop", "--all", "--json", env={"DFO_HOME": str(tmp_path)})
    assert stopped.returncode == 1, stopped.output
    assert "stopping 2 active runs of" in stopped.stderr and stopped.stderr.rstrip().endswith(": mn, solo")
    assert [(r["run"], "unknown target 'gone" in r["error"]) for r in json.loads(stopped.stdout)] == [
        ("mn", True), ("solo", True)]


def test_resume_refuses_an_unconfirmed_start_which_may_be_running(lab):
    # its start got no answer: the run may be going, so a resume would start a second trainer on its checkpoint
    inventory, env = lab
    with Store(Path(env["a"]["DFO_HOME"]) / "dfo.db") as store:
        store.add_run(Run(name="maybe", target="here", variant="long", state="unconfirmed",
                          ended_at="2026-11-29T11:40:03.123Z", inventory_path=str(inventory)))
    refused = dfo("resume", "maybe", "-i", inventory, env=env["a"])
    assert refused.returncode == 1 and refused.stdout == "", refused.output
    assert ("run maybe's start is unconfirmed (it got no answer): it may be running, and a resume would start a "
            "second trainer on its checkpoint") in " ".join(refused.stderr.split()), refused.stderr
    assert "`dfo runs maybe --recheck` looks for it" in " ".join(refused.stderr.split())
