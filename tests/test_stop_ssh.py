"""`dfo stop` as a user runs it (the console script) against a real sshd: its identity check and its signals are
one remote process, so a PID the kernel gives to another process between them is never signalled; its grace
comes from the run's variant (default above the built-in trainer's own bound on a stop), it says while it waits,
and Ctrl-C while it waits leaves the run running. Targets run on the host (ctid: null): no container needed, and
the test sees the run's processes and their PIDs as the target does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import write_inventory
from harness.cli import DFO, Ran, dfo
from orchestrator.store import Store
from test_runs import alive, wait_for



def proc_stat(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""


def starttime(pid: int) -> int | None:
    fields = proc_stat(pid).rpartition(")")[2].split()
    return int(fields[19]) if len(fields) > 19 else None


class Lab:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.gate = tmp_path / "go"
        (tmp_path / "ws").mkdir()
        gated = f"while [ ! -e {self.gate} ]; do sleep 0.05; done; exit 3"
        # a trainer that checkpoints on SIGTERM for `CKPT_S` seconds, then exits 75 (trainer/pipeline.py)
        slow_ckpt = "trap 'sleep {s}; exit 75' TERM; while :; do sleep 0.1; done"
        self.inventory = write_inventory(tmp_path, {
            "defaults": {"min_free_disk_gb": 0, "workspace": str(tmp_path / "ws"), "python": sys.executable},
            "hosts": {"pve1": {"address": "testhost", "containers": {"box": {"ctid": None}}}},
            "variants": {"gated": {"command": gated},
                         "ckpt3": {"command": slow_ckpt.format(s=3)},
                         "ckpt60": {"command": slow_ckpt.format(s=60)},
                         "stubborn": {"command": "trap '' TERM; while :; do sleep 0.1; done", "stop_grace_s": 2}}})

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "DFO_INVENTORY"}  # HOME is the test's ssh_home
        return {**env, "DFO_HOME": str(self.tmp / "state"), **extra}

    def dfo(self, *args: str, timeout: float = 120, **env: str) -> Ran:
        return dfo(*args, "-i", str(self.inventory), env={"DFO_HOME": str(self.tmp / "state"), **env}, timeout=timeout)

    def popen(self, *args: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen([DFO, *args, "-i", str(self.inventory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.env(**env))

    def launch(self, variant: str, name: str) -> int:
        launched = self.dfo("launch", "--host", "box", "--variant", variant, "--name", name, "--no-preflight")
        assert launched.returncode == 0, launched.stderr
        with Store(self.tmp / "state" / "dfo.db") as store:
            return store.get_run(name).pid

    def run(self, name: str):
        with Store(self.tmp / "state" / "dfo.db") as store:
            return store.get_run(name)

    def kill_leftovers(self) -> None:
        with Store(self.tmp / "state" / "dfo.db") as store:
            for run in store.list_runs(active=True):
                if run.pid and alive(run.pid) and run.exit_path in Path(f"/proc/{run.pid}/cmdline").read_text():
                    os.killpg(run.pid, signal.SIGKILL)


@pytest.fixture
def lab(tmp_path, sshd, ssh_home):
    lab = Lab(tmp_path)
    yield lab
    lab.kill_leftovers()


def take_pid(pid: int, timeout: float = 30.0) -> subprocess.Popen:
    """Start a process that leads its own session and group (as an sshd connection or another dfo run does) as
    PID `pid`, once the kernel has freed that number: the kernel's next PID is set to it (ns_last_pid), as happens
    to any number in time when the PIDs wrap around. Retried while another process took the number first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_stat(pid):  # the run's wrapper not reaped yet, or someone else holds the number: wait
            time.sleep(0.05)
            continue
        starter = subprocess.Popen(["sh", "-c", f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid; "
                                                "setsid sleep 60 </dev/null >/dev/null 2>&1 & echo $!"],
                                   stdout=subprocess.PIPE, text=True)
        got = int(starter.communicate(timeout=10)[0])
        if got == pid:
            return starter
        os.kill(got, signal.SIGKILL)
    raise AssertionError(f"PID {pid} was never free to take within {timeout:g}s")


def test_a_pid_reused_between_stops_identity_check_and_its_signal_is_never_signalled(lab: Lab, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("setting the kernel's next PID (ns_last_pid) needs root")
    pid = lab.launch("gated", "g1")
    paused = tmp_path / "paused"
    stopper = lab.popen("stop", "g1", "--grace", "5", "--json", DFO_TEST_PAUSE_AT="identified",
                        DFO_TEST_PAUSE_FILE=str(paused))
    stranger = None
    try:
        wait_for(paused.exists, timeout=60, what="dfo stop past its identity check")  # the run was alive then
        lab.gate.touch()  # now the run ends on its own (exit 3), and its PID goes to a stranger
        wait_for(lambda: (tmp_path / "ws" / "logs" / "g1.log.exit").exists(), what="the run's end")
        stranger = take_pid(pid)
        wait_for(lambda: "(sleep)" in proc_stat(pid), what="the stranger to start")
        stranger_started = starttime(pid)
        paused.unlink()  # stop goes on to its signal
        out, err = stopper.communicate(timeout=90)
        assert stopper.returncode == 0, err
        assert alive(pid) and starttime(pid) == stranger_started, "dfo stop signalled the process that took the run's PID"
        assert json.loads(out) == {"run": "g1", "state": "crashed", "exit_code": 3, "signal": None}  # its own end
        assert lab.run("g1").stop_requested_at is None
    finally:
        stopper.kill()
        if stranger is not None and proc_stat(pid):
            os.kill(pid, signal.SIGKILL)


def test_stop_says_while_it_waits_for_a_checkpoint_and_records_the_trainers_own_exit(lab: Lab) -> None:
    lab.launch("ckpt3", "c1")
    stopped = lab.dfo("stop", "c1", "--json")  # no --grace: 90 s by default, well past its 3 s checkpoint
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout) == {"run": "c1", "state": "stopped", "exit_code": 75, "signal": "TERM"}
    assert ("waiting for run c1 to checkpoint and exit (SIGTERM sent 1 s ago; SIGKILL at 90 s; Ctrl-C leaves it "
            "running)") in stopped.stderr


def test_a_variants_stop_grace_is_stops_default(lab: Lab) -> None:
    lab.launch("stubborn", "s1")  # ignores SIGTERM; its variant says stop_grace_s: 2
    started = time.monotonic()
    stopped = lab.dfo("stop", "s1", "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["signal"] == "KILL" and time.monotonic() - started < 20
    assert "SIGKILL at 2 s" in stopped.stderr
    helped = " ".join(lab.dfo("stop", "--help", COLUMNS="200").stdout.split())
    assert "--grace S" in helped and "Default: the run's variant's `stop_grace_s`, else 90 s" in helped


def test_the_default_grace_outlasts_the_trainers_own_bound_on_a_stop() -> None:
    from orchestrator.inventory import STOP_GRACE_S, Inventory
    from trainer import procsplit

    assert Inventory(hosts={}).stop_grace("nographs") == STOP_GRACE_S
    assert STOP_GRACE_S > procsplit.STOP_GRACE_S + procsplit.REAP_GRACE_S + 10  # its drafters, its targets, a checkpoint


def test_ctrl_c_while_stop_waits_leaves_the_run_running_and_no_sigkill_follows(lab: Lab) -> None:
    pid = lab.launch("ckpt60", "c2")  # checkpoints for 60 s after SIGTERM
    stopper = lab.popen("stop", "c2", "--grace", "4")
    try:
        said = ""
        deadline = time.monotonic() + 60
        while "waiting for run c2" not in said:
            assert time.monotonic() < deadline and stopper.poll() is None, said
            said += os.read(stopper.stderr.fileno(), 4096).decode()
        stopper.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = stopper.communicate(timeout=20)
        assert stopper.returncode == 130, said + err
        assert "interrupted: c2 goes on" in " ".join((said + err).split()) and "no SIGKILL follows" in said + err
        time.sleep(6)  # past its 4 s grace
        assert alive(pid), "the run was killed after dfo stop was interrupted"
        run = lab.run("c2")
        assert run.state == "running" and run.stop_requested_at is not None  # its end will read as stopped
    finally:
        stopper.kill()
