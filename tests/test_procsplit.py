"""The procsplit topology on CPU (gloo): a process per drafter and per target, same lines and exits."""

from __future__ import annotations

import io
import math
import os
import signal
import subprocess
import time

import pytest
import torch

from trainer_helpers import run_trainer, trainer_cmd, trainer_env

UNIFORM_LOSS = math.log(63)
TWO_DRAFTERS = ("--topology", "procsplit", "--set", "run.drafters=cpu,cpu")


def child_pids(pid: int) -> set[int]:
    children = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listing:
            children.update(int(c) for c in listing.read().split())
    return children


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def start_slow_run(tmp_path, name: str, *topology: str) -> subprocess.Popen:
    cmd = trainer_cmd(tmp_path, name, *(topology or TWO_DRAFTERS), "--steps", "1000", "--log-every", "2",
                      "--set", "debug.step_sleep_s=0.1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=trainer_env(),
                            cwd=tmp_path, start_new_session=True)


def read_until_step(proc: subprocess.Popen, step: int, timeout: float = 90) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while f"event=step step={step} " not in (lines[-1] if lines else ""):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        lines.append(proc.stdout.readline())
    return lines


@pytest.mark.slow
def test_procsplit_trains_with_identical_replicas(procsplit_two_drafter_run):
    result = procsplit_two_drafter_run  # *TWO_DRAFTERS, 80 steps, a step line every 20 (tests/conftest.py)
    assert result.code == 0, result.stderr[-3000:]
    assert result.events("start")[0].fields["topology"] == "procsplit"
    assert len({e.fields["pid"] for e in result.events("compile")}) == 2  # two drafter processes
    steps = result.steps
    assert all(s.active == "2/2" for s in steps)
    assert min(s.loss for s in steps[-2:]) < UNIFORM_LOSS * 0.4, [s.loss for s in steps]
    done = result.events("done")[0].fields
    assert done["step"] == "80" and done["replicas"] == "identical"


@pytest.mark.slow
def test_a_killed_drafter_process_ends_the_run_nonzero(tmp_path):
    proc = start_slow_run(tmp_path, "killed")
    try:
        lines = read_until_step(proc, 2)
        pids = {line.split(" drafter=")[1].split()[0]: int(line.split(" pid=")[1].split()[0])
                for line in lines if "event=compile" in line}
        os.kill(pids["1"], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 1
    assert "event=error" in stdout and "drafter1" in stdout and "signal 9" in stdout


@pytest.mark.slow
def test_sigterm_stops_every_process_with_a_checkpoint(tmp_path):
    proc = start_slow_run(tmp_path, "term")
    try:
        read_until_step(proc, 2)
        children = child_pids(proc.pid)
        assert len(children) >= 3  # a target and two drafters (plus multiprocessing's resource tracker)
        os.killpg(proc.pid, signal.SIGTERM)  # as dfo stops a run: the whole process group
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 75, stderr[-3000:]
    assert "reason=sigterm" in stdout and "event=checkpoint" in stdout
    assert (tmp_path / "term" / "checkpoint.pt").is_file()
    time.sleep(0.5)
    assert not [pid for pid in children if alive(pid)]


def cpu_ticks(pid: int) -> int:
    """The user and system CPU `pid` has used, in clock ticks (/proc/PID/stat's utime and stime)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().split(")")[-1].split()
    return int(fields[11]) + int(fields[12])


def wait_until_idle(pids: set[int], timeout: float = 120) -> None:
    """Until every one of `pids` used at most 2 clock ticks in each of two 1-s windows in a row: drafters
    waiting on an empty inbox (a training drafter steps every debug.step_sleep_s, ~10 ticks a second; a waiting
    one only looks up every POLL_S). Polled, not a fixed sleep: a loaded machine can take longer."""
    deadline, quiet = time.monotonic() + timeout, 0
    before = {pid: cpu_ticks(pid) for pid in pids}
    while quiet < 2:
        assert time.monotonic() < deadline, f"drafters {sorted(pids)} still busy after {timeout:g}s"
        time.sleep(1)
        now = {pid: cpu_ticks(pid) for pid in pids}
        quiet = quiet + 1 if all(now[pid] - before[pid] <= 2 for pid in pids) else 0
        before = now


def drafter_pids(lines: list[str]) -> set[int]:
    """The drafter processes' pids, from their compile lines."""
    return {int(line.split(" pid=")[1].split()[0]) for line in lines if "event=compile" in line}


def target_pids(supervisor: int, lines: list[str]) -> set[int]:
    """The supervisor's spawned children that are not drafters (their pids are on the compile lines)."""
    drafters = drafter_pids(lines)
    spawned = set()
    for pid in child_pids(supervisor):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if b"spawn_main" in cmdline.read():
                spawned.add(pid)
    return spawned - drafters


def stop_with_a_stopped_target(tmp_path, name: str, *topology: str) -> tuple[subprocess.Popen, str, float, set]:
    """A run whose target process is SIGSTOPped mid-run (its drafters then wait on an empty inbox), then
    SIGTERMed as dfo stops a run; returns the run, its stdout, the seconds it took to end after the
    SIGTERM, and its processes (as they were before the stop)."""
    proc = start_slow_run(tmp_path, name, *topology)
    try:
        lines = read_until_step(proc, 2)
        children = child_pids(proc.pid)
        [target] = target_pids(proc.pid, lines)
        os.kill(target, signal.SIGSTOP)
        wait_until_idle(drafter_pids(lines))  # the drafters use up the batches already queued and wait for the next one
        os.killpg(proc.pid, signal.SIGTERM)
        stopped = time.monotonic()
        # before: the drafters waited 600 s on their inbox; the tests bound the end at 45 s (it takes a few: 20 and 25 s
        # were a loaded machine's margin away from failing)
        stdout, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    time.sleep(0.5)
    assert not [pid for pid in children if alive(pid)], stderr[-3000:]  # the stopped target was killed too
    return proc, "".join(lines) + stdout, took, children


@pytest.mark.slow
def test_sigterm_with_a_stopped_target_stops_one_rank_with_a_checkpoint_at_once(tmp_path):
    proc, stdout, took, _ = stop_with_a_stopped_target(tmp_path, "onerank", "--topology", "procsplit")
    assert proc.returncode == 75 and took < 45, (proc.returncode, took, stdout[-2000:])
    done = next(line for line in stdout.splitlines() if "event=done" in line)
    checkpoints = [line for line in stdout.splitlines() if "event=checkpoint" in line]
    assert "reason=sigterm" in done and checkpoints, stdout[-2000:]
    assert checkpoints[-1].split(" step=")[1].split()[0] == done.split(" step=")[1].split()[0]
    assert (tmp_path / "onerank" / "checkpoint.pt").is_file()


@pytest.mark.slow
def test_sigterm_stops_one_rank_after_the_step_in_flight(tmp_path):
    # one rank agrees with nobody: it does not run on to the next logging step (here step 1000) first
    cmd = trainer_cmd(tmp_path, "inflight", "--topology", "procsplit", "--steps", "1000", "--log-every", "1000",
                      "--set", "run.warmup_log_steps=2", "--set", "debug.step_sleep_s=0.1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=trainer_env(),
                            cwd=tmp_path, start_new_session=True)
    try:
        read_until_step(proc, 2)
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 75, stderr[-3000:]
    done = next(line for line in stdout.splitlines() if "event=done" in line)
    assert "reason=sigterm" in done and int(done.split(" step=")[1].split()[0]) < 50, done


@pytest.mark.slow
def test_sigterm_with_a_stopped_target_ends_several_ranks_with_an_error_naming_it(tmp_path):
    proc, stdout, took, _ = stop_with_a_stopped_target(tmp_path, "tworanks")
    assert proc.returncode == 1 and took < 45, (proc.returncode, took, stdout[-2000:])
    error = next(line for line in stdout.splitlines() if "event=error" in line)
    assert "target0 sent no batch" in error and "of the stop" in error, error


class Process:
    """Stands in for a supervisor's child: `codes` are what its exitcode reads give, one per read, the last
    repeating (None: still running)."""

    def __init__(self, name: str, *codes: int | None) -> None:
        self.name, self.codes = name, list(codes)

    @property
    def exitcode(self) -> int | None:
        return self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]


def watching(tmp_path, producers: list[Process], drafters: list[Process]):
    """A real Supervisor (tiny-cpu, nothing started) watching stand-in processes, and what it logs."""
    from trainer.config import build_config
    from trainer.metrics import MetricLog
    from trainer.procsplit import Supervisor

    out = io.StringIO()
    supervisor = Supervisor(build_config("tiny-cpu", ["run.topology=procsplit"]), "watched", "off",
                            MetricLog(stream=out), tmp_path, resume=False)
    supervisor.producers, supervisor.drafters = producers, drafters
    return supervisor, out


@pytest.mark.parametrize("code", [1, -9])
def test_a_drafter_that_fails_while_the_supervisor_looks_ends_the_run_nonzero(tmp_path, code):
    # the multi-node flake: node 0's drafter refused a stale checkpoint (exit 1) just after the supervisor
    # had read it as running, the supervisor's next read found every drafter ended, and the node exited 0
    from trainer.pipeline import EXIT_WORKER_FAILED

    supervisor, out = watching(tmp_path, [Process("target0", None)], [Process("drafter0", None, code)])
    assert supervisor._watch() == EXIT_WORKER_FAILED
    assert "event=error" in out.getvalue() and "drafter0: process ended" in out.getvalue(), out.getvalue()


def test_drafters_still_running_after_the_stop_grace_are_named_and_the_run_fails(tmp_path, monkeypatch):
    # a drafter SIGSTOPped, or stuck in a collective with a rank that does not answer: before, the
    # supervisor waited for it for ever after a SIGTERM
    import threading

    import trainer.procsplit
    from trainer.pipeline import EXIT_STOPPED, EXIT_WORKER_FAILED

    monkeypatch.setattr(trainer.procsplit, "STOP_GRACE_S", 0.5, raising=False)
    supervisor, out = watching(tmp_path, [Process("target0", None)],
                               [Process("drafter0", EXIT_STOPPED), Process("drafter1", None)])
    supervisor.stop.set()
    outcome = []
    watch = threading.Thread(target=lambda: outcome.append(supervisor._watch()), daemon=True)
    watch.start()
    watch.join(timeout=10)
    assert outcome == [EXIT_WORKER_FAILED], "the supervisor still waits after the stop"
    error = next(line for line in out.getvalue().splitlines() if "event=error" in line)
    assert "drafter1: did not end within 0.5s of the stop" in error and "drafter0" not in error, error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_procsplit_trees_captures_graphs_on_one_gpu(tmp_path):
    # the point of the topology: reduce-overhead (CUDAGraph Trees) runs in each drafter process's main thread
    result = run_trainer(tmp_path, "graphs", "--preset", "h200-small", "--variant", "trees", "--topology",
                         "procsplit", "--drafters", "cuda:0", "--steps", "60", timeout=290)
    assert result.code == 0, result.stderr[-3000:]
    assert result.steps[-1].phase == "train" and result.steps[-1].tok_s > 0
