"""Launch, stop and logs on this machine (LocalTarget): detached runs, refusals, identity-checked stop, secrets.

These use `command:` variants and a small stand-in trainer package so they stay fast; the real tiny-cpu
trainer and the SSH + pct paths are in tests/test_launch*.py.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from harness.cli import dfo
from orchestrator.errors import InvalidName, RefusedError, RemoteError, UsageError
from orchestrator.package import build_package, package_files
from orchestrator.remote.local import LocalTarget
from orchestrator.runs import RunSpec, follow_log, gone, launch, log_tail, stop
from orchestrator.store import Run, Store

FAKE_TRAINER_MAIN = """
import os, sys, time
print("argv", " ".join(sys.argv[1:]), flush=True)
print("cwd", os.getcwd(), flush=True)
for step in range(3):
    print(f"event=step step={step} tok_s=1.0", flush=True)
"""


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "dfo.db")
    yield s
    kill_leftover_runs(s)  # never leave a test's run behind
    s.close()


def kill_leftover_runs(store: Store) -> None:
    """SIGKILL the process group of every run the registry still calls active whose PID is still that run's
    (its recorded start time, or its exit file on its command line where none was recorded). A run that ended
    unseen leaves its PID to the kernel: signalling that number could end an unrelated process group (an sshd
    connection of a later test, whose process leads its own group)."""
    for run in store.list_runs(active=True):
        if run.pid and _still_the_run(run):
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _still_the_run(run) -> bool:
    try:
        stat = Path(f"/proc/{run.pid}/stat").read_text()
        cmdline = Path(f"/proc/{run.pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    if run.proc_starttime is not None:
        return not gone(stat, run.proc_starttime)
    return bool(run.exit_path) and run.exit_path in cmdline


@pytest.fixture
def workspace(tmp_path) -> str:
    ws = tmp_path / "ws"
    ws.mkdir()
    return str(ws)


def spec(workspace: str, command: str | None = None, **kw) -> RunSpec:
    defaults = dict(target="here", host="local", workspace=workspace, python=sys.executable, variant="v1", command=command)
    return RunSpec(**{**defaults, **kw})


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group `pgid` that are not zombies (this machine's PID 1 may not reap orphans)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def fake_trainer_package(tmp_path: Path):
    trainer = tmp_path / "fake_src" / "trainer"
    trainer.mkdir(parents=True)
    (trainer / "__init__.py").write_text("")
    (trainer / "__main__.py").write_text(FAKE_TRAINER_MAIN)
    return build_package(package_files(trainer, tmp_path / "fake_src" / "no-agent.py"))


def test_command_run_is_detached_logged_recorded_and_writes_its_exit_status(store, workspace):
    launched = launch(LocalTarget("here"), spec(workspace, "echo hello; echo from-run; exit 3"), store, name="r1")
    run = launched.run
    assert run.state == "running" and run.pid > 0 and run.log_path == f"{workspace}/logs/r1.log"
    assert run.proc_starttime is not None or not alive(run.pid)
    exit_file = Path(run.exit_path)
    wait_for(exit_file.exists, what="exit file")
    assert wait_for(lambda: exit_file.read_text().strip()) == "3"
    assert Path(run.log_path).read_text() == "hello\nfrom-run\n"
    assert Path(workspace, "logs", "r1.log").stat().st_size > 0
    assert [e["kind"] for e in store.events("r1")] == ["started"]


class DirectoryEvents:
    """inotify on one directory (Linux, through libc): which names were created, written and moved into it."""

    IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x8, 0x80, 0x100

    def __init__(self, directory: str) -> None:
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0 and self.libc.inotify_add_watch(
            self.fd, directory.encode(), self.IN_CLOSE_WRITE | self.IN_MOVED_TO | self.IN_CREATE) >= 0

    def read(self) -> list[tuple[str, str]]:
        """(kind, name) of every event so far: kind is `created`, `written` or `moved_in`."""
        import struct

        kinds = {self.IN_CREATE: "created", self.IN_CLOSE_WRITE: "written", self.IN_MOVED_TO: "moved_in"}
        events, data = [], b""
        while True:
            try:
                data += os.read(self.fd, 65536)
            except BlockingIOError:
                break
        while data:
            _, mask, _, size = struct.unpack_from("iIII", data)
            name = data[16:16 + size].rstrip(b"\0").decode()
            events += [(kind, name) for bit, kind in kinds.items() if mask & bit]
            data = data[16 + size:]
        return events

    def close(self) -> None:
        os.close(self.fd)


@pytest.mark.parametrize("how", ["exits", "stopped"])
def test_the_exit_file_appears_whole_by_a_rename_never_empty_or_half_written(store, workspace, how):
    """The wrapper wrote LOG.exit with `>`: between its creation and its write a reader found it empty. Its PATH
    set by the run's own `env:` must not keep it from being renamed either."""
    os.makedirs(f"{workspace}/logs")
    events = DirectoryEvents(f"{workspace}/logs")
    try:
        command = "exit 3" if how == "exits" else f"{shutil.which('sleep')} 60"
        run = launch(LocalTarget("here"), spec(workspace, command, env={"PATH": "/nonexistent"}), store, name="x1").run
        if how == "stopped":
            wait_for(lambda: alive(run.pid), what="run start")
            assert stop(LocalTarget("here"), store, "x1", grace_s=10).run.exit_code == 143
        exit_file = Path(run.exit_path)
        assert wait_for(exit_file.exists, what="exit file") and exit_file.read_text() == ("3\n" if how == "exits" else "143\n")
        wait_for(lambda: not alive(run.pid), what="the wrapper's end")
        seen = [(kind, name) for kind, name in events.read() if name.startswith("x1.log.exit")]
    finally:
        events.close()
    assert seen == [("created", "x1.log.exit.part"), ("written", "x1.log.exit.part"), ("moved_in", "x1.log.exit")]
    assert not Path(f"{run.exit_path}.part").exists()


def test_builtin_variant_runs_the_pushed_package_with_its_arguments(store, workspace, tmp_path):
    package = fake_trainer_package(tmp_path)
    run_spec = spec(workspace, compile="nographs", preset="tiny-cpu", args={"steps": 5, "log_every": 1, "drafter.layers": 2})
    launched = launch(LocalTarget("here"), run_spec, store, name="b1", package=package)
    assert launched.push.transferred and launched.run.trainer_hash == package.sha256
    wait_for(Path(launched.run.exit_path).exists, what="exit file")
    log = Path(launched.run.log_path).read_text()
    assert "argv --run-name b1 --variant nographs --preset tiny-cpu --steps 5 --log-every 1 --set drafter.layers=2 --wandb off" in log
    assert f"cwd {workspace}" in log and "event=step step=2" in log
    again = launch(LocalTarget("here"), run_spec, store, name="b2", package=package)
    assert not again.push.transferred


def test_default_name_says_what_the_run_is_and_never_reuses_a_log(store, workspace):
    from datetime import datetime

    now = datetime(2026, 11, 29, 11, 40)
    logs = Path(workspace, "logs")
    logs.mkdir()
    (logs / "train_v1_20261129-1140.log").write_text("someone else's run\n")
    first = launch(LocalTarget("here"), spec(workspace, "true"), store, now=now).run
    second = launch(LocalTarget("here"), spec(workspace, "true"), store, now=now).run
    assert (first.name, second.name) == ("train_v1_20261129-1140-2", "train_v1_20261129-1140-3")
    assert (logs / "train_v1_20261129-1140.log").read_text() == "someone else's run\n"


def test_taken_name_and_existing_log_are_refused_without_touching_anything(store, workspace):
    launch(LocalTarget("here"), spec(workspace, "true"), store, name="taken")
    with pytest.raises(RefusedError, match="already exists"):
        launch(LocalTarget("here"), spec(workspace, "echo second"), store, name="taken")
    Path(workspace, "logs", "old.log").write_text("precious\n")
    with pytest.raises(RefusedError, match="never overwrites"):
        launch(LocalTarget("here"), spec(workspace, "echo clobber"), store, name="old")
    assert Path(workspace, "logs", "old.log").read_text() == "precious\n"
    assert store.find_run("old") is None and len(store.list_runs()) == 1


@pytest.mark.parametrize("field,value", [("name", "x; touch /tmp/pwned"), ("name", "$(id)"), ("variant", "v`id`")])
def test_shell_metacharacters_are_refused_before_any_remote_call(store, workspace, field, value):
    class NoCalls(LocalTarget):
        def run(self, *a, **kw):
            raise AssertionError("no remote call expected")

    kwargs = {"name": value} if field == "name" else {}
    run_spec = spec(workspace, "true", **({"variant": value} if field == "variant" else {}))
    with pytest.raises(InvalidName):
        launch(NoCalls("here"), run_spec, store, **kwargs)
    assert store.list_runs() == [] and os.listdir(workspace) == []


def test_missing_python_or_torch_is_refused_and_nothing_is_written(store, workspace, tmp_path):
    package = fake_trainer_package(tmp_path)
    with pytest.raises(RefusedError, match="not found"):
        launch(LocalTarget("here"), spec(workspace, compile="eager", python="/nonexistent/python3"), store, name="p", package=package)
    no_torch = tmp_path / "python-without-torch"
    no_torch.write_text("#!/bin/sh\nexit 1\n")
    no_torch.chmod(0o755)
    with pytest.raises(RefusedError, match="no torch"):
        launch(LocalTarget("here"), spec(workspace, compile="eager", python=str(no_torch)), store, name="p", package=package)
    assert store.list_runs() == [] and os.listdir(workspace) == []


def test_a_launch_failing_halfway_removes_its_secrets_file_and_empty_log(store, workspace):
    class StartFails(LocalTarget):
        def stream(self, cmd):  # the launch's one call (orchestrator/launchplan.py)
            if isinstance(cmd, str) and "setsid nohup" in cmd:
                cmd = cmd.replace("setsid nohup", "exit 1; setsid nohup")  # dies after reserving the log and secrets
            return super().stream(cmd)

    run_spec = spec(workspace, "sleep 30", secrets=("DFO_TEST_TOKEN",))
    with pytest.raises(RemoteError, match="starting run"):
        launch(StartFails("here"), run_spec, store, name="half", environ={"DFO_TEST_TOKEN": "tok"})
    assert store.find_run("half") is None
    assert list(Path(workspace, "logs").iterdir()) == [] and list(Path(workspace, ".dfo", "secrets").iterdir()) == []
    assert [e["kind"] for e in store.events("half")] == ["launch_failed"]


@pytest.mark.parametrize("planted", ["link", "dangling link", "file"])
def test_a_link_planted_at_the_secrets_path_gets_no_secret_and_the_launch_fails_in_one_line(store, workspace, tmp_path,
                                                                                           planted):
    """Someone who can write the workspace (a co-tenant of the container) planted `.dfo/secrets/NAME.env` (run names
    are predictable) as a link to a file they can read: `cat > FILE` followed it and wrote the secrets there."""
    stolen = tmp_path / "stolen"
    if planted != "dangling link":
        stolen.write_text("")
        stolen.chmod(0o666)
    secrets_dir = Path(workspace, ".dfo", "secrets")
    secrets_dir.mkdir(parents=True)
    if planted == "file":
        (secrets_dir / "planted.env").write_text("")
        (secrets_dir / "planted.env").chmod(0o666)
        stolen = secrets_dir / "planted.env"
    else:
        (secrets_dir / "planted.env").symlink_to(stolen)
    run_spec = spec(workspace, "sleep 30", secrets=("DFO_TEST_TOKEN",))
    with pytest.raises(RemoteError) as info:
        launch(LocalTarget("here"), run_spec, store, name="planted", environ={"DFO_TEST_TOKEN": "tok-4d1e"})
    assert str(info.value) == (f"here: starting run planted failed: the secrets file {secrets_dir}/planted.env already "
                               "exists (planted? remove it)")
    assert not stolen.exists() or "tok-4d1e" not in stolen.read_text()
    assert store.find_run("planted") is None and list(Path(workspace, "logs").iterdir()) == []


def test_stop_terminates_the_process_group_and_records_the_exit(store, workspace):
    command = "sleep 60 & sleep 61; wait"
    run = launch(LocalTarget("here"), spec(workspace, command), store, name="s1").run
    wait_for(lambda: alive(run.pid), what="run start")
    started = time.monotonic()
    result = stop(LocalTarget("here"), store, "s1", grace_s=10)
    assert result.signal == "TERM" and time.monotonic() - started < 8
    assert (result.run.state, result.run.exit_code) == ("stopped", 143)
    assert not alive(run.pid)
    assert live_group_members(run.pid) == []
    with pytest.raises(RefusedError, match="not running"):
        stop(LocalTarget("here"), store, "s1")


def test_stop_escalates_to_sigkill_after_the_grace_period(store, workspace):
    command = "trap '' TERM; while :; do sleep 0.2; done"  # ignores SIGTERM, and so do its children
    run = launch(LocalTarget("here"), spec(workspace, command), store, name="stubborn").run
    wait_for(lambda: alive(run.pid), what="run start")
    time.sleep(0.3)
    result = stop(LocalTarget("here"), store, "stubborn", grace_s=1)
    assert result.signal == "KILL" and result.run.state == "stopped" and not alive(run.pid)


def test_stop_refuses_a_reused_pid_and_leaves_that_process_alone(store, workspace):
    run = launch(LocalTarget("here"), spec(workspace, "true"), store, name="old-run").run
    wait_for(Path(run.exit_path).exists, what="run end")
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        store.update_run("old-run", pid=stranger.pid)  # as if the kernel had given the run's PID to `sleep`
        with pytest.raises(RefusedError, match="no longer run old-run"):
            stop(LocalTarget("here"), store, "old-run", grace_s=1)
        assert stranger.poll() is None
        assert store.get_run("old-run").state == "exited"
    finally:
        stranger.kill()
        stranger.wait()


def test_the_cleanup_of_leftover_runs_kills_a_live_run_and_spares_a_process_that_took_an_ended_runs_pid(store, workspace):
    live = launch(LocalTarget("here"), spec(workspace, "sleep 30"), store, name="live").run
    ended = launch(LocalTarget("here"), spec(workspace, "true"), store, name="ended").run
    wait_for(lambda: alive(live.pid), what="run start")
    wait_for(Path(ended.exit_path).exists, what="run end")
    # a PID really reused is by a process started long after (the kernel cycles through every free PID
    # first); the identity is the start time in clock ticks (10 ms), so the stand-in starts a few ticks later
    # than `ended` did: right after the launch it could share its tick and pass for it
    time.sleep(0.05)
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)  # leads its own group, as sshd's connections do
    try:
        # the registry still calls `ended` running and the kernel gave its PID to `stranger`; a row without a
        # recorded start time is known by its exit file on the command line, which `stranger` lacks too
        store.update_run("ended", pid=stranger.pid)
        store.add_run(Run(name="unseen", target="here", pid=stranger.pid, exit_path=f"{workspace}/logs/unseen.exit",
                          state="running"))
        kill_leftover_runs(store)
        wait_for(lambda: not alive(live.pid), what="the live run's end")
        assert stranger.poll() is None, "a process that merely has a leftover run's PID was killed"
    finally:
        stranger.kill()
        stranger.wait()


def stopper_with(monkeypatch, tmp_path: Path, at: str, insert: str) -> None:
    """Make the stop program (orchestrator/agent/stopper.py, run inside the target) run `insert` (lines at the
    indentation of `at`) just before the line `at`: something happens exactly there, inside its one process."""
    import orchestrator.runs as runs_module

    source = runs_module.STOPPER.read_text()
    [line] = [line for line in source.splitlines() if line.strip() == at]
    indent = line[:len(line) - len(line.lstrip())]
    patched = tmp_path / "stopper.py"
    patched.write_text(source.replace(line, "".join(indent + part + "\n" for part in insert.splitlines()) + line, 1))
    monkeypatch.setattr(runs_module, "STOPPER", patched)


def test_a_run_that_exits_while_stop_checks_it_is_reported_as_exited_not_as_a_reused_pid(store, workspace, tmp_path,
                                                                                          monkeypatch):
    go = tmp_path / "go"
    run = launch(LocalTarget("here"), spec(workspace, f"while [ ! -e {go} ]; do sleep 0.02; done; exit 4"), store,
                 name="quits").run
    wait_for(lambda: alive(run.pid), what="run start")

    # between its first look at the PID (the run alive) and its command line, the run exits on its own
    stopper_with(monkeypatch, tmp_path, 'cmdline = read_text("/proc/%d/cmdline" % pid).replace("\\0", " ").replace("\\n", " ")',
                 f"open({str(go)!r}, 'w').close()\n"
                 f"while not (os.path.exists({run.exit_path!r}) and not live(read_text('/proc/%d/stat' % pid))): time.sleep(0.02)")
    result = stop(LocalTarget("here"), store, "quits", grace_s=1)
    assert result.signal is None  # nothing signalled: it had ended on its own
    assert (result.run.state, result.run.exit_code) == ("crashed", 4)  # its real end, from its exit file
    assert store.get_run("quits").stop_requested_at is None
    with pytest.raises(RefusedError, match="not running"):
        stop(LocalTarget("here"), store, "quits", grace_s=1)


def test_secret_reaches_the_run_but_no_argv_log_or_registry_row(store, workspace, tmp_path):
    value = "s3cr3t-Value-9f2c"
    # the run matches a pattern, so the whole value is written nowhere but the workstation's environment
    command = 'case "$DFO_TEST_TOKEN" in s3cr3t-*-9f2c) echo secret-ok;; esac; sleep 30'
    run_spec = spec(workspace, command, secrets=("DFO_TEST_TOKEN", "DFO_UNSET_SECRET"))
    launched = launch(LocalTarget("here"), run_spec, store, name="sec", environ={"DFO_TEST_TOKEN": value})
    assert launched.missing_secrets == ("DFO_UNSET_SECRET",)
    wait_for(lambda: "secret-ok" in Path(launched.run.log_path).read_text(), what="secret in the run")
    argv = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert value not in argv
    assert list(Path(workspace, ".dfo", "secrets").iterdir()) == []  # sourced, then deleted
    assert value not in Path(launched.run.log_path).read_text()
    dump = "\n".join(sqlite3.connect(store.path).iterdump())
    assert "sec" in dump and value not in dump
    stop(LocalTarget("here"), store, "sec", grace_s=5)


def test_logs_tail_and_follow_see_new_lines_and_closing_never_stops_the_run(store, workspace):
    command = "i=0; while [ $i -lt 400 ]; do echo line-$i; i=$((i + 1)); sleep 0.05; done"
    run = launch(LocalTarget("here"), spec(workspace, command), store, name="chatty").run
    wait_for(lambda: "line-3" in Path(run.log_path).read_text(), what="first lines")
    assert log_tail(LocalTarget("here"), run, lines=2).count("\n") == 2
    seen = b""
    follower = follow_log(LocalTarget("here"), run, lines=1, poll_s=0.2)
    for chunk in follower:
        seen += chunk
        if b"line-30\n" in seen:
            break
    follower.close()
    assert b"line-29\n" in seen
    time.sleep(0.3)
    assert alive(run.pid)
    stop(LocalTarget("here"), store, "chatty", grace_s=5)


def test_stop_records_the_status_of_a_trainer_that_finishes_its_step_on_sigterm(store, workspace, tmp_path):
    trainer = tmp_path / "graceful.py"
    trainer.write_text(
        "import signal, sys, time\n"
        "def finish(*_):\n    time.sleep(0.3); print('checkpoint written', flush=True); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, finish)\nprint('up', flush=True)\ntime.sleep(60)\n"
    )
    command = f"{sys.executable} {trainer}; echo next-command-ran"
    run = launch(LocalTarget("here"), spec(workspace, command), store, name="graceful").run
    wait_for(lambda: "up" in Path(run.log_path).read_text(), what="trainer start")
    result = stop(LocalTarget("here"), store, "graceful", grace_s=10)
    assert (result.signal, result.run.exit_code) == ("TERM", 7)
    log = Path(run.log_path).read_text()
    assert "checkpoint written" in log and "next-command-ran" not in log


@pytest.mark.parametrize("change", [{"args": {"steps;id": 1}}, {"env": {"A B": "x"}}, {"secrets": ("X=$(id)",)}])
def test_argument_and_environment_names_with_shell_syntax_are_refused_up_front(store, workspace, change):
    with pytest.raises(UsageError):
        launch(LocalTarget("here"), spec(workspace, None if "args" in change else "true", compile="eager", **change), store, name="r")
    assert store.list_runs() == [] and os.listdir(workspace) == []


def test_a_shell_loop_stopped_between_commands_is_recorded_as_terminated_not_as_success(store, workspace):
    run = launch(LocalTarget("here"), spec(workspace, "echo up; i=0; while :; do i=$((i + 1)); done"), store, name="spin").run
    wait_for(lambda: "up" in Path(run.log_path).read_text(), what="loop start")
    result = stop(LocalTarget("here"), store, "spin", grace_s=5)
    assert (result.signal, result.run.exit_code) == ("TERM", 143)


@pytest.mark.parametrize("topology,flag", [("threaded", "threads"), ("procsplit", "procsplit")])
def test_inventory_topology_reaches_the_trainer_in_its_own_words(store, workspace, tmp_path, topology, flag):
    from orchestrator.inventory import Variant, parse_inventory
    from orchestrator.runs import spec_for, trainer_topology
    from trainer.config import TOPOLOGIES

    inventory = parse_inventory(json.dumps({  # JSON is YAML
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None, "workspace": workspace, "python": sys.executable}}}},
        "variants": {"v1": {"compile": "eager", "preset": "tiny-cpu", "topology": topology}},
    }))
    launched = launch(LocalTarget("here"), spec_for(inventory, "here", "v1"), store, name="topo", package=fake_trainer_package(tmp_path))
    wait_for(Path(launched.run.exit_path).exists, what="exit file")
    assert f"--topology {flag} " in Path(launched.run.log_path).read_text()
    inventory_words = typing.get_args(Variant.model_fields["topology"].annotation)
    assert {trainer_topology(word) for word in inventory_words} == set(TOPOLOGIES)  # the trainer accepts each one


def test_a_stop_whose_target_never_answers_times_out_and_leaves_the_run_recorded(store, workspace, monkeypatch,
                                                                                 tmp_path):
    import orchestrator.runs as runs_module
    from orchestrator.errors import CommandTimeout

    monkeypatch.setattr(runs_module, "STOP_PROBE_TIMEOUT", 1.0)
    monkeypatch.setattr(runs_module, "KILL_SETTLE_S", 0.5)
    stopper_with(monkeypatch, tmp_path, "settle_end = time.monotonic() + args.settle", "time.sleep(600)")  # it hangs
    run = launch(LocalTarget("here"), spec(workspace, "sleep 30"), store, name="wedged").run
    wait_for(lambda: alive(run.pid), what="run start")
    started = time.monotonic()
    # the bound after its identity check: grace 0.5 + a settle before the signal and one after KILL (2 x 0.5) + 1
    with pytest.raises(CommandTimeout, match=r"stopping wedged: no answer within 2\.5s.*dfo stop wedged"):
        stop(LocalTarget("here"), store, "wedged", grace_s=0.5)
    assert time.monotonic() - started < 8
    assert store.get_run("wedged").state == "running" and alive(run.pid)  # nothing recorded that did not happen
    monkeypatch.undo()
    assert stop(LocalTarget("here"), store, "wedged", grace_s=5).run.state == "stopped"


def test_runs_table_keeps_every_name_whole_on_one_line_at_80_and_120_columns(tmp_path):
    names = ["train_nographs_20261129-1140-2", "sweep.trees.ct200.r1.2-nographs"]
    with Store(tmp_path / "dfo.db") as registry:
        for pid, name in enumerate(names, start=123456):
            registry.add_run(Run(name=name, target="ct200", variant="nographs", state="crashed", exit_code=1, pid=pid,
                                 started_at="2026-11-29T11:40:03.123Z", decision={"decision": "crash"}))
    from rich.console import Console

    from orchestrator.commands.runs import runs_table

    dfo_runs = dfo("runs", env={"DFO_HOME": str(tmp_path), "COLUMNS": "80"})
    assert dfo_runs.returncode == 0, dfo_runs.stderr
    wide = Console(width=120, file=io.StringIO())
    with Store(tmp_path / "dfo.db") as registry:
        wide.print(runs_table(registry.list_runs(), 120))
    for columns, stdout in ((80, dfo_runs.stdout), (120, wide.file.getvalue())):
        lines = stdout.splitlines()
        assert max(len(line) for line in lines) <= columns
        for name in names:
            row = next(line for line in lines if name in line)
            assert "crashed 1" in row and "crash" in row.split("crashed 1")[1]
        for pid in (123456, 123457):  # target and PID at every width (at 80 they were left out)
            assert re.search(rf"\bct200\s+{pid}\b", stdout), stdout
        if columns == 80:
            assert "dfo runs --json" in stdout  # says what it left out, and where to see it


def test_two_launches_racing_for_one_default_name_get_two_names(store, workspace, tmp_path):
    from datetime import datetime

    now = datetime(2026, 11, 29, 11, 40)
    other_workspace = tmp_path / "ws-other"
    other_workspace.mkdir()
    others = []

    class AnotherDfoLaunchesMeanwhile(LocalTarget):
        """While this launch talks to its target, another dfo process launches the same variant elsewhere."""

        def stream(self, cmd):  # the launch's one call (orchestrator/launchplan.py)
            if not others:
                with Store(store.path) as other_store:
                    others.append(launch(LocalTarget("there"), spec(str(other_workspace), "true"), other_store, now=now).run)
            return super().stream(cmd)

    mine = launch(AnotherDfoLaunchesMeanwhile("here"), spec(workspace, "true"), store, now=now).run
    names = {mine.name, others[0].name}
    assert names == {"train_v1_20261129-1140", "train_v1_20261129-1140-2"}
    assert {r.name for r in store.list_runs(active=True)} == names


@pytest.mark.parametrize("fooled", ["command line", "start time"])
def test_each_identity_check_alone_refuses_a_reused_pid(store, workspace, fooled):
    run = launch(LocalTarget("here"), spec(workspace, "sleep 0.3"), store, name="gone").run
    assert run.proc_starttime is not None  # read at launch, while the run was alive
    wait_for(Path(run.exit_path).exists, what="run end")
    time.sleep(0.05)  # a later clock tick (1/100 s) than the run's start, as any reused PID's start would be
    # a stranger that passes one of the two checks: its command line names the run's exit file, or the
    # registry holds its own start time
    stranger = subprocess.Popen(["sh", "-c", f"sleep 30; : {run.exit_path}"], start_new_session=True)
    try:
        wait_for(lambda: Path(f"/proc/{stranger.pid}/cmdline").read_bytes().count(b"\0") > 1, what="stranger start")
        stranger_start = int(Path(f"/proc/{stranger.pid}/stat").read_text().rpartition(")")[2].split()[19])
        assert stranger_start != run.proc_starttime
        if fooled == "command line":
            store.update_run("gone", pid=stranger.pid)
        else:
            store.update_run("gone", pid=stranger.pid, proc_starttime=stranger_start, exit_path=f"{workspace}/logs/other.exit")
        with pytest.raises(RefusedError, match="no longer run gone"):
            stop(LocalTarget("here"), store, "gone", grace_s=1)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize("topology", ["threaded", "procsplit"])
@pytest.mark.parametrize("wandb", ["off", "offline", "online", "auto"])
def test_the_real_trainer_parses_the_command_line_dfo_builds(workspace, topology, wandb):
    import shlex

    from trainer.__main__ import parse_args
    from orchestrator.runs import trainer_command

    run_spec = spec(workspace, compile="nographs", preset="tiny-cpu", topology=topology, wandb=wandb,
                    args={"steps": 50, "log_every": 5, "drafter.layers": 2})
    argv = shlex.split(trainer_command(run_spec, "r1", f"{workspace}/.dfo/pkg/abc"))
    parsed = parse_args(argv[argv.index("trainer") + 1:])
    assert (parsed.run_name, parsed.variant, parsed.preset, parsed.topology, parsed.wandb) == (
        "r1", "nographs", "tiny-cpu", {"threaded": "threads"}.get(topology, topology), wandb)
    assert (parsed.steps, parsed.log_every, parsed.overrides) == ("50", "5", ["drafter.layers=2"])


def test_an_unknown_wandb_mode_is_refused_before_anything_starts(store, workspace):
    with pytest.raises(UsageError, match="--wandb 'bogus'"):
        launch(LocalTarget("here"), spec(workspace, compile="eager", wandb="bogus"), store, name="w")
    assert store.list_runs() == [] and os.listdir(workspace) == []


def test_logs_follow_that_loses_its_stream_says_so_and_fails(tmp_path, workspace):
    with Store(tmp_path / "dfo.db") as registry:
        run = launch(LocalTarget("here"), spec(workspace, "while :; do echo beat; sleep 0.2; done"), registry, name="beat").run
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(json.dumps({"hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None, "workspace": workspace}}}},
                                     "variants": {"v1": {"command": "true"}}}))
    env = {**os.environ, "DFO_HOME": str(tmp_path)}
    follower = subprocess.Popen([str(Path(sys.executable).parent / "dfo"), "logs", "beat", "-f", "-n", "1", "-i", str(inventory)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert follower.stdout.readline() == "beat\n"
        remote_ends = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/cmdline")
                       if b"( cat <&3; kill" in _read(p) and run.log_path.encode() in _read(p)]
        assert len({os.getpgid(pid) for pid in remote_ends}) == 1  # one remote script (and its background cat)
        os.killpg(os.getpgid(remote_ends[0]), signal.SIGKILL)  # the far end goes away, as when the connection drops
        _, err = follower.communicate(timeout=20)
        assert follower.returncode == 1 and "following" in err and "ended unexpectedly; beat is not affected" in err
        assert alive(run.pid)
    finally:
        follower.kill()
        os.killpg(run.pid, signal.SIGKILL)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


BUSY = "i=0; while [ $i -lt 300000 ]; do i=$((i + 1)); done"  # builtins only: the group's leader alone, for a while


@pytest.mark.parametrize("then, signal", [("echo 7 > {exit}", None), ("sleep 30; : {exit}", "TERM")])
def test_stops_signal_waits_out_a_wrapper_alone_in_its_group_and_goes_only_to_a_run(store, tmp_path, then, signal):
    # the wrapper alone is writing its run's exit status (the run ended: no signal, its status read), or is
    # about to start the run (a stop right after the launch: the run is signalled once it is there)
    exit_file = tmp_path / "run.exit"
    wrapper = subprocess.Popen(["sh", "-c", f"{BUSY}; {then.format(exit=exit_file)}"], start_new_session=True)
    try:
        wait_for(lambda: str(exit_file).encode() in Path(f"/proc/{wrapper.pid}/cmdline").read_bytes(), what="start")
        started = int(Path(f"/proc/{wrapper.pid}/stat").read_text().rpartition(")")[2].split()[19])
        store.add_run(Run(name="w", target="here", pid=wrapper.pid, proc_starttime=started, exit_path=str(exit_file),
                          state="running"))
        result = stop(LocalTarget("here"), store, "w", grace_s=5)
    finally:
        wrapper.kill()
        wrapper.wait()
    assert result.signal == signal
    assert result.run.exit_code == (7 if signal is None else None)


def test_the_grace_period_is_time_not_a_count_of_polls(store, workspace, monkeypatch, tmp_path):
    # every look at the run's group takes 1 s more, as a /proc scan does on a busy machine with many processes
    stopper_with(monkeypatch, tmp_path, "found = []", "time.sleep(1)")
    run = launch(LocalTarget("here"), spec(workspace, "trap '' TERM; while :; do sleep 0.2; done"), store, name="slowpoll").run
    wait_for(lambda: alive(run.pid), what="run start")
    time.sleep(0.3)
    started = time.monotonic()
    result = stop(LocalTarget("here"), store, "slowpoll", grace_s=2)
    assert result.signal == "KILL" and not alive(run.pid)
    assert time.monotonic() - started < 9  # 2 s of grace, not 2 s worth of polls (10 polls of 1.2 s = 12 s)


@pytest.mark.parametrize("state", ["unconfirmed", "launching"])
def test_a_start_never_seen_answered_whose_run_ended_before_a_look_is_resolved_then_ended(store, workspace, state):
    # the start's answer never came back (unconfirmed), or the launching dfo died before recording it (launching, its
    # launcher gone), and the run came and went before anyone looked: a `launch_resolved` event, as for a start
    # found running, then its end; it used to be one `ended` event, "its launch was not recorded to the end"
    from orchestrator.runs import look

    run = launch(LocalTarget("here"), spec(workspace, "exit 3"), store, name="brief").run
    wait_for(lambda: Path(run.exit_path).exists() and Path(run.exit_path).read_text().strip(), what="run end")
    gone_dfo = subprocess.Popen(["true"])
    gone_dfo.wait()  # the launching dfo, gone
    store.update_run("brief", state=state, pid=None, proc_starttime=None, started_at=None,
                     ended_at=run.started_at, owner=f"{socket.gethostname()}:{gone_dfo.pid}")
    [looked] = look(LocalTarget("here"), store, [store.get_run("brief")])
    assert (looked.state, looked.exit_code) == ("crashed", 3)
    resolved, ended = store.events("brief")[-2:]
    assert (resolved["kind"], resolved["data"]) == ("launch_resolved", {"pid": None, "how": "found ended by its exit file"})
    assert (ended["kind"], ended["data"]["why"]) == ("ended", "ended before dfo looked")


def test_an_unconfirmed_start_found_by_two_looks_at_once_is_recorded_running_once(store, workspace, tmp_path):
    # two dfo (a watch and a `dfo runs`, say) look at once for a start that got no answer, and both find its
    # process: the guarded transition (UPDATE ... WHERE state IN (unsettled)) lets one record it running, with one
    # `launch_resolved` event; before, each look recorded its own event (two "found" for one run)
    import threading

    from orchestrator.runs import look, start_unseen

    run = launch(LocalTarget("here"), spec(workspace, "sleep 30"), store, name="twice").run
    wait_for(lambda: alive(run.pid), what="run start")
    store.update_run("twice", state="unconfirmed", pid=None, proc_starttime=None, started_at=None, ended_at=run.started_at)
    unseen = store.get_run("twice")
    assert start_unseen(unseen) and not unseen.active
    stores = [Store(store.path) for _ in range(2)]  # each dfo with its own connection to the one registry file
    ready, looked = threading.Barrier(2), []

    def settler(own: Store) -> None:
        ready.wait(timeout=10)
        looked.extend(look(LocalTarget("here"), own, [unseen]))

    threads = [threading.Thread(target=settler, args=(own,)) for own in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for own in stores:
        own.close()
    now = store.get_run("twice")  # the wrapper found (the session leader its exit file names), as both see it
    assert now.state == "running" and now.pid is not None and alive(now.pid)
    assert [(r.state, r.pid) for r in looked] == [("running", now.pid)] * 2
    resolved = store.events("twice", kind="launch_resolved")
    assert [(event["data"]["pid"], event["data"]["how"]) for event in resolved] == [(now.pid, "found by its exit file path")]


@pytest.mark.parametrize("kernel", ["pidfd group signal", "pidfd without group signal (Linux < 6.9)", "no pidfd"])
def test_the_stop_program_signals_the_checked_group_and_never_a_group_whose_number_is_anothers(monkeypatch, tmp_path,
                                                                                              kernel):
    from orchestrator.agent import stopper

    if kernel.startswith("pidfd without"):
        monkeypatch.setattr(stopper, "PIDFD_SIGNAL_PROCESS_GROUP", 1 << 30)  # the kernel answers EINVAL: by number
    elif kernel == "no pidfd":
        monkeypatch.delattr(stopper.os, "pidfd_open", raising=False)
    exit_file = str(tmp_path / "run.exit")
    group = subprocess.Popen(["sh", "-c", f"sleep 30 & sleep 31; wait; : {exit_file}"], start_new_session=True)
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        wait_for(lambda: len(live_group_members(group.pid)) == 3, what="the group")
        identity, stat, _, run = stopper.identify(group.pid, None, exit_file)
        assert identity == "ok" and (run.fd is None) == (kernel == "no pidfd")
        started = stopper.starttime(Path(f"/proc/{stranger.pid}/stat").read_text())
        other = stopper.Run(stranger.pid, started - 1, None)  # its number, another start time: another process's now
        assert other.members() == [] and not other.signal(signal.SIGTERM)
        assert run.signal(signal.SIGTERM)
        wait_for(lambda: live_group_members(group.pid) == [], what="the group's end")
        assert stranger.poll() is None
        assert run.group_flag == (kernel == "pidfd group signal")
    finally:
        for proc in (group, stranger):
            proc.kill()
            proc.wait()


def test_a_look_at_many_late_start_candidates_on_one_target_scans_proc_once_in_one_call(store, workspace, tmp_path,
                                                                                       monkeypatch):
    # launches marked failed whose logs exist may come up late: each is looked for by its exit file path among the
    # target's processes; it was one scan of /proc per row (slow `dfo runs` with many recent failures), now one in all
    import shutil

    from orchestrator.runs import look

    late = launch(LocalTarget("here"), spec(workspace, "sleep 60"), store, name="late").run
    store.update_run("late", state="failed", pid=None, proc_starttime=None, ended_at=late.started_at)  # came up late
    candidates = [store.get_run("late")]
    for index in range(5):  # never came up: their logs are there (a start may still make its process)
        name = f"never{index}"
        store.add_run(Run(name=name, target="here", host="local", variant="v1", state="failed", workspace=workspace,
                          log_path=f"{workspace}/logs/{name}.log", exit_path=f"{workspace}/logs/{name}.log.exit"))
        Path(f"{workspace}/logs/{name}.log").write_text("")
        candidates.append(store.get_run(name))
    scans, shims = tmp_path / "scans", tmp_path / "shims"
    shims.mkdir()
    (shims / "tr").write_text(f'#!/bin/sh\n[ "$(readlink /proc/$$/fd/0)" = /proc/1/cmdline ] && echo >> {scans}\n'
                              f'exec {shutil.which("tr")} "$@"\n')  # each scan of /proc reads PID 1's command line
    (shims / "tr").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    target, calls = LocalTarget("here"), []
    run = target.run
    monkeypatch.setattr(target, "run", lambda *args, **kw: calls.append(args) or run(*args, **kw))
    looked = {r.name: r for r in look(target, store, candidates)}
    assert len(calls) == 1 and scans.read_text().count("\n") == 1, f"{len(calls)} calls, {scans.read_text().count(chr(10))} scans"
    assert (looked["late"].state, looked["late"].pid) == ("running", late.pid)  # adopted by its exit file path
    assert all((looked[f"never{i}"].state, looked[f"never{i}"].pid) == ("failed", None) for i in range(5))


STAT_REST = "S 1 4242 4242 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0"


@pytest.mark.parametrize("stat, started, ended", [
    ("4242 (sh) " + STAT_REST.format(start=777), 777, False),
    ("4242 (a) b (c) " + STAT_REST.format(start=777), 777, False),  # a command name with spaces and parentheses
    ("4242 (sh) " + STAT_REST.format(start=778), 777, True),  # the number is another process's now
    ("4242 (sh) " + STAT_REST.replace("S ", "Z ", 1).format(start=777), 777, True),  # ended, not reaped yet
    ("4242 (sh) " + STAT_REST.replace("S ", "X ", 1).format(start=777), 777, True),  # dead, being torn down
    ("", 777, True),  # no such process
])
def test_dfo_and_its_stop_program_read_a_proc_stat_line_alike(stat, started, ended):
    # `dfo runs` (runs.gone) and the stop program in the container read one /proc/PID/stat line one way: a run the
    # stop program calls gone is never one `dfo runs` calls alive (runs.py read a dead `X` process as alive)
    from orchestrator.agent import stopper

    assert gone(stat, started) is ended
    assert (not stopper.live(stat) or stopper.starttime(stat) != started) is ended


def test_a_run_that_ends_during_a_look_is_never_recorded_lost_without_its_exit_status(store, workspace, tmp_path,
                                                                                      monkeypatch):
    # The wrapper writes the exit file, then its PID goes away. A look that read the exit file (not there yet)
    # and then the PID (gone) recorded the run `lost` with no exit status (a fresh-clone run found a multi-node
    # node that had exited 3 recorded so): the look reads the process first, so a run it sees gone has its
    # exit file already; one that ends in between is seen running, and the next look records its exit status.
    from orchestrator.runs import look

    go = tmp_path / "go"
    run = launch(LocalTarget("here"), spec(workspace, f"while [ ! -e {go} ]; do sleep 0.05; done; exit 3"),
                 store, name="brief").run
    armed = tmp_path / "armed"
    armed.write_text("")
    shim = tmp_path / "bin"
    shim.mkdir()
    # `cat` of the exit file, while armed: print what it holds now, then let the run end and wait until it has
    (shim / "cat").write_text(f"""#!/bin/sh
if [ "$1" = {shlex.quote(run.exit_path)} ] && [ -e {armed} ]; then
    rm -f {armed}; /bin/cat "$@" 2>/dev/null; : > {go}
    i=0; while [ -e /proc/{run.pid} ] && [ "$(cut -d' ' -f3 /proc/{run.pid}/stat 2>/dev/null)" != Z ] && [ $i -lt 300 ]; do
        sleep 0.05; i=$((i + 1)); done
    exit 0
fi
exec /bin/cat "$@"
""")
    (shim / "cat").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    [looked] = look(LocalTarget("here"), store, [store.get_run("brief")])
    assert not armed.exists(), "the look did not read the exit file"
    assert (looked.state, looked.exit_code) == ("running", None), looked  # it ended after its process was seen
    [looked] = look(LocalTarget("here"), store, [looked])
    assert (looked.state, looked.exit_code) == ("crashed", 3), looked
