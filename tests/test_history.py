"""A run's history whether or not anyone watched it (orchestrator/history.py): whatever looks at a run first
brings its stored steps up to its log's end, each step once, and records when the run really ended."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

from harness import cli as harness_cli
from orchestrator.history import sync_history
from test_watch import lab, run_until  # noqa: F401  (lab: the fixture)


def wait_for_exit(lab, name: str, timeout: float = 60.0) -> str:
    exit_file = lab.workspace / "logs" / f"{name}.log.exit"
    deadline = time.monotonic() + timeout
    while not (exit_file.exists() and exit_file.read_text().strip()):
        assert time.monotonic() < deadline, f"{name} did not end within {timeout:g} s"
        time.sleep(0.1)
    return exit_file


def dfo(lab, tmp_path, *args: str) -> harness_cli.Ran:
    return harness_cli.dfo(*args, env={"DFO_HOME": str(tmp_path / "state")})


def test_a_run_that_finished_unwatched_shows_every_step_in_dfo_metrics(lab, tmp_path) -> None:
    lab.launch("short", "h1")  # 30 step lines, then exit 0; nobody watches it
    exit_file = wait_for_exit(lab, "h1")
    time.sleep(1.5)  # dfo looks well after the end: ended_at must still be the end, not the look
    shown = dfo(lab, tmp_path, "metrics", "h1", "--json")
    assert shown.returncode == 0, shown.stderr
    assert [sample["step"] for sample in json.loads(shown.stdout)["samples"]] == list(range(1, 31))
    run = lab.store.get_run("h1")
    assert (run.state, run.exit_code, run.ended_from, run.history_complete) == ("exited", 0, "exit_file", True)
    ended = datetime.fromisoformat(run.ended_at.replace("Z", "+00:00"))
    assert abs(ended.timestamp() - int(os.stat(exit_file).st_mtime)) < 1.0  # the exit file's time, not when dfo looked
    assert ended < datetime.now(timezone.utc).replace(microsecond=0)


def test_a_watched_run_whose_watcher_exits_early_gets_its_full_history_at_the_next_look(lab, tmp_path) -> None:
    lab.launch("nographs", "h2")  # 400 step lines over ~8 s
    watcher = lab.watcher()
    watcher.attach("h2")
    run_until(watcher, lambda w: (lab.store.last_step("h2") or 0) >= 20, timeout=60)
    watcher.close()  # the watch ends early; the run goes on
    assert lab.store.last_step("h2") < 400
    wait_for_exit(lab, "h2")
    listed = dfo(lab, tmp_path, "runs", "h2", "--json")
    assert listed.returncode == 0, listed.stderr
    steps = [sample["step"] for sample in lab.store.samples("h2")]
    assert steps == list(range(1, 401))  # every step, each once: the watcher's and the look's meet exactly
    assert json.loads(listed.stdout)["state"] == "exited"


def test_a_second_look_stores_nothing_twice_and_a_chain_a_live_watch_holds_is_left_to_it(lab) -> None:
    lab.launch("short", "h3")
    wait_for_exit(lab, "h3")
    runs = [lab.store.get_run("h3")]
    assert sync_history(lab.store, runs, lambda run: lab.connections) == {}
    assert sync_history(lab.store, [lab.store.get_run("h3")], lambda run: lab.connections) == {}
    assert [s["step"] for s in lab.store.samples("h3")] == list(range(1, 31))

    lab.launch("nographs", "h4")
    watcher = lab.watcher()
    watcher.attach("h4")  # holds h4's chain: it stores h4's steps itself
    assert watcher.owns("h4")
    run_until(watcher, lambda w: (lab.store.last_step("h4") or 0) >= 5, timeout=60)
    assert sync_history(lab.store, [lab.store.get_run("h4")], lambda run: lab.connections) == {}
    run_until(watcher, lambda w: w.runs()[0].alive is False, timeout=60)
    steps = [s["step"] for s in lab.store.samples("h4")]
    assert steps == sorted(set(steps)) and steps[-1] == 400


def test_one_end_seen_by_two_looks_is_recorded_once_with_the_first_ones_time(lab) -> None:
    from orchestrator.runs import look

    lab.launch("short", "h5")
    stale = lab.store.get_run("h5")  # what a second dfo read before the first one looked: still running
    wait_for_exit(lab, "h5")
    target = lab.connections.container("here")
    [first] = look(target, lab.store, [stale])
    [second] = look(target, lab.store, [stale])  # the same end, seen again from the stale row
    assert (first.state, second.state) == ("exited", "exited") and second.ended_at == first.ended_at
    assert [e["data"]["state"] for e in lab.store.events("h5", kind="ended")] == ["exited"]  # one `ended`, not two


def test_a_watch_that_finds_its_run_ended_records_the_exit_files_time_not_its_own(lab) -> None:
    lab.launch("short", "h6")
    exit_file = wait_for_exit(lab, "h6")
    time.sleep(2.0)  # the watch comes later than the end
    watcher = lab.watcher()
    watcher.attach("h6")
    run_until(watcher, lambda w: not lab.store.get_run("h6").active, timeout=60)
    run = lab.store.get_run("h6")
    ended = datetime.fromisoformat(run.ended_at.replace("Z", "+00:00")).timestamp()
    assert (run.state, run.ended_from) == ("exited", "exit_file")
    assert abs(ended - os.stat(exit_file).st_mtime) < 0.01
