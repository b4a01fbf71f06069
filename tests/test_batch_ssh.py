"""`dfo batch` and `dfo report` as a user runs them: 2 targets on 2 hosts (network namespaces, own sshd each,
a real LXC container behind the pct stand-in) x 3 variants, one of which crashes and falls back. Interrupted
with Ctrl-C midway, the same command again finishes the batch without relaunching a finished cell."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from matplotlib import image

from harness import cli, write_inventory
from orchestrator.batch import CellTable
from orchestrator.store import Store

pytestmark = [pytest.mark.netns, pytest.mark.lxc, pytest.mark.slow]

DFO = str(Path(sys.executable).parent / "dfo")
STEP = 'echo "ts=$(date -u +%Y-%m-%dT%H:%M:%S.%3NZ) event=step step=$i tok_s={tok_s}"; i=$((i + 1)); sleep 0.03'
VARIANTS = {
    "fast": {"command": f"i=0; while [ $i -lt 2000 ]; do {STEP.format(tok_s='$((1000 + i % 3))')}; done"},
    "slow": {"command": f"i=0; while [ $i -lt 2000 ]; do {STEP.format(tok_s='$((600 + i % 3))')}; done"},
    "crashy": {"command": f"i=0; while [ $i -lt 15 ]; do {STEP.format(tok_s='900')}; done; exit 3"},
}
EXPERIMENTS = """
batch: sweep1
targets: [all]
matrix: {variant: [crashy, fast, slow]}
concurrency: {per_target: 1}
stop_when: steady
fallback: [crashy, fast]
"""


def dfo(*args: str, env: dict, timeout: float = 120) -> cli.Ran:
    return cli.dfo(*args, env=env, timeout=timeout)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def cell_states(state: Path) -> dict[str, str]:
    if not (state / "dfo.db").exists():
        return {}
    with Store(state / "dfo.db") as store:
        return {record.cell.id: record.state for record in CellTable(store).records("sweep1")}


def test_matrix_over_two_hosts_falls_back_resumes_and_reports(tmp_path: Path, netns_hosts) -> None:
    hosts = netns_hosts(2)
    inventory = write_inventory(tmp_path, {
        "defaults": {"min_free_disk_gb": 0, "python": sys.executable},
        "hosts": {f"pve{k}": {"address": f"nshost{k}", "containers": {f"ct{k}": {"ctid": 200, "gpus": [0, 1]}}}
                  for k in range(2)},
        "variants": VARIANTS,
        "watch": {"min_steady_steps": 40, "min_steady_seconds": 1, "first_step_grace_s": 60},
    })
    for host in hosts:
        host.containers(200)
    experiments = tmp_path / "sweep.yaml"
    experiments.write_text(EXPERIMENTS)
    state = tmp_path / "state"
    env = {**os.environ, "DFO_HOME": str(state)}
    args = ["batch", str(experiments), "-i", str(inventory), "--poll", "0.3"]

    plan = dfo(*args, "--dry-run", "--json", env=env)
    assert plan.returncode == 0, plan.stderr
    assert [c["run"] for c in json.loads(plan.stdout)["cells"]] == [
        "sweep1.crashy.ct0.r1", "sweep1.crashy.ct1.r1", "sweep1.fast.ct0.r1", "sweep1.fast.ct1.r1",
        "sweep1.slow.ct0.r1", "sweep1.slow.ct1.r1"]

    first = subprocess.Popen([DFO, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: "done" in cell_states(state).values() and "running" in cell_states(state).values(),
                 timeout=60, what="a finished cell while others run")
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=30)
    finally:
        first.kill()
    assert first.returncode == 130, stderr
    assert "again resumes" in stderr
    interrupted = cell_states(state)
    finished_before = {cell for cell, s in interrupted.items() if s in ("done", "failed")}
    with Store(state / "dfo.db") as store:
        runs_before = {run.name: run.pid for run in store.list_runs(batch="sweep1")}

    second = dfo(*args, "--json", env=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr
    result = json.loads(second.stdout)
    cells = {cell["cell"]: cell for cell in result["cells"]}
    assert sorted(cells) == sorted(interrupted) and len(cells) == 6
    assert all(cell["state"] == "done" for cell in cells.values()), [(c["cell"], c["state"], c["why"]) for c in cells.values()]
    for k in range(2):
        crashy = cells[f"crashy.ct{k}.r1"]
        assert crashy["fallbacks"] == ["fast"] and crashy["final_run"] == f"sweep1.crashy.ct{k}.r1.2-fast"
        assert crashy["decision"] == "steady" and 990 < crashy["steady_tok_s"] < 1010
        assert 590 < cells[f"slow.ct{k}.r1"]["steady_tok_s"] < 610
    assert {(b["target"], b["config"]) for b in result["best"]} == {("ct0", "fast"), ("ct1", "fast")}

    with Store(state / "dfo.db") as store:
        runs_after = {run.name: run for run in store.list_runs(batch="sweep1")}
        launches = [event["run"] for event in store.events(kind="started")]
    assert len(runs_after) == 8 and len(launches) == len(set(launches)) == 8  # nothing launched twice
    assert all(runs_after[name].pid == pid for name, pid in runs_before.items())  # nor replaced
    for cell in finished_before:
        assert cells[cell]["runs"] == [name for name in runs_before if name.startswith(f"sweep1.{cell}")]
    assert not [run.name for run in runs_after.values() if run.active]  # every run was stopped or ended

    png = tmp_path / "sweep1.png"
    shown = dfo("report", "sweep1", "--plot", str(png), "--csv", str(tmp_path / "sweep1.csv"), env=env)
    assert shown.returncode == 0, shown.stderr
    assert "best on ct0: fast" in shown.stdout and "crashy.ct1.r1" in shown.stdout
    assert len((tmp_path / "sweep1.csv").read_text().splitlines()) == 7
    pixels = image.imread(png)
    assert pixels.shape[:2] == (500, 1300) and pixels[..., :3].std() > 0.05
