"""A run's history whether or not anyone watched it (orchestrator/history.py): whatever looks at a run first
brings its stored steps up to its log's end, each step once, and records when the run really ended."""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import datetime, timezone

from harness import cli as harness_cli
from harness.nvidia_smi import STATE_ENV, Gpu, NvidiaSmiState
from orchestrator.history import sync_before_attach, sync_history
from orchestrator.observe import PollObserver
from test_watch import lab, run_until, wait_for_exit  # noqa: F401  (lab: the fixture)


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


def watch_json(lab, tmp_path, *args: str) -> list[dict]:
    shown = dfo(lab, tmp_path, "watch", *args, "--json", "-i", str(lab.path))
    assert shown.returncode in (0, 1), shown.output
    return [json.loads(line) for line in shown.stdout.splitlines()]


def test_dfo_watch_of_a_run_that_ended_unwatched_reports_its_end_at_once_every_step_stored_ended_at_its_exit_file(
        lab, tmp_path) -> None:
    lab.launch("short", "h7")  # 30 steps, exit 0; nobody watches it
    exit_file = wait_for_exit(lab, "h7")
    time.sleep(1.5)  # the watch comes well after the end
    events = watch_json(lab, tmp_path, "h7")
    [attached] = [e for e in events if e["kind"] == "attached"]
    assert attached["steps_stored"] == 30  # its history was brought up to its log's end before the watch attached
    assert [e["step"] for e in events if e["kind"] == "step"] == list(range(1, 31))  # all shown at once, each once
    [ended] = [e for e in events if e["kind"] == "ended"]
    assert (ended["state"], ended["exit_code"]) == ("exited", 0)
    [final] = [e for e in events if e["kind"] == "final"]
    run = lab.store.get_run("h7")
    assert (run.state, run.ended_from, run.history_complete) == ("exited", "exit_file", True)
    assert abs(datetime.fromisoformat(run.ended_at.replace("Z", "+00:00")).timestamp()
               - int(os.stat(exit_file).st_mtime)) < 1.0
    assert (final["decision"], final["at_ts"]) == ("exited", run.ended_at)  # judged at its end, not at the watch
    assert [e["data"]["state"] for e in lab.store.events("h7", kind="ended")] == ["exited"]  # recorded once
    assert [s["step"] for s in lab.store.samples("h7")] == list(range(1, 31))  # nothing stored twice


def test_a_watch_reads_the_log_of_a_run_that_ended_unwatched_once(lab, monkeypatch) -> None:
    # what `dfo watch` does (history.sync_before_attach, then the attach): the row is brought up to date, and the
    # log is read once, from its first byte, by the attach that judges it; not caught up first, then read again
    lab.launch("short", "h11")  # 30 steps, exit 0; nobody watches it
    wait_for_exit(lab, "h11")
    reads: list[tuple[str, int | None]] = []
    follow = PollObserver.follow
    monkeypatch.setattr(PollObserver, "follow", lambda self, name, *args, offset=None, **kw: (
        reads.append((name, offset)), follow(self, name, *args, offset=offset, **kw))[1])
    assert sync_before_attach(lab.store, [lab.store.get_run("h11")], lambda run: lab.connections) == {}
    watcher = lab.watcher()
    watcher.attach("h11")
    events = run_until(watcher, lambda w: w.settled())
    assert reads == [("h11", 0)]  # once, whole
    run = lab.store.get_run("h11")
    assert (run.state, run.ended_from, run.history_complete) == ("exited", "exit_file", True)
    assert [s["step"] for s in lab.store.samples("h11")] == list(range(1, 31))
    assert [e.state for e in events if e.kind == "ended"] == ["exited"]
    assert watcher.final_decisions()[0].decision == "exited"


def test_a_crash_that_ended_unwatched_is_judged_from_its_whole_log_after_a_look_stored_its_steps(lab, tmp_path) -> None:
    lab.launch("capturing", "h8")  # 5 steps, then a CUDA-capture error line, exit 1
    wait_for_exit(lab, "h8")
    looked = dfo(lab, tmp_path, "runs", "h8", "--json")  # stores its steps: the log's offset is at its end now
    assert looked.returncode == 0, looked.stderr
    assert lab.store.get_run("h8").history_complete
    [final] = [e for e in watch_json(lab, tmp_path, "h8", "--no-fallback") if e["kind"] == "final"]
    # the watch judges the crash line too (not only the stored steps): the catalogue's signature, not "no traceback"
    assert (final["decision"], final["signature"]) == ("crash", "cuda_capture_unsupported"), final["reason"]


def test_a_running_run_whose_steps_a_look_stored_is_judged_from_its_whole_log_by_the_watch(lab, tmp_path) -> None:
    lab.launch("trees", "h10")  # 3 steps, a worker thread's cudagraph_tls traceback; the process lives on
    deadline = time.monotonic() + 60
    while "AssertionError" not in (lab.workspace / "logs" / "h10.log").read_text():
        assert time.monotonic() < deadline, "h10 printed no traceback within 60 s"
        time.sleep(0.1)
    looked = dfo(lab, tmp_path, "runs", "h10", "--json")  # stores its 3 steps: the offset is past the traceback
    assert looked.returncode == 0 and lab.store.last_step("h10") == 3, looked.stderr
    [final] = [e for e in watch_json(lab, tmp_path, "h10", "--until-decided", "--no-fallback") if e["kind"] == "final"]
    assert (final["decision"], final["signature"]) == ("crash", "cudagraph_tls"), final["reason"]  # not a stall
    assert [s["step"] for s in lab.store.samples("h10")] == [1, 2, 3]


def test_a_watch_after_a_look_judges_every_step_and_stores_and_sends_each_once(lab, tmp_path) -> None:
    lab.launch("nographs", "h9")  # 400 steps over ~8 s
    deadline = time.monotonic() + 60
    while len(lab.log_steps("h9")) < 100:
        assert time.monotonic() < deadline, "h9 logged no 100 steps within 60 s"
        time.sleep(0.1)
    assert dfo(lab, tmp_path, "runs", "h9", "--json").returncode == 0  # a look stores what it logged so far
    looked = lab.store.last_step("h9")
    events = watch_json(lab, tmp_path, "h9", "--until-decided")
    [attached] = [e for e in events if e["kind"] == "attached"]
    assert attached["steps_stored"] >= looked >= 100
    sent = [e["step"] for e in events if e["kind"] == "step"]
    assert sent == sorted(set(sent)), [step for step in sent if sent.count(step) > 1]  # none sent twice
    assert not sent or sent[0] > looked  # the steps a look stored are not sent (steps_stored counts them)
    [final] = [e for e in events if e["kind"] == "final"]
    assert final["decision"] in ("steady", "exited") and final["steady_tok_s"] is not None, final["reason"]
    steps = [s["step"] for s in lab.store.samples("h9")]
    assert steps == list(range(1, steps[-1] + 1))  # each once: the look's, the watch's replay and its stream meet


def test_dfo_batch_judges_a_cell_whose_run_ended_while_no_batch_ran_from_its_whole_log(lab, tmp_path) -> None:
    experiments = tmp_path / "cap.yaml"
    experiments.write_text("batch: cap\ntargets: [here]\nmatrix: {variant: [capturing]}\nfallback: false\n")
    batch = [harness_cli.DFO, "batch", str(experiments), "-i", str(lab.path), "--poll", "0.3", "--json"]
    idle = NvidiaSmiState(tmp_path / "idle-gpu.json", [Gpu(0, memory_used_mib=0, utilization_pct=0)])  # preflight passes
    env = {**os.environ, "DFO_HOME": str(tmp_path / "state"), STATE_ENV: str(idle.path)}
    env.pop("DFO_INVENTORY", None)
    first = subprocess.Popen(batch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    root = "cap.capturing.here.r1"
    try:
        deadline = time.monotonic() + 60
        while not (lab.workspace / "logs" / f"{root}.log").exists():  # launched (it sleeps 4 s first)
            assert time.monotonic() < deadline and first.poll() is None, "the first dfo batch launched nothing"
            time.sleep(0.1)
    finally:
        first.kill()  # the batch dies; its run goes on, ends, and a look stores its steps
        first.wait(timeout=30)
    wait_for_exit(lab, root)
    assert dfo(lab, tmp_path, "runs", root, "--json").returncode == 0
    again = harness_cli.dfo(*batch[1:], env={"DFO_HOME": env["DFO_HOME"], STATE_ENV: env[STATE_ENV]})
    [cell] = json.loads(again.stdout)["cells"]
    assert (cell["state"], cell["decision"]) == ("failed", "crash"), again.output[-2000:]
    decision = lab.store.get_run(root).decision
    assert decision["signature"] == "cuda_capture_unsupported", decision["reason"]  # its crash line was judged
