"""Preflight on local-transport targets: every check's row, through the stand-in nvidia-smi and real files."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from harness import STANDIN_BIN, write_inventory
from harness.cli import dfo
from harness.nvidia_smi import STATE_ENV, Gpu, GpuApp, NvidiaSmiState
from orchestrator.connections import Connections
from orchestrator.errors import InvalidName, UnknownTarget
from orchestrator.inventory import load_inventory
from orchestrator.preflight import CHECKS, preflight


@pytest.fixture
def smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NvidiaSmiState:
    monkeypatch.setenv("PATH", f"{STANDIN_BIN}:{os.environ['PATH']}")
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "smi.json"))
    return NvidiaSmiState(tmp_path / "smi.json", gpus=[Gpu(0), Gpu(1)])


def local_inventory(tmp_path: Path, *, workspace: str | None = None, gpus: list[int] | None = None, **defaults):
    workspace = workspace or str(tmp_path / "ws")
    Path(tmp_path / "ws").mkdir(exist_ok=True)
    box = {"ctid": None, "gpus": gpus or [], "workspace": workspace, "python": sys.executable}
    data = {
        "defaults": {"min_free_disk_gb": 0, **defaults},
        "hosts": {"box": {"transport": "local", "containers": {"box1": box}}},
    }
    return load_inventory(write_inventory(tmp_path, data))


def checks_of(inventory, *targets: str, **kwargs) -> dict[str, tuple[bool, str]]:
    with Connections(inventory) as connections:
        (report,) = preflight(connections, list(targets), **kwargs)
    assert [check.name for check in report.checks] == list(CHECKS)  # every check always gets its row
    return {check.name: (check.ok, check.detail) for check in report.checks}


def test_idle_gpus_pass_every_check(tmp_path: Path, smi: NvidiaSmiState) -> None:
    rows = checks_of(local_inventory(tmp_path), "box1")
    assert all(ok for ok, _ in rows.values()), rows
    assert rows["nvidia_smi"][1] == "0 NVIDIA H200 0/143771 MiB 0%; 1 NVIDIA H200 0/143771 MiB 0%"
    assert "writable" in rows["workspace"][1]
    assert rows["python"][1].startswith(f"{sys.executable} 3.") and "torch" in rows["python"][1]


def test_busy_gpu_and_its_process_fail_their_rows(tmp_path: Path, smi: NvidiaSmiState) -> None:
    smi.set_load(1, memory_used_mib=50000, utilization_pct=100, apps=[GpuApp(pid=777, used_memory_mib=50000)])
    rows = checks_of(local_inventory(tmp_path), "box1")
    assert rows["gpus_idle"] == (False, "busy: GPU 1 50000 MiB 100% (limits 1024 MiB, 10%)")
    assert rows["compute_apps"] == (False, "1 running: pid 777 python 50000 MiB")
    assert rows["nvidia_smi"][0] and rows["workspace"][0]


def test_only_the_targets_own_gpus_count(tmp_path: Path, smi: NvidiaSmiState) -> None:
    smi.set_load(1, memory_used_mib=50000, utilization_pct=100)
    assert checks_of(local_inventory(tmp_path, gpus=[0]), "box1")["gpus_idle"] == (True, "GPU 0 idle")


def test_thresholds_come_from_the_inventory(tmp_path: Path, smi: NvidiaSmiState) -> None:
    smi.set_load(0, memory_used_mib=3000, utilization_pct=5)
    inventory = local_inventory(tmp_path, gpu_idle={"max_memory_mib": 4096, "max_util_pct": 10})
    assert checks_of(inventory, "box1")["gpus_idle"][0]


def test_no_gpu_is_a_plain_failed_check(tmp_path: Path, smi: NvidiaSmiState) -> None:
    smi.set_mode("no_devices")
    rows = checks_of(local_inventory(tmp_path), "box1")
    assert rows["nvidia_smi"] == (False, gpu_message("no_devices"))
    assert rows["gpus_idle"] == (False, "skipped: nvidia_smi failed")
    assert rows["workspace"][0] and rows["python"][0]  # the rest is still checked


def gpu_message(kind: str) -> str:
    from orchestrator.gpu import KNOWN_FAILURES

    return next(text for code, (k, text) in KNOWN_FAILURES.items() if k == kind)


def test_hung_nvidia_smi_fails_within_its_timeout(tmp_path: Path, smi: NvidiaSmiState) -> None:
    smi.set_mode("hang")
    started = time.monotonic()
    rows = checks_of(local_inventory(tmp_path), "box1", nvidia_smi_timeout=1)
    assert rows["nvidia_smi"][0] is False and "did not answer within 1s" in rows["nvidia_smi"][1]
    assert time.monotonic() - started < 8


def test_missing_and_unwritable_workspace(tmp_path: Path, smi: NvidiaSmiState) -> None:
    # not there yet, under a writable directory: the first launch creates it (mkdir -p), so it passes
    ok, detail = checks_of(local_inventory(tmp_path, workspace=str(tmp_path / "nope" / "ws")), "box1")["workspace"]
    assert ok and detail.startswith(f"{tmp_path}/nope/ws not there yet: the first launch creates it ({tmp_path} writable, ")
    assert not (tmp_path / "nope").exists() and not list(tmp_path.glob(".dfo-preflight*"))  # nothing left behind
    # not there, under a directory no launch can write to: refused, with the fix
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        ok, detail = checks_of(local_inventory(tmp_path, workspace=str(locked / "ws")), "box1")["workspace"]
        if os.geteuid() != 0:  # root writes through a mode of 555
            assert not ok and detail == (f"{locked}/ws does not exist and {locked} is not writable, so a launch cannot "
                                         f"create it (create it: mkdir -p {locked}/ws, or set the target's workspace: "
                                         "to a writable path)")
    finally:
        locked.chmod(0o755)
    missing = checks_of(local_inventory(tmp_path, workspace="/proc/dfo-nope"), "box1")["workspace"]
    assert missing == (False, "/proc/dfo-nope does not exist and /proc is not writable, so a launch cannot create it "
                              "(create it: mkdir -p /proc/dfo-nope, or set the target's workspace: to a writable path)")
    unwritable = "/proc" if os.geteuid() == 0 else "/"  # root writes anywhere but into procfs
    assert checks_of(local_inventory(tmp_path, workspace=unwritable), "box1")["workspace"] == (
        False,
        f"{unwritable} is not writable (unwritable)",
    )


def test_too_little_free_disk(tmp_path: Path, smi: NvidiaSmiState) -> None:
    ok, detail = checks_of(local_inventory(tmp_path, min_free_disk_gb=10**5), "box1")["workspace"]
    assert not ok and "needs 100000 GB" in detail


def test_python_that_does_not_run(tmp_path: Path, smi: NvidiaSmiState) -> None:
    data = {"hosts": {"box": {"transport": "local", "containers": {"box1": {"python": "/nonexistent/python"}}}}}
    ok, detail = checks_of(load_inventory(write_inventory(tmp_path, data)), "box1")["python"]
    assert not ok and detail.startswith("/nonexistent/python does not run")


def test_bad_names_fail_before_anything_runs(tmp_path: Path, smi: NvidiaSmiState, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with Connections(local_inventory(tmp_path)) as connections:
        with pytest.raises(InvalidName):
            preflight(connections, ["box1", "x$(touch pwned)"])
        with pytest.raises(UnknownTarget, match="known targets: box1"):
            preflight(connections, ["box2"])
    assert not (tmp_path / "pwned").exists()


def test_a_listed_gpu_the_target_cannot_see_fails_idle(tmp_path: Path) -> None:
    from orchestrator.gpu import Gpu as SmiGpu
    from orchestrator.preflight import gpus_idle_check

    spec = local_inventory(tmp_path, gpus=[0, 3]).target("box1")
    check = gpus_idle_check([SmiGpu(0, "H200", 0, 143771, 0), SmiGpu(1, "H200", 0, 143771, None)], spec)
    assert (check.ok, check.detail) == (False, "GPU 3 not visible (sees 0, 1)")


def test_a_workspace_with_spaces_and_shell_words_is_quoted(tmp_path: Path, smi: NvidiaSmiState, monkeypatch) -> None:
    odd = tmp_path / "my ws;touch injected"
    odd.mkdir()
    monkeypatch.chdir(tmp_path)  # where an unquoted `touch injected` would land
    ok, detail = checks_of(local_inventory(tmp_path, workspace=str(odd)), "box1")["workspace"]
    assert ok and detail.startswith(f"{odd} writable, ") and detail.endswith(" GB free")
    assert not (tmp_path / "injected").exists() and list(odd.iterdir()) == []  # the probe file was removed


def test_preflight_of_a_target_without_a_gpu_says_what_still_works_instead_of_failing(tmp_path: Path, smi) -> None:
    """`dfo preflight --host here` on a laptop: no GPU is a fact about the machine, not a failure to fix."""
    smi.set_mode("no_devices")
    inventory = local_inventory(tmp_path)
    env = {"DFO_HOME": str(tmp_path / "state"), "COLUMNS": "100"}
    shown = dfo("preflight", "--host", "box1", "-i", str(inventory.source), env=env)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "FAIL" not in shown.stdout and "1 of 1 target ready: box1 (CPU only)" in shown.stdout  # was "1 targets"
    assert "box1 has no GPU (nvidia-smi finds none): it is ready for CPU runs" in " ".join(shown.stdout.split())
    listed = local_inventory(tmp_path, gpus=[0])  # the inventory says it has a GPU: now it is a failure
    failed = dfo("preflight", "--host", "box1", "-i", str(listed.source), env=env)
    assert failed.returncode == 1 and "FAIL" in failed.stdout and "has no GPU" not in failed.stdout


def test_preflight_json_ok_says_ready_as_the_text_does_and_host_all_checks_every_target(tmp_path: Path, smi) -> None:
    smi.set_mode("no_devices")
    inventory = local_inventory(tmp_path)
    env = {"DFO_HOME": str(tmp_path / "state")}
    shown = dfo("preflight", "--host", "all", "--json", "-i", str(inventory.source), env=env)  # was: unknown target 'all'
    assert shown.returncode == 0, shown.stdout + shown.stderr
    [report] = json.loads(shown.stdout)
    assert report["target"] == "box1" and report["cpu_only"] is True
    assert report["ok"] is True and report["checks_ok"] is False  # the text says "1 of 1 target ready"; ok was false
    by_host = dfo("preflight", "--host", "host:box", "--json", "-i", str(inventory.source), env=env)
    assert [r["target"] for r in json.loads(by_host.stdout)] == ["box1"]
    unknown = dfo("preflight", "--host", "host:nope", "--host", "ct9", "-i", str(inventory.source), env=env)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.splitlines() == [
        "dfo: error: --host: unknown host 'nope'; known hosts: box",
        f"dfo: error: --host: unknown target 'ct9' in {inventory.source}; known targets: box1 (or use host:NAME, all)"]


def test_preflight_host_takes_an_inventory_group(tmp_path: Path, smi) -> None:
    smi.set_mode("no_devices")
    (tmp_path / "ws").mkdir()
    box = {"ctid": None, "workspace": str(tmp_path / "ws"), "python": sys.executable}
    path = write_inventory(tmp_path, {"defaults": {"min_free_disk_gb": 0},
                                      "hosts": {"box": {"transport": "local", "containers": {"box1": box, "box2": box}}},
                                      "groups": {"second": ["box2"], "both": ["host:box"]}})
    env = {"DFO_HOME": str(tmp_path / "state")}
    for group, targets in (("second", ["box2"]), ("both", ["box1", "box2"])):
        shown = dfo("preflight", "--host", group, "--json", "-i", path, env=env)
        assert shown.returncode == 0, shown.output  # was: unknown target
        assert [report["target"] for report in json.loads(shown.stdout)] == targets
