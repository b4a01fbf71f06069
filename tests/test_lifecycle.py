"""The one run lifecycle (orchestrator/chains.py) on the local target: a chain of one ends on its own verdict,
a stop asked for while a watch is on the run is no crash (exit 143, or 75 from a checkpointing trainer),
and `dfo launch --watch` / `dfo watch` exit non-zero on crash and stall, 0 on steady, with a final line that
says both the verdict and how the run ended."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import cli as harness_cli
from harness import write_inventory
from orchestrator.chains import Claims
from orchestrator.lifecycle import ActionDone, Lifecycle, UnderWay
from orchestrator.runs import stop
from orchestrator.store import Store
from test_watch import FAST_WATCH, PY, lab, run_until  # noqa: F401  (lab: the fixture)

# A trainer that checkpoints on SIGTERM: `event=done reason=sigterm`, then exit 75 (trainer/pipeline.py).
CHECKPOINTING = """\
import signal, sys, time
from datetime import datetime, timezone
def now():
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
def on_term(*_):
    print(f"ts={now()} event=checkpoint step={step}", flush=True)
    print(f"ts={now()} event=done reason=sigterm", flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, on_term)
step = 0
for step in range(1, 100000):
    print(f"ts={now()} event=step step={step} tok_s=1000.0 loss=1.0", flush=True)
    time.sleep(0.02)
"""


def test_a_stop_during_a_watch_is_stopped_not_a_crash_and_nothing_falls_back(lab) -> None:
    lab.launch("silent", "st1")  # 3 steps, then silence: never steady
    watcher = lab.watcher()
    watcher.attach("st1")
    run_until(watcher, lambda w: w.runs()[0].latest is not None)
    stop(lab.connections.container("here"), lab.store, "st1", grace_s=5)
    events = run_until(watcher, lambda w: w.runs()[0].alive is False and w.settled(), timeout=30)
    [decision] = watcher.final_decisions()
    assert (decision.decision, decision.action, decision.next_run) == ("stopped", "none", None)
    assert [r.name for r in lab.store.list_runs()] == ["st1"]  # no fallback launched
    assert lab.store.get_run("st1").state == "stopped" and lab.store.get_run("st1").exit_code == 143
    assert "acting" not in [e.kind for e in events]


def test_a_checkpointing_trainer_stopped_after_steady_keeps_its_steady_verdict(lab, tmp_path) -> None:
    (tmp_path / "ckpt.py").write_text(CHECKPOINTING)
    lab.inventory.variants["ckpt"] = lab.inventory.variants["nographs"].model_copy(update={"command": f"{PY} {tmp_path}/ckpt.py"})
    lab.launch("ckpt", "k1")
    watcher = lab.watcher()
    watcher.attach("k1")
    run_until(watcher, lambda w: w.runs()[0].decision.decision == "steady")
    stop(lab.connections.container("here"), lab.store, "k1", grace_s=10)
    run_until(watcher, lambda w: w.runs()[0].alive is False and w.settled(), timeout=30)
    [decision] = watcher.final_decisions()
    assert (decision.decision, decision.action) == ("steady", "keep")
    assert 990 < decision.steady_tok_s < 1010
    assert [r.name for r in lab.store.list_runs()] == ["k1"]
    assert (lab.store.get_run("k1").state, lab.store.get_run("k1").exit_code) == ("stopped", 75)


def dfo_launch_watch(lab, tmp_path: Path, variant: str, name: str, chain: str, *extra: str, inventory: Path | None = None):
    return harness_cli.dfo("launch", "--host", "here", "--variant", variant, "--name", name, "--no-preflight", "--chain",
                           chain, "--watch", *extra, "-i", str(inventory or lab.path), env={"DFO_HOME": str(tmp_path / "state")})


@pytest.mark.slow
def test_a_chain_of_one_ends_on_its_own_crash_with_exit_1_and_no_fallback(lab, tmp_path) -> None:
    done = dfo_launch_watch(lab, tmp_path, "failing", "one1", "failing")
    assert done.returncode == 1, done.stderr + done.stdout[-2000:]
    assert [r.name for r in lab.store.list_runs()] == ["one1"]  # not the inventory's fallback: the chain had one
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("one1: one1 crash [exit_nonzero] at step 5; exited 3"), last


@pytest.mark.slow
def test_launch_watch_prints_a_crash_once_and_its_other_lines_refer_to_it(lab, tmp_path) -> None:
    # trees: the cudagraph_tls traceback, then it lives on; the fallback stops it and launches nographs. Before, its
    # meaning came three times (the scroll-back's decision line, the panel, the final line) and the decision line
    # twice (recorded again with its successor's name), every one quoting the whole reason
    done = dfo_launch_watch(lab, tmp_path, "trees", "cr1", "trees,nographs", "--until-decided")
    assert done.returncode == 0, done.stderr + done.stdout[-2000:]
    out = done.stdout
    meaning = "CUDAGraph Trees used from a non-main thread"
    assert out.count(meaning) == 1, out  # in cr1's panel, under its state line
    assert out.count("assert torch._C._is_key_in_tls(attr_name)") == 1, out  # its lines, in the panel too
    panel = out[out.index("cr1  trees on here"):out.index("cr1.2-nographs  nographs on here")]
    assert meaning in panel and "AssertionError" in panel and "crash [cudagraph_tls]" in panel, panel
    [said] = [line for line in out.splitlines() if ": crash [" in line and "cr1:" in line and "panel" in line]
    assert said.endswith("cr1: crash [cudagraph_tls] at step 3 (action fallback): the crash: in cr1's panel"), said
    assert "cr1: fell_back next_run=cr1.2-nographs" in out


@pytest.mark.slow
def test_launch_watch_exits_0_on_steady_and_says_steady_and_exited(lab, tmp_path) -> None:
    done = dfo_launch_watch(lab, tmp_path, "nographs", "ok1", "nographs")
    assert done.returncode == 0, done.stderr + done.stdout[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert re.match(r"ok1: ok1 steady at (99\d|1,0\d\d) tok/s; exited 0", last), last  # the mean of 1,000 +/- 0.4%


@pytest.mark.slow
def test_launch_watch_exits_1_on_a_stall(lab, tmp_path) -> None:
    (tmp_path / "stall").mkdir()
    stalling = write_inventory(tmp_path / "stall", {
        "defaults": {"workspace": str(lab.workspace)},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {name: v.model_dump(exclude_none=True, exclude_defaults=True) for name, v in lab.inventory.variants.items()},
        "fallback": ["silent"],
        "watch": {**FAST_WATCH, "stall_floor_s": 2},
    })
    done = dfo_launch_watch(lab, tmp_path, "silent", "sl1", "silent", "--json", inventory=stalling)
    assert done.returncode == 1, done.stderr + done.stdout[-2000:]
    final = json.loads(done.stdout.strip().splitlines()[-1])
    assert (final["decision"], final["run"]) == ("stall", "sl1")
    assert final["ended"]["state"] == "stopped"  # the watch stopped the stalled run: nothing left to fall back to


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_set_value_the_trainer_refuses_fails_the_launch_with_its_message(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DFO_INVENTORY", "XDG_STATE_HOME")}
    env.update(HOME=str(tmp_path / "home"), DFO_HOME=str(tmp_path / "state"))
    dfo = str(Path(sys.executable).parent / "dfo")
    done = subprocess.run([dfo, "launch", "--host", "here", "--variant", "eager", "--name", "bad1", "--no-preflight",
                           "--set", "drafter.layers=two"], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the trainer refused the settings of bad1" in done.stderr and "drafter.layers=two: expected" in done.stderr
    assert "launched" not in done.stdout
    listed = subprocess.run([dfo, "runs", "--json"], capture_output=True, text=True, timeout=60, env=env)
    [run] = json.loads(listed.stdout)
    assert (run["state"], run["exit_code"]) == ("crashed", 2)


def test_a_fallback_left_half_done_by_a_dead_dfo_is_finished_by_the_next_watch_and_not_repeated(lab) -> None:
    lab.launch("trees", "h1")  # crashes in a worker thread and lives on: a watch would fall back from it
    intent = {"run": "h1", "variant": "nographs", "name": "h1.2-nographs", "chain": ["trees", "nographs"],
              "reason": "crash [cudagraph_tls]"}
    lab.store.add_intent("h1", "fallback", intent)  # recorded by a dfo that died before it stopped h1
    watcher = lab.watcher()
    watcher.attach("h1")
    run_until(watcher, lambda w: w.settled(), timeout=60)
    assert [r.name for r in lab.store.list_runs()] == ["h1", "h1.2-nographs"]  # the intended run, once
    assert lab.store.get_run("h1").state == "stopped" and lab.store.get_run("h1.2-nographs").parent == "h1"
    assert lab.store.open_intents("h1") == []
    [chain] = watcher.chains()
    assert chain["runs"] == ["h1", "h1.2-nographs"] and chain["decision"]["decision"] == "steady"


def test_a_fallback_that_raises_a_bug_is_said_as_its_error_and_the_watch_still_settles(lab) -> None:
    # an action that raised anything but a DfoError put nothing on the follower's queue: the run stayed `acting`
    # and `dfo watch --until-decided` waited on it for ever
    lab.launch("trees", "b1")  # crashes in a worker thread and lives on: the watch falls back from it
    watcher = lab.watcher()

    def broken(*args, **kwargs):
        raise KeyError("a bug inside the fallback")

    watcher.lifecycle.supervisor.fall_back = broken
    watcher.attach("b1")
    events = run_until(watcher, lambda w: w.runs()[0].decision.decision == "crash" and w.settled(), timeout=60)
    [error] = [e for e in events if e.kind == "action_error"]
    assert error.run == "b1" and error.error == "internal error: KeyError: 'a bug inside the fallback'"
    assert [r.name for r in lab.store.list_runs()] == ["b1"]  # nothing launched; the intent it recorded, if any, open
    assert not watcher.runs()[0].acting


def test_an_intent_is_recorded_once_carried_out_once_by_racing_dfo_and_taken_over_when_its_holder_dies(tmp_path) -> None:
    import threading
    import time

    from orchestrator.chains import Claims, carry_out_once
    from orchestrator.store import Store

    db = tmp_path / "dfo.db"
    with Store(db) as store:
        intent = store.add_intent_once("mn", "multinode_fallback", {"run": "mn", "variant": "b"})
        again = store.add_intent_once("mn", "multinode_fallback", {"run": "mn", "variant": "b"})
        assert again.id == intent.id  # a second dfo deciding the same fallback shares the first one's intent
    calls, results = [], []

    def carry(data: dict) -> dict:
        calls.append(data)
        time.sleep(1.0)
        return {**data, "next_run": "mn.2-b"}

    def racer() -> None:
        with Store(db) as own:  # each racer its own connection and claim owner, as two dfo processes
            results.append(carry_out_once(own, intent, carry))

    racers = [threading.Thread(target=racer) for _ in range(3)]
    for thread in racers:
        thread.start()
    for thread in racers:
        thread.join(30)
    assert len(calls) == 1 and [r["next_run"] for r in results] == ["mn.2-b"] * 3
    with Store(db) as store:
        assert store.open_intents() == [] and store.get_intent(intent.id).data["next_run"] == "mn.2-b"
        orphan = store.add_intent_once("mn9", "multinode_fallback", {"run": "mn9", "variant": "b"})
        Claims(store, ttl_s=1.5).holds(f"intent:{orphan.id}")  # taken by a dfo that then died (no renewal)
        started = time.monotonic()
        data = carry_out_once(store, orphan, lambda d: {**d, "next_run": "mn9.2-b"}, ttl_s=1.5)
        assert data["next_run"] == "mn9.2-b" and time.monotonic() - started > 0.5  # after its lease ran out
        assert store.open_intents() == []


def test_a_claim_held_by_a_dead_dfo_of_this_workstation_is_taken_in_one_write(tmp_path) -> None:
    # the holder is looked at (a read) before the one write: it was a write that found the lease held, a look at
    # the holder, then a second write with dead_owner (two write transactions where one does)
    import socket
    import time

    from orchestrator.chains import Claims
    from orchestrator.store import Store

    gone_dfo = subprocess.Popen(["true"])
    gone_dfo.wait()  # its pid is gone: a killed dfo of this workstation
    with Store(tmp_path / "dfo.db") as store:
        store.claim("chain:c1", "gone-dfo", pid=gone_dfo.pid, host=socket.gethostname(), ttl_s=15, now=time.time())
        store.claim("chain:c2", "live-dfo", pid=os.getpid(), host="another-workstation", ttl_s=15, now=time.time())
        claims, writes, claim = Claims(store), [], store.claim
        store.claim = lambda *args, **kw: writes.append(kw.get("dead_owner")) or claim(*args, **kw)
        assert claims.holds("chain:c1") and writes == ["gone-dfo"]
        assert (store.claim_of("chain:c1").owner, store.claim_of("chain:c1").pid) == (claims.owner, os.getpid())
        assert not claims.holds("chain:c2") and writes == ["gone-dfo", None]  # one of another workstation: waited out
        assert claims.holder("chain:c2").host == "another-workstation"


# A trainer that logs its way out on SIGTERM: five more step lines and its `done` line, then exit 75.
LOGS_ON_THE_WAY_OUT = CHECKPOINTING.replace(
    '''    print(f"ts={now()} event=checkpoint step={step}", flush=True)''',
    '''    for extra in range(1, 6):
        print(f"ts={now()} event=step step={step + extra} tok_s=1000.0 loss=1.0", flush=True)
    print(f"ts={now()} event=checkpoint step={step + 5}", flush=True)''')


def test_a_run_stopped_while_logging_has_every_step_it_logged_stored(lab, tmp_path) -> None:
    (tmp_path / "out.py").write_text(LOGS_ON_THE_WAY_OUT)
    lab.inventory.variants["out"] = lab.inventory.variants["nographs"].model_copy(update={"command": f"{PY} {tmp_path}/out.py"})
    lab.launch("out", "o1")
    watcher = lab.watcher(poll=3.0)  # a poll every 3 s: the lines of the way out come after the last one
    watcher.attach("o1")
    run_until(watcher, lambda w: (lab.store.last_step("o1") or 0) >= 3)
    watcher.stop_run("o1", "stop_when: steady")  # as a batch's stop_when does
    run_until(watcher, lambda w: w.runs()[0].alive is False and w.settled(), timeout=60)
    assert lab.store.get_run("o1").exit_code == 75
    logged = lab.log_steps("o1")
    assert [s["step"] for s in lab.store.samples("o1")] == logged  # the five after SIGTERM too, each once
    assert "event=done reason=sigterm" in (lab.workspace / "logs" / "o1.log").read_text()


def test_a_stop_is_carried_out_and_recorded_once_when_a_second_watcher_takes_the_chain_over(lab) -> None:
    lab.launch("trees", "d1")  # a thread-bound CUDA-graph crash, the process left alive
    owner, second = lab.watcher(chain_override=["trees"]), lab.watcher(chain_override=["trees"])  # a chain of one: stop
    owner.attach("d1")
    second.attach("d1")
    assert owner.owns("d1") and not second.owns("d1")

    def both(done) -> None:
        run_until(owner, lambda w: (second.step(0.05), done())[1], timeout=60)

    both(lambda: owner.settled() and second.runs()[0].decision.decision == "crash")
    owner.close()  # it gives the chain back: the second takes it over
    run_until(second, lambda w: w.owns("d1") and w.settled(), timeout=30)
    for _ in range(10):
        second.step(0.05)
    kinds = [e["kind"] for e in lab.store.events("d1")]
    assert kinds.count("acting") == 1 and kinds.count("stopped") == 1, kinds
    assert "not_signalled" not in kinds and "took_over" in kinds
    assert lab.store.get_run("d1").state == "stopped"


def test_the_final_line_of_a_chain_whose_successor_is_not_followed_says_so_not_a_traceback(lab) -> None:
    # Lifecycle.done: a fallback launched the successor but the watch could not follow it (its target out of reach
    # then): the chain's current run is one the watch holds no decision of. `dfo watch`'s last line names it,
    # undecided and why (before: a KeyError on the decision's missing `action`, a traceback instead of the line)
    from orchestrator.commands.watch import final_line, finals

    lab.launch("short", "nf1")  # 30 steps, exit 0
    watcher = lab.watcher()
    watcher.attach("nf1")
    run_until(watcher, lambda w: w.settled())
    watcher.chain_runs("nf1").append("nf1.2-fast")  # what Lifecycle.done records before its attach fails
    [final] = finals(watcher, lab.store)
    assert final_line(final) == ("nf1: nf1.2-fast undecided; still running "
                                 "(action none: no decision: not followed by this watch)")
    assert final.to_json()["kind"] == "final" and final.to_json()["chain"] == "nf1"


def test_a_long_watch_keeps_only_the_actions_under_way(tmp_path) -> None:
    # every ended action stayed in Lifecycle.actions: a batch acting on many cells for days grew without bound
    follower = SimpleNamespace(queue=queue.Queue())
    with Store(tmp_path / "dfo.db") as store:
        lifecycle = Lifecycle(follower, store, supervisor=None, claims=Claims(store))
        for i in range(200):
            lifecycle._start_worker(f"r{i}", lambda i=i: ActionDone(f"r{i}"), UnderWay(f"stop r{i}", 5.0))
            deadline = time.monotonic() + 5
            while lifecycle.under_way():
                assert time.monotonic() < deadline, "an action never ended"
                time.sleep(0.001)
        assert [follower.queue.get_nowait().run for _ in range(200)] == [f"r{i}" for i in range(200)]
        assert len(lifecycle.actions) == 1  # the last one, ended; the 199 before it dropped
