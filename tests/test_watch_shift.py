"""A level shift seen by `dfo watch` through a real sshd and a real LXC container behind the pct stand-in: one
`level_shift` event with both levels, stored once, never repeated by a watch that re-attaches, and kept in the
run's decision (`dfo runs --json`).

The run is a recorded log (tests/data/probe/late_drop-0.log: steady at ~97.8k tok/s, declared 55 s in, then
-14% to ~83.9k at step 615 that holds, a probe of the shape tests/decide/test_decide_probe.py scores) played
back inside the container with its timestamps moved to now,
so the watch judges it exactly as `dfo replay` does. The real trainer has no knob that moves its throughput on
cue (trainer/config.py debug.*), and changing trainer/ would make every measured trainer figure stale."""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from harness import write_inventory
from harness.lxc import LxcContainer
from orchestrator.chains import Claims
from orchestrator.commands.watch import event_line
from orchestrator.connections import Connections
from orchestrator.inventory import load_inventory
from orchestrator.runs import launch, spec_for
from orchestrator.store import Store
from orchestrator.view import render
from orchestrator.watch import Watcher
from test_view_progress import shown
from test_watch import PY, run_until
from test_watch_e2e import dfo

pytestmark = pytest.mark.lxc  # about 5 s

SHIFT_LOG = Path(__file__).parent / "data" / "probe" / "late_drop-0.log"
PAUSE_AFTER_STEP = 900  # after the new level is declared (step 785 at the default precision), before the log ends

# Prints the log with each `ts=` moved by (now - the first ts), a few ms a line; after PAUSE_AFTER_STEP it waits
# for the `go` file (at most 60 s), then prints the rest and exits 0.
PLAYER = """\
import os, sys, time
from datetime import datetime, timezone
log, pause_after, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
FMT = "%Y-%m-%dT%H:%M:%S.%fZ"
def stamp(line):
    return datetime.strptime(line.split()[0][3:], FMT).replace(tzinfo=timezone.utc).timestamp()
lines = open(log).read().splitlines()
shift = time.time() - stamp(lines[0])
paused = False
for line in lines:
    ts = datetime.fromtimestamp(stamp(line) + shift, timezone.utc).strftime(FMT)[:-4] + "Z"
    print("ts=" + ts + line[line.index(" "):], flush=True)
    time.sleep(0.004)
    if not paused and " step=" in line and int(line.split(" step=")[1].split()[0]) >= pause_after:
        paused, deadline = True, time.time() + 60
        while not os.path.exists(go) and time.time() < deadline:
            time.sleep(0.05)
"""


def make_lab(tmp_path: Path, container: LxcContainer, log: Path, pause_after: int, watch: dict | None = None):
    """An inventory whose one variant plays `log` back in the container, pausing after step `pause_after` until
    the returned `go` file exists; the watch thresholds are the defaults (the judge of `dfo replay`) + `watch`."""
    scripts = container.path("/workspace/scripts")
    scripts.mkdir(parents=True, exist_ok=True)
    (scripts / "player.py").write_text(PLAYER)
    shutil.copy(log, scripts / "shift.log")
    command = f"{PY} /workspace/scripts/player.py /workspace/scripts/shift.log {pause_after} /workspace/scripts/go"
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0},
        "hosts": {"pve1": {"address": "testhost", "containers": {
            "ct_a": {"ctid": container.vmid, "gpus": [0], "python": PY}}}},
        "variants": {"replayed": {"command": command}},
        "fallback": ["replayed"],
        **({"watch": watch} if watch else {}),
    })
    return inventory, tmp_path / "state", scripts / "go"


@contextmanager
def watching(inventory_path: Path, state: Path, name: str, monkeypatch) -> Iterator[tuple[Watcher, Store]]:
    """Launch the player as `name` and watch it (a Watcher attached to it, and the registry) until the block
    ends; then the watch goes and the run goes on."""
    monkeypatch.setenv("DFO_HOME", str(state))
    inventory = load_inventory(inventory_path)
    with Connections(inventory) as connections, Store(state / "dfo.db") as store:
        launch(connections.container("ct_a"), spec_for(inventory, "ct_a", "replayed"), store, name=name)
        watcher = Watcher(inventory, connections, store)
        try:
            watcher.attach(name)
            yield watcher, store
        finally:
            watcher.close()


def declared_shift(store: Store, name: str) -> bool:
    """The registry holds a declared level_shift event of `name`. A watch whose poll lands between the shift's
    detection and its new level's declaration (a loaded machine reads the log in other chunks) first stores
    an undeclared one: waiting for any level_shift event would stop there."""
    return any(e["data"]["declared"] for e in store.events(name, kind="level_shift"))


def watch_until_the_shift(inventory_path: Path, state: Path, name: str, monkeypatch, declared: bool = True):
    """Launch the player as `name` and watch it until the registry holds a level_shift event (a declared one
    if `declared`); then the watch goes (the run goes on, paused until `go` exists). Returns the watch's
    events, its live view as text, and the run's stored decision."""
    def done(_watcher) -> bool:
        return declared_shift(store, name) if declared else bool(store.events(name, kind="level_shift"))

    with watching(inventory_path, state, name, monkeypatch) as (first, store):
        events = run_until(first, done, timeout=60)
        return events, shown(render(first)), store.get_run(name).decision


def the_declared_shift(events: list) -> dict:
    """The one declared level_shift event among a watch's events, after at most one undeclared event of the
    same shift (sent when a poll landed between its detection and its declaration)."""
    shifts = [e.to_json() for e in events if e.kind == "level_shift"]
    assert [s["declared"] for s in shifts] in ([True], [False, True]), shifts
    assert len({s["at_step"] for s in shifts}) == 1, shifts
    return shifts[-1]


@pytest.fixture
def lab(tmp_path, sshd, ssh_home, container: LxcContainer):
    return make_lab(tmp_path, container, SHIFT_LOG, PAUSE_AFTER_STEP)


def test_a_level_shift_is_one_event_with_both_levels_also_after_a_reattach(lab, monkeypatch) -> None:
    inventory_path, state, go = lab
    events, panel, decision = watch_until_the_shift(inventory_path, state, "sh1", monkeypatch)
    seen = the_declared_shift(events)
    assert 95_000 < seen["from_tok_s"] < 100_000 and seen["from_interval"][0] < seen["from_tok_s"]
    assert abs(seen["declared_tok_s"] / 83_928 - 1) < 0.03 and seen["declared"] is True
    assert 580 <= seen["at_step"] <= 650 < seen["detected_step"] <= PAUSE_AFTER_STEP
    assert decision["level_shifts"][0]["at_step"] == seen["at_step"]
    assert f"since a level shift at step {seen['at_step']} (from {seen['from_tok_s']:,.0f})" in panel
    assert event_line([e for e in events if e.kind == "level_shift"][-1]).endswith(
        f"sh1: level shift at step {seen['at_step']}: {seen['from_tok_s']:,.0f} -> {seen['declared_tok_s']:,.0f} "
        f"tok/s, verdict re-opened at step {seen['detected_step']}, new level declared at step "
        f"{seen['declared_step']} (95% {seen['declared_interval'][0]:,.0f}..{seen['declared_interval'][1]:,.0f})")
    with Store(state / "dfo.db") as store:
        stored_first = [(e["data"]["at_step"], e["data"]["declared"]) for e in store.events("sh1", kind="level_shift")]
    go.write_text("")

    # A second watch re-attaches: it re-judges the stored steps (finding the shift again) and follows the rest
    # of the log to the run's end; it must not report the shift again.
    watched = dfo(inventory_path, state, "watch", "sh1", "--json", timeout=120)
    assert watched.returncode == 0, watched.stderr + watched.stdout[-2000:]
    lines = [json.loads(line) for line in watched.stdout.splitlines()]
    assert [o["kind"] for o in lines if o["kind"] == "level_shift"] == []
    [final] = [o for o in lines if o["kind"] == "final"]
    assert final["decision"] == "steady" and abs(final["steady_tok_s"] / 83_928 - 1) < 0.03
    assert [s["at_step"] for s in final["level_shifts"]] == [seen["at_step"]]

    with Store(state / "dfo.db") as store:
        stored = store.events("sh1", kind="level_shift")
        assert [(e["data"]["at_step"], e["data"]["declared"]) for e in stored] == stored_first
        assert stored_first[-1] == (seen["at_step"], True)
    runs = json.loads(dfo(inventory_path, state, "runs", "--json", "--no-refresh").stdout)
    [shift] = runs[0]["decision"]["level_shifts"]
    assert shift["from_tok_s"] == seen["from_tok_s"] and shift["declared_tok_s"] > 0
    shown_run = dfo(inventory_path, state, "runs", "sh1", "--no-refresh").stdout
    assert f"shift:    level shift at step {seen['at_step']}: {seen['from_tok_s']:,.0f} -> " in shown_run


def test_a_shift_seen_before_its_new_level_holds_is_two_events_and_a_reattach_sends_only_the_second(
        tmp_path, sshd, ssh_home, container, monkeypatch) -> None:
    """e2e2-thr-nographs at `watch.precision: 0.10` (tests/decide/test_decide_real.py): its ~20% drop at step
    ~1,460 is recorded at step 2,360 and the new level declared at step 2,700. The first watch sees the shift
    undeclared and goes; the one that re-attaches sends the declared event only."""
    log = Path(__file__).parent / "data" / "real" / "e2e2-thr-nographs.log"
    inventory_path, state, go = make_lab(tmp_path, container, log, 2_400, watch={"precision": 0.10})
    events, panel, _ = watch_until_the_shift(inventory_path, state, "sh2", monkeypatch, declared=False)
    [seen] = [e for e in events if e.kind == "level_shift"]
    assert seen.declared is False and seen.declared_tok_s is None
    assert abs(seen.from_tok_s / 44_000 - 1) < 0.03 and abs(seen.to_tok_s / 35_500 - 1) < 0.03
    assert event_line(seen).endswith(f"level shift at step {seen.at_step}: {seen.from_tok_s:,.0f} -> "
                                     f"{seen.to_tok_s:,.0f} tok/s, verdict re-opened at step {seen.detected_step} "
                                     f"(new level not declared yet; precision 10%)")
    assert f"re-opened: level shift at step {seen.at_step}" in panel
    go.write_text("")

    watched = dfo(inventory_path, state, "watch", "sh2", "--json", timeout=120)
    assert watched.returncode == 0, watched.stderr + watched.stdout[-2000:]
    lines = [json.loads(line) for line in watched.stdout.splitlines()]
    [declared] = [o for o in lines if o["kind"] == "level_shift"]
    assert (declared["at_step"], declared["declared"]) == (seen.at_step, True)
    assert abs(declared["declared_tok_s"] / 35_500 - 1) < 0.03 and declared["declared_step"] > seen.detected_step
    with Store(state / "dfo.db") as store:
        stored = [(e["data"]["at_step"], e["data"]["declared"]) for e in store.events("sh2", kind="level_shift")]
    assert stored == [(seen.at_step, False), (seen.at_step, True)]


def test_a_shift_shown_by_a_watch_that_only_observed_is_stored_once_it_takes_over(
        tmp_path, sshd, ssh_home, container, monkeypatch) -> None:
    """Two watches of one chain: the owner stops answering before the shift reaches it (never stepped again);
    the other shows the shift while it only observes (storing nothing), then takes the chain over: the shift
    it showed is stored then (once, not sent again), and the run's decision names it."""
    inventory_path, state, _ = make_lab(tmp_path, container, SHIFT_LOG, PAUSE_AFTER_STEP)
    monkeypatch.setenv("DFO_HOME", str(state))
    inventory = load_inventory(inventory_path)
    with Connections(inventory) as connections, Store(state / "dfo.db") as store:
        launch(connections.container("ct_a"), spec_for(inventory, "ct_a", "replayed"), store, name="sh3")
        log = container.path("/workspace/logs/sh3.log")
        deadline = time.monotonic() + 30
        while f" step={PAUSE_AFTER_STEP} " not in log.read_text():  # the shift is in the log: the player paused
            assert time.monotonic() < deadline, "the player did not reach its pause"
            time.sleep(0.1)
        owner = Watcher(inventory, connections, store, claims=Claims(store, ttl_s=3))
        observer = Watcher(inventory, connections, store, claims=Claims(store, ttl_s=3))
        try:
            owner.attach("sh3")
            observer.attach("sh3")
            assert owner.owns("sh3") and not observer.owns("sh3")
            events = run_until(observer, lambda w: w.owns("sh3"), timeout=30)
        finally:
            observer.close()
            owner.close()
        kinds = [e.kind for e in events]
        assert kinds.count("level_shift") == 1 and kinds.index("level_shift") < kinds.index("took_over"), kinds
        [shift] = [e for e in events if e.kind == "level_shift"]
        stored = store.events("sh3", kind="level_shift")
        assert [(e["data"]["at_step"], e["data"]["declared"], e["at"]) for e in stored] == [
            (shift.at_step, True, shift.at)]
        assert [s["at_step"] for s in store.get_run("sh3").decision["level_shifts"]] == [shift.at_step]


def test_while_a_shift_is_being_confirmed_the_watch_shows_the_level_before_it_and_says_a_shift_is_suspected(
        tmp_path, sshd, ssh_home, container, monkeypatch) -> None:
    """The player pauses at step 660, inside the ~15 s in which late_drop-0's drop at step 615 is being
    confirmed (it is recorded at step 690). The watch shows the level before the drop with its own
    interval, says a shift is suspected since step 611 (live view, scroll-back, the stored decision), and
    once the rest of the log arrives it records the shift and the suspicion is gone."""
    inventory_path, state, go = make_lab(tmp_path, container, SHIFT_LOG, 660)
    with watching(inventory_path, state, "sh4", monkeypatch) as (watcher, store):
        events = run_until(watcher, lambda w: (w.chains()[0]["decision"] or {}).get("shift_suspected"), timeout=60)
        panel = shown(render(watcher))
        stored = store.get_run("sh4").decision
        go.write_text("")
        events += run_until(watcher, lambda w: store.events("sh4", kind="level_shift"), timeout=60)
    [suspected] = [e for e in events if e.kind == "decision" and e.decision["shift_suspected"]]
    decision = suspected.decision
    since = decision["shift_suspected"]["since_step"]
    assert 600 <= since <= 620 and decision["decision"] == "steady" and stored["shift_suspected"]["since_step"] == since
    assert 95_000 < decision["steady_tok_s"] < 100_000 and 0 < decision["interval"][0] < decision["steady_tok_s"]
    assert decision["interval"][1] - decision["interval"][0] < 5_000
    assert 81_000 < decision["shift_suspected"]["to_tok_s"] < 87_000
    assert f"steady {decision['steady_tok_s']:,.0f} tok/s (95% " in panel
    assert f"level shift suspected since step {since}, new level ~" in panel
    assert f"level shift suspected since step {since}: ~" in event_line(suspected)
    [shift] = [e for e in events if e.kind == "level_shift"]
    assert shift.at_step == since and shift.from_tok_s == pytest.approx(decision["steady_tok_s"], abs=1)
    assert [e for e in events if e.kind == "decision"][-1].decision["shift_suspected"] is None


def test_a_declared_level_shift_notifies_like_a_verdict_change_once_also_after_a_reattach(
        tmp_path, sshd, ssh_home, container, monkeypatch) -> None:
    """The inventory's notify: webhook (a real HTTP server on 127.0.0.1) hears of the first steady verdict (the
    player pauses at step 400, after it) and then of the steady verdict at the new level after
    late_drop-0's drop, with both levels in its text; a second watch that re-attaches and follows the
    log to its end sends neither again."""
    from test_notify import Receiver

    hook = Receiver()
    try:
        inventory_path, state, go = make_lab(tmp_path, container, SHIFT_LOG, 400)
        inventory_path.write_text(inventory_path.read_text() + f"notify: {{webhook: {json.dumps(hook.url)}}}\n")
        with watching(inventory_path, state, "sh5", monkeypatch) as (watcher, store):
            run_until(watcher, lambda w: w.chains()[0]["decision"]["decision"] == "steady", timeout=60)
            go.write_text("")
            events = run_until(watcher, lambda w: declared_shift(store, "sh5"), timeout=60)
            watcher.notifier.wait(10)
        watched = dfo(inventory_path, state, "watch", "sh5", "--json", timeout=120)
        assert watched.returncode == 0, watched.stderr + watched.stdout[-2000:]
    finally:
        hook.close()
    shift = [e for e in events if e.kind == "level_shift"][-1]
    assert the_declared_shift(events)["at_step"] == shift.at_step
    assert len(hook.posts) == 2, [p["json"]["text"] for p in hook.posts]
    first, second = (p["json"] for p in hook.posts)
    assert first["decision"] == second["decision"] == "steady" and first["level_shifts"] == []
    assert abs(first["steady_tok_s"] / shift.from_tok_s - 1) < 0.03
    assert abs(second["steady_tok_s"] / shift.declared_tok_s - 1) < 0.01
    assert second["text"] == (
        f"dfo: sh5 on ct_a (replayed): steady at step {second['at_step']} at a new level, {shift.from_tok_s:,.0f} -> "
        f"{second['steady_tok_s']:,.0f} tok/s (level shift at step {shift.at_step}); action keep")
