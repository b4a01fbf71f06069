"""The pct stand-in over real LXC containers: exec, push, pull, status, list, start, stop with the
real pct's messages and exit codes (docs/design.md), and container-own PIDs, hostname and nvidia-smi."""

from __future__ import annotations

import subprocess
import time

import pytest

from conftest import PCT_NODE
from harness.nvidia_smi import Gpu

pytestmark = pytest.mark.lxc


def pct(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["pct", *args], capture_output=True, text=True, input=input, timeout=30)


def test_exec_returns_the_commands_own_status_and_runs_in_the_containers_namespaces(container):
    result = pct("exec", container.name, "--", "sh", "-c", "echo $$; hostname; exit 3")
    assert result.returncode == 3
    pid, hostname = result.stdout.split()
    assert int(pid) < 100 and hostname == container.hostname  # the container's own PID namespace
    assert pct("exec", container.name, "--", "no-such-command").returncode == 127


def test_exec_passes_stdin_and_sees_its_own_nvidia_smi(container):
    assert pct("exec", container.name, "--", "cat", input="hello").stdout == "hello"
    container.nvidia_smi([Gpu(0, memory_used_mib=5000)])
    out = pct("exec", container.name, "--", "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits")
    assert out.stdout == "5000\n"


def test_missing_container_reports_configuration_file(container):
    result = pct("exec", "999", "--", "true")
    assert result.returncode == 255
    assert result.stderr.strip() == f"Configuration file 'nodes/{PCT_NODE}/lxc/999.conf' does not exist"


def test_stopped_container_refuses_exec_and_push(containers, tmp_path):
    stopped = containers(start=False)
    assert pct("status", stopped.name).stdout == "status: stopped\n"
    result = pct("exec", stopped.name, "--", "true")
    assert (result.returncode, result.stderr.strip()) == (255, f"container '{stopped.name}' not running!")
    (tmp_path / "f").write_text("x")
    result = pct("push", stopped.name, str(tmp_path / "f"), "/tmp/f")
    assert (result.returncode, result.stderr.strip()) == (255, "can only push files to a running CT")


def test_push_sets_mode_and_does_not_create_parents_and_pull_reads_back(container, tmp_path):
    src = tmp_path / "payload.bin"
    src.write_bytes(bytes(range(256)) * 100)
    assert pct("push", container.name, str(src), "/workspace/payload.bin", "--perms", "0600").returncode == 0
    assert container.path("/workspace/payload.bin").read_bytes() == src.read_bytes()
    assert oct(container.path("/workspace/payload.bin").stat().st_mode & 0o777) == "0o600"
    assert pct("push", container.name, str(src), "/no/such/dir/payload.bin").returncode == 255
    back = tmp_path / "back.bin"
    assert pct("pull", container.name, "/workspace/payload.bin", str(back)).returncode == 0
    assert back.read_bytes() == src.read_bytes()


def test_list_status_start_stop(containers, lxc_path):
    first, second = containers(), containers(start=False)
    rows = pct("list").stdout.splitlines()
    assert rows[0].split() == ["VMID", "Status", "Lock", "Name"]
    assert [row.split() for row in rows[1:]] == [[first.name, "running", first.hostname],
                                                  [second.name, "stopped", second.hostname]]
    assert pct("start", second.name).returncode == 0
    assert pct("status", second.name).stdout == "status: running\n"
    assert pct("stop", first.name).returncode == 0
    assert pct("status", first.name).stdout == "status: stopped\n"


def test_list_prints_nothing_without_containers(tmp_path, monkeypatch, pct_env):
    monkeypatch.setenv("PCT_STANDIN_LXCPATH", str(tmp_path))
    result = pct("list")
    assert (result.returncode, result.stdout) == (0, "")


def test_detached_process_outlives_exec_and_init_reaps_it(container):
    started = time.monotonic()
    launch = "setsid nohup sh -c 'sleep 0.3; echo done > /tmp/out' </dev/null >/dev/null 2>&1 & echo $!"
    result = pct("exec", container.name, "--", "sh", "-c", launch)
    assert result.returncode == 0 and time.monotonic() - started < 5
    pid = result.stdout.strip()
    deadline = time.monotonic() + 5
    while not container.path("/tmp/out").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)
    assert pct("exec", container.name, "--", "test", "-e", f"/proc/{pid}").returncode == 1  # reaped, no zombie


def test_start_cost_delays_every_invocation_and_stays_on_the_host(container, monkeypatch):
    """PCT_STANDIN_START_S models a real node's pct start-up (Perl loading the PVE modules) for benchmarks."""
    monkeypatch.setenv("PCT_STANDIN_START_S", "0.6")
    started = time.monotonic()
    result = pct("exec", container.name, "--", "sh", "-c", 'echo "${PCT_STANDIN_START_S-unset}"')
    assert time.monotonic() - started >= 0.6
    assert (result.returncode, result.stdout) == (0, "unset\n")  # the host's variable, not the container's
    started = time.monotonic()
    assert pct("status", container.name).stdout == "status: running\n"
    assert time.monotonic() - started >= 0.6
    monkeypatch.setenv("PCT_STANDIN_START_S", "half")
    result = pct("status", container.name)
    assert (result.returncode, result.stderr.strip()) == (255, "PCT_STANDIN_START_S=half: expected seconds, e.g. 0.5")
