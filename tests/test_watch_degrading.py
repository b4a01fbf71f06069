"""A run that degrades after `dfo watch` declared it steady: the watch says so, live and in its JSON.

Local target, real agent processes, small trainers written as `command:` variants (tests/test_watch.py's lab),
the nvidia-smi stand-in's memory moved by the test while the agent samples it (`nvidia-smi -lms 1000`)."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from harness import write_inventory
from harness.nvidia_smi import STATE_ENV, Gpu, NvidiaSmiState
from orchestrator.connections import Connections
from orchestrator.decide import memory
from orchestrator.inventory import load_inventory
from orchestrator.runs import stop
from orchestrator.store import Store
from orchestrator.view import render
from test_watch import FAST_WATCH, PY, Lab, cli, run_until
from test_watch_shift import PLAYER

sys.path.insert(0, str(Path(__file__).parent / "decide"))  # the real logs and the leak put on them
from test_decide_degrading import LOGS, leaking  # noqa: E402

WARNING_SGR = "\x1b[1;33m"  # bold yellow, as a colour terminal gets it


def coloured(renderable) -> str:
    """`renderable` as a colour terminal 160 columns wide shows it, escape codes included."""
    console = Console(record=True, width=160, force_terminal=True, color_system="standard", file=io.StringIO())
    console.print(renderable)
    return console.export_text(styles=True)


def plain(shown: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", shown)


QUIET_TRAINER = """\
import os, sys, time
from datetime import datetime, timezone
steps, end = int(sys.argv[1]), sys.argv[2]
print("ts=%s event=start" % datetime.now(timezone.utc).isoformat(), flush=True)
for step in range(1, steps + 1):
    ts = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    print(f"ts={ts} event=step step={step} tok_s={1000 + (step % 7) - 3:.1f} loss=1.0 active=1/1", flush=True)
    time.sleep(0.02)
deadline = time.time() + 600
while not os.path.exists(end) and time.time() < deadline:  # the log goes quiet; the process (and its GPU memory) goes on
    time.sleep(0.05)
"""


@pytest.fixture
def lab(tmp_path, monkeypatch, pct_env):
    """A local target whose one variant is QUIET_TRAINER (300 steps, then quiet until `lab.end` exists: exit 0),
    the nvidia-smi stand-in showing one busy H200 (`lab.gpu`), and a fresh registry."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "quiet_trainer.py").write_text(QUIET_TRAINER)
    gpu = NvidiaSmiState(tmp_path / "nvidia-smi.json", [Gpu(0, memory_used_mib=40_960, utilization_pct=90)])
    monkeypatch.setenv(STATE_ENV, str(gpu.path))
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(tmp_path / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {"quiet": {"command": f"{PY} {tmp_path}/scripts/quiet_trainer.py 300 {tmp_path}/end"}},
        "fallback": ["quiet"],
        "watch": FAST_WATCH,
    })
    monkeypatch.setenv("DFO_HOME", str(tmp_path / "state"))
    inventory = load_inventory(path)
    with Connections(inventory) as connections, Store(tmp_path / "state" / "dfo.db") as store:
        lab = Lab(inventory, connections, store, tmp_path / "ws")
        lab.path, lab.gpu, lab.end = path, gpu, tmp_path / "end"
        yield lab
        for watcher in lab.watchers:
            watcher.close()
        for run in store.list_runs(active=True):
            stop(connections.container(run.target), store, run.name, grace_s=2)


def test_gpu_memory_climbing_while_the_log_is_quiet_is_said_live_as_a_warning_and_kept_in_the_final_decision(
        lab, monkeypatch) -> None:
    """A run declared steady whose log then goes quiet (no line, within the stall limit: 30 s) while its GPU
    memory climbs by 300 MiB a second: the watch says `degrading` from the GPU samples alone, in the stored
    decision and a `decision` event, with no log line after the declaration's, and the live view says it in a
    line of its own, in the warning colour: `memory climbing +17.58 GiB/min on GPU 0 (40.0 -> 44.1 GiB since
    HH:MM:SS), full (...) in ~...` (it was said only at the end of the dimmed reason line). Then the run exits 0 with its
    memory still climbing: the decision the watch ends on (`dfo watch --json`'s `final` line is
    Watcher.final_decisions()) keeps the climb in `degrading_at_end` (`degrading` is null once a run ended; it
    said nothing of the climb before).
    decide/memory.py's minute of samples in 5-s buckets is shortened to 8 s in 1-s buckets here (a bucket closes
    on the sample after it: one per ~2 s of the agent's 1-s samples), so it is said ~15 s into the quiet."""
    monkeypatch.setattr(memory, "MIN_WINDOW_S", 8.0)
    monkeypatch.setattr(memory, "BUCKET_S", 1.0)
    lab.launch("quiet", "m1")
    watcher = lab.watcher()
    watcher.attach("m1")
    run_until(watcher, lambda w: w.runs()[0].decision.decision == "steady")
    run_until(watcher, lambda w: w.runs()[0].latest is not None and w.runs()[0].latest.step == 300)
    quiet_from = time.monotonic()

    def climbing(w) -> bool:
        lab.gpu.set_load(0, memory_used_mib=int(40_960 + 300 * (time.monotonic() - quiet_from)))
        return w.runs()[0].decision.degrading is not None

    events = run_until(watcher, climbing, timeout=28)
    decision = watcher.runs()[0].decision
    assert decision.decision == "steady" and decision.degrading["what"] == "gpu_memory", decision.reason
    # 300 MiB/s is 17.6 GiB/min; the rate is read from the window's first third to its last, and the window
    # starts at the declaration, so the flat stretch before the quiet lowers it: 10.0 on a loaded CI machine
    assert 5 < decision.degrading["gib_per_min"] < 25 and "; degrading: GPU 0 memory 40.0 -> " in decision.reason
    assert [e.step for e in events if e.kind == "step"] == []  # nothing came from the log meanwhile
    assert lab.store.samples("m1")[-1]["step"] == 300
    assert lab.store.get_run("m1").decision["degrading"]["what"] == "gpu_memory"
    assert any(e.kind == "decision" and e.decision["degrading"] for e in events)
    [warning] = [line for line in coloured(render(watcher)).splitlines() if "memory climbing" in line]
    assert WARNING_SGR in warning and " GiB/min on GPU 0 (40.0 -> " in warning and ", full (140 GiB) in ~" in warning, warning
    rate = float(plain(warning).split("memory climbing ")[1].split(" GiB/min")[0])
    assert rate == round(decision.degrading["gib_per_min"], 2)

    lab.end.write_text("")
    run_until(watcher, lambda w: w.settled() and w.runs()[0].alive is False)
    ended = plain(coloured(render(watcher)))
    assert "memory climbing" not in ended and "memory was climbing at the end +" in ended, ended
    [final] = watcher.final_decisions()
    assert (final.decision, final.ended, final.degrading) == ("steady", "exited", None), final.reason
    assert final.degrading_at_end["what"] == "gpu_memory" and final.degrading_at_end["now_gib"] > 41
    assert "; then exited 0; memory was climbing: GPU 0 memory 40.0 -> " in final.reason
    assert lab.store.get_run("m1").decision["degrading_at_end"] == final.degrading_at_end



# ---------------------------------------------------------------- a decline after steady, through `dfo watch`

def test_a_decline_after_steady_is_labelled_live_and_kept_in_the_final_json_of_dfo_watch(tmp_path, pct_env) -> None:
    """tiny-nographs (~5,000 tok/s, declared steady some 12-16 s into its log) slowed 0.1% a second from 60 s on
    (tests/decide/test_decide_degrading.py), played back on the local target with its timestamps moved to now
    (test_watch_shift.PLAYER; the judge reads the log's clock), pausing after step 7,000 (the decline is recorded
    before it: at step ~4,600 since ab98dc5, ~6,560 before). `dfo watch`'s live view says the verdict was re-opened by a decline and its scroll-back says
    the decline; Ctrl-C, then the rest of the log: `dfo watch --json`'s final line keeps the decline in
    `level_shifts` and says the steady verdict was re-opened (it read 'exited 0 before a steady state was
    reached'), and the view of the ended run keeps the label (it read 'exited')."""
    lines = [line for line in leaking(LOGS["tiny-nographs"].lines(), 60.0, 0.001) if line.startswith("ts=")]
    (tmp_path / "leak.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "player.py").write_text(PLAYER)
    go = tmp_path / "go"
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(tmp_path / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {"leaking": {"command": f"{PY} {tmp_path}/player.py {tmp_path}/leak.log 7000 {go}"}},
        "fallback": ["leaking"],
    })
    dfo, env = cli(tmp_path)
    env["COLUMNS"] = "200"

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([dfo, *args, "-i", str(path)], capture_output=True, text=True, timeout=timeout, env=env)

    assert run("launch", "--host", "here", "--variant", "leaking", "--name", "d1", "--no-preflight").returncode == 0
    watching = subprocess.Popen([dfo, "watch", "d1", "-i", str(path)], env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(watching.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120  # 45 s, under load, was the player's ~7,000 lines and dfo's start-up
        while not any(" d1: decline (-" in line for line in printed):  # the scroll-back; the panel is refreshed with it
            assert time.monotonic() < deadline and watching.poll() is None, "dfo watch said no decline: " + "".join(printed)
            time.sleep(0.1)
        watching.send_signal(signal.SIGINT)  # the watch ends, printing its last frame; the run goes on (paused)
        assert watching.wait(timeout=20) == 130
        reader.join(5)
    finally:
        watching.kill()
        go.write_text("")
    live = "".join(printed)
    assert "d1: decline (-" in live and "per minute) over the steps from 211: steady at " in live, live[-3000:]
    assert "d1: undecided (action none): degrading: the level fell -" in live
    # the level the decline re-opened (the steady figure of the last verdict before it: ~4.9-5.0k, where in that
    # range follows the looks the watch made), the same in the scroll-back and in the panel's state line
    declared = re.search(r"over the steps from 211: steady at ([\d,]+) -> ", live).group(1)
    assert abs(int(declared.replace(",", "")) / 5_000 - 1) < 0.03, declared
    assert f"re-opened: decline from step 211, {declared} -> ~4," in live  # the panel's state line

    ended = run("watch", "d1", "--json")
    objects = [json.loads(line) for line in ended.stdout.splitlines()]
    [final] = [o for o in objects if o["kind"] == "final"]
    assert final["decision"] == "exited" and final["ended"] == {"state": "exited", "exit_code": 0}, final["reason"]
    [decline] = final["level_shifts"]
    assert (decline["shape"], decline["at_step"], decline["declared_tok_s"]) == ("decline", 211, None)
    assert decline["rel_per_min"] < -0.03 and decline["change_rel"] < -0.05 and decline["change_rel_95"][1] < 0
    assert final["reason"].startswith(f"exited 0 with the steady verdict of step {final['evidence']['first_steady_declared_step']} "
                                      "re-opened (degrading: the level fell -"), final["reason"]
    assert [o for o in objects if o["kind"] == "level_shift"] == []  # said once, by the first watch

    view = run("watch", "d1").stdout
    assert f"exited; re-opened: decline from step 211, {declared} -> ~4," in view, view[-2000:]
